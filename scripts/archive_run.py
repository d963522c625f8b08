#!/usr/bin/env python3
"""A measured archiving run: push ~1 GB of WAL through a local deployment that archives to S3 (moto_server)
or a directory, and report what it cost and that the archive is right.

Builds its own deployment on 127.0.0.1 (a PostgreSQL 15 primary keeping its WAL with wal_keep_size, 3
safekeepers with --archive, the proposer), loads rows in large transactions until the WAL written passes
--gb, and samples each safekeeper's wal/ directory meanwhile. Then it waits until every safekeeper's
backup_lsn reaches the last complete segment and reports: each safekeeper's wal/ size at its peak and at
the end, the archive's object count and bytes, whether every archived segment is byte-identical to the
primary's, `walsidecar verify-archive --gaps-only`'s verdict, upload throughput and the safekeepers' CPU.
Exit status 0 when the archive is complete, identical and gap-free.

    python3 scripts/archive_run.py --gb 1 --archive s3 --out archive-run.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Run this checkout's package, in this process and in every child it starts.
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from sidecar.deployment import APP, LocalDeployment, free_port  # noqa: E402
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG  # noqa: E402
from sidecar.lsn import format_lsn, parse_lsn, parse_segment_file_name  # noqa: E402
from sidecar.objectstore import open_storage  # noqa: E402
from sidecar.processes import sidecar_argv  # noqa: E402
from sidecar.archivedwal import wal_prefix  # noqa: E402
from sidecar.safekeeper.control import load_control  # noqa: E402

BUCKET = "walsidecar-run"
ROW_PAD = 1000  # bytes of text per row: about 1.1 kB of WAL
ROWS_PER_COMMIT = 50_000  # one transaction, about 55 MB of WAL
SAMPLE = 0.5  # seconds between samples of the safekeepers' wal/ sizes
AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def moto(log: Path) -> Iterator[str]:
    """moto_server on a free 127.0.0.1 port with a bucket; its endpoint; killed by its PID afterwards."""
    import boto3
    port = free_port()
    os.environ.update(AWS)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: see {log}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


def dir_bytes(path: Path) -> int:
    total = 0
    for entry in os.scandir(path):
        try:
            total += entry.stat().st_size if entry.is_file() else 0
        except FileNotFoundError:
            pass  # removed while we looked
    return total


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a running process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """Each safekeeper's wal/ size every SAMPLE seconds: the peak."""

    def __init__(self, dirs: dict[int, Path]) -> None:
        super().__init__(daemon=True)
        self.dirs = dirs
        self.peak = {i: 0 for i in dirs}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE):
            self.sample()

    def sample(self) -> None:
        for i, d in self.dirs.items():
            self.peak[i] = max(self.peak[i], dir_bytes(d))


