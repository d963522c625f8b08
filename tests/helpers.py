"""Small test utilities: free ports and condition polling."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on host that was free a moment ago (bind to port 0 and release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
