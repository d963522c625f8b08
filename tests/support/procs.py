"""Subprocesses started by tests, always stopped by their own PID: sidecar.processes.Child, tracked."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Mapping, Sequence

from sidecar.processes import Child


class ManagedProcess(Child):
    """A Child started as it is made, with the names the tests use for its operations."""

    def __init__(self, argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None, name: str | None = None, **popen_kwargs: Any) -> None:
        super().__init__(name or Path(str(argv[0])).name, argv, log_path, env=env, cwd=cwd, **popen_kwargs)
        self.start()

    def is_running(self) -> bool:
        """True while the process has not exited."""
        return self.running

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within timeout; returns the exit status."""
        return self.stop(timeout)  # type: ignore[return-value]

    def interrupt(self, timeout: float = 10.0) -> int:
        """SIGINT (graceful shutdown), escalating to SIGKILL after timeout."""
        return self.stop(timeout, sig=signal.SIGINT)  # type: ignore[return-value]

    def kill9(self) -> int:
        """SIGKILL and reap; returns the exit status."""
        return self.kill()  # type: ignore[return-value]


class ProcessTracker:
    """Starts ManagedProcesses for one test and kills all of them, by PID, at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.started: list[Child] = []

    def start(self, argv: Sequence[str], *, log_path: Path | None = None, env: Mapping[str, str] | None = None,
              cwd: Path | str | None = None, name: str | None = None, **popen_kwargs: Any) -> ManagedProcess:
        """Start and track a process; its log defaults to LOG_DIR/<name>-<n>.log."""
        label = name or Path(str(argv[0])).name
        if log_path is None:
            log_path = self.log_dir / f"{label}-{len(self.started)}.log"
        return self.track(ManagedProcess(argv, log_path, env=env, cwd=cwd, name=label, **popen_kwargs))

    def spawn(self, name: str, argv: Sequence[str], log_path: Path) -> ManagedProcess:
        """A LocalDeployment's way to start a member: tracked, with a log of its own per start."""
        return self.start(argv, name=name)

    def track(self, proc: Any) -> Any:
        """Register a process started elsewhere so teardown kills it too."""
        self.started.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL every tracked process (and its session's leftovers), then reap."""
        for proc in reversed(self.started):
            # Group first, while the leader's PID still pins the group id to us.
            proc.kill_group()
            proc.kill()

    def log_tails(self, lines: int = 60) -> str:
        """The last lines of every tracked process's log, for a failed test's report."""
        return "\n".join(f"--- {proc!r} log tail ({proc.log_path}) ---\n{proc.log_tail(lines)}"
                         for proc in self.started)
