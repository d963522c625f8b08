"""The one place that chooses the per-message hot path: compiled (sidecar/_hotpath.c) or the pure-Python reference.

The compiled module is built by `pip install` where a C compiler exists and is optional: without it, or with
WALSIDECAR_PURE_PYTHON=1, everything runs on the reference in `consensus/codec.py` and `pgrepl.py`.
"""

from __future__ import annotations

import os
from types import ModuleType

from sidecar import pgrepl
from sidecar.consensus import codec
from sidecar.consensus.messages import Append, AppendReply

__all__ = ["COMPILED", "FrameDecoder", "parse_copy_data", "implementation"]


def _load() -> ModuleType | None:
    if os.environ.get("WALSIDECAR_PURE_PYTHON", "").strip() not in ("", "0"):
        return None
    try:
        from sidecar import _hotpath  # type: ignore[attr-defined]
    except ImportError:
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
