"""`analyze` and `verify-archive` on Spark over real PostgreSQL 15 WAL, checked against pg_waldump; local and S3."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from support.s3 import moto_server
from support.realwal import COMPRESSIONS, GeneratedWal, wal_fixture

from sidecar.analytics.session import spark_session
from sidecar.cli import main
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.pgcluster import find_bin_dir
from sidecar.wal.decode import decode_record, restore_block_image
from sidecar.wal.reader import SegmentDirSource, WalReader

pytestmark = [pytest.mark.spark, pytest.mark.integration]

WALDUMP_LINE = re.compile(
    r"^rmgr: (\S+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+), tx:\s*(\d+), lsn: ([0-9A-F]+/[0-9A-F]+), "
    r"prev ([0-9A-F]+/[0-9A-F]+), desc: (.*)$"
)
BLKREF = re.compile(r", blkref #(\d+): rel (\d+)/(\d+)/(\d+)(?: fork (\w+))? blk (\d+)( FPW(?: for WAL verification)?)?")
XACT_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}) UTC")


@dataclass(frozen=True)
class Dumped:
    """One record as pg_waldump prints it."""

    rmgr: str
    rec_len: int
    tot_len: int
    xid: int
    lsn: int
    prev: int
    desc: str
    blocks: tuple[tuple[str, str, int, bool], ...]  # (spc/db/rel, fork, blkno, has image)


def pg_waldump(*args: str) -> subprocess.CompletedProcess[str]:
    """pg_waldump with timestamps printed in UTC."""
    return subprocess.run([str(find_bin_dir() / "pg_waldump"), *args], capture_output=True, text=True,
                          env={**os.environ, "TZ": "UTC"}, timeout=120, check=False)


def parse_dump(text: str) -> list[Dumped]:
    out = []
    for line in text.splitlines():
        m = WALDUMP_LINE.match(line)
        assert m, f"unparsed pg_waldump line: {line!r}"
        desc = m.group(7)
        blocks = tuple((f"{b[1]}/{b[2]}/{b[3]}", b[4] or "main", int(b[5]), bool(b[6])) for b in BLKREF.findall(desc))
        out.append(Dumped(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), parse_lsn(m.group(5)),
                          parse_lsn(m.group(6)), BLKREF.sub("", desc), blocks))
    return out


def cli(*args: str, progress: bool = False) -> Result:
    """Run walsidecar in this process, so the module's Spark session is the one used."""
    return CliRunner().invoke(main, [*args, "--progress" if progress else "--no-progress"])


def link_copy(src: Path, dst: Path, *, copy: tuple[str, ...] = ()) -> Path:
    """A copy of an archive directory: hard links, except real copies of the files named in copy (to damage)."""
    dst.mkdir(mode=0o755)
    for f in src.iterdir():
        if f.name in copy:
            shutil.copyfile(f, dst / f.name)
        else:
            os.link(f, dst / f.name)
    return dst


# ----- fixtures -----


wal = wal_fixture("analytics")


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One Spark session for the module; S3 credentials are dummies, set before the JVM (and its workers) start."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "test")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "test")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # else boto3 probes an address outside this machine
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        with spark_session("local[2]", {"spark.driver.memory": "1g"}) as session:
            yield session


@pytest.fixture(scope="module")
def dump(wal: GeneratedWal) -> list[Dumped]:
    proc = pg_waldump("--path", str(wal.archive), wal.names[0], wal.names[-1])
    assert "invalid record length" in proc.stderr  # the live segment ends in zeroes
    return parse_dump(proc.stdout)


@dataclass(frozen=True)
class Analyzed:
    stdout: str
    out: Path


@pytest.fixture(scope="module")
def analyzed(wal: GeneratedWal, spark: Any) -> Analyzed:
    out = wal.archive.parent / "out"
    result = cli("analyze", str(wal.archive), "--stats", "--out", str(out), progress=True)
    assert result.exit_code == 0, result.output
    return Analyzed(result.stdout, out)


@pytest.fixture(scope="module")
def s3(spark: Any, test_root: Path) -> Iterator[str]:
    """moto_server on 127.0.0.1, stopped by its PID afterwards; yields its endpoint URL."""
    with moto_server(test_root) as endpoint:
        yield endpoint


