"""Run an asyncio service until SIGINT/SIGTERM, cancelling it cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when WALSIDECAR_EVENT_LOOP=uvloop (the `uvloop` extra), else asyncio's own."""
    choice = os.environ.get("WALSIDECAR_EVENT_LOOP", "asyncio").strip().lower()
    if choice == "asyncio":
        return None
    if choice != "uvloop":
        raise SystemExit(f"WALSIDECAR_EVENT_LOOP={choice!r}: expected asyncio or uvloop")
    try:
        import uvloop
    except ImportError:
        raise SystemExit("WALSIDECAR_EVENT_LOOP=uvloop but uvloop is not installed "
                         "(pip install 'walsidecar[uvloop]')") from None
    return uvloop.new_event_loop


def run_until_signal(main: Coroutine[Any, Any, None]) -> None:
    """Run `main`; the first SIGINT or SIGTERM cancels it so its cleanup runs."""

    async def wrapper() -> None:
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
