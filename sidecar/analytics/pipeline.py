"""The Spark jobs: one task per segment decodes and checks it; aggregations build the datasets and statistics."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sidecar.analytics.arrow import (
    SEGMENTS_SCHEMA,
    SUMMARY_TASK_SCHEMA,
    TASK_SCHEMA,
    summary_from_row,
    summary_row,
    task_batches,
)
from sidecar.analytics.session import StageProgress
from sidecar.objectstore import open_storage, upload_dir
from sidecar.wal.archive import (
    ArchivePlan,
    ChainResult,
    SegmentRef,
    Storage,
    check_chain,
    scan_segment,
)
from sidecar.wal.stats import WalStats, format_stats_record

DATASETS = ("records", "segments", "relations", "commits_per_second", "record_types")
RELATION_KEYS = ("spc", "db", "rel", "fork")
# A Spark task costs about 0.1 s besides its work, as much as decoding several segments: each task scans a run
# of consecutive segments, one task per core, or per SEGMENTS_PER_TASK segments when there are more.
SEGMENTS_PER_TASK = 32


@dataclass
class ScanTask:
    """The mapInArrow function: each input row is an index into segments; yields that segment's batches."""

    storage: Storage
    segments: list[SegmentRef]
    seg_size: int
    with_records: bool  # emit the records
    with_types: bool  # count the records per type, for the statistics

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        by_segno = {s.segno: s for s in self.segments}
        keep = self.with_records or self.with_types
        for batch in batches:
            for index in batch.column(0).to_pylist():
                seg = self.segments[index]
                scan = scan_segment(self.storage, seg, by_segno, self.seg_size, keep_records=keep)
                yield from task_batches(scan, self.with_records, self.with_types)


