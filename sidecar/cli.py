"""The `walsidecar` command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from sidecar import __version__
from sidecar.address import parse_address, parse_listen
from sidecar.config import (CtlSettings, FollowLeaderSettings, ReaderSlotSettings, ReadersSettings,
                            SafekeeperInitSettings, SafekeeperSettings, StartSettings, UpSettings, configured)
from sidecar.logs import get_logger


def link_warning(log: Any, what: str, insecure: bool, link_security: str) -> None:
    """Say at start that links run without TLS or without encryption; nothing under the default."""
    if insecure:
        log.warning(f"--insecure: {what} without TLS or authentication; anyone who can reach it can change "
                    "safekeeper state. Use --certs-dir outside debugging (see `walsidecar certs --help`)")
    elif link_security == "auth-only":
        log.warning(f"--link-security auth-only: {what} with certificates checked at connection start but no "
                    "encryption; anyone on the network path can read the WAL and alter messages")


def _endpoint(monitor: Any, metrics: str | None, certs_dir: Path | None) -> Any:
    """The monitor's endpoint at `metrics` (None: off), over HTTPS off loopback given certificates."""
    from sidecar.http import endpoint_tls
    if not metrics:
        return None
    host, port = parse_listen(metrics)
    endpoint = monitor.endpoint(host, port)
    endpoint.ssl_context = endpoint_tls(host, certs_dir)
    return endpoint


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="walsidecar")
def main() -> None:
    """Quorum-durable commit for a stock PostgreSQL: a WAL proposer and its safekeepers."""


@main.command()
@configured(SafekeeperSettings)
def safekeeper(s: SafekeeperSettings) -> None:
    """Run a safekeeper: store WAL durably and vote in proposer elections."""
    from sidecar.http import run_with_endpoint
    from sidecar.runtime import run_until_signal
    from sidecar.readerauth import AuthFileError
    from sidecar.safekeeper.control import ControlFileError
    from sidecar.safekeeper.monitor import SafekeeperMonitor
    from sidecar.safekeeper.server import Safekeeper, StartupError
    from sidecar.safekeeper.slots import SlotLimits, SlotsFileError
    from sidecar.sizes import DiskLimit, parse_size
    from sidecar.linkauth import client_security, server_security
    from sidecar.tls import TlsError

    host, port = parse_address(s.listen)
    try:
        ctx = server_security(s.certs_dir, s.link_security)
        sk = Safekeeper.open(s.id, s.data_dir, host, port, ctx, reader_port=_reader_port(s),
                             keep_wal=parse_size(s.keep_wal) if s.keep_wal else None,
                             max_disk_usage=DiskLimit.parse(s.max_disk_usage) if s.max_disk_usage else None,
                             archive=_archive(s),
                             slot_limits=SlotLimits(s.max_reader_slots, s.max_slots_per_reader,
                                                    parse_size(s.max_slot_wal_keep_size)
                                                    if s.max_slot_wal_keep_size else None),
                             peers=s.peers, peer_security=client_security(s.certs_dir, s.link_security))
        sk.publisher = _publisher(s, sk)
        if sk.uploader is not None and sk.publisher is not None:
            sk.uploader.election = sk.publisher.election  # the broker's upload lease, in place of ranks
        monitor = SafekeeperMonitor(sk)
        endpoint = _endpoint(monitor, s.metrics, s.certs_dir)
    except (ControlFileError, StartupError, TlsError, AuthFileError, SlotsFileError) as e:
        raise click.ClickException(str(e)) from e
    link_warning(get_logger(node=s.id), f"listening on {s.listen}", s.insecure, s.link_security)
    if s.keep_wal:
        get_logger(node=s.id).warning("--keep-wal without an archive: WAL removed here exists only on the other "
                                      "safekeepers and the primary; it is only as safe as those copies",
                                      keep_wal=s.keep_wal)
    if s.pg_listen and s.pg_auth_file is None:
        get_logger(node=s.id).warning(
            "--pg-listen without --pg-auth-file: " + ("every reader is trusted (--insecure)" if s.insecure else
                                                      "the reader port refuses every connection"))
    try:
        run_until_signal(run_with_endpoint(sk.serve(), endpoint))
    except OSError as e:
        raise click.ClickException(str(e)) from e
    if sk.fatal is not None:
        sys.exit(1)


