"""Small test utilities: free ports and condition polling."""

from __future__ import annotations

import socket
import time
from typing import Callable, TypeVar

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
