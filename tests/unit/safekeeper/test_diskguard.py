"""The disk guard (safekeeper/diskguard.py) on the real filesystem of a temporary directory."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from support.helpers import run
from sidecar.safekeeper.diskguard import DiskGuard
from sidecar.sizes import DiskLimit


def test_a_byte_limit_counts_wal_files_and_flips_both_ways(tmp_path: Path) -> None:
    async def main() -> None:
        guard = DiskGuard(DiskLimit.parse("1MiB"), tmp_path)
        assert not guard.update(1 << 20, "the retention (--keep-wal)") and not guard.active
        assert guard.update((1 << 20) + 1, 'reader slot "s1" at 0/1000000') and guard.active
        assert guard.reason is not None and 'held by reader slot "s1"' in guard.reason
        assert not guard.wait_resumed(0)
        waiter = asyncio.ensure_future(asyncio.to_thread(guard.wait_resumed))
        assert guard.update(0, "flush_lsn") and not guard.active
        assert await asyncio.wait_for(waiter, 5)
    run(main())


def test_a_percentage_counts_the_whole_filesystem(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    used = 100 * (st.f_blocks - st.f_bfree) / st.f_blocks
    guard = DiskGuard(DiskLimit(percent=max(used / 2, 0.001)), tmp_path)
    guard.update(0, "flush_lsn")
    assert guard.active and "% full" in (guard.reason or "")
    assert guard.usage.fs_total == st.f_blocks * st.f_frsize
    assert not DiskGuard(DiskLimit(percent=100), tmp_path).update(0, "flush_lsn")
    unlimited = DiskGuard(None, tmp_path)
    assert not unlimited.update(1 << 40, "flush_lsn") and not unlimited.active
