"""The deterministic simulation (sidecar/sim): seeds that must hold every invariant, and proof
that the checker has teeth (deliberately broken rules are caught within a few seeds)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from click.testing import CliRunner

from sidecar.consensus import acceptor as acceptor_mod
from sidecar.consensus import history as hist
from sidecar.consensus import proposer as proposer_mod
from sidecar.consensus.acceptor import Acceptor, AcceptorAction, RecordEnd, Reply
from sidecar.consensus.messages import TermEntry, VoteReply, VoteRequest
from sidecar.consensus.proposer import Phase, ReportStatus
from sidecar.sim.cli import main as simulate
from sidecar.sim.cli import report_failure
from sidecar.sim.runner import Outcome, first_violation, run_seed, run_seeds
from sidecar.sim.safekeepers import Safekeepers
from sidecar.sim.wal import BOOT
from sidecar.consensus.session import AcceptorSession
from sidecar.sim.world import SimConfig, World

SEEDS = 300
CHUNK = 50

# Invariants that restate a local rule; switched off to see whether the end-to-end ones
# (a lost acknowledged record, two leaders in one term) catch a broken rule on their own.
LOCAL_RULES = frozenset({
    "4 acknowledged position was flushed by a quorum in the term",
    "4 apply position was flushed by every safekeeper in the term",
    "3 promise persisted before the reply",
    "3 history persisted before the reply",
    "3 no WAL below the promise",
    "3 a vote reports every flush acknowledged",
})


def _check(out: Outcome) -> None:
    assert out.ok, report_failure(out, SimConfig())


@pytest.fixture(scope="module")
def outcomes() -> list[Outcome]:
    return sorted(run_seeds(range(SEEDS), jobs=2), key=lambda o: o.seed)


@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK))
def test_seeds_hold_every_invariant(outcomes: list[Outcome], first: int) -> None:
    for out in outcomes[first:first + CHUNK]:
        _check(out)


def test_the_seeds_exercise_the_hard_cases(outcomes: list[Outcome]) -> None:
    totals: dict[str, int] = {}
    for out in outcomes:
        for k, v in out.stats.items():
            totals[k] = totals.get(k, 0) + v
    for what in ("terms streamed", "safekeeper crashes", "torn safekeeper tails", "catch-ups",
                 "proposer crashes", "rival proposers", "primary crashes", "sent primary WAL overwritten",
                 "standbys promoted", "primaries restored from a copy", "stale primaries resumed",
                 "primaries refused"):
        assert totals.get(what, 0) >= 3, (what, totals)
    # Hostile connections of every kind, each refused before it changed anything.
    for kind in ("append", "elect", "cut", "read-only"):
        tried = totals.get(f"rogue connections ({kind})", 0)
        ended = totals.get(f"rogue connections refused ({kind})", 0) + \
            totals.get(f"rogue connections cut short by a crash ({kind})", 0)
        assert tried >= 3 and ended == tried, (kind, totals)
    assert totals.get("scans reused by a vote or Elected", 0) >= 3, totals
    assert totals.get("lying safekeeper replies", 0) >= 3, totals
    assert totals.get("links dropped by the proposer", 0) >= 3, totals
    # Most seeds get commits acknowledged despite everything.
    assert sum(o.stats.get("reports", 0) > 0 for o in outcomes) > 0.7 * len(outcomes)


def test_a_seed_replays_exactly() -> None:
    a, b = run_seed(11, full_trace=True), run_seed(11, full_trace=True)
    assert a.trace == b.trace and a.stats == b.stats
    assert len(a.trace) > SimConfig().steps // 2
    assert run_seed(12, full_trace=True).trace != a.trace


# ---- teeth: each broken rule is found within a modest number of seeds --------------------------

def _found(seeds: int, cfg: SimConfig | None = None) -> Outcome:
    out = first_violation(range(seeds), cfg)
    assert out is not None, f"no violation in {seeds} seeds"
    return out


def test_a_minority_quorum_is_caught() -> None:
    cfg = SimConfig(safekeepers=3, proposer_quorum=1)
    assert _found(10, cfg).invariant.startswith(("3 one proposer per term", "4 "))
    # and, without the rules that state it directly, as acknowledged records no quorum holds
    disabled = LOCAL_RULES | {"3 one proposer per term"}
    assert _found(10, replace(cfg, disabled=disabled)).invariant.startswith("1 ")


def test_counting_positions_below_the_term_start_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule lives in two places: quorum_position and the proposer's per-peer filter.
    def ignoring_term_start(positions, quorum, term_start):  # type: ignore[no-untyped-def]
        counted = sorted(positions, reverse=True)
        return counted[quorum - 1] if len(counted) >= quorum else 0

    monkeypatch.setattr(proposer_mod, "quorum_position", ignoring_term_start)
    monkeypatch.setattr(proposer_mod.Proposer, "_in_term", lambda self, p: p.flush_lsn)
    assert _found(20).invariant.startswith("4 ")


def _vote_without_persisting(self: Acceptor, msg: VoteRequest, end: RecordEnd) -> list[AcceptorAction]:
    granted = msg.term > self.state.term
    if granted:
        self.state = replace(self.state, term=msg.term)  # in memory only
    return [Reply(VoteReply(max(msg.term, self.state.term), granted, end.flush_lsn,
                            hist.up_to(self.state.term_history, end.flush_lsn), self.state.timeline_history,
                            end.tail_lsn, end.tail_crc))]


def test_a_vote_granted_without_persisting_the_term_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Acceptor, "on_vote", _vote_without_persisting)
    assert _found(10).invariant == "3 promise persisted before the reply"
    # and, without the local rules, by its consequence: a term with two leaders (this
    # needs a crash right after the vote and a rival proposer, hence more seeds)
    assert _found(400, SimConfig(disabled=LOCAL_RULES)).invariant in (
        "3 one proposer per term", "1 any quorum recovers every acknowledged record",
        "2 safekeepers agree below their commit_lsn")


def test_truncating_at_the_wrong_point_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep a stale tail: cut at the new term's start instead of the divergence point.
    monkeypatch.setattr(hist, "divergence_point", lambda sk_history, sk_flush, proposer_history:
                        proposer_history[-1].start_lsn)
    assert _found(20).invariant.startswith(("1 ", "2 "))


def test_appending_from_a_connection_that_does_not_hold_the_term_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The Append half of "the term belongs to one connection": any connection may append.
    on_append = Acceptor.on_append
    monkeypatch.setattr(Acceptor, "on_append", lambda self, msg, owner=None: on_append(self, msg, self.owner))
    assert _found(30).invariant == "3 one proposer per term"


def test_electing_from_a_connection_that_did_not_ask_for_the_vote_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The Elected half: any greeted connection may claim the current term.
    monkeypatch.setattr(AcceptorSession, "_asked_for", lambda self, term: True)
    assert _found(30).invariant == "3 one proposer per term"


def test_a_vote_scanned_apart_from_its_application_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the one-step rule (docs/protocol.md beside invariant 3) a vote's flush and scan is one
    # step and its taking effect another: the term's connection writes, syncs and acknowledges in
    # between, and the vote reports less than the safekeeper acknowledged.
    monkeypatch.setattr(Safekeepers, "vote_is_one_step", lambda self: False)
    assert _found(300).invariant == "3 a vote reports every flush acknowledged"


def test_cutting_below_commit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptor_mod, "cuts_committed", lambda point, commit_lsn, flush_lsn: False)
    assert _found(30).invariant.startswith(("1 ", "2 ", "3 one proposer per term"))
    # and, without the check that names the second leader, as acknowledged records lost
    assert _found(60, SimConfig(disabled=frozenset({"3 one proposer per term"}))).invariant.startswith(("1 ", "2 "))


def _restored_primary_after_an_empty_term() -> World:
    """Term 1 commits WAL; term 2 is elected but gets none; then the primary is replaced by
    a copy of an older point that writes new WAL past term 2's start, and a term begins."""
    w = World(5, SimConfig(safekeepers=3), scripted=True)
    svc = w.start_service()
    for n in ("sk1", "sk2", "sk3"):
        w.connect(svc, n)
    w.settle()
    w.produce(40)
    w.settle()
    assert svc.core is not None and svc.core.commit_lsn == w.current.end
    w.end_term(svc)
    w.new_term(svc)
    for n in ("sk1", "sk2", "sk3"):
        w.connect(svc, n)
    w.settle()
    assert svc.core is not None and svc.core.term == 2 and svc.core.phase is Phase.STREAMING
    e = svc.core.term_start
    copy = w.restore_primary(w.current.ends[10])
    while copy.end <= e:
        w.produce(5)
    w.new_term(svc)
    for n in ("sk1", "sk2", "sk3"):
        w.connect(svc, n)
    w.settle()
    return w