def scan_frame(spark: Any, plan: ArchivePlan, *, with_records: bool, with_types: bool = False) -> Any:
    """A DataFrame of TASK_SCHEMA rows (SUMMARY_TASK_SCHEMA without records); each Spark task scans a run of
    consecutive segments."""
    from pyspark.sql.pandas.types import from_arrow_schema

    n = len(plan.segments)
    task = ScanTask(plan.storage, plan.segments, plan.seg_size, with_records, with_types)
    tasks = min(n, max(spark.sparkContext.defaultParallelism, -(-n // SEGMENTS_PER_TASK)))
    ids = spark.range(0, n, 1, numPartitions=max(1, tasks))
    schema = TASK_SCHEMA if with_records else SUMMARY_TASK_SCHEMA
    return ids.mapInArrow(task, from_arrow_schema(schema, prefer_timestamp_ntz=False))


def _collect(plan: ArchivePlan, frame: Any) -> tuple[ChainResult, dict[int, list[dict[str, int]]]]:
    """The chain check over the segment summaries, and each segment's record type counts (by segno)."""
    rows = frame.where(frame.seg.isNotNull()).select("seg", "types").toArrow().to_pylist()
    chain = check_chain(plan, [summary_from_row(r["seg"]) for r in rows])
    return chain, {r["seg"]["segno"]: r["types"] or [] for r in rows}


def verify(spark: Any, plan: ArchivePlan, progress: StageProgress) -> ChainResult:
    """Check every segment (CRCs, page headers, xl_prev) and their continuity."""
    progress.step(f"verifying {len(plan.segments)} segments")
    return _collect(plan, scan_frame(spark, plan, with_records=False))[0]


@dataclass
class AnalyzeResult:
    """What analyze found and wrote."""

    chain: ChainResult
    stats: WalStats | None
    written: list[str] = field(default_factory=list)


def stats_of(chain: ChainResult, types: dict[int, list[dict[str, int]]]) -> WalStats:
    """pg_waldump --stats=record counts over the unbroken WAL from the first segment: the segments check_chain
    linked (chain "ok"), whose records run from valid_start to the one ending at valid_end."""
    stats = WalStats(start_lsn=chain.valid_start, end_lsn=0)
    if chain.valid_start is None or chain.last_valid_lsn is None:
        return stats
    stats.end_lsn = chain.valid_end
    for s in chain.summaries:
        if s.chain == "ok":
            for t in types.get(s.segno, []):
                stats.add_row(t["rmid"], t["recid"], t["count"], t["rec_len"], t["fpi_len"])
    return stats


def analyze(
    spark: Any, plan: ArchivePlan, progress: StageProgress, *, out: str | None, want_stats: bool,
    s3_endpoint: str | None = None,
) -> AnalyzeResult:
    """Decode all segments once, then compute statistics and write the datasets and report.

    The statistics come from per-segment counts; only with out are the records kept (in memory) for the datasets.
    """
    from pyspark import StorageLevel

    progress.step(f"decoding {len(plan.segments)} segments")
    frame = scan_frame(spark, plan, with_records=out is not None, with_types=True)
    if out is not None:
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        chain, types = _collect(plan, frame)
        result = AnalyzeResult(chain, stats_of(chain, types) if want_stats or out is not None else None)
        if out is not None:
            assert result.stats is not None
            records = frame.where(frame.rec.isNotNull()).select("rec.*")
            _write_outputs(records, chain, result.stats, out, progress, s3_endpoint, plan)
            result.written = [f"{out.rstrip('/')}/{name}" for name in (*DATASETS, "report.html")]
        return result
    finally:
        if out is not None:
            frame.unpersist()


def _write_outputs(
    records: Any, chain: ChainResult, stats: WalStats, out: str, progress: StageProgress,
    s3_endpoint: str | None, plan: ArchivePlan,
) -> None:
    from sidecar.analytics.report import write_report

    staging = Path(tempfile.mkdtemp(prefix="walsidecar-out-")) if out.startswith("s3://") else Path(out)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        progress.step("writing records")
        records.write.mode("overwrite").parquet(str(staging / "records"))
        progress.step("aggregating")
        tables = {
            "segments": _segments_table(chain),
            "relations": relations(records).toArrow(),
            "commits_per_second": commits_per_second(records).toArrow(),
            "record_types": record_types_table(stats),
        }
        compression = fpi_compression(records).toArrow()
        for name, table in tables.items():
            _write_table(staging / name, table)
        (staging / "stats.txt").write_text(format_stats_record(stats))
        progress.step("report")
        write_report(staging, plan, chain, stats, tables, compression)
        if out.startswith("s3://"):
            progress.step("uploading")
            upload_dir(staging, open_storage(out, s3_endpoint=s3_endpoint))
    finally:
        if out.startswith("s3://"):
            shutil.rmtree(staging, ignore_errors=True)


def _write_table(directory: Path, table: pa.Table) -> None:
    """A one-file Parquet dataset, replacing what was there."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    pq.write_table(table, directory / "part-00000.parquet")


def _segments_table(chain: ChainResult) -> pa.Table:
    rows = []
    for s in chain.summaries:
        row = summary_row(s)
        row["chain"] = s.chain
        row["continues_to_next"] = s.continues_to_next
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=SEGMENTS_SCHEMA)


def record_types_table(stats: WalStats) -> pa.Table:
    """The statistics rows as data: rmgr, record type, count, record/FPI/combined bytes."""
    from sidecar.wal.rmgrdesc import identify, rmgr_name

    rows = [
        {"rmid": rmid, "recid": recid, "rmgr": rmgr_name(rmid), "record_type": identify(rmid, recid << 4),
         "count": r.count, "record_bytes": r.rec_len, "fpi_bytes": r.fpi_len, "combined_bytes": r.rec_len + r.fpi_len}
        for (rmid, recid), r in sorted(stats.rows.items())
    ]
    schema = pa.schema([("rmid", pa.int16()), ("recid", pa.int16()), ("rmgr", pa.string()), ("record_type", pa.string()),
                        ("count", pa.int64()), ("record_bytes", pa.int64()), ("fpi_bytes", pa.int64()),
                        ("combined_bytes", pa.int64())])
    return pa.Table.from_pylist(rows, schema=schema)


def _block_refs(records: Any) -> Any:
    from pyspark.sql import functions as F

    return records.select("lsn", "tot_len", F.explode("blocks").alias("b")).select("lsn", "tot_len", "b.*")


def relations(records: Any) -> Any:
    """Write volume per relation fork: block references, records, distinct blocks, FPIs and bytes.

    record_bytes counts each record touching the relation once, whole; data_bytes and fpi_bytes are the
    block data and stored images belonging to the relation itself.
    """
    from pyspark.sql import functions as F

    refs = _block_refs(records)
    per_block = refs.groupBy(*RELATION_KEYS).agg(
        F.count("*").alias("block_refs"),
        F.countDistinct("blkno").alias("distinct_blocks"),
        F.sum(F.col("has_image").cast("long")).alias("fpi_count"),
        F.sum("bimg_len").cast("long").alias("fpi_bytes"),
        F.sum("data_len").cast("long").alias("data_bytes"),
    )
    per_record = (refs.groupBy("lsn", *RELATION_KEYS).agg(F.first("tot_len").alias("tot_len"))
                  .groupBy(*RELATION_KEYS).agg(F.count("*").alias("records"), F.sum("tot_len").alias("record_bytes")))
    return (per_block.join(per_record, list(RELATION_KEYS))
            .withColumn("relation", F.concat_ws("/", "spc", "db", "rel"))
            .withColumn("wal_bytes", F.col("fpi_bytes") + F.col("data_bytes"))
            .select("relation", *RELATION_KEYS, "records", "block_refs", "distinct_blocks", "fpi_count",
                    "fpi_bytes", "data_bytes", "wal_bytes", "record_bytes")
            .orderBy(F.desc("wal_bytes"), "spc", "db", "rel", "fork"))


def commits_per_second(records: Any) -> Any:
    """Commits and aborts per second of their commit/abort timestamps."""
    from pyspark.sql import functions as F

    from sidecar.wal.decode import XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED

    op = F.col("info").bitwiseAND(0x70)
    is_commit = op.isin(XLOG_XACT_COMMIT, XLOG_XACT_COMMIT_PREPARED)
    return (records.where(F.col("xact_time").isNotNull())
            .groupBy(F.date_trunc("second", "xact_time").alias("second"))
            .agg(F.sum(is_commit.cast("long")).alias("commits"), F.sum((~is_commit).cast("long")).alias("aborts"))
            .orderBy("second"))


def fpi_compression(records: Any) -> Any:
    """Full-page images by compression method: count, stored bytes and bytes saved by compression and holes."""
    from pyspark.sql import functions as F

    images = _block_refs(records).where("has_image")
    return (images.groupBy(F.coalesce("compression", F.lit("none")).alias("compression"))
            .agg(F.count("*").alias("images"), F.sum("bimg_len").cast("long").alias("stored_bytes"),
                 F.sum(F.lit(8192) - F.col("bimg_len")).cast("long").alias("saved_bytes"))
            .orderBy("compression"))
