"""Click definitions of the operator commands; `sidecar.cli` registers them on `walsidecar`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sidecar.config import CheckSettings, InitPostgresSettings, StatusSettings, configured, tls_options

PG_DSN_HELP = "libpq connection string of the primary."
SAFEKEEPERS_HELP = "Comma-separated HOST:PORT list of all safekeepers (their --listen addresses)."
APP_HELP = "The sidecar's application_name (as in synchronous_standby_names)."
SLOT_HELP = "The sidecar's replication slot (its horizon slot is <slot>_horizon)."
LOG_FORMAT = click.option("--log-format", type=click.Choice(["plain", "json"]), default="plain", show_default=True,
                          help="Log line format (this command logs little; its report goes to stdout).")
LOG_LEVEL = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                         show_default=True, help="Least severe log level shown.")


@click.command()
@click.option("--pg-dsn", help=PG_DSN_HELP + " Required.")
@click.option("--safekeepers", help=SAFEKEEPERS_HELP + " Required.")
@click.option("--quorum", type=int, help="Quorum the proposer runs with; default N//2+1.")
@click.option("--application-name", default="walsidecar", show_default=True, help=APP_HELP)
@click.option("--slot", default="walsidecar", show_default=True, help=SLOT_HELP)
@click.option("--proposer-metrics", help="Also check the proposer's --metrics endpoint (HOST:PORT).")
@click.option("--format", "format", type=click.Choice(["console", "json"]), default="console", show_default=True,
              help="One line per check, or a JSON document.")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for each answer.")
@tls_options("client")
@LOG_FORMAT
@LOG_LEVEL
@configured(CheckSettings)
def check(**kw: object) -> None:
    """Check the primary, the safekeepers and the sidecar: OK, WARNING or FAILED per line (exit 1 on FAILED)."""
    from sidecar.logs import configure
    from sidecar.ops.check import run_check

    configure(str(kw["log_format"]), str(kw["log_level"]))
    sys.exit(run_check(CheckSettings.model_construct(**kw)))


@click.command()
@click.option("--proposer-metrics", help="The proposer's --metrics address (HOST:PORT): the full picture.")
@click.option("--safekeepers", help=SAFEKEEPERS_HELP + " Each is asked directly (works with the proposer down).")
@click.option("--pg-dsn", help=PG_DSN_HELP + " Adds its flush LSN, waiting commits and the sidecar's sync state.")
@click.option("--quorum", type=int, help="Quorum the proposer runs with; default N//2+1.")
@click.option("--application-name", default="walsidecar", show_default=True, help=APP_HELP)
@click.option("--slot", default="walsidecar", show_default=True, help=SLOT_HELP)
@click.option("--format", "format", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="A table like `patronictl list`, or JSON.")
@click.option("--watch", type=float, help="Refresh every this many seconds until Ctrl-C.")
@click.option("--count", type=int, help="With --watch: stop after this many refreshes.")
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds to wait for each answer.")
@tls_options("client")
@LOG_FORMAT
@LOG_LEVEL
@configured(StatusSettings)
def status(**kw: object) -> None:
    """Show each safekeeper's state, term, flush LSN and lag, and the proposer's term and commit LSN."""
    from sidecar.logs import configure
    from sidecar.ops.status import run_status

    configure(str(kw["log_format"]), str(kw["log_level"]))
    sys.exit(run_status(StatusSettings.model_construct(**kw)))


@click.command("init-postgres")
@click.option("--pg-dsn", help=PG_DSN_HELP + " Connect as a superuser. Required.")
@click.option("--application-name", default="walsidecar", show_default=True, help=APP_HELP)
@click.option("--slot", default="walsidecar", show_default=True, help=SLOT_HELP)
@click.option("--role", default="walsidecar", show_default=True,
              help="Role to create with LOGIN REPLICATION and pg_monitor for the sidecar; '' for none.")
@click.option("--max-slot-wal-keep-size", default="10GB", show_default=True,
              help="Set when unlimited (-1): WAL the primary keeps for a safekeeper that stays down.")
@click.option("--sync", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Name the sidecar in an empty synchronous_standby_names: on, off, or auto (only once it streams).")
@click.option("--uninstall", is_flag=True, help="Apply sql/uninstall.sql instead (stop `walsidecar start` first).")
@click.option("--sql-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory holding install.sql and uninstall.sql; default: the package's sql/.")
@LOG_FORMAT
@LOG_LEVEL
@configured(InitPostgresSettings)
def init_postgres(**kw: object) -> None:
    """Prepare a primary with sql/install.sql: role, settings, slots and views; say what needs a restart."""
    from sidecar.logs import configure
    from sidecar.ops.initpg import run_init

    configure(str(kw["log_format"]), str(kw["log_level"]))
    sys.exit(run_init(InitPostgresSettings.model_construct(**kw)))