def test_a_stale_primary_is_refused_after_a_term_without_wal() -> None:
    # Term 2 has no WAL, yet every vote fingerprints the last record (of term 1), so the
    # primary restored from an older copy fails the byte comparison and is refused.
    # (tests/test_safekeeper_scan.py checks the same rule on the real safekeeper.)
    w = _restored_primary_after_an_empty_term()
    assert w.stats.get("primaries refused") == 1 and not w.services[0].alive


def test_a_failing_seed_prints_its_replay_command_and_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Acceptor, "on_vote", _vote_without_persisting)
    res = CliRunner().invoke(simulate, ["--seeds", "2", "--jobs", "1"])
    assert res.exit_code == 1
    assert "replay: python3 scripts/simulate.py --seeds 1 --first-seed 0 --trace" in res.output
    assert "VoteReply(" in res.output  # the trace of the schedule
    assert res.output.strip().splitlines()[-1].startswith("simulated 2 seeds") and "2 violations" in res.output


def test_the_cli_summary_is_last_and_zero_means_success() -> None:
    res = CliRunner().invoke(simulate, ["--seeds", "3", "--first-seed", "5", "--steps", "300", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1].endswith(": 0 violations")


# ---- a scripted scenario: two terms, a lagging and a stale safekeeper ----------------------------

def _stored(world: World, name: str) -> bytes:
    disk = world.by_name[name].disk
    assert disk.start == BOOT
    return disk.read(BOOT, disk.end)


def test_two_terms_with_a_lagging_and_a_stale_safekeeper() -> None:
    rng = random.Random(1234)
    w = World(99, SimConfig(safekeepers=3), scripted=True)
    names = ("sk1", "sk2", "sk3")
    svc = w.start_service()
    for n in names:
        w.connect(svc, n)
    w.settle()
    p1, pg = svc.core, w.current
    assert p1 is not None and p1.phase is Phase.STREAMING and p1.term == 1
    assert [c.start_lsn for c in svc.checks] == [BOOT]

    # Term 1: WAL arrives in random pieces, delivered and acknowledged in a random order.
    for _ in range(300):
        w.produce(rng.randint(1, 3))
        w.busy(rng.randint(0, 6))
    w.settle()
    end1 = pg.end
    assert p1.commit_lsn == end1
    w.heartbeat(svc)
    w.settle()
    for n in names:
        assert _stored(w, n) == pg.read(BOOT, end1), n
        assert w.by_name[n].commit_lsn == end1
    flushes = [r.flush_lsn for r in svc.reports]
    assert flushes == sorted(flushes) and flushes[-1] == end1
    assert svc.reports[-1] == ReportStatus(end1, end1, end1)

    # sk1 drops out; sk2 and sk3 commit more of term 1.
    w.disconnect(svc, "sk1")
    w.produce(100)
    w.settle()
    end2 = pg.end
    assert p1.commit_lsn == end2
    # sk2 drops out too: sk3 alone receives a tail that no quorum acknowledges.
    w.disconnect(svc, "sk2")
    w.produce(50)
    w.settle()
    end3 = pg.end
    assert p1.commit_lsn == end2 and w.by_name["sk3"].disk.end == end3
    assert w.by_name["sk1"].disk.end == end1 < end2

    # The primary is replaced by a copy that stops at end2 and writes new WAL from there.
    pg2 = w.restore_primary(end2)
    assert svc.core is None
    w.new_term(svc)
    reports1 = len(svc.reports)
    w.connect(svc, "sk1")
    w.connect(svc, "sk2")
    w.produce(5)
    w.settle()
    p2 = svc.core
    assert p2 is not None and p2.phase is Phase.STREAMING and p2.term == 2
    assert svc.checks[-1].start_lsn == end2 and svc.checks[-1].donor == "sk2"
    assert p2.history == (TermEntry(1, BOOT), TermEntry(2, end2))
    # sk1 lagged below E and was caught up from the primary's WAL.
    assert [(f.peer, f.start, f.end) for f in svc.fetched] == [("sk1", end1, end2)]

    for _ in range(100):
        w.produce(rng.randint(1, 3))
        w.busy(rng.randint(0, 6))
    w.settle()

    # sk3 comes back with its stale term-1 tail: it is cut at E and fed term 2's WAL.
    assert w.by_name["sk1"].truncations[-1] == end1
    w.connect(svc, "sk3")
    w.settle()
    assert w.by_name["sk3"].truncations[-1] == end2
    final = pg2.end
    assert p2.commit_lsn == final
    w.heartbeat(svc)
    w.settle()
    for n in names:
        sk = w.by_name[n]
        assert _stored(w, n) == pg2.read(BOOT, final), n
        assert sk.persisted.term == 2 and sk.persisted.term_history == p2.history
        assert sk.commit_lsn == final
    assert svc.reports[-1] == ReportStatus(final, final, final)
    term2 = [r.flush_lsn for r in svc.reports[reports1:]]
    assert term2 == sorted(term2)
    assert w.stats.get("refusals by safekeepers", 0) == 0


def test_a_lost_disk_votes_twice_without_the_amnesia_rule() -> None:
    # A safekeeper restarted with the same id on an empty data directory forgot its promises:
    # without learning its term from its peers it grants a term it already granted.
    cfg = SimConfig(amnesia_rule=False, disk_losses=1.0)
    assert _found(300, cfg).invariant in ("3 one proposer per term", "1 any quorum recovers every acknowledged record",
                                          "2 safekeepers agree below their commit_lsn")


def test_a_lost_disk_loses_an_acknowledged_commit_without_the_later_term_rule() -> None:
    """A commit acknowledged by {sk1, sk2}; sk1's disk is lost and it learns its term; voting at once with an
    empty WAL, it elects with a peer that lacks the commit a donor without it."""
    cfg = SimConfig(later_term_rule=False, disk_losses=1.0)
    assert _found(300, cfg).invariant.startswith(("1 ", "2 "))


def test_a_stale_reader_snapshot_without_the_cut_check_serves_cut_wal() -> None:
    """The reader process decides on a snapshot older than the safekeeper: without throwing away a read
    whose snapshot's cut generation is behind (walsender.py), it serves WAL a cut took away: invariant 5."""
    assert _found(300, SimConfig(reader_cut_check=False)).invariant.startswith("5 ")


def test_lost_disks_with_the_amnesia_rule_are_safe() -> None:
    out = first_violation(range(150), SimConfig(disk_losses=1.0))
    assert out is None, report_failure(out, SimConfig())


def test_a_failover_that_does_not_end_the_old_timeline_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fence rule (consensus/lineage.py), the old primary's sidecar, still alive after a failover
    promoted a standby, wins a later term and has commits acknowledged: invariant 7 finds it."""
    from types import SimpleNamespace

    from sidecar.consensus import lineage

    no_fence = SimpleNamespace(latest=lineage.latest, fenced_out=lambda fence, timeline, history: None)
    monkeypatch.setattr(acceptor_mod, "lineage", no_fence)
    monkeypatch.setattr(proposer_mod, "lineage", no_fence)
    assert _found(300, SimConfig(failovers=0.3)).invariant.startswith("7 ")


def test_a_failover_without_the_degraded_gate_loses_a_degraded_acknowledgement() -> None:
    """--commit-wait degrade-after acknowledges commits some safekeepers alone hold. Without the failover's gate
    (its votes must cover the open range; its last broker transaction checks the range still stands), a failover
    promotes a standby from voters that lack them: the promoted standby lacks an acknowledged record (1b)."""
    out = _found(400, SimConfig(degrade=1.0, degraded_gate=False, failovers=0.3))
    assert out.invariant.startswith("1b "), report_failure(out, SimConfig(degrade=1.0, degraded_gate=False))
    assert "a failover promoted it" in out.detail


def test_degrade_after_with_the_gate_is_safe() -> None:
    """Every seed degrades (after 4, 15 or 40 steps without a quorum), with failovers: nothing acknowledged is lost."""
    outs = list(run_seeds(range(300), SimConfig(degrade=1.0, failovers=0.3), jobs=2))
    bad = [o for o in outs if not o.ok]
    assert not bad, report_failure(min(bad, key=lambda o: o.seed), SimConfig(degrade=1.0, failovers=0.3))
    stats = Counter()
    for o in outs:
        stats.update(o.stats)
    # The runs did what they are for: degraded acknowledgements, ranges closed, failovers promoted and refused.
    assert stats["degraded acknowledgements"] and stats["degraded range closed"] and stats["failovers promoted"]
    assert stats["failovers refused by the degraded gate"] + stats["failovers refused: the degraded range changed"]
