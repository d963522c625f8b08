"""`walsidecar failover`: turn a standby into the primary without losing an acknowledged commit.

Five steps, each said as it happens: fence (a new term from a quorum: the old sidecar's next Append
is refused, and the old primary's timeline ends at the term's start E, for good: consensus/lineage.py),
recover (voters below E get the donor's WAL; E is committed), catch up the standby to E, check its
timeline history and promote it, resume (how to start the sidecar on it). A failed step leaves the
safekeepers holding every acknowledged commit and the standby a standby: the command can be run
again, or `failover --undo` gives the old primary its timeline back.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from sidecar.address import Address
from sidecar.config import FailoverBase, FailoverSettings
from sidecar.consensus import lineage, primary_check
from sidecar.consensus.degraded import describe
from sidecar.consensus.messages import NO_DEGRADED, DegradedRange
from sidecar.timelines import TimelineHistory
from sidecar.consensus.proposer import FailoverTerm, ProposerConfig, VerifyPrimary
from sidecar.linkauth import client_security
from sidecar.lsn import format_lsn, parse_lsn
from sidecar.consensus.messages import InfoReply
from sidecar.ops.probe import redact_dsn
from sidecar.skclient import ProbeError, probe_safekeeper
from sidecar.pgrepl import history_file_name, parse_timeline_history
from sidecar.proposer.catchup import DonorReader
from sidecar.proposer.fence import Fence, FenceError, Fenced
from sidecar.walclient import ReaderError, ReaderUnreachable, WalReader

PROGRESS_INTERVAL = 2.0
POLL_INTERVAL = 0.2

Say = Callable[[str], None]


class FailoverError(Exception):
    """A step refused or failed; nothing was promoted and the command can be run again."""


@dataclass(frozen=True)
class StandbyFeeds:
    """How the standby gets its WAL: the servers its primary_conninfo names, its slot, its restore_command."""

    readers: tuple[Address, ...]
    slot: str
    restore_command: str


async def standby_feeds(conn: psycopg.AsyncConnection) -> StandbyFeeds:
    rows = dict(await (await conn.execute(
        "SELECT name, setting FROM pg_settings "
        "WHERE name IN ('primary_conninfo', 'primary_slot_name', 'restore_command')")).fetchall())
    readers: list[Address] = []
    try:
        info = conninfo_to_dict(rows.get("primary_conninfo") or "")
        hosts, ports = str(info.get("host") or "").split(","), str(info.get("port") or "5432").split(",")
        if len(ports) == 1:
            ports *= len(hosts)
        readers = [Address(h, int(p)) for h, p in zip(hosts, ports) if h and p.isdigit()]
    except (psycopg.ProgrammingError, ValueError):
        pass  # not a conninfo we can read: the receiver's own state is all there is to say
    return StandbyFeeds(tuple(readers), rows.get("primary_slot_name") or "", rows.get("restore_command") or "")


@dataclass(frozen=True)
class StandbyState:
    in_recovery: bool
    system_id: int
    wal_seg_size: int
    pg_version: int
    timeline: int
    history: TimelineHistory
    replay_lsn: int
    receive_lsn: int


async def read_standby(conn: psycopg.AsyncConnection) -> StandbyState:
    """What the standby is and where it stands; its timeline is the one it receives, else the newest it knows.

    With no WAL receiver (its primary is gone) the last checkpoint's timeline may be an older one: after a
    pg_rewind onto a newer timeline, no restartpoint has happened on it yet. A standby follows the newest
    timeline whose history it holds (recovery_target_timeline = latest), which pg_rewind or its receiver
    put in pg_wal, and its minimum recovery point names it too.
    """
    row = await (await conn.execute(
        "SELECT pg_is_in_recovery(), (SELECT system_identifier FROM pg_control_system()), "
        "(SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'), "
        "current_setting('server_version_num')::int, "
        "coalesce((SELECT received_tli FROM pg_stat_wal_receiver), "
        "         greatest((SELECT timeline_id FROM pg_control_checkpoint()), "
        "                  (SELECT min_recovery_end_timeline FROM pg_control_recovery()), "
        "                  (SELECT max(('x' || substr(name, 1, 8))::bit(32)::int) FROM pg_ls_waldir() "
        "                   WHERE name ~ '^[0-9A-F]{8}[.]history$'))), "
        "coalesce(pg_last_wal_replay_lsn(), '0/0')::text, coalesce(pg_last_wal_receive_lsn(), '0/0')::text, "
        "CASE WHEN pg_is_in_recovery() THEN '0/0' ELSE pg_current_wal_lsn()::text END")).fetchone()
    in_recovery, system_id, seg_size, version, timeline, replay, receive, current = row
    if not in_recovery:
        timeline = int((await (await conn.execute(
            "SELECT pg_walfile_name(pg_current_wal_lsn())")).fetchone())[0][:8], 16)
        replay = receive = current
    history: TimelineHistory = ()
    if timeline > 1:
        text = (await (await conn.execute("SELECT pg_read_file(%s)",
                                          (f"pg_wal/{history_file_name(timeline)}",))).fetchone())[0]
        history = parse_timeline_history(text)
    return StandbyState(bool(in_recovery), int(system_id), int(seg_size), int(version) // 10000, int(timeline),
                        history, parse_lsn(replay), parse_lsn(receive))


def lineage_problem(standby: StandbyState, safekeepers: TimelineHistory, end: int) -> str | None:
    """Why the standby's timeline history disagrees with the safekeepers' below `end`; None if it agrees."""
    ours = primary_check.switches_below(standby.history, end)
    theirs = primary_check.switches_below(safekeepers, end)
    if ours != theirs:
        return (f"the standby's timeline history {list(ours)} (timeline {standby.timeline}) leaves the safekeepers' "
                f"({list(theirs)}) before {format_lsn(end)}: it follows another primary's WAL; rebuild it from a "
                "base backup of this cluster")
    return None


class Failover:
    """The five steps against one standby and the safekeepers."""

    def __init__(self, s: FailoverBase, say: Say = print) -> None:
        self.s = s
        self.say = say
        self.security = client_security(s.certs_dir, s.link_security)
        self.donor = DonorReader(s)
        self._cluster = s.cluster or ""  # the broker's name of the cluster (the standby's system id by default)

    async def run(self) -> None:
        """All five steps: the gate's three, then promote and resume."""
        s, say = self.s, self.say
        say(f"walsidecar failover: promoting the standby at {redact_dsn(s.standby_dsn)} with every acknowledged "
            f"commit, over {len(s.safekeepers)} safekeepers (quorum {s.quorum})")
        async with await psycopg.AsyncConnection.connect(s.standby_dsn, autocommit=True,
                                                         connect_timeout=10) as conn:
            standby = await read_standby(conn)
            if not standby.in_recovery:
                self._already_primary(standby)
                await self._resume(conn)
                return
            fence, fenced = await self._gate_steps(conn, standby)
            try:
                feeds = await standby_feeds(conn)
                await self._promote(conn, fenced)
                await self._drop_slot(feeds)
            finally:
                await fence.close()
            await self._resume(conn)

    async def gate(self) -> None:
        """Fence, recover and catch up, and promote nothing: Patroni's pre_promote, which promotes after it.

        Once this returns, the old primary's timeline ends at E on a quorum and the standby replayed E:
        whoever promotes it next (Patroni's pg_ctl promote) holds every acknowledged commit.
        """
        s, say = self.s, self.say
        say(f"walsidecar failover-gate: readying the standby at {redact_dsn(s.standby_dsn)} for promotion with "
            f"every acknowledged commit, over {len(s.safekeepers)} safekeepers (quorum {s.quorum})")
        async with await psycopg.AsyncConnection.connect(s.standby_dsn, autocommit=True,
                                                         connect_timeout=10) as conn:
            standby = await read_standby(conn)
            if not standby.in_recovery:
                self._already_primary(standby)
                return
            fence, fenced = await self._gate_steps(conn, standby)
            await fence.close()
        say(f"gate open: the standby replayed E = {format_lsn(fenced.start_lsn)} (term {fenced.term}); timeline "
            f"{fenced.fence.timeline} ends there for good; it may be promoted now")

    async def _feed_pg_wal(self, conn: psycopg.AsyncConnection, fenced: Fenced) -> None:
        """Write the committed WAL the standby lacks, up to E, into its pg_wal, where its startup process reads
        next once its WAL receiver finds no primary (wal_retrieve_retry_interval later).

        For failover-gate, which runs on the standby's host as its OS user: a Patroni replica streams from
        the leader, which is gone, and a restore_command would be run again and again at the promotion
        (each a new process and three reader connections), delaying it by seconds.
        """
        from sidecar.config import RestoreWalSettings
        from sidecar.lsn import segment_file_name, segment_number
        from sidecar.ops.restore import Exit, restore_wal
        from sidecar.pgrepl import segment_timeline
        s, end = self.s, fenced.start_lsn
        st = await read_standby(conn)
        have = max(st.replay_lsn, st.receive_lsn)
        if have >= end:
            self.say(f"  the standby already has the WAL up to E (received {format_lsn(st.receive_lsn)})")
            return
        pg_wal = Path((await (await conn.execute("SHOW data_directory")).fetchone())[0]) / "pg_wal"
        rs = RestoreWalSettings(safekeeper_readers=s.safekeeper_readers,  # type: ignore[attr-defined]
                                reader_user=s.reader_user, reader_passfile=s.reader_passfile,
                                reader_timeout=s.reader_timeout, certs_dir=s.certs_dir, insecure=s.insecure,
                                link_security=s.link_security, on_error="continue", retry_for=0,
                                # What the safekeepers removed once archived: the standby may be further behind.
                                archive=getattr(s, "archive", None), s3_endpoint=getattr(s, "s3_endpoint", None),
                                cluster=getattr(s, "cluster", None))
        seg = st.wal_seg_size
        for segno in range(segment_number(max(st.replay_lsn, 1), seg), segment_number(end - 1, seg) + 1):
            # The segment of the standby's replay position may hold switches of earlier failovers: its
            # file is the newest timeline's, not the one its first byte was written on.
            tli = segment_timeline(fenced.timeline_history, fenced.fence.timeline, segno, seg)
            name = segment_file_name(tli, segno, seg)
            code = await asyncio.to_thread(restore_wal, rs, name, pg_wal / name, stop=False)
            if code != Exit.RESTORED:
                raise FailoverError(f"cannot get {name} (up to E = {format_lsn(end)}) from the safekeepers' reader "
                                    f"ports {', '.join(map(str, s.safekeeper_readers))}: restore-wal exit "  # type: ignore[attr-defined]
                                    f"{int(code)} (its log line says why)")
            self.say(f"  wrote {name} into the standby's pg_wal (committed WAL up to E)")

    def _already_primary(self, standby: StandbyState) -> None:
        self.say(f"the standby is already a primary (timeline {standby.timeline}, at "
                 f"{format_lsn(standby.replay_lsn)}): a failover promoted it; nothing to fence or promote")

    async def _gate_steps(self, conn: psycopg.AsyncConnection, standby: StandbyState) -> tuple[Fence, Fenced]:
        """Steps 1-3 and the checks before a promotion; the fence term is still held (close it) when it returns."""
        s, say = self.s, self.say
        say(f"  standby: system {standby.system_id}, timeline {standby.timeline}, replayed up to "
            f"{format_lsn(standby.replay_lsn)}")
        gate = await self._open_range(standby)
        say("1/5 fence: winning a new term from a quorum of safekeepers (no WAL is streamed)")
        fence = Fence(replace(self._config(standby), gate=gate), self.security, precheck=self._precheck(standby),
                      copy=self.donor.copy, say=say)
        try:
            try:
                fenced = await fence.run(s.timeout)
            except FenceError as e:
                raise FailoverError(f"fence: {e}") from None
            say(f"2/5 recover: {', '.join(fence.committed_on())} hold the WAL up to E = "
                f"{format_lsn(fenced.start_lsn)} in term {fenced.term}; E is committed: every reader may have it")
            say(f"  timeline {fenced.fence.timeline} ends at E for good: from now on no term streams from a "
                "primary still on it (the old primary's commits wait and are never acknowledged); "
                "`walsidecar failover --undo` lifts this while nothing was promoted")
            say(f"3/5 catch up: waiting for the standby to replay up to {format_lsn(fenced.start_lsn)}")
            if getattr(s, "safekeeper_readers", ()):
                await self._feed_pg_wal(conn, fenced)
            await self._catch_up(conn, fenced.start_lsn, fence)
            say("4/5 promote: checking the standby's timeline history against the safekeepers'")
            standby = await read_standby(conn)
            problem = lineage_problem(standby, fenced.timeline_history, fenced.start_lsn)
            if problem is not None:
                raise FailoverError(f"not promoting: {problem}")
            # The term is held to the end: had the old primary's sidecar taken a newer one, its
            # commits past E would not be on the standby.
            try:
                fence.check()
            except FenceError as e:
                raise FailoverError(f"not promoting: the fence term was lost: {e}") from None
            await self._final(gate, fenced.term)
        except BaseException:
            await fence.close()
            raise
        return fence, fenced

    async def _open_range(self, standby: StandbyState) -> DegradedRange:
        """The open degraded range of --commit-wait degrade-after, which the fence's votes must cover: etcd's with
        --broker. Refuse when a safekeeper was written by a sidecar running degrade-after and etcd cannot say (no
        --broker, or no mark of such a sidecar under the cluster name given): a range may be open on members this
        failover does not hear."""
        from sidecar.broker import Broker, BrokerError
        s, say = self.s, self.say
        marked = [f"{address} was written in term {info.degrade_term} by a sidecar with --commit-wait degrade-after"
                  for address, info in (await self._quorum_answers()).items() if info.degrade_term]
        if not s.broker:
            if marked:
                raise FailoverError("not promoting: " + "; ".join(marked) + ". Commits may have been acknowledged "
                                    "that only some safekeepers hold, and its open degraded range (if any) is in etcd: "
                                    "run failover with --broker and --cluster (the sidecar's)")
            return NO_DEGRADED
        # The sidecar's default cluster name is the primary's system id, which the standby shares.
        cluster = self._cluster = s.cluster or str(standby.system_id)
        broker = Broker(s.broker, s.certs_dir)
        try:
            gate = await broker.read_degraded(cluster)
            known = await broker.degrade_after_marked(cluster)
        except BrokerError as e:
            raise FailoverError(f"not promoting: cannot read the degraded range of cluster {cluster} from etcd "
                                f"({e}); a sidecar with --commit-wait degrade-after may have acknowledged commits "
                                "that only some safekeepers hold: run failover again once etcd answers") from None
        finally:
            broker.close()
        if marked and not known:
            raise FailoverError("not promoting: " + "; ".join(marked) + f", but etcd holds no mark of such a sidecar "
                                f"under cluster {cluster} (walsidecar/{cluster}/degrade-after): give --cluster the "
                                "name the sidecar was started with")
        if gate:
            say(f"  etcd holds an open {describe(gate)}: the fence's votes must include one of its members that "
                f"still holds its WAL of term {gate.term}")
        elif known:
            say(f"  etcd holds no open degraded range for cluster {cluster}")
        return gate

    async def _quorum_answers(self) -> dict[str, InfoReply]:
        """InfoReplies of a quorum of safekeepers (waiting up to --timeout for them); FailoverError without."""
        s = self.s
        # Every safekeeper that joined a degrade-after sidecar's term is marked (degrade_term), and a term needs a
        # quorum: any quorum of answers includes a marked one. Those that answer later are not waited for.
        answers: dict[str, InfoReply] = {}
        problems: dict[str, str] = {}
        deadline = time.monotonic() + s.timeout
        while len(answers) < s.quorum:
            for address in s.safekeepers:
                if address in answers:
                    continue
                try:
                    answers[address] = await probe_safekeeper(address, min(s.timeout, 10.0), self.security)
                except ProbeError as e:
                    problems[address] = str(e)
            if len(answers) >= s.quorum:
                break
            if time.monotonic() > deadline:
                raise FailoverError(f"only {len(answers)} of {len(s.safekeepers)} safekeepers answered within "
                                    f"{s.timeout:g}s, a quorum of {s.quorum} is needed ("
                                    + "; ".join(f"{a}: {p}" for a, p in sorted(problems.items())
                                                if a not in answers) + "): start them, then run failover again")
            await asyncio.sleep(POLL_INTERVAL)
        return answers

    async def _final(self, gate: DegradedRange, fence_term: int) -> None:
        """Just before promoting: etcd still holds the range the votes covered (or none), which is closed, and no
        sidecar of an older term may open one from now on (the failover term rises to ours)."""
        from sidecar.broker import Broker, BrokerError
        s = self.s
        if not s.broker:
            return
        broker = Broker(s.broker, s.certs_dir)
        try:
            done = await broker.failover_final(self._cluster, gate, fence_term)
        except BrokerError as e:
            raise FailoverError(f"not promoting: cannot write the failover's term to etcd ({e}): run failover again "
                                "once etcd answers") from None
        finally:
            broker.close()
        if not done:
            raise FailoverError(f"not promoting: the degraded range in etcd changed while failing over (the old "
                                f"primary's sidecar recorded {'a new version of it' if gate else 'one'}): run "
                                "failover again, which reads it afresh")
        if gate:
            self.say(f"  the {describe(gate)} is closed: E holds every commit acknowledged in it, on a quorum")

    def _config(self, st: StandbyState) -> ProposerConfig:
        s = self.s
        return ProposerConfig(proposer_id="walsidecar-failover", peers=s.safekeepers, quorum=s.quorum,
                              system_id=st.system_id, timeline=st.timeline, timeline_history=st.history,
                              wal_seg_size=st.wal_seg_size,
                              pg_version=st.pg_version, bootstrap_lsn=0, failover=FailoverTerm.END)

    async def undo(self) -> None:
        """Lift the fence of a failover that never promoted: the old primary's sidecar may win terms again."""
        s, say = self.s, self.say
        info = await self._identity()
        say(f"walsidecar failover --undo: lifting the fence of the last failover, over {len(s.safekeepers)} "
            f"safekeepers (quorum {s.quorum})")
        config = ProposerConfig(proposer_id="walsidecar-failover-undo", peers=s.safekeepers, quorum=s.quorum,
                                system_id=info.system_id, timeline=info.timeline, wal_seg_size=info.wal_seg_size,
                                pg_version=info.pg_version, bootstrap_lsn=0, failover=FailoverTerm.LIFT)
        fence: Fence

        async def precheck(a: VerifyPrimary) -> str | None:
            """Before any vote: there must be a fence, and nothing may have streamed past it on a new timeline."""
            ended = fence.probed_fence()
            if not ended.timeline:
                return "no failover fence is set on the safekeepers: there is nothing to undo"
            now = fence.probed_timeline(a.donor)
            if now and now != ended.timeline and lineage.fenced_out(ended, now, a.timeline_history) is None:
                return (f"the safekeepers' WAL goes on on timeline {now}, after the failover of term {ended.term} "
                        f"ended timeline {ended.timeline}: the promoted standby's sidecar streams; a promoted "
                        "failover cannot be undone (rejoin the old primary as a standby with pg_rewind)")
            say(f"  the failover of term {ended.term} ended timeline {ended.timeline} at {format_lsn(ended.lsn)}; "
                "its WAL was not continued on another timeline")
            return None

        fence = Fence(config, self.security, precheck=precheck, copy=self.donor.copy, say=say)
        try:
            try:
                fenced = await fence.run(s.timeout)
            except FenceError as e:
                raise FailoverError(f"undo: {e}") from None
        finally:
            await fence.close()
        say(f"undone in term {fenced.term}: timeline {fenced.replaced.timeline} no longer ends at "
            f"{format_lsn(fenced.replaced.lsn)}; the old primary's sidecar streams again once it wins a term. "
            "Do not promote the standby that failover was for: run failover again for that")

    async def _identity(self) -> InfoReply:
        """The cluster the safekeepers belong to, from the first that answers (an undo has no standby to ask)."""
        problems = []
        for address in self.s.safekeepers:
            try:
                info = await probe_safekeeper(address, min(self.s.timeout, 10.0), self.security)
            except ProbeError as e:
                problems.append(f"{address}: {e}")
                continue
            if info.system_id:
                return info
            problems.append(f"{address}: holds no cluster yet")
        raise FailoverError("no safekeeper says which cluster it holds: " + "; ".join(problems))

    def _precheck(self, standby: StandbyState):  # type: ignore[no-untyped-def]
        async def check(a: VerifyPrimary) -> str | None:
            """Before any vote: the standby must follow the safekeepers' timelines up to E."""
            self.say(f"  the safekeepers' log ends at {format_lsn(a.start_lsn)}")
            return lineage_problem(standby, a.timeline_history, a.start_lsn)
        return check

    async def _catch_up(self, conn: psycopg.AsyncConnection, end: int, fence: Fence) -> None:
        """Wait until the standby replayed `end`, saying how far it is; refuse when it stops moving."""
        last, moved, said = -1, time.monotonic(), 0.0
        while True:
            try:
                fence.check()
            except FenceError as e:
                raise FailoverError(f"not promoting: the fence term was lost: {e}") from None
            st = await read_standby(conn)
            if not st.in_recovery:
                raise FailoverError("the standby was promoted by someone else while catching up; check it "
                                    "holds every acknowledged commit (its timeline starts at or after E)")
            if st.replay_lsn >= end:
                beyond = "" if st.replay_lsn == end else \
                    f" (it replayed to {format_lsn(st.replay_lsn)}: WAL beyond E that no quorum acknowledged)"
                self.say(f"  the standby replayed up to {format_lsn(end)}{beyond}")
                return
            now = time.monotonic()
            if st.replay_lsn != last:
                last, moved = st.replay_lsn, now
            if now - said >= PROGRESS_INTERVAL:
                said = now
                self.say(f"  standby at {format_lsn(st.replay_lsn)} (received {format_lsn(st.receive_lsn)}), "
                         f"{(end - st.replay_lsn) / 1048576:.1f} MiB to go")
            if now - moved > self.s.catchup_timeout:
                raise FailoverError(await self._why_stalled(conn, st, end))
            await asyncio.sleep(POLL_INTERVAL)

    async def _why_stalled(self, conn: psycopg.AsyncConnection, st: StandbyState, end: int) -> str:
        """The cause, read where it is: the standby's WAL receiver and settings, and the reader ports' answers."""
        row = await (await conn.execute("SELECT status, conninfo FROM pg_stat_wal_receiver")).fetchone()
        feeds = await standby_feeds(conn)
        head = (f"not promoting: the standby stopped at {format_lsn(st.replay_lsn)}, below E = {format_lsn(end)}, "
                f"for {self.s.catchup_timeout:g}s; ")
        refused, unreachable = [], []
        for address in feeds.readers:
            try:
                await asyncio.to_thread(self._probe, address, st.replay_lsn, st.timeline)
            except ReaderUnreachable as e:
                unreachable.append(f"{address} ({e.message})")
            except ReaderError as e:
                refused.append(f"{address} refuses to stream from {format_lsn(st.replay_lsn)}: {e.message}")
        if refused:
            missing = [what for what, have in (("a reader slot where it streams (primary_slot_name)", feeds.slot),
                                               ("a restore_command ('walsidecar restore-wal %f %p ...')",
                                                feeds.restore_command)) if not have]
            fix = (f"give the standby {' and '.join(missing)}" if missing else
                   "its slot and its restore_command did not keep that WAL: see restore-wal's errors in the "
                   "standby's log and `walsidecar check` for the archive")
            return head + "; ".join(refused) + f". {fix[0].upper()}{fix[1:]}, then run failover again"
        if row is not None:
            where = f"its WAL receiver is {row[0]} ({row[1]})"
        elif not feeds.readers:
            where = "it has no WAL receiver and its primary_conninfo names no server"
        elif len(unreachable) == len(feeds.readers):
            where = f"it has no WAL receiver: its primary_conninfo names {', '.join(unreachable)}, which cannot be reached"
        else:
            where = (f"it has no WAL receiver, although {', '.join(map(str, feeds.readers))} would serve it from "
                     f"{format_lsn(st.replay_lsn)}: its log says why its WAL receiver stops")
        return (head + where + ". Point its primary_conninfo at the safekeepers' reader ports (and its "
                "restore_command at `walsidecar restore-wal`), then run failover again")

    def _probe(self, address: Address, lsn: int, timeline: int) -> None:
        """Start a stream from `lsn` as the standby asks for it: the reader port's refusal raises ReaderError."""
        with WalReader(address, self.s, application_name="walsidecar failover") as r:
            for _ in r.stream(lsn, timeline=timeline, stop_at=lsn + 1):
                break

    async def _drop_slot(self, feeds: StandbyFeeds) -> None:
        """A promoted standby reads from the safekeepers no more: its slot would hold their WAL for ever."""
        if not feeds.slot:
            return
        for address in feeds.readers:
            try:
                await asyncio.to_thread(self._drop_one, address, feeds.slot)
                self.say(f"  dropped the standby's reader slot {feeds.slot!r} on {address}")
            except ReaderError as e:
                self.say(f"  WARNING: the standby's reader slot {feeds.slot!r} on {address} is left: {e.message}; it "
                         f"holds WAL there: walsidecar readers slot drop {feeds.slot} --safekeeper-readers {address}")

    def _drop_one(self, address: Address, slot: str) -> None:
        with WalReader(address, self.s, application_name="walsidecar failover") as r:
            if r.read_slot(slot) is not None:
                r.drop_slot(slot)

    async def _promote(self, conn: psycopg.AsyncConnection, fenced: Fenced) -> None:
        self.say("  promoting: SELECT pg_promote()")
        promoted = (await (await conn.execute("SELECT pg_promote(true, %s)",
                                              (int(self.s.timeout),))).fetchone())[0]
        if not promoted:
            raise FailoverError(f"pg_promote() did not finish within {self.s.timeout:g}s; see the standby's log "
                                "(run failover again once it is a primary: it goes straight to resume)")
        st = await read_standby(conn)
        self.say(f"  promoted: the new primary is on timeline {st.timeline}, from {format_lsn(fenced.start_lsn)}")

    async def _resume(self, conn: psycopg.AsyncConnection) -> None:
        s = self.s
        names = (await (await conn.execute("SHOW synchronous_standby_names")).fetchone())[0]
        args = ["walsidecar", "start", "--pg-dsn", s.standby_dsn, "--safekeepers", ",".join(s.safekeepers)]
        args += ["--insecure"] if s.insecure else ["--certs-dir", str(s.certs_dir)]
        if s.link_security != "tls":
            args += ["--link-security", s.link_security]
        self.say("5/5 resume: start the sidecar on the new primary (a new term on its timeline; commits wait "
                 "for the quorum again):\n    " + shlex.join(args))
        if not names.strip():
            self.say("  WARNING: synchronous_standby_names is empty on the new primary: its commits do not wait "
                     "for the safekeepers. ALTER SYSTEM SET synchronous_standby_names = 'walsidecar'; "
                     "SELECT pg_reload_conf();")
        self.say("  the old primary must not come back as a primary: `walsidecar check` on it says how to rejoin "
                 "it as a standby (pg_rewind)")


