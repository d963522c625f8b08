"""Small test utilities: free ports, condition polling, running the `walsidecar` command."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on host that was free a moment ago (`deployment.free_port`: below the ephemeral range)."""
    from sidecar.deployment import free_port as pick
    return pick(host)


def consecutive_free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive TCP ports on `host` that were all free a moment ago."""
    for _ in range(50):
        base = free_port(host)
        if base + n > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll predicate until it returns a truthy value and return that value.

    Exceptions listed in ignore count as "not yet"; on timeout raises
    AssertionError("timed out waiting for {what}") with the last such exception chained.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ignore as exc:
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc is not None else ""
            raise AssertionError(f"timed out waiting for {what}{detail}") from last_exc
        time.sleep(interval)


def run(coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
    """Run a coroutine to completion on a fresh event loop, with a time limit."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(
    predicate: Callable[[], Awaitable[T] | T], what: str, timeout: float = 20, interval: float = 0.02
) -> T:
    """Poll `predicate` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


def walsidecar(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `walsidecar ARGS` with this interpreter; WALSIDECAR_* variables only from `env`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("WALSIDECAR_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=full)


def peak_rss(pid: int) -> int:
    """The most resident memory process `pid` has had so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def data_files(data_dir: Path) -> dict[str, bytes]:
    """Every file of a safekeeper's data directory (control file, segments), byte for byte, by relative path.

    Not wal.spare (nor wal.spare.tmp while it is made): a zero-filled segment a background thread
    makes whenever the last one was taken, which holds no state and may appear at any moment.
    """
    return {str(p.relative_to(data_dir)): p.read_bytes()
            for p in sorted(data_dir.rglob("*")) if p.is_file() and not p.name.startswith("wal.spare")}


def created(data_dir: Path, node_id: int, members: int = 3) -> Path:
    """`data_dir`, made a new cluster's safekeeper `node_id` (`walsidecar safekeeper-init`) if it is empty or
    absent; left alone if it holds anything (a control file, or what a test put there). Without it an empty
    directory is a lost disk that does not vote."""
    from sidecar.safekeeper.create import create_data_dir
    data_dir = Path(data_dir)
    if not data_dir.exists() or not any(data_dir.iterdir()):
        create_data_dir(node_id, data_dir, members)
    return data_dir
