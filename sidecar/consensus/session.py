"""One connection's conversation with a safekeeper's acceptor, sans IO.

The server and the simulator both drive every connection through an `AcceptorSession`, so the
rules about *who* may say *what* live here once: a Greeting comes first, only a proposer may
change state, only the connection that sent the term's Elected may append in it, and how large
a frame the connection may send next. For each message the caller asks `needs_record_end(msg)`;
if so it flushes and scans its WAL, then calls `receive(msg, end)` (all three one step: nothing is
acknowledged between the scan and the message taking effect) and executes the actions in
order (the acceptor's rules for Persist before Reply hold), and calls `closed()` when the
connection ends.
"""

from __future__ import annotations

import enum

from sidecar.consensus import codec, limits
from sidecar.consensus.acceptor import Acceptor, AcceptorAction, AcceptorError, RecordEnd, Reply
from sidecar.consensus.messages import Append, DegradedRecord, Elected, Greeting, InfoRequest, Message, VoteRequest


class Role(enum.Enum):
    """What the peer authenticated as; only a proposer may change a safekeeper's state."""

    PROPOSER = "proposer"
    SAFEKEEPER = "safekeeper"
    CLIENT = "client"


class AcceptorSession:
    """Greeting-first, role gating and term ownership for one connection to the shared acceptor.

    Used by its connection's executor only, and under the lock that guards the shared acceptor
    (the safekeeper's `acceptor_lock`): `holds_term` reads the acceptor's owner, which another
    connection's Elected or `closed()` changes.
    """

    def __init__(self, acceptor: Acceptor, role: Role = Role.PROPOSER, conn: object = None) -> None:
        self.acceptor = acceptor
        self.role = role
        self.conn = conn  # the service's handle on this connection (where flush acks go)
        self.greeted = False
        self.asked_term = -1  # the term this connection last asked a vote in (granted or already held)
        self._scan_epoch = -1

    @property
    def holds_term(self) -> bool:
        """True if this connection sent the Elected the acceptor applied last."""
        return self.acceptor.owner is self

    @property
    def max_frame(self) -> int:
        """Largest frame this connection may send next: WAL-sized only for the term's holder."""
        if self.holds_term:
            return codec.MAX_FRAME
        if self.greeted:
            return limits.CONTROL_MAX_FRAME
        return limits.PREAUTH_MAX_FRAME

    def needs_record_end(self, msg: Message) -> bool:
        """True if `receive(msg)` needs a fresh RecordEnd: flush the WAL, scan it, pass it in."""
        if type(msg) not in (VoteRequest, Elected) or not self.greeted:
            return False
        if self.acceptor.cached_end() is not None:
            return False
        self._scan_epoch = self.acceptor.wal_epoch
        return True

    def receive(self, msg: Message, end: RecordEnd | None = None) -> list[AcceptorAction]:
        """The actions for `msg`, in the order they must be carried out; AcceptorError refuses it."""
        acc = self.acceptor
        if type(msg) is Append and self.greeted:  # the hot path: one call, nothing else
            return acc.on_append(msg, self)
        if type(msg) is InfoRequest:  # anyone may ask, at any time; nothing changes
            return [Reply(acc.info())]
        if self.role is not Role.PROPOSER:
            raise AcceptorError(
                f"a {self.role.value} connection may only ask for information, not send {type(msg).__name__}")
        if not self.greeted and type(msg) is not Greeting:
            raise AcceptorError(f"the first message must be a Greeting, not {type(msg).__name__}")
        match msg:
            case Greeting():
                actions = acc.on_greeting(msg)
                self.greeted = True
                return actions
            case VoteRequest():
                actions = acc.on_vote(msg, self._record_end(end))
                if msg.term and acc.state.term == msg.term:
                    self.asked_term = msg.term
                return actions
            case Elected():
                if msg.term >= acc.state.term and not self._asked_for(msg.term):
                    raise AcceptorError(f"Elected for term {msg.term} on a connection that did not ask "
                                        "for a vote in it: the term belongs to the connection elected in it")
                return acc.on_elected(msg, self._record_end(end), self)
            case DegradedRecord():  # only the term's owner: on_degraded checks it holds the term
                return acc.on_degraded(msg, self)
        raise AcceptorError(f"unexpected {type(msg).__name__} from a proposer")

    def closed(self) -> None:
        """The connection is gone: it no longer holds the term (a reconnect must be elected again)."""
        if self.holds_term:
            self.acceptor.owner = None

    def _asked_for(self, term: int) -> bool:
        """Only a connection that asked for a vote in `term` (granted, or held already) may claim it."""
        return self.asked_term == term

    def _record_end(self, end: RecordEnd | None) -> RecordEnd:
        acc = self.acceptor
        if end is None:
            end = acc.cached_end()
            if end is None:
                raise ValueError("this message needs a RecordEnd: ask needs_record_end() first")
            return end
        acc.remember_end(self._scan_epoch, end)
        return end
