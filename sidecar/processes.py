"""walsidecar child processes (safekeepers, the proposer): own session, log file, stopped by PID."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def sidecar_argv(*args: str, log_format: str = "plain") -> list[str]:
    """The command line running `walsidecar ARGS` with this interpreter."""
    return [sys.executable, "-m", "sidecar", *args, "--log-format", log_format]


def tls_args(certs_dir: Path | None) -> list[str]:
    """`--certs-dir DIR`, or `--insecure` when there are no certificates."""
    return ["--certs-dir", str(certs_dir)] if certs_dir is not None else ["--insecure"]


class Child:
    """One child process whose stdout and stderr are appended to `log_path`.

    It runs in a session of its own, so a Ctrl-C aimed at the parent does not reach it:
    the parent decides the order in which things stop.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self._popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def sidecar(cls, name: str, args: Sequence[str], log_path: Path, log_format: str = "plain") -> Child:
        """A `walsidecar` subcommand (not started yet)."""
        return cls(name, sidecar_argv(*args, log_format=log_format), log_path)

    def __repr__(self) -> str:
        return f"Child({self.name!r}, pid={self.pid}, returncode={self.returncode})"

    def start(self) -> Child:
        """Spawn the process (again, if it ran before and has exited)."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        """PID of the last process started, or None before the first start()."""
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status of the last process (negative: killed by that signal), None while it runs."""
        return self._popen.poll() if self._popen is not None else None

    @property
    def running(self) -> bool:
        """True while the last process started has not exited."""
        return self._popen is not None and self._popen.poll() is None

    def kill(self) -> int | None:
        """SIGKILL this PID (if it still runs) and reap it; returns the exit status."""
        if self._popen is None:
            return None
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGKILL)
        return self._popen.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (a clean shutdown), SIGKILL after `timeout` seconds; returns the exit status."""
        if self._popen is None:
            return None
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)
            try:
                self._popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._popen.kill()
        return self._popen.wait()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log file (empty when there is none)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
