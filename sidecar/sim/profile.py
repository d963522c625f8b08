"""What a simulated run is asked to do, and what its seed draws: the cluster and how hostile it is."""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_ID = 7301
PG_VERSION = 15  # the major version, as the proposer reads it from server_version_num


@dataclass(frozen=True)
class SimConfig:
    """What a run is asked to do; everything else is drawn from the seed."""

    steps: int = 1500
    safekeepers: int | None = None  # None: 3, or sometimes 5, drawn from the seed
    proposer_quorum: int | None = None  # None: a majority; anything else is a deliberately broken rule
    trace: int | None = 80  # events kept for the report; None keeps all
    disabled: frozenset[str] = frozenset()  # invariants not checked (to see what else catches a bug)
    # A safekeeper restarted on a lost disk learns its term from its peers before voting
    # (Acceptor.amnesic); False shows what happens without that rule.
    amnesia_rule: bool = True
    # Having learned it, it grants no vote until its WAL holds the start of a later term
    # (AcceptorState.lost_disk_term); False shows the acknowledged commit it can lose without that rule.
    later_term_rule: bool = True
    # The reader process throws away a read whose snapshot's cut generation is behind the safekeeper's
    # (walsender.py, readerprocess.py); False shows what a stale snapshot would serve without that check.
    reader_cut_check: bool = True
    disk_losses: float | None = None  # weight of losing a safekeeper's disk; None: drawn from the seed
    failovers: float | None = None  # weight of starting `walsidecar failover`; None: drawn from the seed
    # Share of seeds whose sidecars run --commit-wait degrade-after (drawn apart from the rest of the seed, so that
    # the other seeds run as they always did); 1.0: every seed.
    degrade: float = 0.3
    # A failover's gate refuses votes that do not cover an open degraded range, and its last broker transaction
    # checks the range did not change (consensus/degraded.py); False shows the acknowledgement lost without it.
    degraded_gate: bool = True


@dataclass(frozen=True)
class Profile:
    """The seed's personality: cluster size, how hostile the environment is, proposer limits."""

    safekeepers: int
    chaos: float
    seg_size: int
    max_inflight: int
    buffer_limit: int
    mid_crash: float  # chance that a safekeeper dies between two actions of one message
    rivals: float  # weight of starting a second, competing proposer
    rogues: float  # weight of hostile connections (term hijacks, cuts below commit, read-only writers)
    liars: float  # weight of a safekeeper reply claiming a flush it never made
    disk_losses: float  # weight of a safekeeper's state and WAL wiped, restarted with the same id
    failovers: float  # weight of a `walsidecar failover` to a standby, the old primary often left alive

    @staticmethod
    def draw(rng: random.Random, cfg: SimConfig) -> Profile:
        return Profile(
            safekeepers=cfg.safekeepers or rng.choice((3, 3, 3, 5)),
            chaos=rng.choice((0.3, 1.0, 1.0, 2.5)),
            seg_size=rng.choice((1024, 8192, 16 << 20)),
            max_inflight=rng.choice((32 << 20, 4000, 700)),
            buffer_limit=rng.choice((64 << 20, 6000, 1500)),
            mid_crash=rng.choice((0.0, 0.002, 0.01)),
            rivals=rng.choice((0.0, 0.05, 0.3)),
            rogues=rng.choice((0.0, 0.3, 1.0)),
            liars=rng.choice((0.0, 0.2, 1.0)),
            disk_losses=rng.choice((0.0, 0.1, 0.4)) if cfg.disk_losses is None else cfg.disk_losses,
            failovers=rng.choice((0.0, 0.05, 0.3)) if cfg.failovers is None else cfg.failovers,
        )
