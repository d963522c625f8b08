"""The fence term of `walsidecar failover`: the core `Proposer` run against the safekeepers with no primary.

Winning a term fences the old sidecar (its next Append is refused). The term's start E is the most
advanced voter log, as in any election; with no primary to stream from, the voters below E are fed
the donor's WAL, read from its reader port in the new term (the original walproposer's recovery),
until a quorum holds E. E is then committed and a heartbeat tells every safekeeper so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sidecar.consensus import codec, limits, lineage
from sidecar.consensus.messages import AppendReply, Message, TimelineFence
from sidecar.timelines import TimelineHistory
from sidecar.consensus.proposer import (
    DropPeer, ElectionWon, FetchWal, GateRefused, GreetingsRefused, Phase, Proposer, ProposerConfig, ProposerEvent,
    ReportStatus, Send, StartStreaming, TermLost, TermsExhausted, VerifyPrimary,
)
from sidecar.linkauth import Security
from sidecar.logs import get_logger
from sidecar.lsn import format_lsn
from sidecar.proposer import actions
from sidecar.proposer.catchup import reader_address
from sidecar.proposer.peers import PeerLink

HEARTBEAT_INTERVAL = 1.0
ELECTION_TIMEOUT = 5.0


class FenceError(Exception):
    """The fence or the recovery cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class Fenced:
    """A term won and its start committed on a quorum: WAL up to `start_lsn` is every reader's."""

    term: int
    start_lsn: int  # E
    donor: str
    voters: tuple[str, ...]
    timeline_history: TimelineHistory  # the donor's: the primary's timeline switches up to E
    fence: TimelineFence  # what this term's Elected set: the timeline it ended at E, or the lift of an undo
    replaced: TimelineFence  # the voters' latest fence before this term


# Checks the donor's log before any vote (failover: does the standby belong to it?); a reason refuses it.
Precheck = Callable[[VerifyPrimary], Awaitable[str | None]]
# Copies the donor's WAL [start, end) read in `term` into `sink(lsn, data)`, pausing while `link` has a backlog.
DonorCopy = Callable[[str, int, int, int, Callable[[int, bytes], None], PeerLink], Awaitable[None]]
Say = Callable[[str], None]


