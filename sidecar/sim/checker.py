"""The invariants of docs/protocol.md, checked against the simulated world after every step.

What is checked, precisely (N safekeepers, Q = N // 2 + 1, whatever quorum the proposer
was configured with):

1. Recovery. `committed` is the WAL from BOOT to the end of the last record that ends at
   or below the highest flush position ever reported to a primary, taken from the primary
   it was reported to (all such primaries must agree on it: a report to a primary that
   disagrees with earlier acknowledged bytes is itself a violation). For every set of Q
   safekeepers that may vote (a lost disk votes only once it learned its term and its WAL,
   after the crash considered, holds the start of a later term: docs/protocol.md "A lost
   disk"), every member that an election by that set could pick as donor must hold
   `committed` byte for byte and report a flush_lsn at or above its end. A member could be
   the donor if its donor key (last log term, flush) can reach the maximum of the set's
   keys, where each key ranges over every crash the member could still suffer: from only
   its fsynced bytes surviving to all written bytes surviving, each followed by the
   restart scan (end of the last complete record). Records, not raw positions, are what
   must survive: a reported position may fall inside a record whose tail the primary
   never flushed; the primary discards that torn record after a crash and writes new WAL
   over it, so those bytes were never a commit and never need recovering.
1b. A proposer starts streaming only from a primary that holds all of `committed`
   (otherwise acknowledged commits are missing from the database it serves).
2. Agreement. For any two safekeepers, the complete records both hold that end at or
   below the lower of their commit_lsn knowledge are equal, byte for byte (compared up
   to the lower of the two last record ends below that bound). Raw positions would be too
   strong, for the reason in 1; bytes past a safekeeper's last complete record (a torn
   tail after a crash) are not WAL: its restart scan cuts them.
3. One proposer per term: every Elected and Append a safekeeper accepts for term T comes
   from the same Proposer instance, and no two instances stream in the same term. A
   safekeeper writes WAL only for a term at or above every term it has promised (granted
   or persisted), persists a granted term before the VoteReply leaves, and persists the
   new term history before the ElectedReply leaves. A lost disk takes its promises with it (the
   checker forgets them): what keeps its votes to one per term then is one owner per term.
   A VoteReply never reports less than the safekeeper acknowledged (the end of the last complete
   record at or below the highest flush it put in an AppendReply since its WAL was last cut):
   quorum intersection counts on it.
5. Readers, through the real `ReadCursor`: a piece of WAL sent to a reader never ends above the
   commit position (nor the flush position) of the safekeeper that served it, at the moment it is
   sent; and every complete record a reader receives is the acknowledged record at that position
   (`committed`), so no later quorum disagrees with it.
6. A reader never receives two different versions of a record for the same position across term
   changes: it follows from 5 (both would equal `committed`), and is checked as such. Bytes past a
   reader's last complete record are not a record: a new term may cut them (a torn tail the
   primary rewrote) and the reader re-requests them from its last record end, as a standby does.
7. A failover is final: once a failover promoted a standby after its fence term ended timeline T at
   E, no primary still on T (or on a timeline that left T below E) has a position above E reported
   as flushed, in any later term, until a later failover promotes another standby: the old primary,
   alive or brought back, never has another commit acknowledged.
4. Reports to the primary, per replication stream: the flush position never decreases,
   never exceeds the WAL the stream received, and never exceeds the Q-th highest position
   that safekeepers really had fsynced while in the proposer's term (positions below the
   term start count as zero), except inside an open degraded range (--commit-wait degrade-after):
   then the broker holds a range of the proposer's term, and every member of one of its recorded
   versions had fsynced the position in the term; and when the core decides a report above its
   quorum commit, the broker and every member (but a lost disk) hold that very version of the range.
   `apply` never exceeds the lowest such position over all N.
   While a range is open, invariant 1 holds for the acknowledged records a quorum held when they
   were acknowledged; every acknowledged record, degraded ones included, must be held by a standby
   a failover promotes (1b, at the promotion) and by every primary a sidecar streams from.
"""

from __future__ import annotations

