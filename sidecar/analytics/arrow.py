"""Segment scans as Arrow record batches: the `records` and `segments` schemas and their conversion."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sidecar.wal.archive import Problem, SegmentScan, SegmentSummary
from sidecar.wal.decode import (
    BKPBLOCK_FORK_MASK,
    BKPBLOCK_HAS_IMAGE,
    BKPBLOCK_WILL_INIT,
    BKPIMAGE_APPLY,
    BKPIMAGE_COMPRESS_LZ4,
    BKPIMAGE_COMPRESS_PGLZ,
    BKPIMAGE_COMPRESS_ZSTD,
    FORK_NAMES,
    POSTGRES_EPOCH_UNIX_US,
)
from sidecar.wal.format import RM_MAX_CUSTOM_ID, rmid_is_valid
from sidecar.wal.rmgrdesc import RM_XACT_ID, identify, rmgr_name

BLOCK_TYPE = pa.struct([
    ("block_id", pa.int16()),
    ("spc", pa.int64()),
    ("db", pa.int64()),
    ("rel", pa.int64()),
    ("fork", pa.string()),
    ("blkno", pa.int64()),
    ("flags", pa.int16()),
    ("will_init", pa.bool_()),
    ("data_len", pa.int32()),
    ("has_image", pa.bool_()),
    ("bimg_len", pa.int32()),
    ("hole_offset", pa.int32()),
    ("hole_length", pa.int32()),
    ("bimg_info", pa.int16()),
    ("apply_image", pa.bool_()),
    ("compression", pa.string()),
])

RECORD_SCHEMA = pa.schema([
    ("segno", pa.int64()),
    ("tli", pa.int32()),
    ("lsn", pa.int64()),
    ("end_lsn", pa.int64()),
    ("prev", pa.int64()),
    ("xid", pa.int64()),
    ("rmid", pa.int16()),
    ("rmgr", pa.string()),
    ("info", pa.int16()),
    ("recid", pa.int16()),  # pg_waldump --stats=record key: info >> 4, xact HAS_INFO bit masked
    ("record_type", pa.string()),
    ("tot_len", pa.int64()),
    ("rec_len", pa.int64()),  # tot_len without full-page images, as pg_waldump's "rec" length
    ("fpi_len", pa.int64()),
    ("main_len", pa.int64()),
    ("crc", pa.int64()),
    ("xact_time", pa.timestamp("us", tz="UTC")),
    ("block_count", pa.int16()),
    ("blocks", pa.list_(pa.field("item", BLOCK_TYPE))),
])

PROBLEM_TYPE = pa.struct([("lsn", pa.int64()), ("kind", pa.string()), ("segment", pa.string()), ("message", pa.string())])

SUMMARY_SCHEMA = pa.schema([
    ("segno", pa.int64()),
    ("tli", pa.int32()),
    ("name", pa.string()),
    ("size", pa.int64()),
    ("start_lsn", pa.int64()),
    ("records", pa.int64()),
    ("first_lsn", pa.int64()),
    ("first_prev", pa.int64()),
    ("last_lsn", pa.int64()),
    ("last_end", pa.int64()),
    ("record_bytes", pa.int64()),
    ("fpi_bytes", pa.int64()),
    ("crc_failures", pa.int32()),
    ("sysid", pa.string()),  # a uint64, beyond int64's range in general
    ("page_tli_min", pa.int32()),
    ("page_tli_max", pa.int32()),
    ("reached_end", pa.bool_()),
    ("end_reason", pa.string()),
    ("head_bytes_read", pa.int64()),
    ("problems", pa.list_(pa.field("item", PROBLEM_TYPE))),
])

SEGMENTS_SCHEMA = SUMMARY_SCHEMA.append(pa.field("chain", pa.string())).append(pa.field("continues_to_next", pa.bool_()))

# Records of one segment counted per pg_waldump --stats=record row.
TYPE_STATS_TYPE = pa.list_(pa.field("item", pa.struct([
    ("rmid", pa.int16()),
    ("recid", pa.int16()),
    ("count", pa.int64()),
    ("rec_len", pa.int64()),
    ("fpi_len", pa.int64()),
])))

# The output of one Spark task: batches of records, then one segment summary with its record type counts;
# the columns a row does not use are null. A task emitting no records leaves out their column (Spark then
# plans a smaller query).
SUMMARY_TASK_SCHEMA = pa.schema([("seg", pa.struct(list(SUMMARY_SCHEMA))), ("types", TYPE_STATS_TYPE)])
TASK_SCHEMA = SUMMARY_TASK_SCHEMA.insert(0, pa.field("rec", pa.struct(list(RECORD_SCHEMA))))

_NAME_KEYS = (RM_MAX_CUSTOM_ID + 1) * 16
_RMGR_NAMES = pa.array([rmgr_name(r) if rmid_is_valid(r) else None for r in range(RM_MAX_CUSTOM_ID + 1)])
_TYPE_NAMES = pa.array([identify(k >> 4, (k & 15) << 4) if rmid_is_valid(k >> 4) else None for k in range(_NAME_KEYS)])
_FORKS = pa.array(list(FORK_NAMES) + [None] * (BKPBLOCK_FORK_MASK + 1 - len(FORK_NAMES)))
_COMPRESSIONS = pa.array([None, "pglz", "lz4", "zstd"])

BATCH_ROWS = 65536


def _blocks_array(blocks: dict[str, np.ndarray], counts: np.ndarray) -> pa.ListArray:
    """The block references as list<struct>, one list per record."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flags = blocks["fork_flags"]
    bimg_info = blocks["bimg_info"]
    has_image = (flags & BKPBLOCK_HAS_IMAGE) != 0
    method = np.select(
        [(bimg_info & BKPIMAGE_COMPRESS_PGLZ) != 0, (bimg_info & BKPIMAGE_COMPRESS_LZ4) != 0,
         (bimg_info & BKPIMAGE_COMPRESS_ZSTD) != 0], [1, 2, 3], 0)
    children = [
        pa.array(blocks["block_id"], pa.int16()), pa.array(blocks["spc"]), pa.array(blocks["db"]),
        pa.array(blocks["rel"]), pc.take(_FORKS, pa.array(flags & BKPBLOCK_FORK_MASK)), pa.array(blocks["blkno"]),
        pa.array(flags, pa.int16()), pa.array((flags & BKPBLOCK_WILL_INIT) != 0),
        pa.array(blocks["data_len"], pa.int32()), pa.array(has_image), pa.array(blocks["bimg_len"], pa.int32()),
        pa.array(blocks["hole_offset"], pa.int32()), pa.array(blocks["hole_length"], pa.int32()),
        pa.array(bimg_info, pa.int16()), pa.array(has_image & ((bimg_info & BKPIMAGE_APPLY) != 0)),
        pc.take(_COMPRESSIONS, pa.array(method)),
    ]
    struct = pa.StructArray.from_arrays(children, fields=list(BLOCK_TYPE))
    return pa.ListArray.from_arrays(pa.array(offsets), struct, type=RECORD_SCHEMA.field("blocks").type)


