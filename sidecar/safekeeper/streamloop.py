"""The term holder's Append stream: which implementation serves it, chosen here and only here.

Two implementations of one loop, the elected proposer's steady state on its connection (receive an
Append, write it, group commit, acknowledge):

* "python", the reference: `Safekeeper.converse`'s own loop, one message at a time through the
  session and the acceptor. The simulator and an install without a C compiler run it.
* "compiled", the C loop in `_streamloop` (built from csrc/streamloop.c when the package is
  installed): it serves the plain Appends of the term's holder within the segment open for writing
  itself, and hands everything else back to the reference unread. It checks what
  `Acceptor.on_append` checks, records each write through the same methods
  (`Safekeeper._wrote_in_place`: `Acceptor.appended`, the positions, the counters), asks the same
  `GroupCommit` object when to sync and acknowledges through the reference's own
  `Safekeeper._acknowledge`; TLS stays the connection's `ssl.SSLSocket`.

`WALSIDECAR_IMPL` chooses, as `PSYCOPG_IMPL` does for psycopg: `python`, `compiled` (an error if the
compiled loop does not load), or unset for the compiled loop where it was built and the reference
elsewhere. tests/unit/safekeeper/test_streamloop.py runs both on the same valid and hostile streams.
"""

from __future__ import annotations

import os
import ssl
from types import ModuleType
from typing import Any

from sidecar.consensus.groupcommit import Decision, GroupCommit
from sidecar.consensus.session import AcceptorSession
from sidecar.safekeeper.proposerport import Link
from sidecar.safekeeper.storage import WalStorage

# The loops' host: server.py's Safekeeper (typed Any here, as it imports this module), with its acceptor,
# lock, storage, disk guard, stop flags, and the reference's `_wrote_in_place` and `_acknowledge`.
Host = Any

IMPL_ENV = "WALSIDECAR_IMPL"
IMPLS = ("python", "compiled")

# run()'s first value: the rest starts with a frame for the reference (or the stream ended), or the
# connection no longer streams here (the term moved, the safekeeper stopped, the disk guard holds).
HANDED_BACK, CONDITION, _RECEIVE_FAILED = 0, 1, 2


class ImplError(RuntimeError):
    """WALSIDECAR_IMPL names an implementation that is not there."""


def _load() -> ModuleType:
    from sidecar.safekeeper import _streamloop  # type: ignore[attr-defined]
    return _streamloop


def chosen(requested: str | None = None) -> ModuleType | None:
    """The compiled loop, or None for the reference, as `requested` (default: WALSIDECAR_IMPL) says."""
    want = (os.environ.get(IMPL_ENV, "") if requested is None else requested).strip().lower()
    if want not in ("", *IMPLS):
        raise ImplError(f"{IMPL_ENV}={want!r}: expected one of {', '.join(IMPLS)} (or unset)")
    if want == "python":
        return None
    try:
        return _load()
    except ImportError as e:
        if want == "compiled":
            raise ImplError(f"{IMPL_ENV}=compiled, but the compiled stream loop does not load: {e} "
                            "(install with a C compiler and Python's headers, or set it to python)") from None
        return None


def name(loop: ModuleType | None) -> str:
    """The implementation's name, for logs and the bench."""
    return "python" if loop is None else "compiled"


def streams(server: Host, session: AcceptorSession, link: Link) -> bool:
    """True if the compiled loop may take the connection now: it holds the term, nothing is decoded and
    waiting, WAL storage is open, and nothing stops or holds back the stream."""
    return session.holds_term and not link.has_decoded and isinstance(server.storage, WalStorage) \
        and server.stopped is None and server.fatal is None and not server.guard.active


def run(loop: Any, server: Host, session: AcceptorSession, link: Link, commit: GroupCommit) -> int:
    """Serve the connection with the compiled loop until the reference must go on; HANDED_BACK or CONDITION.

    What the loop received and did not serve goes back into the link's decoder, so the reference
    reads on from exactly there; a receive's failure is the link's, as in `Link.read`.
    """
    storage = server.storage
    assert isinstance(storage, WalStorage)
    span = storage.write_span()
    if span is None:  # no segment open at write_lsn: the reference's write opens it
        return HANDED_BACK
    code, rest, end = loop.run(server, session, link, commit, Decision.SYNC_NOW, server.acceptor,
                               server.acceptor_lock, server.guard, link.sock, isinstance(link.sock, ssl.SSLSocket),
                               span, link.take_undecoded(), link.max_frame)
    if code == _RECEIVE_FAILED:
        raise link.receive_failed(end)
    link.give_back(rest, end)
    return code
