"""Every command given bad input exits non-zero with a message that says what is wrong, never a traceback."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.helpers import free_port, walsidecar
from sidecar.cli import main
from sidecar.safekeeper.control import CONTROL_FILE

SKS = "127.0.0.1:7601,127.0.0.1:7602,127.0.0.1:7603"
DSN = "host=127.0.0.1 port=5432 dbname=postgres"
SK = ("safekeeper", "--id", "1", "--insecure")
START = ("start", "--pg-dsn", DSN, "--safekeepers", SKS, "--insecure")


@pytest.fixture
def taken() -> Iterator[str]:
    """An address something already listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "bad.toml").write_text("quorum = [\n")
    (tmp_path / "typo.toml").write_text("qourum = 2\n")
    (tmp_path / "noetcd.yml").write_text("scope: main\nname: node1\n")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / CONTROL_FILE).write_bytes(b"garbage")
    (tmp_path / "ctl-is-dir" / CONTROL_FILE).mkdir(parents=True)
    (tmp_path / "sk").mkdir()
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "000000010000000000000001").write_bytes(b"junk")
    return tmp_path


def _unreachable() -> str:
    return f"host=127.0.0.1 port={free_port()} dbname=postgres connect_timeout=3"


# (command line, what the message must say); {d} is the test's directory, {taken} an address in use.
CASES = [
    # missing required options, bad values
    (("safekeeper",), "id is required"),
    (("safekeeper", "--id", "x"), "'x' is not a valid integer"),
    ((*SK, "--data-dir", "{d}/sk", "--listen", "nowhere"), "'nowhere' is not an address"),
    ((*SK, "--data-dir", "{d}/sk", "--listen", "127.0.0.1:7601", "--log-level", "loud"), "'loud' is not one of"),
    (("start",), "pg_dsn is required"),
    ((*START, "--quorum", "5"), "quorum 5 is larger than the 3 safekeepers"),
    ((*START, "--slot", "Bad-Slot"), "invalid replication slot name"),
    (("start", "--pg-dsn", "hots=x", "--safekeepers", SKS, "--insecure"), "--pg-dsn is not a libpq connection string"),
    (("start", "--pg-dsn", DSN, "--safekeepers", "127.0.0.1:1,127.0.0.1:1,127.0.0.1:2", "--insecure"),
     "listed twice"),
    ((*START, "--certs-dir", "{d}"), "--certs-dir = '{d}': cannot be used with --insecure: give either --certs-dir "
                                      "or --insecure, not both"),
    (("check", "--pg-dsn", DSN, "--safekeepers", "127.0.0.1:1,,127.0.0.1:2", "--insecure"),
     "--safekeepers = '127.0.0.1:1,,127.0.0.1:2': an empty item between commas"),
    (("check", "--timeout", "5"), "safekeepers is required"),  # bare `check` may point at a running `up`
    (("check", "--pg-dsn", DSN, "--safekeepers", SKS, "--format", "xml"), "'xml' is not one of"),
    (("status", "--insecure"), "nothing to ask"),
    (("status", "--safekeepers", SKS, "--insecure", "--watch", "-1"), "greater than 0"),
    (("init-postgres",), "pg_dsn is required"),
    (("init-postgres", "--pg-dsn", DSN, "--sync", "maybe"), "'maybe' is not one of"),
    (("up", "--pg-port", "x"), "'x' is not a valid integer"),
    (("up", "--no-such-option"), "No such option"),
    (("certs", "create-ca"), "Missing option '--ca-dir'"),
    (("certs", "create-node", "--ca-dir", "{d}/noca", "--certs-dir", "{d}/n", "--role", "proposer"), "no CA in"),
    (("certs", "create-node", "--ca-dir", "{d}", "--certs-dir", "{d}/n", "--role", "king"), "'king' is not one of"),
    (("analyze",), "Missing argument 'SOURCE'"),
    (("analyze", "{d}/archive"), "nothing to do"),
    (("verify-archive",), "Missing argument 'SOURCE'"),
    # config files
    ((*SK, "--config", "{d}/missing.toml"), "cannot read the config file"),
    ((*SK, "--config", "{d}/bad.toml"), "is not valid TOML"),
    ((*START, "--config", "{d}/typo.toml"), "qourum"),
    # data directories
    ((*SK, "--data-dir", "{d}/afile", "--listen", "127.0.0.1:7601"), "is a file"),
    ((*SK, "--data-dir", "{d}/damaged", "--listen", "127.0.0.1:7601"), "the control file is corrupt"),
    ((*SK, "--data-dir", "{d}/ctl-is-dir", "--listen", "127.0.0.1:7601"), "Is a directory"),
    (("certs", "create-ca", "--ca-dir", "{d}/afile"), "is a file"),
    (("analyze", "{d}/afile", "--stats"), "is not a directory"),
    (("verify-archive", "{d}/nothing"), "is not a directory"),
    (("verify-archive", "{d}/archive"), "FAILED: truncated segment"),
    # ports in use
    ((*SK, "--data-dir", "{d}/sk", "--listen", "{taken}"), "cannot listen on {taken} for the safekeeper (--listen): "
                                                           "Address already in use"),
    ((*SK, "--data-dir", "{d}/sk", "--listen", "127.0.0.1:{free}", "--metrics", "{taken}"),
     "cannot listen on {taken} for the safekeeper metrics endpoint (--metrics): Address already in use"),
    ((*START, "--metrics", "{taken}"), "cannot listen on {taken} for the proposer metrics endpoint (--metrics)"),
    ((*START, "--commit-wait", "cancel-after=10s"), "write wait (the default), terminate-after=DURATION"),
    ((*START, "--commit-wait", "degrade-after=10s"), "degrade-after records its degraded ranges in etcd: give --broker"),
    ((*START, "--commit-wait", "degrade-after=10s", "--broker", "http://127.0.0.1:2379"), "give --cluster"),
    ((*START, "--commit-wait", "terminate-after=soon"), "terminate-after=soon: 'soon' is not a duration"),
    # certificates
    (("safekeeper", "--id", "1", "--data-dir", "{d}/sk", "--listen", "127.0.0.1:7601", "--certs-dir", "{d}/nocerts"),
     "lacks ca.crt, node.crt, node.key"),
    (("start", "--pg-dsn", DSN, "--safekeepers", SKS, "--certs-dir", "{d}/nocerts"), "lacks ca.crt"),
    (("check", "--pg-dsn", DSN, "--safekeepers", SKS, "--certs-dir", "{d}/nocerts"), "lacks ca.crt"),
    (("status", "--safekeepers", SKS, "--certs-dir", "{d}/nocerts"), "lacks ca.crt"),
    # a primary nothing answers at
    (("check", "--pg-dsn", "{unreachable}", "--safekeepers", "127.0.0.1:{free}", "--insecure"), "Connection refused"),
    (("status", "--pg-dsn", "{unreachable}", "--insecure"), "Primary:  unreachable"),
    (("init-postgres", "--pg-dsn", "{unreachable}"), "Connection refused"),
    # follow-leader's lost-leader check needs Patroni's etcd3 section
    (("follow-leader", "--sidecar-config", "{d}/typo.toml", "--patroni-config", "{d}/noetcd.yml"),
     "no etcd3 section"),
    (("follow-leader", "--sidecar-config", "{d}/typo.toml", "--leader-lost-after", "0"),
     "--leader-lost-after = 0.0: Input should be greater than 0"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a[:3]) + f" [{i}]" for i, (a, _) in enumerate(CASES)])
def test_bad_input_gets_a_message_and_no_traceback(args: tuple[str, ...], message: str, files: Path,
                                                   taken: str) -> None:
    fill = {"d": str(files), "taken": taken, "free": str(free_port()), "unreachable": _unreachable()}
    out = walsidecar(*(a.format(**fill) for a in args), timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert message.format(**fill) in text, text
    assert "Traceback" not in text, text


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_an_unreadable_data_dir_is_named(files: Path) -> None:
    (files / "sk").chmod(0)
    try:
        out = walsidecar(*SK, "--data-dir", str(files / "sk"), "--listen", f"127.0.0.1:{free_port()}")
    finally:
        (files / "sk").chmod(0o755)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    assert str(files / "sk") in out.stdout + out.stderr


def test_ctl_option_errors_have_no_traceback() -> None:
    if "ctl" not in main.commands:
        pytest.skip("no ctl command in this checkout")
    for args in (("ctl", "--no-such-option"), ("ctl", "--dir")):
        out = walsidecar(*args)
        assert out.returncode != 0 and out.stderr.strip(), args
        assert "Traceback" not in out.stdout + out.stderr, args
