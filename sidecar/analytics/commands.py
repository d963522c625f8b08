"""The `analyze` and `verify-archive` commands; Spark and pyarrow are imported only when one of them runs.

They need the analytics extra (PySpark, numba, pyarrow; Spark needs Java 17+), which the core install leaves out."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from sidecar.config import VerifyArchiveSettings, configured
from sidecar.lsn import format_lsn

F = Callable[..., Any]
INSTALL_HINT = "pip install 'walsidecar[analytics]' and a Java 17+ runtime (scripts/install.sh installs both)"
# Shown under each command's --help: the core install (pip install walsidecar) leaves the extra out.
NEEDS_EXTRA = f"Needs the analytics extra: {INSTALL_HINT}."


# What spark_options adds: passed through to Spark, not settings (verify-archive has settings besides).
SPARK_OPTIONS = frozenset({"master", "confs", "spark_ui", "s3_endpoint", "progress", "first", "last"})


def spark_options(fn: F) -> F:
    """--master, --conf, --spark-ui, --s3-endpoint and --progress/--no-progress."""
    options = [
        click.option("--master", default="local[*]", show_default=True, envvar="WALSIDECAR_SPARK_MASTER",
                     help="Spark master URL, passed through to Spark."),
        click.option("--conf", "confs", multiple=True, metavar="KEY=VALUE",
                     help="Spark configuration, passed through (repeatable); overrides walsidecar's defaults."),
        click.option("--spark-ui", is_flag=True, help="Run the Spark web UI (off by default)."),
        click.option("--s3-endpoint", envvar="AWS_ENDPOINT_URL", metavar="URL",
                     help="S3 endpoint for s3:// sources and outputs (default: AWS's, or AWS_ENDPOINT_URL)."),
        click.option("--progress/--no-progress", default=True, show_default=True,
                     help="Show a progress bar for the Spark stages on stderr."),
        click.option("--first", metavar="SEGMENT", help="First segment file to read (default: the lowest in SOURCE)."),
        click.option("--last", metavar="SEGMENT", help="Last segment file to read (default: the highest in SOURCE)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _imports() -> None:
    try:
        import numba  # noqa: F401
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        raise _missing(exc) from exc


def _missing(exc: ImportError) -> click.ClickException:
    return click.ClickException(f"{exc.name} is not installed: install the analytics extra: {INSTALL_HINT}")


def _plan(source: str, first: str | None, last: str | None, s3_endpoint: str | None) -> Any:
    try:
        from sidecar.wal.archive import open_storage, plan_archive
    except ImportError as exc:  # numpy: the plan lives beside the segment scan
        raise _missing(exc) from exc
    try:
        return plan_archive(open_storage(source, s3_endpoint=s3_endpoint), first, last)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


def _run(master: str, confs: tuple[str, ...], spark_ui: bool, progress: bool, work: Callable[[Any, Any], Any]) -> Any:
    from sidecar.analytics.session import StageProgress, parse_conf, spark_session

    try:
        conf = parse_conf(confs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--conf") from exc
    with spark_session(master, conf, ui=spark_ui) as spark, StageProgress(spark, sys.stderr if progress else None) as bar:
        return work(spark, bar)


@click.command(epilog=NEEDS_EXTRA)
@click.argument("source")
@click.option("--out", metavar="DIR", help="Write the Parquet datasets, stats.txt and report.html here "
                                           "(a directory or s3://bucket/prefix).")
@click.option("--stats", "want_stats", is_flag=True,
              help="Print the per-record-type table in the layout of pg_waldump --stats=record.")
@spark_options
def analyze(source: str, out: str | None, want_stats: bool, master: str, confs: tuple[str, ...], spark_ui: bool,
            s3_endpoint: str | None, progress: bool, first: str | None, last: str | None) -> None:
    """Decode archived WAL with Spark into datasets, a report and statistics.

    SOURCE is a directory of WAL segments (an archive, pg_wal, a safekeeper's wal/) or s3://bucket/prefix.
    With --stats the output for segments FIRST..LAST equals that of
    `pg_waldump --stats=record --path SOURCE FIRST LAST`.
    """
    if out is None and not want_stats:
        raise click.UsageError("nothing to do: give --out DIR, --stats, or both")
    _imports()
    from sidecar.analytics.pipeline import analyze as run_analyze
    from sidecar.wal.stats import format_stats_record

    plan = _plan(source, first, last, s3_endpoint)
    result = _run(master, confs, spark_ui, progress,
                  lambda spark, bar: run_analyze(spark, plan, bar, out=out, want_stats=want_stats,
                                                 s3_endpoint=s3_endpoint))
    chain = result.chain
    if want_stats:
        if chain.valid_start is None:
            start = plan.segments[0].segno * plan.seg_size if plan.segments else 0
            raise click.ClickException(f"could not find a valid record after {format_lsn(start)}")
        click.echo(format_stats_record(result.stats), nl=False)
    for p in chain.problems[:5]:
        click.echo(f"warning: {p.describe()}", err=True)
    if len(chain.problems) > 5:
        click.echo(f"warning: {len(chain.problems) - 5} more problems; run verify-archive for all", err=True)
    if out is not None:
        click.echo(f"wrote {', '.join(result.written)}", err=True)


@click.command("verify-archive", epilog=NEEDS_EXTRA)
@click.argument("source")
@spark_options
@configured(VerifyArchiveSettings)
def verify_archive(s: VerifyArchiveSettings, source: str, master: str, confs: tuple[str, ...], spark_ui: bool,
                   s3_endpoint: str | None, progress: bool, first: str | None, last: str | None) -> None:
    """Check archived WAL: CRC of every record, page headers, xl_prev chain, missing segments, timelines.

    Exits 1 naming the segment and LSN of the first problem; prints a summary when the archive is intact.
    SOURCE is a directory of WAL segments, file:///path or s3://bucket/prefix (the safekeepers upload to
    <--archive>/<cluster>/<system id>/wal). With --safekeepers, a segment missing below any safekeeper's
    backup_lsn is a problem too, as is an object a safekeeper found not to hold its WAL of that segment.
    """
    plan = _plan(source, first, last, s3_endpoint)
    gaps = _backup_gaps(s, plan)
    if s.gaps_only:
        _report(gaps)
        click.echo(f"OK: no gap in {plan.storage.location} below the safekeepers' backup_lsn")
        return
    _imports()
    from sidecar.analytics.pipeline import verify

    chain = _run(master, confs, spark_ui, progress, lambda spark, bar: verify(spark, plan, bar))
    segs = plan.segments
    _report(sorted(set(chain.problems) | set(gaps)))
    tlis = sorted({s.tli for s in segs})
    last_seg = chain.summaries[-1] if chain.summaries else None
    click.echo(f"OK: {len(segs)} segments {segs[0].name}..{segs[-1].name} (timeline {', '.join(map(str, tlis))})")
    click.echo(f"  {chain.records:,} records from {format_lsn(chain.valid_start or 0)} to {format_lsn(chain.valid_end or 0)}:"
               " every CRC valid, page headers and xl_prev chain consistent")
    if last_seg is not None and not last_seg.reached_end:
        click.echo(f"  WAL ends in {last_seg.name}: {last_seg.end_reason}")


def _report(problems: list[Any]) -> None:
    """Print the problems and exit 1, if there are any."""
    if not problems:
        return
    click.echo(f"FAILED: {problems[0].describe()}")
    for p in problems[1:20]:
        click.echo(f"  also: {p.describe()}")
    if len(problems) > 20:
        click.echo(f"  and {len(problems) - 20} more")
    sys.exit(1)


def _backup_gaps(s: VerifyArchiveSettings, plan: Any) -> list[Any]:
    """Segments the archive lacks below each safekeeper's backup_lsn; a safekeeper that does not answer fails."""
    import asyncio

    from sidecar.linkauth import client_security
    from sidecar.skclient import probe_safekeeper
    from sidecar.wal.archive import backup_gaps, reported_mismatch

    if not s.safekeepers:
        return []
    link = client_security(s.certs_dir, s.link_security)

    async def ask() -> list[Any]:
        return await asyncio.gather(*(probe_safekeeper(a, s.timeout, link) for a in s.safekeepers),
                                    return_exceptions=True)

    gaps = []
    for addr, reply in zip(s.safekeepers, asyncio.run(ask())):
        if isinstance(reply, BaseException):
            raise click.ClickException(f"safekeeper {addr} did not answer ({reply}): its backup_lsn is unknown")
        who = f"safekeeper {reply.node_id} ({addr})"
        gaps += backup_gaps(plan, reply.backup_lsn, who)
        if reply.archive_mismatch:
            gaps.append(reported_mismatch(reply.archive_mismatch, reply.backup_lsn, who))
    return sorted(set(gaps))
