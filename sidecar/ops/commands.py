"""Click definitions of the operator commands; `sidecar.cli` registers them on `walsidecar`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sidecar.config import (
    CheckSettings, FailoverGateSettings, FailoverSettings, InitPostgresSettings, RestoreWalSettings, StatusSettings, configured,
)


@click.command()
@configured(CheckSettings)
def check(s: CheckSettings) -> None:
    """Check the primary, the safekeepers and the sidecar: OK, WARNING or FAILED per line (exit 1 on FAILED)."""
    from sidecar.ops.check import run_check
    sys.exit(run_check(s))


@click.command()
@configured(StatusSettings)
def status(s: StatusSettings) -> None:
    """Show each safekeeper's state, term, flush LSN and lag, and the proposer's term and commit LSN.

    Give --proposer-metrics for the full picture; --safekeepers asks each directly (works with the
    proposer down); --pg-dsn adds the primary's view.

    \b
    Exit codes (of the last refresh with --watch --count):
      0  the proposer answers and has a quorum of safekeepers (without
         --proposer-metrics: a majority of --safekeepers answer, or the primary does)
      1  the quorum is lost, or the proposer (or the primary) does not answer
      2  the TLS options are wrong (--certs-dir)
    """
    from sidecar.ops.status import run_status
    sys.exit(run_status(s))


@click.command("init-postgres")
@configured(InitPostgresSettings)
def init_postgres(s: InitPostgresSettings) -> None:
    """Prepare a primary with sql/install.sql: role, settings, slots and views; say what needs a restart."""
    from sidecar.ops.initpg import run_init
    sys.exit(run_init(s))


@click.command("restore-wal")
@click.argument("name", metavar="%f")
@click.argument("target", metavar="%p", type=click.Path(dir_okay=False, path_type=Path))
@configured(RestoreWalSettings)
def restore_wal(s: RestoreWalSettings, name: str, target: Path) -> None:
    """PostgreSQL's restore_command: fetch WAL file %f from the safekeepers (else --archive) into %p.

    restore_command = 'walsidecar restore-wal %f %p --config /etc/walsidecar/restore.toml'

    \b
    Exit codes (PostgreSQL takes 1-125 as "not there" and moves on, above 125 stops recovery):
      0  restored, checked (size, page headers, record CRCs)
      1  %f is known not to exist: beyond the committed end (a majority of the
         safekeepers say so), or, with --archive alone, not in the archive
      2  wrong usage or options (also: an archive of several systems and no --system-id)
      3  too few safekeepers answered to know, and the archive lacks %f or did not answer
      4  the safekeepers (or the archive) that hold %f gave WAL that fails the checks
      5  %p could not be written
      6  %f is committed, but no safekeeper that answered holds it (nor the archive)
    Under archive recovery (recovery.signal; --on-error stop) 2-6 become 130-134,
    after asking again for --retry-for seconds: recovery stops instead of opening
    without WAL that exists. A standby (standby.signal) gets 2-6 and asks again.
    """
    from sidecar.ops.restore import restore_wal as run
    sys.exit(int(run(s, name, target)))


@click.command()
@configured(FailoverSettings)
def failover(s: FailoverSettings) -> None:
    """Promote a standby without losing an acknowledged commit: fence, recover, catch up, promote, resume.

    \b
    Each step says what it does. Exit code 0: the standby is the primary
    (also when it already was); 1: a step refused or failed, nothing was
    promoted, and the command can be run again.
    """
    from sidecar.ops.failover import run_failover
    sys.exit(run_failover(s))


@click.command("failover-gate")
@configured(FailoverGateSettings)
def failover_gate(s: FailoverGateSettings) -> None:
    """Patroni's pre_promote: fence, recover and catch up this node's standby to E; promote nothing.

    \b
    Patroni runs it on the node that won its leader lock, then promotes
    that node itself. Exit code 0: the old primary's timeline ends at the
    quorum's commit position E for good and the standby replayed E, so it
    holds every acknowledged commit. 1: it cannot fence a quorum or the
    standby cannot reach E in time; nothing that matters changed, and
    Patroni keeps the node a replica (docs/ha.md).
    """
    from sidecar.ops.failover import run_failover_gate
    sys.exit(run_failover_gate(s))
