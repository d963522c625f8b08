"""Run an asyncio service until SIGINT/SIGTERM, cancelling it cleanly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any


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

    asyncio.run(wrapper())
