"""The installed `walsidecar` command: what PostgreSQL runs as the postgres OS user (restore_command).

scripts/install.sh installs the package (not editable) into the venv whose python runs the tests, so the
command reads nothing from the checkout, which the postgres user may not be able to read (a clone under
/root). The tests import the checkout's code; the installed copy must be the same, file for file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.processes import walsidecar_argv

ROOT = Path(__file__).resolve().parents[2]


def installed_command() -> Path:
    """`walsidecar` next to this interpreter, holding this checkout's code; the test fails if it does not."""
    command = Path(walsidecar_argv()[0])
    if not os.access(command, os.X_OK):
        pytest.fail(f"{command} is missing: install the package into {Path(sys.executable).parent.parent} "
                    "(scripts/install.sh, which scripts/test.sh runs)")
    installed = installed_package_dir()
    if files(installed) != files(ROOT / "sidecar"):
        pytest.fail(f"{installed} is not this checkout's sidecar/: run scripts/install.sh (scripts/test.sh does)")
    return command


def installed_argv(*args: str, log_format: str = "plain") -> list[str]:
    """The command line running `walsidecar ARGS` from the installed command, as PostgreSQL does."""
    return [str(installed_command()), *args, "--log-format", log_format]


def installed_package_dir(*, user: str | None = None) -> Path:
    """Where this interpreter's venv imports `sidecar` from outside any checkout (as `user`, with runuser)."""
    code = "import os, sidecar; print(os.path.dirname(os.path.realpath(sidecar.__file__)))"
    argv = [sys.executable, "-P", "-c", code]
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(argv, cwd="/", env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stderr}"
    return Path(out.stdout.strip())


def files(package: Path) -> dict[str, str]:
    """Every file of a package directory but what a build made (bytecode, the compiled stream loop), by
    relative path: its SHA-256."""
    return {str(p.relative_to(package)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(package.rglob("*"))
            if p.is_file() and p.suffix not in (".pyc", ".so") and "__pycache__" not in p.parts}
