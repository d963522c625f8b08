"""The `walsidecar` command."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sidecar import __version__
from sidecar.logs import configure, get_logger

LOG_FORMAT = click.option("--log-format", type=click.Choice(["plain", "json"]), default="plain",
                          show_default=True, envvar="WALSIDECAR_LOG_FORMAT", help="Log line format.")
LOG_LEVEL = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
                         default="info", show_default=True, envvar="WALSIDECAR_LOG_LEVEL")


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
@click.option("--id", "node_id", type=click.IntRange(min=1), required=True, help="This safekeeper's id (stable, unique).")
@click.option("--listen", default="127.0.0.1:7601", show_default=True, help="HOST:PORT to accept proposers on.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where the control file and WAL segments live.")
@LOG_FORMAT
@LOG_LEVEL
def safekeeper(node_id: int, listen: str, data_dir: Path, log_format: str, log_level: str) -> None:
    """Run a safekeeper: store WAL durably and vote in proposer elections."""
    from sidecar.runtime import run_until_signal
    from sidecar.safekeeper.control import ControlFileError
    from sidecar.safekeeper.server import Safekeeper

    configure(log_format, log_level)
    host, port = _listen(listen)
    sk = Safekeeper(node_id, data_dir, host, port)
    try:
        sk.open()
    except ControlFileError as e:
        raise click.ClickException(str(e)) from e
    run_until_signal(sk.serve())
    if sk.fatal is not None:
        sys.exit(1)


@main.command()
@click.option("--pg-dsn", required=True, envvar="WALSIDECAR_PG_DSN",
              help="libpq connection string of the primary (a role with REPLICATION).")
@click.option("--safekeepers", required=True, envvar="WALSIDECAR_SAFEKEEPERS",
              help="Comma-separated HOST:PORT list of all safekeepers.")
@click.option("--quorum", type=int, default=None, help="Votes and flushes needed; default and minimum N//2+1.")
@click.option("--application-name", default="walsidecar", show_default=True,
              help="Name the primary lists in synchronous_standby_names.")
@click.option("--slot", default="walsidecar", show_default=True, help="Physical replication slot to stream from.")
@click.option("--wal-buffer", "wal_buffer_mb", type=click.IntRange(min=1), default=64, show_default=True,
              help="MiB of WAL kept in memory for lagging safekeepers; beyond it they catch up from the primary.")
@click.option("--allow-primary-mismatch", is_flag=True,
              help="DANGEROUS: stream even if the primary lacks WAL a quorum committed (loses that WAL).")
@LOG_FORMAT
@LOG_LEVEL
def start(pg_dsn: str, safekeepers: str, quorum: int | None, application_name: str, slot: str,
          wal_buffer_mb: int, allow_primary_mismatch: bool, log_format: str, log_level: str) -> None:
    """Run the WAL proposer attached to a primary."""
    from sidecar.consensus.quorum import QuorumError, validate_quorum
    from sidecar.proposer.primary import PrimaryConfigError
    from sidecar.proposer.service import PrimaryMismatch, ProposerService, StartOptions
    from sidecar.runtime import run_until_signal

    configure(log_format, log_level)
    log = get_logger(role="proposer")
    names = tuple(s.strip() for s in safekeepers.split(",") if s.strip())
    for name in names:
        _listen(name)
    if len(set(names)) != len(names):
        raise click.BadParameter("a safekeeper is listed twice", param_hint="--safekeepers")
    try:
        q = validate_quorum(len(names), quorum)
    except QuorumError as e:
        raise click.BadParameter(str(e), param_hint="--quorum") from e
    if len(names) < 3:
        log.warning("fewer than 3 safekeepers: losing any one of them stops commits", safekeepers=len(names))
    service = ProposerService(StartOptions(pg_dsn, names, q, application_name, slot, allow_primary_mismatch,
                                           wal_buffer_mb * 1024 * 1024))
    try:
        run_until_signal(service.run())
    except PrimaryMismatch as e:
        raise click.ClickException(f"refusing to stream: {e}") from e
    except PrimaryConfigError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--dir", "base_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/tmp/walsidecar-up"), show_default=True, help="Where the cluster and safekeepers live.")
@click.option("--pg-port", type=int, default=55432, show_default=True)
@click.option("--safekeeper-port", type=int, default=7601, show_default=True,
              help="First of three consecutive safekeeper ports.")
@LOG_FORMAT
@LOG_LEVEL
def up(base_dir: Path, pg_port: int, safekeeper_port: int, log_format: str, log_level: str) -> None:
    """Run the embedded default: a local PostgreSQL, 3 safekeepers and the proposer, until Ctrl-C."""
    from sidecar.embedded import Embedded

    configure(log_format, log_level)
    Embedded(base_dir, pg_port, safekeeper_port, log_format).run()


if __name__ == "__main__":
    main()
