"""Record body decoding, record type names and the pg_waldump statistics layout, on synthesised WAL."""

from __future__ import annotations

import struct
from pathlib import Path

import lz4.block
import pytest
import zstandard
from support.records import INVALID_BLOCKS, build_record, page_with_hole, pglz_runs
from support.walbuilder import WalBuilder

from sidecar.lsn import segment_file_name
from sidecar.pgcluster import ClusterError, find_bin_dir
from sidecar.wal.archive import LocalStorage, plan_archive, scan_segment
from sidecar.wal.decode import (
    BKPBLOCK_HAS_DATA,
    BKPBLOCK_SAME_REL,
    BKPBLOCK_WILL_INIT,
    BKPIMAGE_APPLY,
    BKPIMAGE_COMPRESS_LZ4,
    BKPIMAGE_COMPRESS_PGLZ,
    BKPIMAGE_COMPRESS_ZSTD,
    BKPIMAGE_HAS_HOLE,
    decode_record,
    is_abort,
    is_commit,
    pglz_decompress,
    restore_block_image,
    xact_time,
)
from sidecar.wal.format import WalFormatError
from sidecar.wal.rmgrdesc import identify, rmgr_name, stats_recid, stats_row_name
from sidecar.wal.stats import WalStats, format_stats_record, stats_from_records

def test_decodes_blocks_images_and_main_data() -> None:
    page = page_with_hole(64, 7000)
    holed = page[:64] + page[7000:]
    lz4_img = lz4.block.compress(holed, store_size=False)
    rec = build_record(
        [
            {"id": 0, "rel": (1663, 5, 16384), "blkno": 7, "data": b"abc",
             "image": holed, "hole_offset": 64, "bimg_info": BKPIMAGE_HAS_HOLE | BKPIMAGE_APPLY},
            {"id": 1, "flags": BKPBLOCK_SAME_REL | BKPBLOCK_WILL_INIT, "blkno": 8, "data": b"defg"},
            {"id": 3, "fork": 2, "rel": (1663, 5, 16390), "blkno": 0, "image": lz4_img, "hole_offset": 64,
             "hole_length": 7000 - 64, "bimg_info": BKPIMAGE_HAS_HOLE | BKPIMAGE_COMPRESS_LZ4},
        ],
        main=b"M" * 300,
        origin=4,
        toplevel=999,
    )
    dec = decode_record(rec)
    b0, b1, b3 = dec.blocks
    assert (b0.block_id, b0.spc, b0.db, b0.rel, b0.blkno, b0.fork, b0.data_len) == (0, 1663, 5, 16384, 7, 0, 3)
    assert (b0.bimg_len, b0.hole_offset, b0.hole_length, b0.compression) == (len(holed), 64, 7000 - 64, None)
    assert (b1.rel, b1.blkno, b1.has_image, b1.data_len) == (16384, 8, False, 4)
    assert (b3.block_id, b3.fork, b3.rel, b3.compression, b3.hole_length) == (3, 2, 16390, "lz4", 7000 - 64)
    assert rec[b1.data_offset : b1.data_offset + 4] == b"defg"
    assert (dec.main_len, dec.origin, dec.toplevel_xid) == (300, 4, 999)
    assert rec[dec.main_offset :] == b"M" * 300
    assert dec.fpi_len == len(holed) + len(lz4_img)
    assert restore_block_image(rec, b0) == page
    assert restore_block_image(rec, b3) == page


@pytest.mark.parametrize("method", ["pglz", "lz4", "zstd"])
def test_compressed_images_restore_with_and_without_hole(method: str) -> None:
    page = page_with_hole(200, 6000)
    flag = {"pglz": BKPIMAGE_COMPRESS_PGLZ, "lz4": BKPIMAGE_COMPRESS_LZ4, "zstd": BKPIMAGE_COMPRESS_ZSTD}[method]
    compress = {
        "pglz": pglz_runs,
        "lz4": lambda b: lz4.block.compress(b, store_size=False),
        "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
    }[method]
    holed = page[:200] + page[6000:]
    with_hole = build_record([{"id": 0, "rel": (1, 2, 3), "blkno": 1, "image": compress(holed), "hole_offset": 200,
                               "hole_length": 5800, "bimg_info": flag | BKPIMAGE_HAS_HOLE | BKPIMAGE_APPLY}])
    whole = build_record([{"id": 0, "rel": (1, 2, 3), "blkno": 1, "image": compress(page), "bimg_info": flag}])
    for rec in (with_hole, whole):
        (block,) = decode_record(rec).blocks
        assert block.compression == method
        assert restore_block_image(rec, block) == page


