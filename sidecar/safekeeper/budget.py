"""The consensus port's connection places, counted from accept, and the file descriptors they need.

A connection holds a place from the moment it is accepted, not from when it has authenticated
(audit M-1): a TLS handshake or an auth-only proof in progress costs a descriptor and buffers too.
Connections still authenticating have a small cap of their own; when it is full, the oldest of
them is dropped for the newcomer, so that silent connections cannot keep the proposer out and a
flood has to keep opening connections faster than a handshake takes. Once authenticated, every
role but the proposer's shares fewer places than the total, leaving the proposer's own places
free, as PostgreSQL's superuser_reserved_connections does (audit M-5).
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Callable

# Every connection on the consensus port, from accept until it is closed.
MAX_CONNECTIONS = 64
# Of those, the ones not yet authenticated (TLS handshake or auth-only proof under way).
MAX_HANDSHAKING = 16
# Places only a connection authenticated as the proposer may take.
PROPOSER_RESERVED = 4
# Connections of other roles (client, safekeeper): whatever they hold, the handshaking cap and the
# reserved places stay free, so a proposer's new connection is never turned away by them.
OTHERS_MAX = MAX_CONNECTIONS - MAX_HANDSHAKING - PROPOSER_RESERVED
# Descriptors besides the connections: the listening sockets, the data directory's files, the
# event loop's own, the archive's and the broker's connections.
FD_MARGIN = 128


class Place:
    """One accepted connection's place: handshaking until `authenticated`, then its role's."""

    def __init__(self, budget: ConnectionBudget, drop: Callable[[], None], peer: str) -> None:
        self._budget = budget
        self.drop = drop  # closes the connection at once
        self.peer = peer
        self.role: str | None = None  # None while handshaking
        self.released = False

    def authenticated(self, role: str) -> bool:
        """The connection proved `role`: keep its place, or False if its role's places are all taken."""
        return self._budget._authenticated(self, role)

    def release(self) -> None:
        """The connection is closed (idempotent)."""
        self._budget._release(self)


class ConnectionBudget:
    """Places on the consensus port.

    Thread contract: `admit` (the accept thread), `Place.authenticated` and `Place.release` (each
    connection's thread, or whoever drops it) may run concurrently with each other; each takes the
    budget's lock, and a dropped connection's `drop` is called under it (it must not block).
    """

    def __init__(self, limit: int = MAX_CONNECTIONS, handshaking: int = MAX_HANDSHAKING,
                 reserved: int = PROPOSER_RESERVED, proposer_role: str = "proposer") -> None:
        if not (0 < handshaking and 0 <= reserved and handshaking + reserved < limit):
            raise ValueError(f"{handshaking} handshaking and {reserved} reserved places do not fit in {limit}")
        self.limit, self.max_handshaking, self.reserved = limit, handshaking, reserved
        self.others_max = limit - handshaking - reserved
        self._proposer_role = proposer_role
        self._handshaking: dict[Place, None] = {}  # oldest first
        self._lock = threading.Lock()
        self.proposers = 0
        self.others = 0

    @property
    def total(self) -> int:
        return len(self._handshaking) + self.proposers + self.others

    @property
    def handshaking(self) -> int:
        return len(self._handshaking)

    def admit(self, drop: Callable[[], None], peer: str) -> tuple[Place | None, Place | None]:
        """A connection was accepted: its place (None: refuse it), and the connection dropped for it, if any.

        The dropped one is released here and its `drop` called; the caller logs both.
        """
        with self._lock:
            return self._admit(drop, peer)

    def _admit(self, drop: Callable[[], None], peer: str) -> tuple[Place | None, Place | None]:
        evicted = None
        if self._handshaking and (len(self._handshaking) >= self.max_handshaking or self.total >= self.limit):
            evicted = next(iter(self._handshaking))
            self._release_locked(evicted)
            evicted.drop()
        if self.total >= self.limit:  # only authenticated proposers' connections: there is no one to drop
            return None, evicted
        place = Place(self, drop, peer)
        self._handshaking[place] = None
        return place, evicted

    def _authenticated(self, place: Place, role: str) -> bool:
        with self._lock:
            return self._authenticated_locked(place, role)

    def _authenticated_locked(self, place: Place, role: str) -> bool:
        if place.released or place.role is not None:
            return not place.released
        if role != self._proposer_role and self.others >= self.others_max:
            return False
        del self._handshaking[place]
        place.role = role
        if role == self._proposer_role:
            self.proposers += 1
        else:
            self.others += 1
        return True

    def _release(self, place: Place) -> None:
        with self._lock:
            self._release_locked(place)

    def _release_locked(self, place: Place) -> None:
        if place.released:
            return
        place.released = True
        if place.role is None:
            self._handshaking.pop(place, None)
        elif place.role == self._proposer_role:
            self.proposers -= 1
        else:
            self.others -= 1


def descriptors_needed(connections: int, readers: int, reader_fds: int = 2) -> int:
    """File descriptors a safekeeper needs at its limits: every connection place, every reader
    (its socket and the segment it reads), and the margin for everything else."""
    return connections + readers * reader_fds + FD_MARGIN


class TooFewDescriptors(Exception):
    """The hard RLIMIT_NOFILE is below what the connection limits need."""


def raise_descriptor_limit(needed: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (a shell's or a container's 1024 is often far
    below it); the (old, new) soft limit. TooFewDescriptors if even the hard limit is below `needed`:
    running out mid-write would stop the safekeeper, so it does not start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise TooFewDescriptors(
            f"the file descriptor limit (RLIMIT_NOFILE) is {hard}, and the safekeeper needs {needed} at its "
            f"connection limits: raise it (ulimit -n, LimitNOFILE= in systemd, --ulimit nofile= in docker)")
    # No hard limit at all: the kernel's per-process maximum bounds it anyway; ask for a generous one.
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft == resource.RLIM_INFINITY or (soft != resource.RLIM_INFINITY and soft >= target):
        return soft, soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return soft, target
