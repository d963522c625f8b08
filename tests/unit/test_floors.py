"""The bench's C stand-ins (scripts/floor_safekeeper.c, scripts/floor_proposer.c) speak the protocol version the
services do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.consensus.messages import PROTOCOL_VERSION

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize("name", ["floor_safekeeper.c", "floor_proposer.c"])
def test_the_floor_stand_ins_speak_this_protocol_version(name: str) -> None:
    # A proposer refuses a safekeeper of another version, and a safekeeper a proposer: the bench's floor rows
    # would only time out.
    m = re.search(r"^#define PROTOCOL_VERSION (\d+)$", (SCRIPTS / name).read_text(), re.M)
    assert m is not None and int(m.group(1)) == PROTOCOL_VERSION, \
        f"{name} speaks version {m and m.group(1)}; walsidecar speaks {PROTOCOL_VERSION}"
