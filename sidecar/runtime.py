"""Run an asyncio service until SIGINT/SIGTERM, cancelling it cleanly."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when installed (WALSIDECAR_EVENT_LOOP=auto, the default, or uvloop), else asyncio's."""
    choice = os.environ.get("WALSIDECAR_EVENT_LOOP", "auto").strip().lower()
    if choice not in ("auto", "asyncio", "uvloop"):
        raise SystemExit(f"WALSIDECAR_EVENT_LOOP={choice!r}: expected auto, asyncio or uvloop")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "auto":
            return None
        raise SystemExit("WALSIDECAR_EVENT_LOOP=uvloop but uvloop is not installed (pip install uvloop)") from None
    return uvloop.new_event_loop


def settle_heap() -> None:
    """Move start-up objects out of the collector's sight and collect young objects less often.

    The services allocate a few short-lived objects per message; with the default thresholds the
    cyclic collector runs every few hundred messages and rescans every module, config and
    metric object loaded at start-up each time it reaches the older generations.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def run_until_signal(main: Coroutine[Any, Any, None]) -> None:
    """Run `main`; the first SIGINT or SIGTERM cancels it so its cleanup runs."""

    async def wrapper() -> None:
        settle_heap()
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(wrapper())