@main.command("safekeeper-init")
@configured(SafekeeperInitSettings)
def safekeeper_init(s: SafekeeperInitSettings) -> None:
    """Create a safekeeper's data directory in a new cluster: once, when the cluster is made, never on a restart.

    Afterwards a data directory without its control file is a lost disk, which learns its term from its --peers
    before it votes.
    """
    from sidecar.safekeeper.control import ControlFileError
    from sidecar.safekeeper.create import CreateError, create_data_dir

    try:
        create_data_dir(s.id, s.data_dir, s.members)
    except (CreateError, ControlFileError, OSError) as e:
        raise click.ClickException(str(e)) from e
    get_logger(node=s.id).info("safekeeper created in a new cluster", data_dir=str(s.data_dir), members=s.members,
                               term=0)


def _publisher(s: SafekeeperSettings, sk: Any) -> Any:
    """The broker publisher of --broker (None without it)."""
    from sidecar.broker import Broker
    from sidecar.safekeeper.publish import Publisher
    if not s.broker:
        return None
    if any(e.startswith("http://") for e in s.broker) and not s.insecure:
        get_logger(node=s.id).warning("--broker over plain http: anyone on the network path can read and alter "
                                      "the safekeepers' published state; use https:// with etcd --client-cert-auth")
    # With an archive, the uploader asks publisher.election before each upload.
    return Publisher(sk, Broker(s.broker, s.certs_dir), ttl=s.broker_lease, cluster=s.cluster,
                     advertise=s.advertise, advertise_pg=s.advertise_pg,
                     elect_uploader=s.archive is not None)


def _reader_port(s: SafekeeperSettings) -> Any:
    """The reader port's options from --pg-listen, --pg-auth-file and --certs-dir; None without --pg-listen."""
    from sidecar.readerauth import AuthFile
    from sidecar.safekeeper.pgserver import ReaderPort
    from sidecar.tls import reader_port_context, server_end_point
    if not s.pg_listen:
        return None
    host, port = parse_listen(s.pg_listen)
    auth = AuthFile(s.pg_auth_file) if s.pg_auth_file is not None else None
    # Readers are libpq clients: TLS with the node certificate; a client certificate only marks a proposer.
    if s.certs_dir is None:
        return ReaderPort(host, port, auth, s.insecure, authentication_timeout=s.pg_authentication_timeout,
                          wal_sender_timeout=s.pg_wal_sender_timeout)
    return ReaderPort(host, port, auth, s.insecure, reader_port_context(s.certs_dir), server_end_point(s.certs_dir),
                      s.pg_authentication_timeout, s.pg_wal_sender_timeout, s.certs_dir)


def _archive(s: SafekeeperSettings) -> Any:
    """The uploader's options from --archive, --s3-endpoint, --cluster and --archive-takeover; None without --archive."""
    from sidecar.safekeeper.backup import ArchiveOptions
    return ArchiveOptions(s.archive, s.s3_endpoint, s.cluster, s.archive_takeover) if s.archive else None


@main.group()
@configured(ReadersSettings)
def readers(s: ReadersSettings) -> None:
    """Manage the readers of the safekeepers' reader port (--pg-auth-file): names and SCRAM verifiers."""


def _auth_file(s: ReadersSettings) -> Path:
    if s.pg_auth_file is None:
        raise click.UsageError("give --pg-auth-file FILE (the safekeepers' --pg-auth-file)")
    return s.pg_auth_file


