"""What happens to a commit that waits in SyncRep while the sidecar has no safekeeper quorum (--commit-wait).

Pure: the service reads the waiters from pg_stat_activity, owns the clock, and terminates what
`TerminateAfter.decide` returns. Nothing here moves the flush position reported to the primary: with
`wait` and `terminate-after` a commit is acknowledged only by a quorum; `degrade-after` (opt-in) has the
proposer core acknowledge with the safekeepers that are up after T without a quorum, inside a range
recorded first (consensus/degraded.py). Ending a wait is done by terminating
the backend, never by cancelling it: a cancelled SyncRep wait returns success to the client with a
WARNING (syncrep.c), a terminated one closes the connection without acknowledging the commit, so
the client learns that the outcome is unknown instead of believing a commit durable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*")
_SECONDS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from `30s`, `500ms`, `2m`, `1h` or a bare number of seconds."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration: write a number with ms, s, m or h (e.g. 30s)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


@dataclass(frozen=True)
class CommitWait:
    """A parsed --commit-wait: `wait` (never end a wait), `terminate-after=T` or `degrade-after=T`."""

    policy: Literal["wait", "terminate", "degrade"] = "wait"
    after: float = 0.0  # seconds, for terminate and degrade

    def __str__(self) -> str:
        return "wait" if self.policy == "wait" else f"{self.policy}-after={self.after:g}s"


_POLICIES = {"terminate-after": "terminate", "degrade-after": "degrade"}


def parse_commit_wait(text: str) -> CommitWait:
    """`wait`, `terminate-after=DURATION` or `degrade-after=DURATION`; ValueError saying what is accepted."""
    t = text.strip()
    if t == "wait":
        return CommitWait()
    name, eq, value = t.partition("=")
    policy = _POLICIES.get(name.strip())
    if policy is not None and eq:
        try:
            after = parse_duration(value)
        except ValueError as e:
            raise ValueError(f"{name.strip()}={value.strip()}: {e}") from None
        if after <= 0:
            raise ValueError(f"{name.strip()} needs a duration above 0 (e.g. {name.strip()}=30s)")
        return CommitWait(policy, after)  # type: ignore[arg-type]
    raise ValueError(f"{text!r} is not a commit-wait policy: write wait (the default), terminate-after=DURATION "
                     "(e.g. terminate-after=30s) or degrade-after=DURATION (e.g. degrade-after=30s)")


@dataclass(frozen=True)
class WaiterKey:
    """One commit waiting in SyncRep, as pg_stat_activity shows it.

    The pid alone would carry a wait over to the next commit of the same session, or to another
    session that got the pid again; with backend_start and query_start it names this one wait.
    """

    pid: int
    backend_start: str
    query_start: str


@dataclass(frozen=True)
class Waiter:
    key: WaiterKey
    since: float  # when the sidecar first saw it waiting (its clock): it waited at least now - since


class SyncRepWaiters:
    """Since when each commit waits, as the sidecar saw it: a lower bound on its wait, never more.

    pg_stat_activity has no start of a wait event; query_start is earlier for a long statement,
    and would end a wait that had not lasted T. A sidecar that restarts sees every wait afresh.
    """

    def __init__(self) -> None:
        self._since: dict[WaiterKey, float] = {}

    def observe(self, now: float, keys: Iterable[WaiterKey]) -> list[Waiter]:
        seen = {k: self._since.get(k, now) for k in keys}
        self._since = seen  # a wait no longer listed ended: forget it
        return [Waiter(k, at) for k, at in seen.items()]


class TerminateAfter:
    """terminate-after=T: end the waits that lasted T while the sidecar had no quorum.

    A wait counts only from when the quorum was lost: a commit that waited long behind a slow
    but working quorum, and finds the quorum gone a moment ago, is not ended at once. Once the
    quorum is back, nothing is ended; its next loss starts the count again.
    """

    def __init__(self, after: float) -> None:
        if after <= 0:
            raise ValueError("the wait before terminating must be above 0")
        self.after = after
        self.no_quorum_since: float | None = None

    def decide(self, now: float, waiters: Iterable[Waiter], quorum: bool) -> list[Waiter]:
        """The waiters to terminate now: those that waited `after` seconds without a quorum."""
        if quorum:
            self.no_quorum_since = None
            return []
        if self.no_quorum_since is None:
            self.no_quorum_since = now
        lost = self.no_quorum_since
        return [w for w in waiters if now - max(w.since, lost) >= self.after]