def run_failover(s: FailoverSettings) -> int:
    """0 when the standby is the primary (or, with --undo, the fence is lifted); 1 when a step refused or failed."""
    failover = Failover(s, lambda line: print(line, flush=True))
    try:
        asyncio.run(failover.undo() if s.undo else failover.run())
    except FailoverError as e:
        print(f"failover stopped: {e}\nnothing was promoted; the safekeepers keep every acknowledged commit: "
              "fix the cause and run failover again", flush=True)
        return 1
    except psycopg.OperationalError as e:
        print(f"failover stopped: cannot reach the standby: {str(e).strip()}\nnothing was promoted: run failover "
              "again", flush=True)
        return 1
    except psycopg.Error as e:
        print(f"failover stopped: the standby refused a query: {str(e).strip()} (connect as a superuser)\n"
              "nothing was promoted: run failover again", flush=True)
        return 1
    return 0


def run_failover_gate(s: FailoverBase) -> int:
    """Patroni's pre_promote: 0 when the standby replayed E behind a fence term; 1 vetoes the promotion."""
    from sidecar.logs import get_logger
    log = get_logger(command="failover-gate")
    gate = Failover(s, lambda line: print(line, flush=True))
    try:
        asyncio.run(gate.gate())
    except FailoverError as e:
        reason = str(e)
    except psycopg.OperationalError as e:
        reason = f"cannot reach the standby: {' '.join(str(e).split())}"
    except psycopg.Error as e:
        reason = f"the standby refused a query: {' '.join(str(e).split())} (connect as a superuser)"
    else:
        log.info("gate open: the standby holds every acknowledged commit", standby=redact_dsn(s.standby_dsn))
        return 0
    # Patroni takes a non-zero exit as a veto: it releases the leader lock and keeps this node a replica.
    log.error("gate closed: not promoting this standby", reason=reason, standby=redact_dsn(s.standby_dsn),
              safekeepers=",".join(s.safekeepers), quorum=s.quorum)
    return 1