class Fence:
    """Drive one term of the core without a primary: elect, recover voters below E, commit E."""

    def __init__(self, config: ProposerConfig, security: Security, *, precheck: Precheck, copy: DonorCopy,
                 say: Say = print, min_term: int = 0,
                 link_factory: Callable[..., PeerLink] = PeerLink) -> None:
        self.config = config
        self.core = Proposer(config, min_term=min_term)
        self.say = say
        self.log = get_logger(role="failover")
        self._precheck, self._copy = precheck, copy
        self.links = {name: link_factory(name, self._up, self._message, self._down, security)
                      for name in config.peers}
        self.commits: dict[str, int] = {}  # safekeeper -> the commit position it last reported in our term
        self.donor = ""
        self.voters: tuple[str, ...] = ()
        self._fetches: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: FenceError | None = None
        self._changed = asyncio.Event()

    # ---- running -------------------------------------------------------------------------------

    async def run(self, timeout: float) -> Fenced:
        """Fence and recover; FenceError if it cannot be done within `timeout` seconds (nothing is lost then)."""
        for link in self.links.values():
            self._spawn(link.run())
        self._spawn(self._ticker())
        try:
            await asyncio.wait_for(self._until_committed(), timeout)
        except asyncio.TimeoutError:
            raise FenceError(self._stuck(timeout)) from None
        core = self.core
        donor_vote = core.peers[self.donor].vote
        history = donor_vote.timeline_history if donor_vote is not None else ()
        before = lineage.latest(*(p.vote.fence for p in core.peers.values() if p.vote is not None))
        return Fenced(core.term, core.term_start, self.donor, self.voters, history, core.fence, before)

    def probed_fence(self) -> TimelineFence:
        """The latest fence of the safekeepers probed so far (before any vote): what an undo would lift."""
        return lineage.latest(*(p.probe.fence for p in self.core.peers.values() if p.probe is not None))

    def probed_timeline(self, donor: str) -> int:
        """The timeline `donor`'s WAL was last written on, from its probe (0: unknown)."""
        probe = self.core.peers[donor].probe
        return probe.timeline if probe is not None else 0

    def check(self) -> None:
        """FenceError if the term was lost since (another proposer took a higher one): do not promote then."""
        if self._failed is not None:
            raise self._failed

    async def close(self) -> None:
        """Leave the term: the safekeepers keep its promise and its WAL; the next proposer starts above it."""
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    def committed_on(self) -> list[str]:
        """The safekeepers that reported E as committed (their readers may have it)."""
        return sorted(n for n, c in self.commits.items() if self.core.term_start and c >= self.core.term_start)

    async def _until_committed(self) -> None:
        while True:
            if self._failed is not None:
                raise self._failed
            if self.core.phase is Phase.STREAMING and len(self.committed_on()) >= self.config.quorum:
                return
            self._changed.clear()
            await self._changed.wait()

    def _stuck(self, timeout: float) -> str:
        core = self.core
        greeted = [p.name for p in core.peers.values() if p.greeted_term is not None]
        if core.phase in (Phase.GREETING, Phase.PROBING):
            return (f"only {len(greeted)} of {len(core.peers)} safekeepers answered within {timeout:g}s "
                    f"({', '.join(greeted) or 'none'}), a quorum of {self.config.quorum} is needed: start the "
                    "others (or check --safekeepers and the certificates), then run failover again")
        if core.phase is Phase.VOTING and core.gate_waiting:
            gate = self.config.gate
            heard = {p.node_id for p in core.peers.values() if p.greeted_term is not None}
            missing = sorted(n for n in gate.members if n not in heard)
            return (f"not promoting: {core.gate_waiting}; the votes must include a safekeeper that holds those "
                    f"acknowledged commits, and within {timeout:g}s none did (members not heard: safekeepers "
                    f"{', '.join(map(str, missing)) or 'none'}; heard: {', '.join(sorted(greeted)) or 'none'}): "
                    "start them, then run failover again")
        if core.phase is Phase.VOTING:
            return (f"no quorum of votes for term {core.term} within {timeout:g}s: is another proposer campaigning? "
                    "Run failover again")
        held = {p.name: format_lsn(p.flush_lsn) for p in core.peers.values() if p.elected}
        return (f"term {core.term}: a quorum did not reach {format_lsn(core.term_start)} within {timeout:g}s "
                f"(in the term: {held}); the safekeepers keep everything: run failover again")

    async def _ticker(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            ticks += 1
            self._run(self.core.heartbeat())
            if ticks % int(ELECTION_TIMEOUT / HEARTBEAT_INTERVAL) == 0:
                self._run(self.core.election_timeout())

    # ---- links ---------------------------------------------------------------------------------

    def _up(self, name: str) -> None:
        self._run(self.core.peer_connected(name))

    def _message(self, name: str, msg: Message) -> None:
        if isinstance(msg, AppendReply) and msg.term == self.core.term:
            self.commits[name] = msg.commit_lsn
            self._changed.set()
        self._run(self.core.peer_message(name, msg))

    def _down(self, name: str) -> None:
        task = self._fetches.pop(name, None)
        if task is not None:
            task.cancel()
        self._run(self.core.peer_disconnected(name))

    # ---- actions -------------------------------------------------------------------------------

    def _run(self, todo: list) -> None:  # type: ignore[type-arg]
        for a in todo:
            match a:
                case Send():
                    try:
                        self.links[a.peer].send(a.message)
                    except codec.EncodeError as e:
                        self._fail(f"cannot encode a message for {a.peer} ({e}): a bug, please report it")
                case VerifyPrimary():
                    self._spawn(self._verify(a))
                case StartStreaming():
                    self.say(f"  term {self.core.term} won: the old sidecar is fenced (its next Append is refused); "
                             f"E = {format_lsn(a.start_lsn)} (donor {self.donor})")
                case FetchWal():
                    self._fetches[a.peer] = self._spawn(self._recover(a))
                case ReportStatus():
                    if a.flush_lsn >= self.core.term_start > 0:
                        # A heartbeat carries the new commit position to every safekeeper now.
                        self._run(self.core.heartbeat())
                case TermLost():
                    self._fail(f"another proposer took term {a.term} ({a.reason}) before this term fenced the old "
                               "primary's timeline: run failover again (once it fences, the old primary's sidecar "
                               "can take no term)")
                case GreetingsRefused():
                    self._fail(actions.refused_text(a, len(self.links), self.config.quorum,
                               "the standby is not of the safekeepers' cluster"))
                case DropPeer():
                    self.log.error("safekeeper broke the protocol; dropping the link", peer=a.peer, reason=a.reason,
                                   **actions.log_fields(a.fields))
                    self.links[a.peer].drop(faulted=True)
                case TermsExhausted():
                    self._fail(actions.exhausted_text(a, limits.MAX_TERM))
                case GateRefused():
                    self._fail(f"not promoting: {a.reason}; the fence sent no Elected (nothing was fenced or cut)")
                case ElectionWon():
                    self.donor, self.voters = a.donor, tuple(a.voters)
                    actions.log_event(self.log, a)
                case ProposerEvent():
                    actions.log_event(self.log, a)
        self._changed.set()

    async def _verify(self, a: VerifyPrimary) -> None:
        core = self.core
        if a.start_lsn == 0:
            problem: str | None = "the safekeepers hold no WAL: there is nothing to fail over to"
        else:
            problem = await self._precheck(a)
        if problem is not None:
            self._run(core.primary_refused(problem))
            self._fail(problem)
            return
        self._run(core.primary_verified())

    async def _recover(self, a: FetchWal) -> None:
        """Feed `a.peer` the donor's WAL [a.start, a.end), read in our term (so up to the donor's flush)."""
        core, link = self.core, self.links[a.peer]
        port = core.peers[self.donor].reader_port
        if not port:
            self._fail(f"the donor {self.donor} serves no readers (no --pg-listen): recovery reads its WAL "
                       "from its reader port; give it one and run failover again")
            return
        self.say(f"  recovering {a.peer} from the donor {self.donor}: {format_lsn(a.start)} .. {format_lsn(a.end)}")
        self.log.info("recovering safekeeper from the donor", peer=a.peer, donor=self.donor, term=core.term,
                      start_lsn=format_lsn(a.start), end_lsn=format_lsn(a.end))

        def sink(lsn: int, data: bytes) -> None:
            self._run(core.catchup_data(a.peer, lsn, data))

        try:
            await self._copy(reader_address(self.donor, port), a.start, a.end, core.term, sink, link)
        except Exception as e:  # the reader's errors: the link retries after a reconnect
            self.log.error("recovery from the donor failed; retrying after a reconnect", peer=a.peer,
                           donor=self.donor, term=core.term, error=str(e))
            self.say(f"  recovering {a.peer} failed ({e}); retrying")
            link.drop(faulted=True)
            return
        finally:
            self._fetches.pop(a.peer, None)
        self._run(core.catchup_done(a.peer))

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            self._failed = FenceError(reason)
        self._changed.set()

    def _spawn(self, coro) -> asyncio.Task:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._fail(f"internal error: {task.exception()!r}")
