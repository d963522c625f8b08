"""Structured logging set-up (structlog): plain for people, JSON for machines."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import structlog

# key -> function(value) giving extra fields for any line carrying that key (see set_context_provider).
_providers: dict[str, Callable[[object], dict[str, object]]] = {}
_configured = ("plain", "info")  # what configure() was last given: a child process logs the same way


def set_context_provider(key: str, provider: Callable[[object], dict[str, object]]) -> None:
    """Lines with field `key` also get `provider(value)`'s fields (without overriding explicit ones).

    The proposer uses it so that every line about a safekeeper (`peer=`) names its id, term and
    flush LSN, whichever code logged it.
    """
    _providers[key] = provider


def _add_context(logger: object, method: str, event: dict) -> dict:
    for key, provider in list(_providers.items()):
        if key in event:
            try:
                extra = provider(event[key])
            except Exception:  # a context lookup must never lose the line itself
                continue
            for k, v in extra.items():
                event.setdefault(k, v)
    return event


def configure(fmt: str = "plain", level: str = "info") -> None:
    """Route structlog to stderr in the chosen format."""
    global _configured
    _configured = (fmt, level)
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_context,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def current() -> tuple[str, str]:
    """(format, level) as last configured."""
    return _configured


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**bound)


def module_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    """A logger for a module's top level: bound anew at each line, so that it follows the configuration of
    the moment, not the one at import (get_logger's binds it at once: a test capturing logs after another
    test imported the module would see nothing)."""
    return structlog.get_logger(**bound)  # type: ignore[no-any-return]