def _stats_recids(rmid: np.ndarray, info: np.ndarray) -> np.ndarray:
    """stats_recid over columns: info >> 4, with the xact HAS_INFO bit masked."""
    recid = info >> 4
    return np.where(rmid == RM_XACT_ID, recid & 0x07, recid)


def records_table(scan: SegmentScan) -> pa.Table:
    """The records of a segment scan as a table of RECORD_SCHEMA, straight from its column arrays."""
    cols = scan.record_columns
    n = len(scan)
    rmid = cols["rmid"]
    info = cols["info"]
    tot_len = cols["tot_len"]
    fpi_len = cols["fpi_len"]
    recid = _stats_recids(rmid, info)
    xact = pa.array(cols["xact_time"] + POSTGRES_EPOCH_UNIX_US, mask=cols["xact_valid"] == 0)
    s = scan.summary
    arrays = [
        pa.array(np.full(n, s.segno, dtype=np.int64)),
        pa.array(np.full(n, s.tli, dtype=np.int32)),
        pa.array(cols["lsn"]),
        pa.array(cols["end_lsn"]),
        pa.array(cols["prev"]),
        pa.array(cols["xid"]),
        pa.array(rmid, pa.int16()),
        pc.take(_RMGR_NAMES, pa.array(rmid)),
        pa.array(info, pa.int16()),
        pa.array(recid, pa.int16()),
        pc.take(_TYPE_NAMES, pa.array(rmid * 16 + (info >> 4))),
        pa.array(tot_len),
        pa.array(tot_len - fpi_len),
        pa.array(fpi_len),
        pa.array(cols["main_len"]),
        pa.array(cols["crc"]),
        xact.cast(pa.timestamp("us", tz="UTC")),
        pa.array(cols["block_count"], pa.int16()),
        _blocks_array(scan.block_columns, cols["block_count"]),
    ]
    return pa.Table.from_arrays(arrays, schema=RECORD_SCHEMA)


