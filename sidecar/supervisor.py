"""Keep a LocalDeployment's members running: restart the ones that die, with backoff; the primary's death ends it.

A member stopped on purpose (`walsidecar ctl stop`) is held: not restarted until it is started again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sidecar.deployment import DeploymentError, LocalDeployment, Member


# `ctl start` waits this long, at most, for a member to be back in the cluster (`up` supervises nothing meanwhile).
SETTLE_TIMEOUT = 10.0
SETTLE_POLL = 0.05


class PrimaryExited(DeploymentError):
    """PostgreSQL stopped without being asked to: there is nothing left to protect."""


class Backoff:
    """Delays between restarts: `first`, doubling up to `cap`; back to `first` once a run lasted `reset_after`."""

    def __init__(self, first: float = 0.5, cap: float = 30.0, reset_after: float = 60.0) -> None:
        self.first, self.cap, self.reset_after = first, cap, reset_after
        self.failures = 0

    def delay(self, ran_for: float) -> float:
        """The wait before the next start of a process that ran `ran_for` seconds."""
        if ran_for >= self.reset_after:
            self.failures = 0
        delay = min(self.cap, self.first * 2 ** self.failures)
        self.failures += 1
        return delay


@dataclass
class Watched:
    """What the supervisor knows of one member."""

    member: Member
    started: float
    held: bool = False  # stopped on purpose: stays stopped
    restarts: int = 0
    due: float | None = None  # when it is restarted, once seen dead
    backoff: Backoff = field(default_factory=Backoff)
    problem: str | None = None  # why it does not get its WAL, as last seen
    problem_since: float | None = None
    failing: bool = False  # the problem lasted FAILING_AFTER: logged, shown by `ctl members`


CHECK_INTERVAL = 5.0  # seconds between looks at whether a running member gets its WAL
FAILING_AFTER = 15.0  # a problem that lasts this long is logged: a WAL receiver retries every 5 s


class Supervisor:
    """Call tick() often: it notices members that exited and restarts them when their backoff is over,
    and members that run but keep failing to get their WAL (a standby whose reader port refuses it)."""

    def __init__(self, d: LocalDeployment, log: Any, clock: Callable[[], float] = time.monotonic,
                 back: Callable[[str], str | None] | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 describe: Callable[[str], str | None] | None = None) -> None:
        self.d, self.log, self.clock, self.sleep = d, log, clock, sleep
        # What a running member is beyond "running" (an HA node's Patroni role and state), for `ctl members`.
        self.describe = describe
        # What says a member started on request is back in the cluster: None while it is not, else how it is
        # ("" when there is nothing to wait for). Without it a start returns once the process is spawned.
        self.back = back
        self.watched = {name: Watched(m, clock()) for name, m in d.members.items()}
        self.checked = clock()

    def tick(self) -> None:
        now = self.clock()
        if now - self.checked >= CHECK_INTERVAL:
            self.checked = now
            self.check_streaming(now)
        for name, w in self.watched.items():
            if w.held or w.member.running:
                continue
            child = w.member.process
            code = child.returncode if child is not None else None
            if name == "primary":
                if not any(m.takes_over for m in self.d.members.values()):
                    raise PrimaryExited(f"PostgreSQL (the primary) exited with code {code}; stopping everything. "
                                        f"See {w.member.log_path}")
                # A standby can take over (walsidecar failover): the safekeepers and it stay up.
                w.held = True
                self.log.error("the primary exited; the standby can take over with `walsidecar failover`",
                               exit_code=code, log=str(w.member.log_path))
                continue
            if w.due is None:
                w.due = now + w.backoff.delay(now - w.started)
                self.log.error("member exited; restarting it", member=name, exit_code=code,
                               log=str(w.member.log_path), restart_in=round(w.due - now, 1), restarts=w.restarts)
            elif now >= w.due:
                self._start(w)
                w.restarts += 1
                self.log.info("member restarted", member=name, pid=self._pid(w), restarts=w.restarts)

    def check_streaming(self, now: float) -> None:
        """Ask each running member whether it gets its WAL; log a problem that lasts, and its end."""
        for name, w in self.watched.items():
            problem = w.member.streaming_problem() if w.member.running else None
            if problem is None:
                if w.failing:
                    self.log.info("member streams again", member=name)
                w.problem, w.problem_since, w.failing = None, None, False
                continue
            if w.problem_since is None:
                w.problem_since = now
            w.problem = problem
            if not w.failing and now - w.problem_since >= FAILING_AFTER:
                w.failing = True
                self.log.error("member keeps failing to get its WAL", member=name, problem=problem,
                               seconds=round(now - w.problem_since), log=str(w.member.log_path))

    def _start(self, w: Watched) -> None:
        w.member.start()
        w.held, w.due, w.started = False, None, self.clock()

    def _pid(self, w: Watched) -> int | None:
        child = w.member.process
        return child.pid if child is not None else None

    def _get(self, name: str) -> Watched:
        if name not in self.watched:
            raise KeyError(f"no member {name!r}: one of {', '.join(self.watched)}")
        return self.watched[name]

    def stop(self, name: str) -> str:
        """Stop member `name` and hold it stopped."""
        w = self._get(name)
        w.held, w.due = True, None
        if not w.member.running:
            return f"{name} is not running; it stays stopped until `ctl start {name}`"
        w.member.stop()
        self.log.info("member stopped on request", member=name)
        return f"stopped {name}; it stays stopped until `ctl start {name}`"

    def kill(self, name: str) -> str:
        """SIGKILL member `name` (a host loss for an HA node) and hold it stopped."""
        w = self._get(name)
        w.held, w.due = True, None
        if not w.member.running:
            return f"{name} is not running; it stays stopped until `ctl start {name}`"
        w.member.kill()
        self.log.info("member killed on request", member=name)
        return f"killed {name} (SIGKILL); it stays stopped until `ctl start {name}`"

    def start(self, name: str) -> str:
        """Start member `name` now (and supervise it again)."""
        w = self._get(name)
        if w.member.running:
            w.held = False
            return f"{name} is already running (pid {self._pid(w)})"
        self._start(w)
        self.log.info("member started on request", member=name, pid=self._pid(w))
        return f"started {name} (pid {self._pid(w)})" + self._settle(name, w)

    def restart(self, name: str) -> str:
        """Stop member `name` and start it again."""
        w = self._get(name)
        if w.member.running:
            w.member.stop()
        self._start(w)
        self.log.info("member restarted on request", member=name, pid=self._pid(w))
        return f"restarted {name} (pid {self._pid(w)})" + self._settle(name, w)

    def _settle(self, name: str, w: Watched) -> str:
        """Wait, for SETTLE_TIMEOUT at most, until `back` says member `name` is back; what to add to the answer.

        So that what the operator runs next (`walsidecar status`) already sees it, not a link still waiting
        out its reconnect pause.
        """
        if self.back is None:
            return ""
        deadline = self.clock() + SETTLE_TIMEOUT
        while (how := self.back(name)) is None:
            if not w.member.running:
                return f"; it exited at once: see {w.member.log_path}"
            if self.clock() >= deadline:
                return f"; not back in the cluster after {SETTLE_TIMEOUT:g}s: see {w.member.log_path}"
            self.sleep(SETTLE_POLL)
        return f"; {how}" if how else ""

    def members(self) -> list[dict[str, Any]]:
        """name, pid, state and restarts of each member."""
        now = self.clock()
        rows = []
        for name, w in self.watched.items():
            if w.member.running:
                state = "running"
                more = self.describe(name) if self.describe is not None else None
                if more:
                    state = f"running: {more}"
            elif w.held:
                state = "stopped"
            elif w.due is not None:
                state = f"restarting in {max(w.due - now, 0):.1f}s"
            else:
                state = "exited"
            if w.failing and w.member.running and w.problem_since is not None:
                state = f"running, failing for {now - w.problem_since:.0f}s: {w.problem}"
            rows.append({"name": name, "pid": self._pid(w) if w.member.running else None, "state": state,
                         "restarts": w.restarts})
        return rows