def test_pglz_rejects_corrupt_input() -> None:
    data = b"abc" + b"\0" * 500 + b"xyz"
    packed = pglz_runs(data)
    assert pglz_decompress(packed, len(data)) == data
    with pytest.raises(WalFormatError):
        pglz_decompress(packed[:-1], len(data))
    with pytest.raises(WalFormatError):
        pglz_decompress(bytes([1, 0x00, 0x05]) + b"x", 10)  # a match before any output


# Block references decode_record rejects, and a word of its message.
@pytest.mark.parametrize(("blocks", "message"), INVALID_BLOCKS)
def test_invalid_block_headers_are_rejected(blocks: list[dict[str, object]], message: str) -> None:
    with pytest.raises(WalFormatError, match=message):
        decode_record(build_record(blocks))


def test_inconsistent_lengths_are_rejected() -> None:
    rec = bytearray(build_record([{"id": 0, "rel": (1, 1, 1), "blkno": 0, "data": b"xyz"}], main=b"mm"))
    with pytest.raises(WalFormatError, match="invalid length"):
        decode_record(bytes(rec[:-1]))
    rec[24 + 1] &= ~BKPBLOCK_HAS_DATA
    with pytest.raises(WalFormatError, match="HAS_DATA not set"):
        decode_record(bytes(rec))
    with pytest.raises(WalFormatError, match="invalid block_id"):
        decode_record(build_record([]) + bytes([40, 0, 0, 0]))


def test_transaction_timestamps() -> None:
    commit = build_record([], main=struct.pack("<q", 123_456_789) + b"\0" * 8, rmid=1, info=0x80)
    abort = build_record([], main=struct.pack("<q", 42), rmid=1, info=0x20)
    prepare = build_record([], main=struct.pack("<q", 42), rmid=1, info=0x10)
    for rec, want in ((commit, 123_456_789), (abort, 42), (prepare, None)):
        info = rec[16]
        assert xact_time(1, info, rec, decode_record(rec)) == want
    assert is_commit(1, 0x80) and is_commit(1, 0x30) and not is_commit(1, 0x20)
    assert is_abort(1, 0x20) and is_abort(1, 0xC0) and not is_abort(10, 0x20)


# ----- names and statistics -----


def test_record_type_names() -> None:
    assert (rmgr_name(10), identify(10, 0x80), identify(10, 0x90)) == ("Heap", "INSERT+INIT", "UNKNOWN (90)")
    assert identify(1, 0x80) == "COMMIT" and stats_recid(1, 0x80) == 0 and stats_recid(10, 0x80) == 8
    assert stats_row_name(2, 0) == "Storage/UNKNOWN (0)" and stats_row_name(20, 5) == "Generic/Generic"
    assert rmgr_name(128) == "custom128" and identify(200, 0x30) == "UNKNOWN (30)"
    with pytest.raises(ValueError):
        rmgr_name(50)


def test_empty_statistics_layout() -> None:
    text = format_stats_record(WalStats())
    lines = text.splitlines()
    assert lines[0] == "WAL statistics between 0/0 and 0/0:"
    assert lines[-1].split() == ["Total", "0", "0", "[0.00%]", "0", "[0.00%]", "0", "[100%]"]


@pytest.fixture(scope="module")
def pg_waldump() -> Path:
    try:
        return find_bin_dir() / "pg_waldump"
    except ClusterError as exc:
        pytest.skip(str(exc))


def test_every_record_type_and_layout_matches_pg_waldump(tmp_path: Path, pg_waldump: Path) -> None:
    """One record of every resource manager and info value (and two custom rmgrs): names and layout as pg_waldump."""
    import subprocess

    seg = 1024 * 1024
    b = WalBuilder(seg, seg_size=seg, prev=seg - 100)
    for rmid in [*range(22), 128, 255]:
        for recid in range(16):
            if (rmid, recid) != (0, 4):  # XLOG_SWITCH would end the segment
                b.add(body=bytes(recid * 3 + rmid % 7), rmid=rmid, info=recid << 4)
    b.switch()
    name = segment_file_name(1, 1, seg)
    (tmp_path / name).write_bytes(b.bytes())
    want = subprocess.run([str(pg_waldump), "--stats=record", "--path", str(tmp_path), name],
                          capture_output=True, text=True, check=True).stdout
    storage = LocalStorage(tmp_path)
    plan = plan_archive(storage)
    (ref,) = plan.segments
    scan = scan_segment(storage, ref, plan.by_segno(), plan.seg_size)
    assert scan.summary.reached_end and not scan.summary.problems
    assert format_stats_record(stats_from_records(scan.records)) == want
