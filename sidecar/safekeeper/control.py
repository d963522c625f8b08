"""The safekeeper's control file: its persisted AcceptorState, versioned and checksummed.

Layout of `DIR/safekeeper.control`, integers little-endian:
magic b"WSKC" | u32 format version | u32 body length | u32 CRC32C of the body | body,
where the body is UTF-8 JSON. Bump CONTROL_VERSION whenever AcceptorState changes.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c

from sidecar.consensus.messages import DegradedRange, TermEntry, TimelineFence
from sidecar.timelines import TimelineEntry
from sidecar.consensus.state import AcceptorState
from sidecar.durable import write_durably

CONTROL_FILE = "safekeeper.control"
CONTROL_MAGIC = b"WSKC"
# 2: the failover fence (AcceptorState.fence); 3: members and lost_disk_term; 4: degraded and degrade_term
CONTROL_VERSION = 4
# Versions this build reads: a version 1 file has no fence, as if none was set; versions 1 and 2 have no member
# count (unknown until the next Greeting) and no lost disk being recovered.
# Versions before 4 hold no degraded range (none was ever recorded by them).
_READS = {1: frozenset({"fence", "members", "lost_disk_term", "degraded", "degrade_term"}),
          2: frozenset({"members", "lost_disk_term", "degraded", "degrade_term"}),
          3: frozenset({"degraded", "degrade_term"}),
          4: frozenset()}  # version -> the fields it lacks
_HEADER = struct.Struct("<4sIII")
_CORRUPT_HINT = "the control file is corrupt; restore it or re-create this safekeeper from its peers"
_HISTORY_FIELDS = {"term_history": TermEntry, "timeline_history": TimelineEntry}


class ControlFileError(Exception):
    """The control file exists but cannot be trusted; the safekeeper must not start."""


@dataclass(frozen=True)
class ControlData:
    node_id: int
    state: AcceptorState


def control_path(data_dir: Path) -> Path:
    return Path(data_dir) / CONTROL_FILE


def load_control(data_dir: Path) -> ControlData | None:
    """Read the control file; None for a fresh safekeeper (no file), ControlFileError if bad.

    Only reads: tools and tests call it while the safekeeper runs, and removing the temp file
    here once deleted a save in progress under the safekeeper's feet (see remove_leftovers).
    """
    path = control_path(data_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    version, body = _unframe(path, raw)
    try:
        return _decode(json.loads(body.decode("utf-8")), _READS[version])
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError) as e:
        raise ControlFileError(f"{path}: unreadable contents ({e}): {_CORRUPT_HINT}") from e


def remove_leftovers(data_dir: Path) -> None:
    """Remove the temp file of a save a crash interrupted. Only the safekeeper that owns
    `data_dir` may call this, before it serves (the leftover is harmless: saves truncate it)."""
    control_path(data_dir).with_name(CONTROL_FILE + ".tmp").unlink(missing_ok=True)


def save_control(data_dir: Path, data: ControlData) -> None:
    """Durably replace the control file: write a temp file, fsync, rename, fsync the directory.

    On a full disk the temp file is removed and the old control file stays as it was.
    """
    body = json.dumps(_encode(data), separators=(",", ":")).encode("utf-8")
    blob = _HEADER.pack(CONTROL_MAGIC, CONTROL_VERSION, len(body), google_crc32c.value(body)) + body
    write_durably(control_path(data_dir), blob)


def _unframe(path: Path, raw: bytes) -> tuple[int, bytes]:
    """Check the header and checksum; return the format version and the body."""
    if len(raw) < _HEADER.size:
        raise ControlFileError(f"{path}: truncated ({len(raw)} bytes, header needs {_HEADER.size}): {_CORRUPT_HINT}")
    magic, version, length, crc = _HEADER.unpack_from(raw)
    if magic != CONTROL_MAGIC:
        raise ControlFileError(f"{path}: not a walsidecar control file (magic {magic!r}, expected {CONTROL_MAGIC!r})")
    if version not in _READS:
        raise ControlFileError(
            f"{path}: control file format version {version} is not supported (this build reads version "
            f"{CONTROL_VERSION}); run the walsidecar release that wrote it")
    body = raw[_HEADER.size:]
    if len(body) != length:
        what = "truncated" if len(body) < length else "trailing garbage"
        raise ControlFileError(f"{path}: {what}: body is {len(body)} bytes, header says {length}: {_CORRUPT_HINT}")
    if google_crc32c.value(body) != crc:
        raise ControlFileError(f"{path}: checksum mismatch: {_CORRUPT_HINT}")
    return version, body


def _encode(data: ControlData) -> dict[str, Any]:
    out: dict[str, Any] = {"node_id": data.node_id}
    for f in dataclasses.fields(AcceptorState):
        value = getattr(data.state, f.name)
        if f.name in _HISTORY_FIELDS:
            value = [list(dataclasses.astuple(entry)) for entry in value]
        elif f.name == "fence":
            value = list(dataclasses.astuple(value))
        elif f.name == "degraded":
            value = [value.term, value.start_lsn, value.version, sorted(value.members)]
        out[f.name] = value
    return out


def _decode(obj: Any, lacks: frozenset[str] = frozenset()) -> ControlData:
    """Rebuild ControlData from the JSON body; ValueError/TypeError on any deviation."""
    if not isinstance(obj, dict):
        raise ValueError("body is not a JSON object")
    names = ["node_id"] + [f.name for f in dataclasses.fields(AcceptorState) if f.name not in lacks]
    missing, unknown = set(names) - obj.keys(), obj.keys() - set(names)
    if missing or unknown:
        parts = [f"{kind} fields {sorted(keys)}" for kind, keys in (("missing", missing), ("unknown", unknown)) if keys]
        raise ValueError(", ".join(parts))
    values = {}
    for name in names[1:]:
        entry_type = _HISTORY_FIELDS.get(name)
        if name == "fence":
            values[name] = _fence(obj[name])
        elif name == "degraded":
            values[name] = _degraded(obj[name])
        else:
            values[name] = _history(name, obj[name], entry_type) if entry_type else _uint(name, obj[name])
    return ControlData(node_id=_uint("node_id", obj["node_id"]), state=AcceptorState(**values))


def _history(name: str, value: Any, entry_type: type) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} is not a list")
    entries = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"{name} entry {item!r} is not a pair")
        entries.append(entry_type(_uint(name, item[0]), _uint(name, item[1])))
    return tuple(entries)


def _fence(value: Any) -> TimelineFence:
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"fence {value!r} is not [term, timeline, lsn]")
    return TimelineFence(*(_uint("fence", v) for v in value))


def _degraded(value: Any) -> DegradedRange:
    if not isinstance(value, list) or len(value) != 4 or not isinstance(value[3], list):
        raise ValueError(f"degraded {value!r} is not [term, start_lsn, version, [members]]")
    term, start, version = (_uint("degraded", v) for v in value[:3])
    return DegradedRange(term, start, version, frozenset(_uint("degraded member", v) for v in value[3]))


def _uint(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is {value!r}, expected a non-negative integer")
    return value
