"""The command line refuses bad configuration with a clear message."""

from __future__ import annotations

from pathlib import Path

from support.helpers import free_port, walsidecar
from sidecar.consensus.state import AcceptorState
from sidecar.safekeeper.control import CONTROL_FILE, ControlData, save_control


def test_every_command_has_help() -> None:
    for cmd in ((), ("safekeeper",), ("start",), ("up",), ("analyze",), ("verify-archive",), ("certs",),
                ("certs", "create-ca"), ("certs", "create-node")):
        out = walsidecar(*cmd, "--help")
        assert out.returncode == 0 and "Usage:" in out.stdout, (cmd, out.stderr)


def test_minority_quorum_is_refused() -> None:
    out = walsidecar("start", "--pg-dsn", "host=127.0.0.1", "--safekeepers",
                     "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "--quorum", "1", "--insecure")
    assert out.returncode != 0
    assert "two quorums must intersect" in out.stderr


def test_bad_safekeeper_address_is_refused() -> None:
    out = walsidecar("start", "--pg-dsn", "host=127.0.0.1", "--safekeepers", "127.0.0.1:1,nonsense", "--insecure")
    assert out.returncode != 0
    assert "HOST:PORT" in out.stderr


def test_corrupt_control_file_stops_the_safekeeper(tmp_path: Path) -> None:
    save_control(tmp_path, ControlData(1, AcceptorState(system_id=42, wal_seg_size=16 << 20, timeline=1, term=3)))
    path = tmp_path / CONTROL_FILE
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    out = walsidecar("safekeeper", "--id", "1", "--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path),
                     "--insecure", timeout=30)
    assert out.returncode != 0
    assert "corrupt" in out.stderr
    assert path.read_bytes() == bytes(raw), "the corrupt control file must be left for the operator"


def test_safekeeper_refuses_another_nodes_data_dir(tmp_path: Path) -> None:
    save_control(tmp_path, ControlData(2, AcceptorState()))
    out = walsidecar("safekeeper", "--id", "1", "--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path),
                     "--insecure", timeout=30)
    assert out.returncode != 0
    assert "belongs to safekeeper 2" in out.stderr


def test_incomplete_certificates_dir_is_refused(tmp_path: Path) -> None:
    """A certificates directory that lacks its key is refused before anything is opened."""
    from sidecar.certs import create_ca, create_node
    create_ca(tmp_path / "ca")
    create_node(tmp_path / "ca", tmp_path / "c", "safekeeper", 1)
    (tmp_path / "c" / "node.key").unlink()
    out = walsidecar("safekeeper", "--id", "1", "--listen", f"127.0.0.1:{free_port()}", "--data-dir",
                     str(tmp_path / "sk"), "--certs-dir", str(tmp_path / "c"), timeout=30)
    assert out.returncode == 1 and "lacks node.key" in out.stderr and "walsidecar certs create-node" in out.stderr
    assert "Traceback" not in out.stderr


def test_safekeeper_init_creates_a_new_clusters_safekeeper_once(tmp_path: Path) -> None:
    from sidecar.safekeeper.control import load_control
    data = tmp_path / "sk2"
    out = walsidecar("safekeeper-init", "--id", "2", "--data-dir", str(data), "--members", "3", timeout=30)
    assert out.returncode == 0, out.stderr
    assert load_control(data) == ControlData(2, AcceptorState(members=3))
    out = walsidecar("safekeeper-init", "--id", "2", "--data-dir", str(data), "--members", "3", timeout=30)
    assert out.returncode == 1 and "already holds safekeeper 2's control file" in out.stderr, out.stderr
    wiped = tmp_path / "wiped"
    (wiped / "wal").mkdir(parents=True)  # a lost control file: a lost disk, never a new cluster's member
    out = walsidecar("safekeeper-init", "--id", "3", "--data-dir", str(wiped), "--members", "3", timeout=30)
    assert out.returncode == 1 and "is not empty (wal)" in out.stderr and "--peers" in out.stderr, out.stderr
    assert load_control(wiped) is None
