"""The bench's C stand-in safekeeper (scripts/floor_safekeeper.c) speaks the protocol version the proposer does."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.consensus.messages import PROTOCOL_VERSION

SOURCE = Path(__file__).resolve().parents[2] / "scripts" / "floor_safekeeper.c"


def test_the_floor_safekeeper_speaks_this_protocol_version() -> None:
    # A proposer refuses a safekeeper of another version: the bench's floor rows would only time out.
    m = re.search(r"^#define PROTOCOL_VERSION (\d+)$", SOURCE.read_text(), re.M)
    assert m is not None and int(m.group(1)) == PROTOCOL_VERSION, \
        f"{SOURCE.name} speaks version {m and m.group(1)}; the proposer speaks {PROTOCOL_VERSION}"
