"""Subprocesses started by tests, always stopped by their own PID."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence


class ManagedProcess:
    """A child process whose stdout and stderr go to a log file."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        name: str | None = None,
        **popen_kwargs: Any,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.name = name or Path(self.argv[0]).name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with self.log_path.open("ab") as log:
            # Own session: a Ctrl-C aimed at pytest does not reach the child first.
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=None if cwd is None else str(cwd),
                start_new_session=True,
                **popen_kwargs,
            )

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, returncode={self.returncode})"

    @property
    def pid(self) -> int:
        """OS process id."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status (negative signal number if killed), or None while running."""
        return self._popen.poll()

    def is_running(self) -> bool:
        """True while the process has not exited."""
        return self._popen.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send sig to this PID if it is still running."""
        if self.is_running():
            self._popen.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for exit and return the exit status; raises subprocess.TimeoutExpired."""
        return self._popen.wait(timeout)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within timeout; returns the exit status."""
        self.send_signal(signal.SIGTERM)
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill9()

    def interrupt(self, timeout: float = 10.0) -> int:
        """SIGINT (graceful shutdown), escalating to SIGKILL after timeout."""
        self.send_signal(signal.SIGINT)
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill9()

    def kill9(self) -> int:
        """SIGKILL and reap; returns the exit status."""
        self.send_signal(signal.SIGKILL)
        return self._popen.wait()

    def kill_group(self) -> None:
        """SIGKILL what is left of the session this process leads (its own descendants)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_text(self) -> str:
        """Everything the process has written so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class ProcessTracker:
    """Starts ManagedProcesses for one test and kills all of them at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.started: list[ManagedProcess] = []

    def start(
        self,
        argv: Sequence[str],
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        name: str | None = None,
        **popen_kwargs: Any,
    ) -> ManagedProcess:
        """Start and track a process; its log defaults to LOG_DIR/<name>-<n>.log."""
        label = name or Path(str(argv[0])).name
        if log_path is None:
            log_path = self.log_dir / f"{label}-{len(self.started)}.log"
        proc = ManagedProcess(argv, log_path, env=env, cwd=cwd, name=label, **popen_kwargs)
        self.started.append(proc)
        return proc

    def track(self, proc: ManagedProcess) -> ManagedProcess:
        """Register a process started elsewhere so teardown kills it too."""
        self.started.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL every tracked process (and its session's leftovers), then reap."""
        for proc in reversed(self.started):
            # Group first, while the leader's PID still pins the group id to us.
            proc.kill_group()
            if proc.is_running():
                proc.kill9()
