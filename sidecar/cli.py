"""The `walsidecar` command."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sidecar import __version__
from sidecar.config import SafekeeperSettings, StartSettings, UpSettings, configured
from sidecar.logs import configure, get_logger

# Every option also comes from --config (TOML) or WALSIDECAR_<OPTION>: see sidecar/config.py.
LOG_FORMAT = click.option("--log-format", type=click.Choice(["plain", "json"]), default="plain",
                          show_default=True, help="Log line format.")
LOG_LEVEL = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
                         default="info", show_default=True, help="Least severe log level shown.")
METRICS_HELP = ("HOST:PORT to serve Prometheus /metrics and a JSON /status on (e.g. 127.0.0.1:9187); "
                "off when not given.")


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
@LOG_FORMAT
@LOG_LEVEL
@configured(SafekeeperSettings)
def safekeeper(id: int, listen: str, data_dir: Path, metrics: str | None, log_format: str, log_level: str) -> None:
    """Run a safekeeper: store WAL durably and vote in proposer elections."""
    from sidecar.http import parse_listen, run_with_endpoint
    from sidecar.runtime import run_until_signal
    from sidecar.safekeeper.control import ControlFileError
    from sidecar.safekeeper.monitor import SafekeeperMonitor
    from sidecar.safekeeper.server import Safekeeper, StartupError

    configure(log_format, log_level)
    host, port = _listen(listen)
    sk = Safekeeper(id, data_dir, host, port)
    try:
        sk.open()
    except (ControlFileError, StartupError) as e:
        raise click.ClickException(str(e)) from e
    monitor = SafekeeperMonitor(sk)
    endpoint = monitor.endpoint(*parse_listen(metrics)) if metrics else None
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
@LOG_FORMAT
@LOG_LEVEL
@configured(StartSettings)
def start(pg_dsn: str, safekeepers: tuple[str, ...], quorum: int, application_name: str, slot: str,
          wal_buffer: int, allow_primary_mismatch: bool, metrics: str | None, quorum_wait_alert: float,
          log_format: str, log_level: str) -> None:
    """Run the WAL proposer attached to a primary."""
    from sidecar.http import parse_listen, run_with_endpoint
    from sidecar.proposer.monitor import ProposerMonitor
    from sidecar.proposer.primary import PrimaryConfigError
    from sidecar.proposer.service import PrimaryMismatch, ProposerService, StartOptions
    from sidecar.runtime import run_until_signal

    configure(log_format, log_level)
    log = get_logger(role="proposer")
    if len(safekeepers) < 3:
        log.warning("fewer than 3 safekeepers: losing any one of them stops commits", safekeepers=len(safekeepers))
    monitor = ProposerMonitor(quorum_wait_alert or None)
    service = ProposerService(StartOptions(pg_dsn, safekeepers, quorum, application_name, slot, allow_primary_mismatch,
                                           wal_buffer * 1024 * 1024), monitor=monitor)
    endpoint = monitor.endpoint(*parse_listen(metrics)) if metrics else None
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
@LOG_FORMAT
@LOG_LEVEL
@configured(UpSettings)
def up(dir: Path, pg_port: int, safekeeper_port: int, metrics_port: int, log_format: str, log_level: str) -> None:
    """Run the embedded default: a local PostgreSQL, 3 safekeepers and the proposer, until Ctrl-C."""
    from sidecar.embedded import Embedded

    configure(log_format, log_level)
    Embedded(dir, pg_port, safekeeper_port, log_format, metrics_port=metrics_port).run()


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