def wait_until(what: str, cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    target = int(args.gb * 1024**3)
    with contextlib_moto(args, work) as (url, endpoint):
        extra = ["--archive", url, "--archive-takeover", "5", *(["--s3-endpoint", endpoint] if endpoint else [])]
        d = LocalDeployment(work / "deployment", safekeepers=3,
                            extra={f"safekeeper{i}": extra for i in (1, 2, 3)})
        with d:
            # The primary keeps all the run's WAL, to compare the archive with it.
            keep = f"{int(args.gb * 1024) + 512}MB"
            d.pg.init({"synchronous_standby_names": APP, "wal_keep_size": keep, "max_wal_size": "1GB"})
            d.start_all(timeout=120)
            sk_pids = {i: d.safekeepers[i].pid for i in (1, 2, 3)}
            cpu0 = {i: cpu_seconds(p) for i, p in sk_pids.items()}
            with d.sql() as c:
                sysid = int(c.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0])
                c.execute("CREATE TABLE load (id bigint, pad text)")
                start = parse_lsn(c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
            wal_dirs = {i: d.data_dir(f"safekeeper{i}") / "wal" for i in (1, 2, 3)}
            sampler = Sampler(wal_dirs)
            sampler.start()
            began = time.monotonic()
            n = 0
            with d.sql() as c:
                end = start
                while end - start < target:
                    c.execute("INSERT INTO load SELECT g, repeat('w', %s) FROM generate_series(%s, %s) g",
                              (ROW_PAD, n + 1, n + ROWS_PER_COMMIT))
                    n += ROWS_PER_COMMIT
                    end = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
                c.execute("SELECT pg_switch_wal()")
                c.execute("INSERT INTO load VALUES (-1, 'after the switch')")
                end = parse_lsn(c.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
            load_seconds = time.monotonic() - began
            done = end - end % SEG

            def backup(i: int) -> int:
                data = load_control(d.data_dir(f"safekeeper{i}"))
                return data.state.backup_lsn if data else 0

            wait_until(f"every backup_lsn to reach {format_lsn(done)}",
                       lambda: all(backup(i) >= done for i in (1, 2, 3)), args.timeout)
            archive_seconds = time.monotonic() - began
            wait_until("removal below backup_lsn", lambda: all(
                min((parse_segment_file_name(p.name)[1] for p in w.iterdir() if len(p.name) == 24), default=done // SEG)
                >= done // SEG for w in wal_dirs.values()), 120)
            sampler.done.set()
            sampler.join()
            sampler.sample()
            cpu1 = {i: cpu_seconds(p) for i, p in sk_pids.items()}

            store = open_storage(url, s3_endpoint=endpoint).child(wal_prefix(str(sysid), sysid))
            objects = store.list()
            segments = sorted(k for k in objects if len(k) == 24)
            identical, differing, not_in_pg_wal = 0, [], []
            for name in segments:
                local = d.pg.pg_wal_dir / name
                if not local.exists():
                    not_in_pg_wal.append(name)
                elif store.read(name) == local.read_bytes():
                    identical += 1
                else:
                    differing.append(name)
            segnos = [parse_segment_file_name(n)[1] for n in segments]
            contiguous = segnos == list(range(segnos[0], segnos[-1] + 1)) if segnos else False

            client = d.certs_dir("client", "client")
            tls = ["--certs-dir", str(client)] if client is not None else ["--insecure"]
            verify = subprocess.run(sidecar_argv("verify-archive", store.location, "--safekeepers",
                                                 ",".join(d.addresses), *tls, "--gaps-only",
                                                 *(["--s3-endpoint", endpoint] if endpoint else [])),
                                    capture_output=True, text=True, timeout=300)

            uploaded, upload_seconds = 0, 0.0
            for i in (1, 2, 3):
                log = d.log_path(f"safekeeper{i}")
                text = log.read_text(errors="replace") if log is not None else ""
                for m in re.finditer(r"segment archived .*?seconds=([0-9.]+)", text):
                    uploaded += 1
                    upload_seconds += float(m.group(1))
            return {
                "archive": url, "wal_written_bytes": end - start, "start_lsn": format_lsn(start),
                "end_lsn": format_lsn(end), "load_seconds": round(load_seconds, 1),
                "archived_all_seconds": round(archive_seconds, 1),
                "safekeeper_wal_peak_bytes": sampler.peak,
                "safekeeper_wal_end_bytes": {i: dir_bytes(w) for i, w in wal_dirs.items()},
                "archive_objects": len(objects), "archive_bytes": sum(objects.values()),
                "archive_segments": len(segments), "archive_partials": sum(k.endswith(".partial") for k in objects),
                "segments_identical_to_primary": identical, "segments_differing": differing,
                "segments_not_in_pg_wal": not_in_pg_wal, "segments_contiguous": contiguous,
                "verify_archive_gaps_only": {"exit": verify.returncode,
                                             "output": (verify.stdout + verify.stderr).strip().splitlines()[-3:]},
                "segments_uploaded": uploaded,
                "upload_mb_per_s": round(uploaded * SEG / 2**20 / upload_seconds, 1) if upload_seconds else None,
                "safekeeper_cpu_seconds": {i: round(cpu1[i] - cpu0[i], 1) if cpu0[i] is not None and cpu1[i] is not None
                                           else None for i in (1, 2, 3)},
            }


@contextmanager
def contextlib_moto(args: argparse.Namespace, work: Path) -> Iterator[tuple[str, str | None]]:
    """(archive URL, S3 endpoint or None) for --archive s3 or file."""
    if args.archive == "file":
        yield f"file://{work / 'archive'}", None
        return
    with moto(work / "moto.log") as endpoint:
        yield f"s3://{BUCKET}/archive", endpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="GiB of WAL to write (default 1)")
    p.add_argument("--archive", choices=["s3", "file"], default="s3",
                   help="moto_server S3 (default) or a local directory")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the archive to catch up")
    p.add_argument("--workdir", type=Path, help="parent of the scratch directory (default: the system's temp dir)")
    p.add_argument("--out", type=Path, help="also write the report as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (data, logs)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="walsidecar-archive-run-", dir=args.workdir))
    os.chmod(work, 0o755)  # the postgres OS user reaches its data directory below it when run as root
    try:
        report = run(args, work)
    finally:
        if args.keep:
            print(f"scratch directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = (report["segments_identical_to_primary"] == report["archive_segments"] and report["segments_contiguous"]
          and report["verify_archive_gaps_only"]["exit"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
