"""walclient's pieces that need no safekeeper: the reader port's conninfo, and a port that does not answer."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from sidecar.address import Address
from sidecar.config import RestoreWalSettings
from sidecar.walclient import ReaderUnreachable, WalReader, reader_conninfo


def settings(*ports: int, **kw: object) -> RestoreWalSettings:
    return RestoreWalSettings(safekeeper_readers=tuple(f"127.0.0.1:{p}" for p in ports), insecure=True,
                              reader_timeout=2, **kw)


def test_the_conninfo_asks_for_replication_and_verify_full_with_certificates(tmp_path: Path) -> None:
    for name in ("ca.crt", "node.crt", "node.key"):
        (tmp_path / name).write_text("x")
    s = RestoreWalSettings(safekeeper_readers=("db1:7701",), certs_dir=tmp_path, reader_passfile=tmp_path / "pgpass",
                           reader_user="archiver")
    info = conninfo_to_dict(reader_conninfo(Address("db1", 7701), s))
    assert info == {"host": "db1", "port": "7701", "user": "archiver", "dbname": "replication",
                    "replication": "true", "connect_timeout": "10", "passfile": str(tmp_path / "pgpass"),
                    "sslmode": "verify-full", "sslrootcert": str(tmp_path / "ca.crt"),
                    "sslcert": str(tmp_path / "node.crt"), "sslkey": str(tmp_path / "node.key")}
    insecure = conninfo_to_dict(reader_conninfo(Address("::1", 7701), settings(1)))
    assert insecure["sslmode"] == "prefer" and insecure["host"] == "::1" and "passfile" not in insecure


def test_a_closed_port_is_unreachable_and_says_where() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ReaderUnreachable) as e:
            WalReader(Address("127.0.0.1", port), settings(port)).connect()
    assert str(port) in e.value.message and e.value.sqlstate is None