def type_stats(scan: SegmentScan) -> list[dict[str, int]]:
    """The scan's records counted per (rmid, recid): count, record bytes without FPIs, FPI bytes (TYPE_STATS_TYPE)."""
    cols = scan.record_columns
    keys, which = np.unique(cols["rmid"] * 16 + _stats_recids(cols["rmid"], cols["info"]), return_inverse=True)
    sums = np.zeros((2, len(keys)), dtype=np.int64)
    np.add.at(sums[0], which, cols["tot_len"] - cols["fpi_len"])
    np.add.at(sums[1], which, cols["fpi_len"])
    counts = np.bincount(which, minlength=len(keys))
    return [{"rmid": int(k >> 4), "recid": int(k & 15), "count": int(n), "rec_len": int(r), "fpi_len": int(f)}
            for k, n, r, f in zip(keys, counts, sums[0], sums[1])]


def summary_row(s: SegmentSummary) -> dict[str, Any]:
    """A segment summary as a SUMMARY_SCHEMA row."""
    row = {f.name: getattr(s, f.name) for f in SUMMARY_SCHEMA if f.name not in ("sysid", "problems")}
    row["sysid"] = None if s.sysid is None else str(s.sysid)
    row["problems"] = [vars(p) for p in s.problems]
    return row


def summary_from_row(row: dict[str, Any]) -> SegmentSummary:
    """The SegmentSummary a SUMMARY_SCHEMA row holds."""
    fields = {k: v for k, v in row.items() if k in SegmentSummary.__dataclass_fields__}
    fields["sysid"] = None if row.get("sysid") is None else int(row["sysid"])
    fields["problems"] = [Problem(**p) for p in row.get("problems") or []]
    return SegmentSummary(**fields)


def task_batches(scan: SegmentScan, with_records: bool, with_types: bool) -> Iterator[pa.RecordBatch]:
    """The batches a Spark task emits for one segment: its records (if wanted), then its summary with the
    record type counts (if wanted)."""
    rec_type = TASK_SCHEMA.field("rec").type
    seg_type = TASK_SCHEMA.field("seg").type
    if with_records and len(scan):
        table = records_table(scan)
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            rec = pa.StructArray.from_arrays(batch.columns, fields=list(rec_type))
            others = [pa.nulls(len(batch), seg_type), pa.nulls(len(batch), TYPE_STATS_TYPE)]
            yield pa.RecordBatch.from_arrays([rec, *others], schema=TASK_SCHEMA)
    seg = pa.array([summary_row(scan.summary)], type=seg_type)
    types = pa.array([type_stats(scan) if with_types else None], type=TYPE_STATS_TYPE)
    if with_records:
        yield pa.RecordBatch.from_arrays([pa.nulls(1, rec_type), seg, types], schema=TASK_SCHEMA)
    else:
        yield pa.RecordBatch.from_arrays([seg, types], schema=SUMMARY_TASK_SCHEMA)
