#!/usr/bin/env python3
"""How long a safekeeper takes to start on a data directory holding --mib MiB of WAL.

Writes synthetic PostgreSQL 15 WAL (tests/support/walbuilder.py: records of --record-size bytes, 16 MiB
segments) through the safekeeper's storage into a temporary directory, then times
Safekeeper.open() twice: the first start checks the whole record chain (no checkpoint yet),
the second only page headers below the checkpoint the first one recorded (see
sidecar/safekeeper/walcheck.py). The page cache is warm in both.

    python3 scripts/bench_safekeeper_start.py --mib 1024 --record-size 200
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from sidecar.consensus.messages import TermEntry  # noqa: E402
from sidecar.consensus.state import AcceptorState  # noqa: E402
from sidecar.logs import configure  # noqa: E402
from sidecar.lsn import DEFAULT_SEGMENT_SIZE as SEG  # noqa: E402
from sidecar.safekeeper.control import ControlData, save_control  # noqa: E402
from sidecar.safekeeper.server import Safekeeper  # noqa: E402
from sidecar.safekeeper.storage import WalStorage  # noqa: E402
from support.walbuilder import DEFAULT_SYSID, WalBuilder  # noqa: E402


def build(data_dir: Path, size: int, record_size: int) -> int:
    """Store `size` bytes of WAL from the first segment on; return where it ends."""
    st = WalStorage(data_dir / "wal", SEG, 1)
    st.open_at(SEG)
    b = WalBuilder(SEG, seg_size=SEG)
    pos = SEG
    while pos < SEG + size:  # 64 MiB at a time, one builder, so xl_prev links run through
        b.fill_to(min(b.end + (64 << 20), SEG + size), record_size)
        st.write(pos, b.buf[pos - SEG:])
        pos = b.end
    st.flush()
    st.close()
    save_control(data_dir, ControlData(1, AcceptorState(system_id=DEFAULT_SYSID, wal_seg_size=SEG, pg_version=15,
                                                        timeline=1, term=1, term_history=(TermEntry(1, SEG),))))
    return b.end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="MiB of WAL to store")
    ap.add_argument("--record-size", type=int, default=200, help="bytes per WAL record (small is the worst case)")
    args = ap.parse_args()
    configure("plain", "warning")
    data_dir = Path(tempfile.mkdtemp(prefix="walsidecar-start-"))
    try:
        end = build(data_dir, args.mib << 20, args.record_size)
        print(f"{(end - SEG) >> 20} MiB of WAL, {args.record_size}-byte records, {SEG >> 20} MiB segments")
        for what in ("first start (whole record chain)", "second start (from the checkpoint)"):
            began = time.perf_counter()
            sk = Safekeeper.open(1, data_dir, "127.0.0.1", 0)
            print(f"{what}: {time.perf_counter() - began:.2f} s")
            sk.storage.close()
    finally:
        shutil.rmtree(data_dir)


if __name__ == "__main__":
    main()
