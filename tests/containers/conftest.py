"""Fixtures of the container suite: skip (or fail) when no engine or image is there."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from containers.harness import ContainerDeployment, availability


@pytest.fixture(scope="session")
def container_engine() -> None:
    """A Docker engine with walsidecar's images; skips with the reason when there is none."""
    a = availability()
    if a.fail:
        pytest.fail(f"container tests cannot run: {a.reason}", pytrace=False)
    if not a.ok:
        pytest.skip(a.reason)


@pytest.fixture
def container_deployment(container_engine: None, test_dir: Path) -> Iterator[ContainerDeployment]:
    """Primary, three safekeepers and the proposer as containers, the sidecar already synchronous.

    The containers are removed at teardown; their logs go to the captured output, which pytest
    shows for a failed test.
    """
    d = ContainerDeployment(test_dir)
    try:
        d.start_all()
        with d.sql() as c:
            c.execute("CREATE TABLE load (id int, pad text)")
        yield d
    finally:
        print(d.logs())
        d.stop_all()