# ----- set-up -----

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def listening_addresses(pid: int) -> list[str]:
    """Hex local addresses (as /proc/net/tcp* shows them) of the TCP sockets process pid listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].partition(":")[0])
    return found


def test_analyze_needs_out_or_stats(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["analyze", str(tmp_path)])
    assert result.exit_code == 2 and "--out DIR, --stats, or both" in result.stderr
    result = CliRunner().invoke(main, ["analyze", "gs://bucket/wal", "--stats"])
    assert result.exit_code == 1 and "unsupported storage 'gs://bucket/wal'" in result.stderr


def test_spark_workers_load_the_compiled_scan_from_the_cache(wal: GeneratedWal, spark: Any) -> None:
    """The Python workers run the decoder the driver compiled: they load it from the same cache, not compile it."""
    from sidecar.wal import jit
    from sidecar.wal.archive import LocalStorage, plan_archive, scan_segment

    plan = plan_archive(LocalStorage(wal.archive))
    first = plan.segments[0]
    scan_segment(plan.storage, first, plan.by_segno(), plan.seg_size)  # compiles or loads the kernel here

    def in_worker(_: Iterator[int]) -> Iterator[tuple[str | None, int, int]]:
        from sidecar.wal import jit, kernel
        from sidecar.wal.archive import scan_segment

        scan_segment(plan.storage, first, plan.by_segno(), plan.seg_size)
        stats = kernel.scan.stats
        yield jit.cache_dir(), sum(stats.cache_hits.values()), sum(stats.cache_misses.values())

    ((cache, hits, misses),) = spark.sparkContext.parallelize([0], 1).mapPartitions(in_worker).collect()
    assert (cache, misses) == (jit.cache_dir(), 0) and hits >= 1


def test_spark_listens_on_loopback_only(spark: Any) -> None:
    jvm_pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    addresses = listening_addresses(jvm_pid) + listening_addresses(os.getpid())
    assert addresses and set(addresses) <= LOOPBACK, addresses
    assert spark.sparkContext.uiWebUrl is None


# ----- statistics against pg_waldump -----


def test_stats_equal_pg_waldump_for_the_whole_range(wal: GeneratedWal, analyzed: Analyzed) -> None:
    want = pg_waldump("--stats=record", "--path", str(wal.archive), wal.names[0], wal.names[-1])
    assert want.stdout.startswith("WAL statistics between")
    assert analyzed.stdout == want.stdout
    assert (analyzed.out / "stats.txt").read_text() == want.stdout
    for method in ("LogicalMessage/MESSAGE", "XLOG/SWITCH", "XLOG/FPI", "Heap2/MULTI_INSERT+INIT", "Transaction/ABORT"):
        assert method in want.stdout


def assert_stats_equal(wal: GeneratedWal, first: str, last: str) -> bool:
    """analyze --stats prints what pg_waldump --stats=record prints for FIRST..LAST; False when both find no record."""
    want = pg_waldump("--stats=record", "--path", str(wal.archive), first, last)
    got = cli("analyze", str(wal.archive), "--stats", "--first", first, "--last", last)
    assert got.stdout == want.stdout, (first, last, got.output)
    if want.stdout:
        assert got.exit_code == 0, got.output
        return True
    assert "could not find a valid record after" in want.stderr
    assert got.exit_code == 1 and "could not find a valid record after" in got.stderr
    return False


def test_stats_equal_pg_waldump_for_single_segments_and_ranges(wal: GeneratedWal, spark: Any) -> None:
    empty = [name for name in wal.names if not assert_stats_equal(wal, name, name)]
    assert len(empty) == 1  # the segment the big message runs through: no record starts there
    assert_stats_equal(wal, wal.names[1], wal.names[3])
    # From that segment on, both look for the first record in the segments after it.
    assert_stats_equal(wal, empty[0], wal.names[-1])


# ----- datasets against pg_waldump's records -----


def test_records_match_pg_waldump(analyzed: Analyzed, dump: list[Dumped]) -> None:
    records = pq.read_table(analyzed.out / "records").sort_by("lsn").to_pylist()
    assert len(records) == len(dump) > 10_000
    commits = 0
    for r, d in zip(records, dump):
        assert (r["lsn"], r["prev"], r["xid"], r["rec_len"], r["tot_len"], r["rmgr"]) == (
            d.lsn, d.prev, d.xid, d.rec_len, d.tot_len, d.rmgr), format_lsn(d.lsn)
        assert d.desc.startswith(r["record_type"] + " ") or d.desc == r["record_type"], (d.desc, r["record_type"])
        blocks = tuple((f"{b['spc']}/{b['db']}/{b['rel']}", b["fork"], b["blkno"], b["has_image"]) for b in r["blocks"])
        assert blocks == d.blocks, format_lsn(d.lsn)
        if d.rmgr == "Transaction" and d.desc.startswith(("COMMIT", "ABORT")):
            m = XACT_TIME.search(d.desc)
            assert m and r["xact_time"].strftime("%Y-%m-%d %H:%M:%S.%f") == m.group(1)
            commits += d.desc.startswith("COMMIT")
        else:
            assert r["xact_time"] is None
    assert commits > 100
    per_second = pq.read_table(analyzed.out / "commits_per_second").to_pylist()
    assert sum(row["commits"] for row in per_second) == commits
    assert sum(row["aborts"] for row in per_second) == 1


def test_relations_agree_with_pg_waldump(analyzed: Analyzed, dump: list[Dumped]) -> None:
    refs: Counter[tuple[str, str]] = Counter()
    images: Counter[tuple[str, str]] = Counter()
    records: Counter[tuple[str, str]] = Counter()
    for d in dump:
        for rel, fork, _blk, fpw in d.blocks:
            refs[rel, fork] += 1
            images[rel, fork] += fpw
        for key in {(rel, fork) for rel, fork, _, _ in d.blocks}:
            records[key] += 1
    rows = pq.read_table(analyzed.out / "relations").to_pylist()
    assert {(r["relation"], r["fork"]): r["block_refs"] for r in rows} == dict(refs)
    assert {(r["relation"], r["fork"]): r["fpi_count"] for r in rows} == {k: v for k, v in images.items()}
    assert {(r["relation"], r["fork"]): r["records"] for r in rows} == dict(records)
    assert rows[0]["wal_bytes"] == max(r["wal_bytes"] for r in rows)


def test_report_and_segment_datasets(wal: GeneratedWal, analyzed: Analyzed) -> None:
    html = (analyzed.out / "report.html").read_text()
    for chart in ("wal_by_rmgr", "segments", "top_relations", "commits_per_second"):
        assert f"charts/{chart}.png" in html
        assert (analyzed.out / "charts" / f"{chart}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Archive intact" in html
    segments = pq.read_table(analyzed.out / "segments").to_pylist()
    assert [s["name"] for s in segments] == wal.names
    assert all(s["chain"] == "ok" and s["crc_failures"] == 0 and not s["problems"] for s in segments)
    assert [s["continues_to_next"] for s in segments] == [True] * (len(segments) - 1) + [None]
    assert any(s["records"] == 0 for s in segments)  # inside the big message
    assert any(s["end_reason"] == "XLOG_SWITCH" for s in segments)
    types = pq.read_table(analyzed.out / "record_types").to_pylist()
    assert sum(t["count"] for t in types) == sum(s["records"] for s in segments)


def test_full_page_images_of_every_compression_restore(wal: GeneratedWal) -> None:
    """Each stored image restores to a valid page whose hole is [pd_lower, pd_upper), as the server wrote it."""
    seen: Counter[str] = Counter()
    reader = WalReader(SegmentDirSource(wal.archive), wal.first_segno * SEG, keep_data=True)
    for rec in reader.tuples():
        data = rec[8]
        assert data is not None
        for block in decode_record(data, rec[0]).blocks:
            if not block.has_image:
                continue
            page = restore_block_image(data, block)
            pd_lower, pd_upper, _special, version = (int.from_bytes(page[i : i + 2], "little") for i in (12, 14, 16, 18))
            assert len(page) == 8192 and version == 0x2004, format_lsn(rec[0])
            if block.hole_length:
                assert (block.hole_offset, block.hole_offset + block.hole_length) == (pd_lower, pd_upper)
            seen[block.compression or "none"] += 1
    assert all(seen[m] > 10 for m in (*COMPRESSIONS, "none")), seen


# ----- verify-archive -----


def test_verify_archive_passes_a_clean_archive(wal: GeneratedWal, dump: list[Dumped], spark: Any) -> None:
    result = cli("verify-archive", str(wal.archive))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"OK: {len(wal.names)} segments {wal.names[0]}..{wal.names[-1]}")
    assert f"{len(dump):,} records" in result.stdout


def test_verify_archive_names_a_flipped_byte(wal: GeneratedWal, dump: list[Dumped], spark: Any, test_dir: Path) -> None:
    victim = next(d for d in dump if d.lsn // SEG == wal.first_segno + 1 and d.tot_len >= 200
                  and d.lsn % 8192 + d.tot_len < 8192 and d.lsn % SEG > SEG // 2)
    name = wal.names[1]
    archive = link_copy(wal.archive, test_dir / "archive", copy=(name,))
    with open(archive / name, "r+b") as f:
        f.seek(victim.lsn % SEG + 100)
        byte = f.read(1)[0]
        f.seek(victim.lsn % SEG + 100)
        f.write(bytes([byte ^ 0x10]))
    result = cli("verify-archive", str(archive))
    assert result.exit_code == 1
    assert result.stdout.startswith(f"FAILED: CRC failure in segment {name} at {format_lsn(victim.lsn)}"), result.stdout


def test_verify_archive_names_a_missing_segment(wal: GeneratedWal, spark: Any, test_dir: Path) -> None:
    archive = link_copy(wal.archive, test_dir / "archive")
    missing = wal.names[2]
    (archive / missing).unlink()
    result = cli("verify-archive", str(archive))
    assert result.exit_code == 1
    start = format_lsn((wal.first_segno + 2) * SEG)
    assert result.stdout.startswith(f"FAILED: missing segment in segment {missing} at {start}"), result.stdout


def test_verify_archive_names_a_truncated_segment(wal: GeneratedWal, spark: Any, test_dir: Path) -> None:
    name = wal.names[1]
    archive = link_copy(wal.archive, test_dir / "archive", copy=(name,))
    keep = 5 * 1024 * 1024 + 123
    os.truncate(archive / name, keep)
    result = cli("verify-archive", str(archive))
    assert result.exit_code == 1
    at = format_lsn((wal.first_segno + 1) * SEG + keep)
    assert result.stdout.startswith(f"FAILED: truncated segment in segment {name} at {at}"), result.stdout


# ----- S3 -----


def s3_filesystem(endpoint: str) -> Any:
    """pyarrow's S3 filesystem on the moto endpoint."""
    from pyarrow import fs

    url = urlparse(endpoint)
    return fs.S3FileSystem(endpoint_override=url.netloc, scheme=url.scheme, region="us-east-1")