def _read_password(name: str) -> str:
    """Twice at a terminal; otherwise one line from stdin."""
    if sys.stdin.isatty():
        return click.prompt(f"password for reader {name}", hide_input=True, confirmation_prompt=True)
    return sys.stdin.readline().rstrip("\r\n")


@readers.command("add")
@click.argument("name")
@configured(ReadersSettings)
def readers_add(s: ReadersSettings, name: str) -> None:
    """Add reader NAME (or set its password): prompts at a terminal, else reads one line from stdin."""
    from sidecar.readerauth import AuthFileError, add
    path = _auth_file(s)
    try:
        new = add(path, name, _read_password(name))
    except AuthFileError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{'added' if new else 'changed the password of'} reader {name} in {path}")


@readers.command("remove")
@click.argument("name")
@configured(ReadersSettings)
def readers_remove(s: ReadersSettings, name: str) -> None:
    """Remove reader NAME."""
    from sidecar.readerauth import AuthFileError, remove
    path = _auth_file(s)
    try:
        remove(path, name)
    except AuthFileError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"removed reader {name} from {path}")


@readers.command("list")
@configured(ReadersSettings)
def readers_list(s: ReadersSettings) -> None:
    """The readers' names, one a line."""
    from sidecar.readerauth import AuthFileError, load
    try:
        names = sorted(load(_auth_file(s)))
    except AuthFileError as e:
        raise click.ClickException(str(e)) from e
    for n in names:
        click.echo(n)


@readers.group("slot")
def readers_slot() -> None:
    """Reader slots on every safekeeper, over their reader ports: create, drop, list."""


