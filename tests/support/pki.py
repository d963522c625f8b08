"""One certificate authority per test session and a certificates directory per role, made on demand."""

from __future__ import annotations

from pathlib import Path

from sidecar.certs import create_ca, create_node


class TestPKI:
    """The session's CA under `root/ca`; `certs(role, id)` is the directory a process of that role uses."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_dir = root / "ca"
        create_ca(self.ca_dir)
        self._dirs: dict[tuple[str, int | None], Path] = {}

    def certs(self, role: str, node_id: int | None = None) -> Path:
        key = (role, node_id)
        if key not in self._dirs:
            d = self.root / (f"{role}-{node_id}" if node_id is not None else role)
            create_node(self.ca_dir, d, role, node_id)
            self._dirs[key] = d
        return self._dirs[key]

    def args(self, role: str, node_id: int | None = None) -> list[str]:
        """`--certs-dir DIR` for a walsidecar command line."""
        return ["--certs-dir", str(self.certs(role, node_id))]


_session: TestPKI | None = None


def session_pki() -> TestPKI:
    """The PKI the `pki` session fixture made (conftest.py)."""
    assert _session is not None, "the pki session fixture has not run"
    return _session


def install(pki: TestPKI | None) -> None:
    global _session
    _session = pki


def foreign_ca(tmp: Path, role: str, node_id: int | None = None) -> Path:
    """A certificates directory from a CA that is not the deployment's."""
    create_ca(tmp / "other-ca")
    create_node(tmp / "other-ca", tmp / f"other-{role}", role, node_id)
    return tmp / f"other-{role}"
