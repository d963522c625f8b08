"""No walsidecar process a test started may leave a Python traceback in its log (issue 23).

A traceback in a service's log is an exception nobody handled: a crash, a thread that died, or a shutdown
that is not clean. Tests look at what they expect; this looks at everything else the processes wrote.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

MARK = b"Traceback"
# Logs of other programs that no tracker knows: moto_server (tests/support/s3.py) is Python, and its
# tracebacks are its own.
NOT_OURS = ("moto-*.log",)
EXCERPT_LINES = 12


def is_walsidecar(argv: Iterable[str]) -> bool:
    """A `walsidecar ...` command line: the installed command or `python -m sidecar`."""
    argv = list(argv)
    return any(Path(a).name == "walsidecar" for a in argv[:1]) or \
        any(a == "-m" and b == "sidecar" for a, b in zip(argv, argv[1:]))


def walsidecar_logs(test_dir: Path, started: Iterable[Any]) -> list[Path]:
    """The logs to scan: those of the started processes with a walsidecar command line, and every other `*.log`
    under `test_dir` (the members of a `walsidecar up`, restore-wal's output in a server log), except the logs
    of started processes that are not walsidecar (etcd, pgbench) and moto_server's, which are not ours to judge."""
    ours, theirs = set(), set()
    for proc in started:
        path = getattr(proc, "log_path", None)
        if path is not None:
            (ours if is_walsidecar(getattr(proc, "argv", ())) else theirs).add(Path(path))
    found = {p for p in test_dir.rglob("*.log") if not any(p.match(g) for g in NOT_OURS)} if test_dir.is_dir() else set()
    return sorted(p for p in ours | (found - theirs) if p.is_file())


def tracebacks(paths: Iterable[Path]) -> dict[Path, str]:
    """For each log holding a traceback, the lines from its first one on (a few)."""
    out: dict[Path, str] = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # removed by the test: nothing left to judge
        at = data.find(MARK)
        if at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            out[path] = "\n".join(data[start:].decode(errors="replace").splitlines()[:EXCERPT_LINES])
    return out


def report(found: dict[Path, str]) -> str:
    return "a walsidecar process left a traceback in its log:\n" + "\n".join(
        f"--- {path} ---\n{excerpt}" for path, excerpt in found.items())