def _slot_name(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    from sidecar.pgrepl import ReplicationProtocolError, check_slot_name
    try:
        for name in (value if isinstance(value, tuple) else (value,)):
            check_slot_name(name)
    except ReplicationProtocolError as e:
        raise click.BadParameter(str(e)) from None
    return value


@readers_slot.command("create")
@click.argument("name", callback=_slot_name)
@configured(ReaderSlotSettings)
def readers_slot_create(s: ReaderSlotSettings, name: str) -> None:
    """Create physical slot NAME on every safekeeper (exit 1 if any refused)."""
    from sidecar.ops import readerslots
    sys.exit(readerslots.create(s, name))


@readers_slot.command("drop")
@click.argument("name", callback=_slot_name)
@configured(ReaderSlotSettings)
def readers_slot_drop(s: ReaderSlotSettings, name: str) -> None:
    """Drop slot NAME on every safekeeper (exit 1 if any refused)."""
    from sidecar.ops import readerslots
    sys.exit(readerslots.drop(s, name))


@readers_slot.command("list")
@click.argument("names", nargs=-1, required=True, callback=_slot_name)
@configured(ReaderSlotSettings)
def readers_slot_list(s: ReaderSlotSettings, names: tuple[str, ...]) -> None:
    """Where slots NAMES stand on every safekeeper (READ_REPLICATION_SLOT; exit 1 if one did not answer)."""
    from sidecar.ops import readerslots
    sys.exit(readerslots.show(s, names))


@main.command()
@configured(StartSettings)
def start(s: StartSettings) -> None:
    """Run the WAL proposer attached to a primary."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    from sidecar.http import run_with_endpoint
    from sidecar.consensus.commitwait import parse_commit_wait
    from sidecar.proposer.monitor import ProposerMonitor
    from sidecar.proposer.primary import PrimaryConfigError
    from sidecar.proposer.options import StartOptions
    from sidecar.config import ReaderCredentials
    from sidecar.sizes import parse_size
    from sidecar.proposer.service import PrimaryMismatch, ProposerService
    from sidecar.runtime import run_until_signal
    from sidecar.linkauth import client_security
    from sidecar.tls import TlsError

    try:
        conninfo_to_dict(s.pg_dsn)  # libpq's own parser: a typo is reported now, not at the first connection
    except psycopg.ProgrammingError as e:
        raise click.ClickException(f"--pg-dsn is not a libpq connection string: {e}") from None
    log = get_logger(role="proposer")
    if len(s.safekeepers) < 3:
        log.warning("fewer than 3 safekeepers: losing any one of them stops commits", safekeepers=len(s.safekeepers))
    try:
        ctx = client_security(s.certs_dir, s.link_security)
        # WAL the primary recycled comes from a safekeeper's reader port: reader `walsidecar`, with libpq's
        # own password file (PGPASSFILE or ~/.pgpass).
        readers = ReaderCredentials(certs_dir=s.certs_dir, insecure=s.insecure)
        service = ProposerService(StartOptions(s.pg_dsn, s.safekeepers, s.quorum, s.application_name, s.slot,
                                               s.allow_primary_mismatch, s.wal_buffer * 1024 * 1024, ctx, readers,
                                               primary_retention=parse_size(s.primary_retention) if s.primary_retention else None,
                                               archive=(s.archive, s.s3_endpoint, s.cluster) if s.archive else None,
                                               commit_wait=parse_commit_wait(s.commit_wait),
                                               broker=(s.broker, s.cluster, s.certs_dir)
                                               if s.broker and s.cluster else None))
        monitor = ProposerMonitor(service, s.quorum_wait_alert or None)  # reads the service's published view
        service.subscribe(monitor)
        endpoint = _endpoint(monitor, s.metrics, s.certs_dir)
    except TlsError as e:
        raise click.ClickException(str(e)) from e
    link_warning(log, "talking to the safekeepers", s.insecure, s.link_security)
    try:
        run_until_signal(run_with_endpoint(service.run(), endpoint))
    except OSError as e:
        raise click.ClickException(str(e)) from e
    except PrimaryMismatch as e:
        raise click.ClickException(f"refusing to stream: {e}") from e
    except PrimaryConfigError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@configured(UpSettings)
def up(s: UpSettings) -> None:
    """Run the embedded default: a local PostgreSQL, 3 safekeepers and the proposer, until Ctrl-C."""
    from sidecar.deployment import DeploymentError
    from sidecar.embedded import Embedded

    if s.ha:
        from sidecar.embedded_ha import EmbeddedHa
        if s.standby:
            raise click.UsageError("--ha runs two nodes, each the other's standby: leave out --standby")
        try:
            EmbeddedHa(s.dir, s.pg_port, s.safekeeper_port, s.log_format, insecure=s.insecure,
                       link_security=s.link_security).run()
        except DeploymentError as e:
            raise click.ClickException(str(e)) from e
        return
    try:
        Embedded(s.dir, s.pg_port, s.safekeeper_port, s.log_format, metrics_port=s.metrics_port,
                 insecure=s.insecure, link_security=s.link_security, standby=s.standby).run()
    except DeploymentError as e:
        raise click.ClickException(str(e)) from e


@main.command("follow-leader")
@configured(FollowLeaderSettings)
def follow_leader(s: FollowLeaderSettings) -> None:
    """Run `walsidecar start` on this node while its Patroni is the leader; stop it when demoted (docs/ha.md)."""
    from sidecar.patroni import FollowLeader, patroni_dcs
    try:
        dcs = patroni_dcs(s.patroni_config) if s.patroni_config is not None else None
    except ValueError as e:
        raise click.ClickException(f"--patroni-config: {e}") from e
    FollowLeader(s.patroni_url, s.sidecar_config, s.poll_interval, dcs, s.leader_lost_after).run()


@main.group()
@configured(CtlSettings)
def ctl(s: CtlSettings) -> None:
    """Stop, start, kill and list the members of a running `walsidecar up` (safekeeper1-3, proposer, primary;
    under `up --ha`: etcd, safekeeper1-3, node1, node2).

    A member stopped with `ctl stop` or `ctl kill` stays stopped until `ctl start`; one that dies on its own is
    restarted.
    """
    click.get_current_context().obj = s


def _ctl(action: str, member: str | None = None) -> None:
    from sidecar.ctl import CtlError, members_table, request
    s: CtlSettings = click.get_current_context().find_object(CtlSettings)
    try:
        answer = request(s.dir, action, member, timeout=s.timeout)
    except CtlError as e:
        raise click.ClickException(str(e)) from e
    if answer.get("message"):
        click.echo(answer["message"])
    click.echo(members_table(answer.get("members", [])))


@ctl.command("members")
def ctl_members() -> None:
    """Each member's name, pid, state and restarts."""
    _ctl("members")


@ctl.command("stop")
@click.argument("member")
def ctl_stop(member: str) -> None:
    """Stop MEMBER; it stays stopped until `ctl start MEMBER`."""
    _ctl("stop", member)


@ctl.command("start")
@click.argument("member")
def ctl_start(member: str) -> None:
    """Start MEMBER (again)."""
    _ctl("start", member)


@ctl.command("kill")
@click.argument("member")
def ctl_kill(member: str) -> None:
    """SIGKILL MEMBER; for an `up --ha` node, all of it at once (Patroni, PostgreSQL, sidecar): a host loss."""
    _ctl("kill", member)


@ctl.command("restart")
@click.argument("member")
def ctl_restart(member: str) -> None:
    """Stop MEMBER and start it again."""
    _ctl("restart", member)


@main.group()
def certs() -> None:
    """Make the deployment's CA and a certificate for each process (mutually authenticated TLS)."""


@certs.command("create-ca")
@click.option("--ca-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where to write ca.crt and ca.key (0600). Keep ca.key off the servers.")
@click.option("--overwrite", is_flag=True, help="Replace an existing CA (every certificate it signed stops working).")
def create_ca(ca_dir: Path, overwrite: bool) -> None:
    """Create the deployment's certificate authority: CA_DIR/ca.crt and CA_DIR/ca.key."""
    from sidecar.certs import CertsError
    from sidecar.certs import create_ca as make
    try:
        path = make(ca_dir, overwrite=overwrite)
    except CertsError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {path} and {ca_dir / 'ca.key'}")


@certs.command("create-node")
@click.option("--ca-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The CA's directory (from `walsidecar certs create-ca`).")
@click.option("--certs-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Where to write ca.crt, node.crt and node.key (0600): one directory per process.")
@click.option("--role", required=True, type=click.Choice(["proposer", "safekeeper", "client"]),
              help="proposer (`walsidecar start`), safekeeper (needs --id) or client (`check`, `status`: read-only).")
@click.option("--id", "node_id", type=int, help="The safekeeper's --id (safekeeper certificates only).")
@click.option("--host", "hosts", multiple=True,
              help="DNS name or IP address the process is reached at (repeatable); default localhost and 127.0.0.1.")
@click.option("--overwrite", is_flag=True, help="Replace existing node.crt and node.key (e.g. to reissue them).")
def create_node(ca_dir: Path, certs_dir: Path, role: str, node_id: int | None, hosts: tuple[str, ...],
                overwrite: bool) -> None:
    """Create a certificate for one process, signed by the CA: CERTS_DIR/ca.crt, node.crt, node.key."""
    from sidecar.certs import CertsError
    from sidecar.certs import create_node as make
    try:
        ident = make(ca_dir, certs_dir, role, node_id, hosts, overwrite=overwrite)
    except CertsError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {certs_dir}/node.crt ({ident}) and node.key, signed by {ca_dir}/ca.crt")


def _register_operator_commands() -> None:
    from sidecar.ops.commands import check, failover, failover_gate, init_postgres, restore_wal, status
    for cmd in (check, status, init_postgres, restore_wal, failover, failover_gate):
        main.add_command(cmd)


_register_operator_commands()


def _register_analytics_commands() -> None:
    # The commands import Spark only when they run.
    from sidecar.analytics.commands import analyze, verify_archive
    for cmd in (analyze, verify_archive):
        main.add_command(cmd)


_register_analytics_commands()


if __name__ == "__main__":
    main()
