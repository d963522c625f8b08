"""The schedule of a simulated run: one frozen event per step, formatted only when printed.

Positions are printed as `@N`, N bytes past the bootstrap LSN (BOOT); 0 is "nothing".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sidecar.consensus.messages import (
    Append,
    AppendReply,
    Elected,
    ElectedReply,
    Greeting,
    GreetingReply,
    Message,
    Refusal,
    TermHistory,
    VoteReply,
    VoteRequest,
)
from sidecar.sim.wal import BOOT


def pos(lsn: int) -> str:
    return "0" if lsn == 0 else f"@{lsn - BOOT}"


def hist(history: TermHistory) -> str:
    return "[" + " ".join(f"t{e.term}{pos(e.start_lsn)}" for e in history) + "]"


def message(m: Message) -> str:
    """A short, readable rendering of one protocol message."""
    match m:
        case Append():
            body = f"{pos(m.begin_lsn)}..{pos(m.end_lsn)}" if m.data else "heartbeat"
            return f"Append(t{m.term} {body} commit={pos(m.commit_lsn)})"
        case AppendReply():
            return f"AppendReply(t{m.term} flush={pos(m.flush_lsn)} commit={pos(m.commit_lsn)})"
        case VoteRequest():
            return f"VoteRequest(t{m.term})" if m.term else "VoteRequest(probe)"
        case VoteReply():
            verdict = "granted" if m.granted else "refused"
            return (f"VoteReply(t{m.term} {verdict} flush={pos(m.flush_lsn)} {hist(m.term_history)} "
                    f"tail={pos(m.tail_lsn)})")
        case Elected():
            return f"Elected(t{m.term} start={pos(m.start_lsn)} {hist(m.term_history)})"
        case ElectedReply():
            return f"ElectedReply(t{m.term} flush={pos(m.flush_lsn)})"
        case Greeting():
            return f"Greeting(tli {m.timeline})"
        case GreetingReply():
            return f"GreetingReply(t{m.term})"
        case Refusal():
            return f"Refusal({m.reason})"
    return repr(m)


@dataclass(frozen=True)
class Event:
    """Something that happened at one step; `args` are rendered lazily by `text`."""

    step: int
    actor: str
    what: str
    args: tuple[Any, ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.step:>6}  {self.actor:<10} {self.what}" + "".join(f" {_show(a)}" for a in self.args)


@dataclass(frozen=True)
class Delivery:
    """A message taken off a connection and handed to its receiver."""

    step: int
    conn: str
    to_safekeeper: bool
    msg: Message

    def __str__(self) -> str:
        arrow = "->" if self.to_safekeeper else "<-"
        return f"{self.step:>6}  {self.conn:<10} {arrow} {message(self.msg)}"


def _show(a: Any) -> str:
    if isinstance(a, bool) or not isinstance(a, int):
        return str(a)
    return pos(a) if a >= BOOT else str(a)


class Trace:
    """The last `keep` events (all of them if keep is None)."""

    def __init__(self, keep: int | None) -> None:
        self.events: deque[Event | Delivery] = deque(maxlen=keep)

    def add(self, e: Event | Delivery) -> None:
        self.events.append(e)

    def lines(self, last: int | None = None) -> list[str]:
        evs = list(self.events)
        return [str(e) for e in (evs[-last:] if last else evs)]
