"""What reading the records that start in one segment gives, whichever engine reads them: columns and how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sidecar.wal.decode import BlockRef

# Per record; xact_time counts only where xact_valid is 1 (a commit or abort record).
RECORD_COLUMNS = ("lsn", "end_lsn", "prev", "xid", "rmid", "info", "tot_len", "fpi_len", "main_len", "crc",
                  "xact_time", "xact_valid", "block_count")
(R_LSN, R_END, R_PREV, R_XID, R_RMID, R_INFO, R_TOT_LEN, R_FPI_LEN, R_MAIN_LEN, R_CRC, R_XACT_TIME, R_XACT_VALID,
 R_BLOCK_COUNT) = range(len(RECORD_COLUMNS))

# Per block reference, in the records' order: BlockRef's fields.
BLOCK_COLUMNS: tuple[str, ...] = BlockRef._fields
(B_BLOCK_ID, B_FORK_FLAGS, B_SPC, B_DB, B_REL, B_BLKNO, B_DATA_LEN, B_BIMG_LEN, B_HOLE_OFFSET, B_HOLE_LENGTH,
 B_BIMG_INFO, B_IMAGE_OFFSET, B_DATA_OFFSET) = range(len(BLOCK_COLUMNS))


def empty_columns(names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {name: np.zeros(0, dtype=np.int64) for name in names}


@dataclass
class RecordScan:
    """The records read (kept or only counted), and why reading stopped, as scan_segment sums them up."""

    records: dict[str, np.ndarray] = field(default_factory=lambda: empty_columns(RECORD_COLUMNS))
    blocks: dict[str, np.ndarray] = field(default_factory=lambda: empty_columns(BLOCK_COLUMNS))
    count: int = 0
    record_bytes: int = 0
    fpi_bytes: int = 0
    first_lsn: int | None = None
    first_prev: int | None = None
    last_lsn: int | None = None
    last_end: int | None = None
    reached_end: bool = False  # the last record reaches the segment end (or is an XLOG_SWITCH)
    last_is_switch: bool = False
    decode_error: str | None = None
    stop_reason: str = ""  # the reader's, when it stopped before the segment end
    stop_lsn: int = 0  # the reader's stop_lsn
    fetched: int = 0  # bytes read from following segments