import bisect
import itertools

from sidecar.consensus.acceptor import holds_term_after
from sidecar.consensus import history as hist
from sidecar.consensus import lineage
from sidecar.consensus.messages import (
    NO_DEGRADED, AppendReply, DegradedRange, ElectedReply, GreetingReply, Message, TimelineFence, VoteReply,
)
from sidecar.consensus.proposer import Proposer, ReportStatus
from sidecar.consensus.quorum import majority
from sidecar.sim.nodes import Service, SimSafekeeper
from sidecar.sim.trace import pos
from sidecar.sim.wal import BOOT, Disk, Primary, record_end


class Violation(Exception):
    """An invariant does not hold."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


_COMMITTED = "committed"


class Checker:
    """Ground truth recorded as the world runs, and the invariants checked against it."""

    def __init__(self, safekeepers: list[SimSafekeeper], disabled: frozenset[str] = frozenset()) -> None:
        self.safekeepers = safekeepers
        self.disabled = disabled
        self.q = majority(len(safekeepers))
        self.quorums = list(itertools.combinations(range(len(safekeepers)), self.q))
        self._by_quorum = True  # whether the report being acknowledged was flushed by a quorum
        self.pairs = list(itertools.combinations(range(len(safekeepers)), 2))
        self.committed = bytearray()  # acknowledged WAL from BOOT, whole records only
        self.in_term: dict[int, dict[str, int]] = {}  # term -> safekeeper -> fsynced end in that term
        self.term_owner: dict[int, str] = {}
        self.streaming_owner: dict[int, str] = {}
        self.promised: dict[str, int] = {}
        self.acked: dict[str, int] = {}  # safekeeper -> highest flush acknowledged since its last cut
        # Whole records readers received beyond the acknowledged WAL (only when invariant 5 is not
        # checked): compared once acknowledged WAL covers them, so invariant 6 stands on its own.
        self.read_ahead: list[tuple[str, int, bytes]] = []
        self._seen: tuple[object, ...] = ()
        self.fences: list[tuple[TimelineFence, str]] = []  # failovers that promoted: (the fence, the new primary)
        self._pair_versions: dict[tuple[int, int], tuple[int, int]] = {}
        # degrade-after: the broker's open range and every version of it recorded, the end of the records
        # acknowledged by a quorum (invariant 1's while a range is open), the safekeepers that lost a disk.
        self.degraded_record = NO_DEGRADED
        self.degraded_versions: list[DegradedRange] = []
        self.quorum_end = BOOT
        self.disks_lost: set[str] = set()
        self.by_node = {sk.node_id: sk for sk in safekeepers}
        self._degraded_acked: dict[tuple[str, int], int] = {}

    @property
    def committed_end(self) -> int:
        return BOOT + len(self.committed)

    def _fail(self, invariant: str, detail: str) -> None:
        if invariant not in self.disabled:
            raise Violation(invariant, detail)

    # ---- ground truth fed by the actors -----------------------------------------------------

    def durable(self, sk: SimSafekeeper) -> None:
        """The safekeeper's fsynced WAL changed: credit it to the term its history ends in."""
        th = sk.persisted.term_history
        if th:
            per = self.in_term.setdefault(th[-1].term, {})
            if sk.disk.durable > per.get(sk.name, 0):
                per[sk.name] = sk.disk.durable

    def holds_committed(self, disk: Disk) -> bool:
        """True if `disk` holds every acknowledged record, byte for byte."""
        return self._disk_holds_committed(disk, self.committed_end)

    def disk_lost(self, sk: SimSafekeeper) -> None:
        """Its promises went with its disk: one owner per term is what still holds them to account.

        What it fsynced in a term stays counted (invariant 4 is about what was flushed when reported).
        """
        self.promised.pop(sk.name, None)
        self.acked.pop(sk.name, None)
        self.disks_lost.add(sk.name)

    def degraded_recorded(self, record: DegradedRange) -> None:
        if record.term != self.degraded_record.term:
            self.degraded_versions = []
        self.degraded_record = record
        self.degraded_versions.append(record)

    def degraded_closed(self) -> None:
        self.degraded_record, self.degraded_versions = NO_DEGRADED, []

    def degraded_acknowledged(self, svc: Service, core: Proposer, st: ReportStatus) -> None:
        """The core reports above its quorum commit: its range must be recorded, in the broker and on its members."""
        key = (svc.label, core.term)
        if st.flush_lsn <= self._degraded_acked.get(key, 0):
            return  # the same acknowledgement again (its write or apply moved)
        self._degraded_acked[key] = st.flush_lsn
        d = core.degraded
        if not d or self.degraded_record != d:
            self._fail("4 a degraded acknowledgement is recorded first",
                       f"{svc.label} (term {core.term}) reports flush {pos(st.flush_lsn)} above its quorum commit "
                       f"{pos(core.commit_lsn)} with range {d} while the broker holds {self.degraded_record}")
            return
        for node in d.members:
            sk = self.by_node[node]
            if sk.persisted.degraded != d and sk.name not in self.disks_lost:
                self._fail("4 a degraded acknowledgement is recorded first",
                           f"{svc.label} (term {core.term}) reports flush {pos(st.flush_lsn)} with range {d}, which "
                           f"its member {sk.name} does not hold ({sk.persisted.degraded})")

    def truncated(self, sk: SimSafekeeper, lsn: int) -> None:
        """An Elected cut sk's WAL at `lsn`: what it acknowledged above was never committed (or
        invariant 1 says so), and a vote may report less from now on."""
        if self.acked.get(sk.name, 0) > lsn:
            self.acked[sk.name] = lsn

    def accepted(self, sk: SimSafekeeper, term: int, sender: str, what: str) -> None:
        owner = self.term_owner.setdefault(term, sender)
        if owner != sender:
            self._fail("3 one proposer per term",
                       f"{sk.name} accepted {what} for term {term} from {sender}, but {owner} also led term {term}")

    def wrote(self, sk: SimSafekeeper, term: int) -> None:
        promise = max(self.promised.get(sk.name, 0), sk.persisted.term)
        if term < promise:
            self._fail("3 no WAL below the promise",
                       f"{sk.name} wrote WAL of term {term} after promising term {promise}")

    def replied(self, sk: SimSafekeeper, msg: Message) -> None:
        if isinstance(msg, AppendReply):
            if msg.flush_lsn > self.acked.get(sk.name, 0):
                self.acked[sk.name] = msg.flush_lsn
            return
        if isinstance(msg, VoteReply):
            acked = self.acked.get(sk.name, 0)
            last = sk.disk.last_record(acked) if acked and sk.disk.start is not None else None
            if last is not None and msg.flush_lsn < last[1]:
                self._fail("3 a vote reports every flush acknowledged",
                           f"{sk.name} voted (term {msg.term}) with flush {pos(msg.flush_lsn)}, below the record "
                           f"ending at {pos(last[1])} it acknowledged (flush {pos(acked)})")
        if isinstance(msg, VoteReply) and msg.granted:
            self.promised[sk.name] = max(self.promised.get(sk.name, 0), msg.term)
            if sk.persisted.term < msg.term:
                self._fail("3 promise persisted before the reply",
                           f"{sk.name} granted term {msg.term} with term {sk.persisted.term} persisted")
        elif isinstance(msg, GreetingReply):
            self.promised[sk.name] = max(self.promised.get(sk.name, 0), msg.term)
        elif isinstance(msg, ElectedReply) and sk.acceptor is not None and msg.term == sk.acceptor.elected_term:
            th = sk.persisted.term_history
            if not th or th[-1].term != msg.term:
                self._fail("3 history persisted before the reply",
                           f"{sk.name} answered Elected(t{msg.term}) with history ending in "
                           f"t{th[-1].term if th else 0} persisted")

    def streaming(self, svc: Service, core: Proposer) -> None:
        owner = self.streaming_owner.setdefault(core.term, svc.label)
        if owner != svc.label:
            self._fail("3 one proposer per term", f"{svc.label} and {owner} both stream in term {core.term}")
        self._primary_holds_committed(svc.primary, self.committed_end, f"{svc.label} starts streaming from it")

    def reported(self, svc: Service, core: Proposer, st: ReportStatus) -> None:
        stream = svc.stream
        assert stream is not None
        if st.flush_lsn < stream.flushed:
            self._fail("4 acknowledged position never moves back",
                       f"{svc.label} reported flush {pos(st.flush_lsn)} after {pos(stream.flushed)}")
        stream.flushed = max(stream.flushed, st.flush_lsn)
        if st.flush_lsn > stream.pos:
            self._fail("4 no acknowledgement beyond the WAL received",
                       f"{svc.label} reported flush {pos(st.flush_lsn)}, received only {pos(stream.pos)}")
        self._flushed_by_quorum(svc, core, st)
        # The failover that decides is the latest one that promoted before this term: a later failover may
        # choose another lineage (its standby holds every acknowledged commit, as any standby it promotes).
        deciding = sorted(((f, promoted) for f, promoted in self.fences if f.term < core.term), key=lambda x: x[0].term)
        for fence, promoted in deciding[-1:]:
            pg = svc.primary
            if st.flush_lsn > fence.lsn and lineage.fenced_out(fence, pg.timeline, pg.history) is not None:
                self._fail("7 a failover is final",
                           f"{svc.label} (term {core.term}) reported flush {pos(st.flush_lsn)} to {pg.name} "
                           f"(timeline {pg.timeline}) after the failover of term {fence.term} ended timeline "
                           f"{fence.timeline} at {pos(fence.lsn)} and promoted {promoted}")
        if st.flush_lsn:
            self._acknowledge(svc.primary, st.flush_lsn, svc.label)

    def _flushed_by_quorum(self, svc: Service, core: Proposer, st: ReportStatus) -> None:
        per = self.in_term.get(core.term, {})
        truth = sorted((v if v >= core.term_start else 0 for v in per.values()), reverse=True)
        truth += [0] * (len(self.safekeepers) - len(truth))
        self._by_quorum = st.flush_lsn <= truth[self.q - 1]
        if not self._by_quorum and not self._held_by_members(core, st.flush_lsn, per):
            self._fail("4 acknowledged position was flushed by a quorum in the term",
                       f"{svc.label} (term {core.term}, start {pos(core.term_start)}) reported flush "
                       f"{pos(st.flush_lsn)} but only {pos(truth[self.q - 1])} was fsynced by {self.q} "
                       f"safekeepers in term {core.term}")
        if st.apply_lsn > truth[-1]:
            self._fail("4 apply position was flushed by every safekeeper in the term",
                       f"{svc.label} reported apply {pos(st.apply_lsn)}; the lowest in-term flush is {pos(truth[-1])}")

    def _held_by_members(self, core: Proposer, flush: int, per: dict[str, int]) -> bool:
        """Inside an open range of `core`'s term: every member of one of its recorded versions fsynced `flush` in it."""
        if self.degraded_record.term != core.term:
            return False
        for v in self.degraded_versions:
            names = [self.by_node[n].name for n in v.members if n in self.by_node]
            if names and all(per.get(n, 0) >= max(flush, core.term_start) for n in names):
                return True
        return False

    def failover_committed(self, svc: Service, core: Proposer, st: ReportStatus, holder: Disk | None) -> None:
        """A failover's term committed up to `st.flush_lsn` (at most E): that WAL is acknowledged, read from
        `holder`, a safekeeper's disk in the term (no primary is told; readers may have it)."""
        self._flushed_by_quorum(svc, core, st)
        if holder is None or holder.start is None or holder.start > self.committed_end:
            return
        _, ends = holder.chain()
        k = bisect.bisect_right(ends, min(st.flush_lsn, holder.durable))
        if k and ends[k - 1] > self.committed_end:
            self.committed += holder.read(self.committed_end, ends[k - 1])
            self._check_read_ahead()
        if k:
            self.quorum_end = max(self.quorum_end, min(ends[k - 1], self.committed_end))

    def failed_over(self, fence: TimelineFence, standby: Primary) -> None:
        """A failover promoted `standby` after `fence`: it holds every acknowledged record, and its old lineage must
        never be acknowledged again."""
        self._primary_holds_committed(standby, self.committed_end, "a failover promoted it")
        self.fences.append((fence, standby.name))

    def _acknowledge(self, primary: Primary, flush: int, who: str) -> None:
        end = primary.record_end_at_or_below(flush)
        self._primary_holds_committed(primary, min(end, self.committed_end), f"{who} acknowledged {pos(flush)} to it")
        if end > self.committed_end:
            self.committed += primary.data[len(self.committed):end - BOOT]
            primary.agree = end
            self._check_read_ahead()
        if self._by_quorum:
            self.quorum_end = max(self.quorum_end, min(end, self.committed_end))
        self._by_quorum = True

    def _primary_holds_committed(self, primary: Primary, upto: int, why: str) -> None:
        if primary.agree >= upto:
            return
        if primary.end < upto or primary.data[primary.agree - BOOT:upto - BOOT] != \
                self.committed[primary.agree - BOOT:upto - BOOT]:
            self._fail("1b the primary holds every acknowledged record",
                       f"{primary.name} lacks acknowledged WAL below {pos(upto)} ({why})")
            return
        primary.agree = upto

    def served(self, reader: str, sk: SimSafekeeper, start: int, end: int) -> None:
        """`sk` sent WAL [start, end) to `reader`."""
        acc = sk.acceptor
        assert acc is not None
        if end > acc.state.commit_lsn or end > acc.flush_lsn:
            self._fail("5 a reader gets nothing above the commit position",
                       f"{sk.name} sent {reader} WAL up to {pos(end)} with commit_lsn {pos(acc.state.commit_lsn)} "
                       f"and flush {pos(acc.flush_lsn)}")

    def reader_records(self, reader: str, records: list[tuple[int, int]], data: bytearray, base: int) -> None:
        """`reader` completed these records: each must be the acknowledged one (and so never change)."""
        for start, end in records:
            if end > self.committed_end:
                self._fail("5 a reader gets nothing above the commit position",
                           f"{reader} received a whole record [{pos(start)}, {pos(end)}) beyond the acknowledged "
                           f"WAL, which ends at {pos(self.committed_end)}")
                self.read_ahead.append((reader, start, bytes(data[start - base:end - base])))
                continue
            self._check_record(reader, start, bytes(data[start - base:end - base]))

    def _check_record(self, reader: str, start: int, record: bytes) -> None:
        if start < BOOT or record != self.committed[start - BOOT:start - BOOT + len(record)]:
            self._fail("6 a reader never receives two versions of the same WAL",
                       f"{reader} received a record [{pos(start)}, {pos(start + len(record))}) that differs "
                       "from the acknowledged one")

    def _check_read_ahead(self) -> None:
        keep = []
        for reader, start, record in self.read_ahead:
            if start + len(record) <= self.committed_end:
                self._check_record(reader, start, record)
            else:
                keep.append((reader, start, record))
        self.read_ahead = keep

    # ---- checks after every step -------------------------------------------------------------

    def after_step(self) -> None:
        sks = self.safekeepers
        seen = (self.committed_end, self.quorum_end, self.degraded_record) + tuple(sk.version for sk in sks)
        if seen == self._seen:
            return
        self._seen = seen
        views = [self._views(sk) for sk in sks]
        self._check_recovery(sks, views)
        self._check_agreement(sks)

    def _views(self, sk: SimSafekeeper) -> list[tuple[tuple[int, int], int]]:
        """(donor key, flush) for every crash sk could suffer now, least WAL surviving first."""
        if sk.view_version == sk.version:
            return sk.views
        disk, th = sk.disk, sk.persisted.term_history
        ups = [disk.durable]
        if disk.end > disk.durable:
            ends = disk.chain()[1]
            k = bisect.bisect_right(ends, disk.durable)
            ups += [e for e in ends[k:] if e <= disk.end] + [disk.end]
        views = []
        for u in ups:
            flush = record_end(disk, u, fingerprint=False).flush_lsn
            views.append((hist.donor_key(th, flush), flush))
        sk.views, sk.view_version = views, sk.version
        return views

    def _check_recovery(self, sks: list[SimSafekeeper], views: list[list[tuple[tuple[int, int], int]]]) -> None:
        # Inside an open degraded range what was acknowledged beyond the quorum is on its members, not on any
        # quorum: the failover's gate (1b at each promotion) is what keeps it.
        end = min(self.quorum_end, self.committed_end) if self.degraded_record else self.committed_end
        if end == BOOT:
            return
        voting = [self._voting_views(sk, v) for sk, v in zip(sks, views)]
        for quorum in self.quorums:
            if not all(voting[i] for i in quorum):
                continue  # no election counts a lost disk that does not vote yet
            best = max(voting[i][0][0] for i in quorum)  # the worst case: everyone keeps only fsynced WAL
            for i in quorum:
                flush = next((f for key, f in voting[i] if key >= best), None)
                if flush is None:
                    continue  # cannot be this set's donor after any crash
                sk = sks[i]
                names = ",".join(sks[j].name for j in quorum)
                if flush < end:
                    self._fail("1 any quorum recovers every acknowledged record",
                               f"an election by {{{names}}} can pick {sk.name} as donor with flush "
                               f"{pos(flush)}, below the acknowledged records ending at {pos(end)}")
                elif not self._disk_holds_committed(sk.disk, end):
                    self._fail("1 any quorum recovers every acknowledged record",
                               f"an election by {{{names}}} can pick {sk.name} as donor, whose WAL "
                               f"differs from the acknowledged records below {pos(end)}")

    @staticmethod
    def _voting_views(sk: SimSafekeeper, views: list[tuple[tuple[int, int], int]]) -> list[tuple[tuple[int, int], int]]:
        """The views (crash outcomes) of `views` in which sk may grant a vote, as its control file says
        (docs/protocol.md "A lost disk"): none for a lost disk that has not learned its term, and for one that
        did, only those whose WAL reaches the start of a later term. With those rules off (the teeth tests)
        nothing here holds it back."""
        if sk.wiped:
            return []
        t = sk.persisted.lost_disk_term
        if not t:
            return views
        return [v for v in views if holds_term_after(sk.persisted.term_history, t, v[1])]

    def _disk_holds_committed(self, disk: Disk, end: int) -> bool:
        mark = disk.marks.get(_COMMITTED, BOOT)
        if mark >= end:
            return True
        if disk.start != BOOT or disk.end < end or \
                disk.data[mark - BOOT:end - BOOT] != self.committed[mark - BOOT:end - BOOT]:
            return False
        disk.marks[_COMMITTED] = end
        return True

    def _check_agreement(self, sks: list[SimSafekeeper]) -> None:
        versions = self._pair_versions
        for i, j in self.pairs:
            a, b = sks[i], sks[j]
            if versions.get((i, j)) == (a.version, b.version):
                continue
            versions[(i, j)] = (a.version, b.version)
            da, db = a.disk, b.disk
            if da.start is None or db.start is None:
                continue
            # Complete records both hold: a torn tail past either's last record is not WAL.
            limit = min(a.commit_lsn, b.commit_lsn, da.end, db.end)
            last_a, last_b = da.last_record(limit), db.last_record(limit)
            if last_a is None or last_b is None:
                continue
            upto = min(last_a[1], last_b[1])
            key = (i, j)
            mark = max(min(da.marks.get(key, BOOT), db.marks.get(key, BOOT)), da.start, db.start)
            if upto <= mark:
                continue
            if da.read(mark, upto) != db.read(mark, upto):
                self._fail("2 safekeepers agree below their commit_lsn",
                           f"{a.name} and {b.name} (commit_lsn {pos(a.commit_lsn)}, {pos(b.commit_lsn)}) "
                           f"hold different WAL in [{pos(mark)}, {pos(upto)})")
                return
            da.marks[key] = db.marks[key] = upto

