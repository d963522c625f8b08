"""When the proposer's standby status goes to the primary: one sans-IO policy, fed positions and `now`.

The primary's commits wait for the flush position of our status, so a status that moves flush goes out now
(a driver that handles several safekeepers' replies in one pass sends one message for all of them). A status
that moves only write or apply waits up to `delay` for one that moves flush: it spares the walsender a
wake-up for every safekeeper's reply. Without news, the last positions are repeated every
`keepalive_interval`, asking for a reply when the primary has been silent that long (so silence means
trouble); a keepalive that asks for a reply is answered at once if the positions moved, else at most once
per `answer_interval` (a stopping primary asks after every reply). The reported flush never goes back
(invariant 4): `report` refuses it.

The driver (proposer/replication.py's ReplicationStream; the simulator's services) calls `report` and
`keepalive` on input, `poll(now, heard_at)` after each input and when the time it returned comes, and `sent`
once a status was written: `poll` says send this status now, look again at time T, or nothing until the next
input.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.lsn import format_lsn

# How long a status that moves only write or apply may wait for one that moves flush. A primary with
# synchronous_commit = remote_write or remote_apply may wait this much longer.
STATUS_DELAY = 0.01
# How often the positions are repeated without news, and how long a silent primary is asked for a reply after.
KEEPALIVE_INTERVAL = 1.0
# A stopping primary asks for a reply after every reply; answering each at once is a busy loop.
ANSWER_INTERVAL = 0.1

Positions = tuple[int, int, int]  # write, flush, apply


@dataclass(frozen=True)
class SendStatus:
    """Send a Standby Status Update with these positions now."""

    write: int
    flush: int
    apply: int
    reply_requested: bool = False

    @property
    def positions(self) -> Positions:
        return self.write, self.flush, self.apply


class StatusSchedule:
    """The status policy of one replication stream (a new stream, a new schedule)."""

    def __init__(self, *, delay: float = STATUS_DELAY, keepalive_interval: float = KEEPALIVE_INTERVAL,
                 answer_interval: float = ANSWER_INTERVAL) -> None:
        self.delay = delay
        self.keepalive_interval = keepalive_interval
        self.answer_interval = answer_interval
        self.positions: Positions = (0, 0, 0)  # the latest reported; every status carries them
        self._sent: Positions | None = None  # what the last status sent carried (None: none sent yet)
        self._sent_at = 0.0
        self._changed_at: float | None = None  # when positions first differed from those sent
        self._answer = False  # the primary asked for a reply that is not sent yet

    def report(self, write: int, flush: int, apply: int, now: float) -> None:
        """New positions to report. ValueError if flush goes back: the walsender would move its slot back,
        possibly onto removed WAL."""
        if flush < self.positions[1]:
            raise ValueError(f"flush went backwards: {format_lsn(flush)} < {format_lsn(self.positions[1])}")
        self.positions = (write, flush, apply)
        if self._changed_at is None and self.positions != self._sent:
            self._changed_at = now

    def keepalive(self) -> None:
        """The primary asked for a reply."""
        self._answer = True

    def sent(self, status: SendStatus, now: float) -> None:
        """`status` went out at `now`."""
        self._sent, self._sent_at = status.positions, now
        self._changed_at = None if status.positions == self.positions else now
        self._answer = False

    def poll(self, now: float, heard_at: float) -> SendStatus | float | None:
        """A status to send now, else the time to poll again (None: only after the next input).
        `heard_at`: when the primary last sent anything."""
        due: list[float] = []
        if self._sent is None:
            return self._status()
        if self.positions != self._sent:
            if self.positions[1] != self._sent[1] or self._answer:
                return self._status()  # commits wait for flush; an asked reply carries the news at once
            assert self._changed_at is not None
            due.append(self._changed_at + self.delay)
        if self._answer:
            due.append(self._sent_at + self.answer_interval)
        periodic = self._sent_at + self.keepalive_interval
        due.append(periodic)
        at = min(due)
        if now < at:
            return at
        # While we send statuses the walsender never pings us; ask, so silence means trouble.
        return self._status(reply_requested=now >= periodic and now - heard_at >= self.keepalive_interval)

    def _status(self, reply_requested: bool = False) -> SendStatus:
        return SendStatus(*self.positions, reply_requested=reply_requested)
