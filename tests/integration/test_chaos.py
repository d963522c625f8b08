"""Short runs of scripts/chaos.py (kills, partitions and failovers with the old primary alive, under
load, then no acknowledged write is lost) and the network-namespace hosts that partitions cut
(tests/netns.py)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from support import netns
import pytest

pytestmark = pytest.mark.integration

CHAOS = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


needs_netns = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))


# The lines of chaos.py's stderr that say what failed; the log tails after them can be long.
VERDICT = ("CHAOS FAILURE", "CHAOS ERROR", "LOST WRITES", "  key ", "WAL MISMATCH")


def run_chaos(base: Path, *args: str, rounds: int = 6, timeout: float = 240) -> dict[str, str]:
    """Run `rounds` rounds of chaos.py; the fields of its summary line, after checking it passed."""
    out = subprocess.run([sys.executable, str(CHAOS), "--rounds", str(rounds), "--dir", str(base), *args],
                         check=False, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    verdict = "\n".join(line for line in out.stderr.splitlines() if line.startswith(VERDICT))
    report = f"stdout:\n{out.stdout}\nverdict:\n{verdict}\nstderr:\n{out.stderr[-6000:]}"
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    fields = dict(re.findall(r"(\w+)=(\S+)", summary))
    assert summary.startswith("summary:"), report
    assert fields["rounds"] == str(rounds), report
    assert fields["lost"] == "0" and fields["wal_mismatches"] == "0" and fields["unsafe_acks"] == "0", report
    assert int(fields["acknowledged"]) > 0, report
    assert fields["result"] == "ok", report
    assert not base.exists(), "the data directory is removed after a passing run"
    return fields


def test_no_acknowledged_write_is_lost_under_chaos(test_dir: Path) -> None:
    run_chaos(test_dir / "chaos", "--seed", "1")


@pytest.mark.timeout(480)  # verify-archive runs Spark at the end
def test_a_corrupt_archive_is_named_and_no_safekeeper_removes_what_it_does_not_hold(test_dir: Path) -> None:
    # Each archive-corruption round plants a same-size object of random bytes under the name of the segment
    # the primary writes (every safekeeper must name it, keep that segment and, once it is set aside, upload
    # the right one) and flips a bit in an archived object (verify-archive must name it at the end); the run
    # then checks every segment a safekeeper removed against the primary's copy in the archive.
    fields = run_chaos(test_dir / "chaos", "--seed", "3", "--writers", "2",
                       "--kinds", "safekeeper,sidecar,archive-corruption", timeout=420)
    assert int(fields["archive_plants"]) >= 1 and int(fields["archive_flips"]) >= 1, fields
    assert fields["unverified_removals"] == "0", fields
    assert int(fields["safekeeper_kills"]) + int(fields["sidecar_kills"]) >= 1, fields


@pytest.mark.timeout(480)
def test_a_corrupt_s3_archive_is_named_and_no_safekeeper_removes_what_it_does_not_hold(test_dir: Path) -> None:
    # The same rounds against a bucket of a moto_server (started and stopped by chaos.py).
    fields = run_chaos(test_dir / "chaos", "--seed", "5", "--writers", "2", "--kinds", "archive-corruption",
                       "--archive-store", "s3", timeout=420, rounds=2)
    assert fields["archive_plants"] == "2" and fields["archive_flips"] == "2", fields
    assert fields["unverified_removals"] == "0", fields


@needs_netns
def test_no_acknowledged_write_is_lost_under_partitions_and_kills(test_dir: Path) -> None:
    # Seed 1 draws: sidecar kill, safekeeper kill, two safekeepers cut off, one cut off,
    # sidecar kill, primary crash.
    before = set(_ours())  # another run's hosts may exist meanwhile
    fields = run_chaos(test_dir / "chaos", "--seed", "1", "--kinds", "safekeeper,sidecar,primary,partition")
    assert int(fields["partitions"]) >= 1, fields
    assert int(fields["safekeeper_kills"]) + int(fields["sidecar_kills"]) + int(fields["primary_crashes"]) >= 1
    assert set(_ours()) <= before, "every namespace, link and route made for the run is gone"


def test_failover_live_loses_no_acknowledged_write(test_dir: Path) -> None:
    # Issue 23 §5: `walsidecar failover` while the old primary and its sidecar keep taking writes, the
    # old side killed only once the new primary's sidecar runs. Whatever either primary acknowledged
    # must be on the new one. Before the safekeepers refused the old lineage, the old sidecar won the
    # term after the fence's and its primary's acknowledged commits were missing on the new primary.
    fields = run_chaos(test_dir / "chaos", "--seed", "1", "--kinds", "failover-live", rounds=3, timeout=600)
    assert int(fields["promotions"]) >= 1, fields
    assert int(fields["promotions"]) + int(fields["refusals"]) == 3, fields


def _ours() -> list[str]:
    """Namespaces, links and routes of tests/netns.py that exist now."""
    names = [line.split()[0] for line in netns.ip("netns", "list").splitlines() if line.startswith(netns.PREFIX)]
    names += [link["ifname"] for link in json.loads(netns.ip("-j", "link", "show"))
              if link["ifname"].startswith(netns.PREFIX)]
    names += [r["dst"] for r in json.loads(netns.ip("-j", "-4", "route", "show", "proto", "213") or "[]")]
    return names


def _serve_once(host: netns.Host, port: int) -> subprocess.Popen[str]:
    """A process inside `host` that answers each connection on host.address:port with its PID."""
    code = ("import os, socket\n"
            f"s = socket.create_server(({host.address!r}, {port}))\n"
            "print('listening', flush=True)\n"
            "while True:\n"
            "    c, _ = s.accept()\n"
            "    c.sendall(str(os.getpid()).encode()); c.close()\n")
    proc = subprocess.Popen(host.argv([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
    return proc


def _ask(address: str, port: int) -> bytes:
    with socket.create_connection((address, port), timeout=10) as c:
        return c.recv(64)


@needs_netns
def test_netns_link_is_cut_and_healed_for_real() -> None:
    before = _ours()
    with netns.Hosts(2) as hosts:
        one, two = hosts
        assert one.address != two.address and one.namespace != two.namespace
        servers = [_serve_once(h, 7700) for h in hosts]
        try:
            # ip netns exec runs the command itself: the PID we hold is the server's.
            assert _ask(one.address, 7700) == str(servers[0].pid).encode()
            one.cut()
            assert not one.link_up
            with pytest.raises(OSError):  # no route, and nothing leaks out by the default route
                _ask(one.address, 7700)
            assert _ask(two.address, 7700) == str(servers[1].pid).encode(), "the other host is unaffected"
            one.heal()
            assert _ask(one.address, 7700) == str(servers[0].pid).encode()
        finally:
            for proc in servers:
                proc.kill()
                proc.wait()
    assert _ours() == before


@needs_netns
def test_netns_leftovers_of_a_killed_run_are_removed() -> None:
    tests_dir = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(tests_dir)!r}); from support import netns\n"
            "h = netns.Hosts(1)\nprint(h[1].namespace, flush=True)\nimport time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        namespace = proc.stdout.readline().strip()
        assert namespace in _ours()
        assert namespace not in netns.remove_leftovers(), "a live run's namespace is left alone"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    removed = netns.remove_leftovers()
    assert namespace in removed
    assert not [n for n in _ours() if f"{proc.pid:x}" in n]


def test_chaos_help() -> None:
    out = subprocess.run([sys.executable, str(CHAOS), "--help"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--rounds" in out.stdout and "--seed" in out.stdout, out.stderr
