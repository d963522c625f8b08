"""The `walsidecar` command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sidecar import __version__
from sidecar.config import LINK_SECURITY, SafekeeperSettings, StartSettings, UpSettings, configured, tls_options
from sidecar.logs import configure, get_logger

if TYPE_CHECKING:
    from sidecar.config import LinkSecurity

# Every option also comes from --config (TOML) or WALSIDECAR_<OPTION>: see sidecar/config.py.
LOG_FORMAT = click.option("--log-format", type=click.Choice(["plain", "json"]), default="plain",
                          show_default=True, help="Log line format.")
LOG_LEVEL = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
                         default="info", show_default=True, help="Least severe log level shown.")
METRICS_HELP = ("HOST:PORT to serve Prometheus /metrics and a JSON /status on (e.g. 127.0.0.1:9187); "
                "off when not given. Plain HTTP on loopback, HTTPS with the --certs-dir certificate elsewhere.")


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
    from sidecar.http import endpoint_tls, parse_listen
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


def _listen(value: str) -> tuple[str, int]:
    from sidecar.proposer.peers import parse_address
    try:
        return parse_address(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


@main.command()
@click.option("--id", "id", type=int, help="This safekeeper's id (stable, unique, 1 or more). Required.")
@click.option("--listen", default="127.0.0.1:7601", show_default=True, help="HOST:PORT to accept proposers on.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the control file and WAL segments live. Required.")
@click.option("--metrics", help=METRICS_HELP)
@tls_options("safekeeper")
@LOG_FORMAT
@LOG_LEVEL
@configured(SafekeeperSettings)
def safekeeper(id: int, listen: str, data_dir: Path, metrics: str | None, certs_dir: Path | None, insecure: bool,
               link_security: LinkSecurity, log_format: str, log_level: str) -> None:
    """Run a safekeeper: store WAL durably and vote in proposer elections."""
    from sidecar.http import run_with_endpoint
    from sidecar.runtime import run_until_signal
    from sidecar.safekeeper.control import ControlFileError
    from sidecar.safekeeper.monitor import SafekeeperMonitor
    from sidecar.safekeeper.server import Safekeeper, StartupError
    from sidecar.linkauth import server_security
    from sidecar.tls import TlsError

    configure(log_format, log_level)
    host, port = _listen(listen)
    try:
        ctx = server_security(certs_dir, link_security)
        sk = Safekeeper.open(id, data_dir, host, port, ctx)
        monitor = SafekeeperMonitor(sk)
        endpoint = _endpoint(monitor, metrics, certs_dir)
    except (ControlFileError, StartupError, TlsError) as e:
        raise click.ClickException(str(e)) from e
    link_warning(get_logger(node=id), f"listening on {listen}", insecure, link_security)
    try:
        run_until_signal(run_with_endpoint(sk.serve(), endpoint))
    except OSError as e:
        raise click.ClickException(str(e)) from e
    if sk.fatal is not None:
        sys.exit(1)


@main.command()
@click.option("--pg-dsn", help="libpq connection string of the primary (a role with REPLICATION). Required.")
@click.option("--safekeepers", help="Comma-separated HOST:PORT list of all safekeepers. Required.")
@click.option("--quorum", type=int, default=None, help="Votes and flushes needed; default and minimum N//2+1.")
@click.option("--application-name", default="walsidecar", show_default=True,
              help="Name the primary lists in synchronous_standby_names.")
@click.option("--slot", default="walsidecar", show_default=True, help="Physical replication slot to stream from.")
@click.option("--wal-buffer", type=int, default=64, show_default=True,
              help="MiB of WAL kept in memory for lagging safekeepers; beyond it they catch up from the primary.")
@click.option("--allow-primary-mismatch", is_flag=True,
              help="DANGEROUS: stream even if the primary lacks WAL a quorum committed (loses that WAL).")
@click.option("--metrics", help=METRICS_HELP)
@click.option("--quorum-wait-alert", type=float, default=10.0, show_default=True,
              help="Log an error and set walsidecar_proposer_quorum_wait_alert when WAL has waited this many "
                   "seconds for the quorum (commits are hanging); 0 turns it off.")
@tls_options("proposer")
@LOG_FORMAT
@LOG_LEVEL
@configured(StartSettings)
def start(pg_dsn: str, safekeepers: tuple[str, ...], quorum: int, application_name: str, slot: str,
          wal_buffer: int, allow_primary_mismatch: bool, metrics: str | None, quorum_wait_alert: float,
          certs_dir: Path | None, insecure: bool, link_security: LinkSecurity, log_format: str, log_level: str) -> None:
    """Run the WAL proposer attached to a primary."""
    from sidecar.http import run_with_endpoint
    from sidecar.proposer.monitor import ProposerMonitor
    from sidecar.proposer.primary import PrimaryConfigError
    from sidecar.proposer.service import PrimaryMismatch, ProposerService, StartOptions
    from sidecar.runtime import run_until_signal
    from sidecar.linkauth import client_security
    from sidecar.tls import TlsError

    configure(log_format, log_level)
    log = get_logger(role="proposer")
    if len(safekeepers) < 3:
        log.warning("fewer than 3 safekeepers: losing any one of them stops commits", safekeepers=len(safekeepers))
    monitor = ProposerMonitor(quorum_wait_alert or None)
    try:
        ctx = client_security(certs_dir, link_security)
        service = ProposerService(StartOptions(pg_dsn, safekeepers, quorum, application_name, slot,
                                               allow_primary_mismatch, wal_buffer * 1024 * 1024, ctx), monitor=monitor)
        endpoint = _endpoint(monitor, metrics, certs_dir)
    except TlsError as e:
        raise click.ClickException(str(e)) from e
    link_warning(log, "talking to the safekeepers", insecure, link_security)
    try:
        run_until_signal(run_with_endpoint(service.run(), endpoint))
    except OSError as e:
        raise click.ClickException(str(e)) from e
    except PrimaryMismatch as e:
        raise click.ClickException(f"refusing to stream: {e}") from e
    except PrimaryConfigError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--dir", "dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/tmp/walsidecar-up"), show_default=True, help="Where the cluster and safekeepers live.")
@click.option("--pg-port", type=int, default=55432, show_default=True, help="Port of the local PostgreSQL.")
@click.option("--safekeeper-port", type=int, default=7601, show_default=True,
              help="First of three consecutive safekeeper ports.")
@click.option("--metrics-port", type=int, default=7610, show_default=True,
              help="First of four consecutive metrics ports (proposer, then safekeepers 1-3); 0 picks free ports.")
@click.option("--insecure", is_flag=True,
              help="Run the safekeeper links without TLS (for debugging); by default `up` makes its own CA "
                   "and certificates under --dir.")
@click.option("--link-security", type=click.Choice(LINK_SECURITY), default="tls", show_default=True,
              help="auth-only: the children check certificates at connection start but do not encrypt "
                   "(see `walsidecar safekeeper --help`).")
@LOG_FORMAT
@LOG_LEVEL
@configured(UpSettings)
def up(dir: Path, pg_port: int, safekeeper_port: int, metrics_port: int, insecure: bool, link_security: str,
       log_format: str, log_level: str) -> None:
    """Run the embedded default: a local PostgreSQL, 3 safekeepers and the proposer, until Ctrl-C."""
    from sidecar.embedded import Embedded

    configure(log_format, log_level)
    Embedded(dir, pg_port, safekeeper_port, log_format, metrics_port=metrics_port, insecure=insecure,
             link_security=link_security).run()


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
    from sidecar.ops.commands import check, init_postgres, status
    for cmd in (check, status, init_postgres):
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
