"""The one place that chooses the per-message hot path: compiled (sidecar/_hotpath.c) or the pure-Python reference.

The compiled module is built by `pip install` where a C compiler exists and is optional: without it, or with
WALSIDECAR_PURE_PYTHON=1, everything runs on the reference in `consensus/codec.py` and `pgrepl.py`.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

from sidecar import pgrepl
from sidecar.consensus import codec
from sidecar.consensus.messages import Append, AppendReply

__all__ = ["COMPILED", "FrameDecoder", "parse_copy_data", "implementation"]


_FIELDS = {
    Append: ("term", "begin_lsn", "commit_lsn", "peer_horizon_lsn", "data"),
    AppendReply: ("term", "flush_lsn", "commit_lsn"),
    pgrepl.XLogData: ("start", "wal_end", "send_time", "data"),
}


def _load() -> ModuleType | None:
    if os.environ.get("WALSIDECAR_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        from sidecar import _hotpath  # type: ignore[attr-defined]
    except ImportError:
        return None
    # The compiled code sets these fields as the generated __init__ does, without calling it: a message that
    # gains a field or a check in __post_init__ runs on the reference until _hotpath.c follows.
    for cls, names in _FIELDS.items():
        if tuple(f.name for f in dataclasses.fields(cls)) != names or hasattr(cls, "__post_init__"):
            return None
    _hotpath.configure(Append, AppendReply, pgrepl.XLogData, codec.FrameDecoder._parse, pgrepl.parse_copy_data)
    return _hotpath


COMPILED = _load()


def implementation() -> str:
    """"compiled" or "python": which hot path this process runs."""
    return "python" if COMPILED is None else "compiled"


if COMPILED is not None:

    class CompiledFrameDecoder(codec.FrameDecoder):
        """codec.FrameDecoder whose frame loop is compiled; what it does not take it hands to the reference."""

        _parse = COMPILED.parse_frames_method

    FrameDecoder: type[codec.FrameDecoder] = CompiledFrameDecoder
    parse_copy_data = COMPILED.parse_copy_data
else:
    FrameDecoder = codec.FrameDecoder
    parse_copy_data = pgrepl.parse_copy_data
