"""Child processes (safekeepers, the proposer, tools): own session, log file, stopped by PID."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def sidecar_argv(*args: str, log_format: str = "plain") -> list[str]:
    """The command line running `walsidecar ARGS` with this interpreter."""
    return [sys.executable, "-m", "sidecar", *args, "--log-format", log_format]


def walsidecar_argv(*args: str) -> list[str]:
    """The command line running the installed `walsidecar ARGS` (beside this interpreter), as another OS user would.

    PostgreSQL runs its restore_command as its own user, who may not read this process's checkout.
    """
    installed = Path(sys.executable).with_name("walsidecar")
    return [str(installed) if installed.exists() else "walsidecar", *args]


def tls_args(certs_dir: Path | None) -> list[str]:
    """`--certs-dir DIR`, or `--insecure` when there are no certificates."""
    return ["--certs-dir", str(certs_dir)] if certs_dir is not None else ["--insecure"]


class Child:
    """One child process whose stdout and stderr are appended to `log_path`.

    It runs in a session of its own, so a Ctrl-C aimed at the parent does not reach it:
    the parent decides the order in which things stop. Every signal goes to the PID it started.
    With `parent_death_signal` the kernel sends it that signal when its parent dies, even by SIGKILL.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None, parent_death_signal: int | None = None, **popen_kwargs: Any) -> None:
        self.name = name
        self.parent_death_signal = parent_death_signal
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env or {})  # on top of this process's environment
        self.cwd = cwd
        self.popen_kwargs = popen_kwargs
        self._popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def sidecar(cls, name: str, args: Sequence[str], log_path: Path, log_format: str = "plain") -> Child:
        """A `walsidecar` subcommand (not started yet)."""
        return cls(name, sidecar_argv(*args, log_format=log_format), log_path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, pid={self.pid}, returncode={self.returncode})"

    def start(self) -> Child:
        """Spawn the process (again, if it ran before and has exited)."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **self.env} if self.env else None,
                                           cwd=None if self.cwd is None else str(self.cwd),
                                           start_new_session=True,
                                           preexec_fn=None if self.parent_death_signal is None else
                                           die_with_parent(self.parent_death_signal),
                                           **self.popen_kwargs)
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

    def send_signal(self, sig: int) -> None:
        """Send `sig` to this PID if it still runs."""
        if self.running:
            assert self._popen is not None
            self._popen.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit and return the exit status; raises subprocess.TimeoutExpired."""
        assert self._popen is not None, f"{self.name} was never started"
        return self._popen.wait(timeout)

    def kill(self) -> int | None:
        """SIGKILL this PID (if it still runs) and reap it; returns the exit status."""
        if self._popen is None:
            return None
        self.send_signal(signal.SIGKILL)
        return self._popen.wait()

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        """`sig` (SIGTERM: a clean shutdown), SIGKILL after `timeout` seconds; returns the exit status."""
        if self._popen is None:
            return None
        self.send_signal(sig)
        try:
            return self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    def restart(self, timeout: float = 15.0) -> Child:
        """stop() then start(): the same command line, appending to the same log."""
        self.stop(timeout)
        return self.start()

    def kill_group(self) -> None:
        """SIGKILL what is left of the session this process leads (its own descendants)."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_text(self) -> str:
        """Everything the process has written to its log so far (empty when there is none)."""
        return read_log(self.log_path)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the log file."""
        return tail(self.log_text(), lines)


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def name_thread(name: str) -> None:
    """Name the calling OS thread (at most 15 bytes), as `top -H`, `ps -L` and /proc/PID/task show it."""
    try:
        _libc().prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # only a name


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(sig: int) -> Callable[[], None]:
    """A preexec_fn asking the kernel to send `sig` to the child when this process dies.

    Linux sends it when the *thread* that forked exits, so only the main thread may start such children.
    The child checks its parent afterwards: a parent that died before the prctl call sends nothing.
    """
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
    return preexec


def read_log(path: Path) -> str:
    """A log file's text so far; empty when it does not exist (yet)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def tail(text: str, lines: int = 40) -> str:
    """The last `lines` lines of `text`."""
    return "\n".join(text.splitlines()[-lines:])


def process_tree(roots: Sequence[int]) -> list[int]:
    """`roots` and every process descending from them (from /proc), roots first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        if pid in out:
            continue
        out.append(pid)
        todo += children.get(pid, [])
    return out