def test_s3_source_and_output_give_the_local_results(
    wal: GeneratedWal, analyzed: Analyzed, dump: list[Dumped], s3: str
) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3)
    client.create_bucket(Bucket="wal")
    for name in wal.names:
        client.upload_file(str(wal.archive / name), "wal", f"archive/{name}")
    client.put_object(Bucket="wal", Key="archive/notes.txt", Body=b"not WAL")
    client.put_object(Bucket="wal", Key="archive/deeper/000000010000000000000099", Body=b"not this level")

    result = cli("analyze", "s3://wal/archive", "--stats", "--out", "s3://wal/out", "--s3-endpoint", s3)
    assert result.exit_code == 0, result.output
    assert result.stdout == analyzed.stdout
    fs = s3_filesystem(s3)
    remote = pq.read_table("wal/out/records", filesystem=fs).sort_by("lsn")
    local = pq.read_table(analyzed.out / "records").sort_by("lsn")
    assert remote.equals(local)
    for name in ("segments", "relations", "commits_per_second", "record_types"):
        assert pq.read_table(f"wal/out/{name}", filesystem=fs).num_rows == pq.read_table(analyzed.out / name).num_rows
    assert fs.get_file_info("wal/out/report.html").size > 0

    verified = cli("verify-archive", "s3://wal/archive", "--s3-endpoint", s3)
    assert verified.exit_code == 0, verified.output
    assert f"{len(dump):,} records" in verified.stdout
