"""Running seeds: one in-process, or many across worker processes."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from sidecar.sim.checker import Violation
from sidecar.sim.profile import SimConfig
from sidecar.sim.world import World


@dataclass(frozen=True)
class Outcome:
    seed: int
    steps: int
    stats: dict[str, int] = field(default_factory=dict)
    invariant: str | None = None  # None: every check held
    detail: str = ""
    trace: tuple[str, ...] = ()  # the last events, or all of them when asked to trace

    @property
    def ok(self) -> bool:
        return self.invariant is None


def run_seed(seed: int, cfg: SimConfig | None = None, full_trace: bool = False) -> Outcome:
    """Run one seed to its last step or its first violation."""
    cfg = cfg or SimConfig()
    world = World(seed, replace(cfg, trace=None) if full_trace else cfg)
    try:
        world.run()
    except Violation as v:
        return Outcome(seed, world.step_no, world.stats, v.invariant, v.detail, tuple(world.trace.lines()))
    except Exception as e:  # a crash of the core (or of the simulator) is a finding too
        where = "".join(traceback.format_exception(e)[-3:]).strip()
        return Outcome(seed, world.step_no, world.stats, "exception", f"{e!r}\n{where}",
                       tuple(world.trace.lines()))
    return Outcome(seed, world.step_no, world.stats, trace=tuple(world.trace.lines()) if full_trace else ())


def _run(args: tuple[int, SimConfig | None]) -> Outcome:
    return run_seed(*args)


def run_seeds(seeds: Iterable[int], cfg: SimConfig | None = None, jobs: int = 1,
              on_outcome: Callable[[Outcome], None] | None = None) -> Iterator[Outcome]:
    """Outcomes of many seeds (in completion order when jobs > 1)."""
    work = [(s, cfg or SimConfig()) for s in seeds]
    if jobs <= 1 or len(work) < 2:
        yield from map(_run, work)
        return
    with multiprocessing.Pool(jobs) as pool:
        yield from pool.imap_unordered(_run, work, chunksize=max(1, min(64, len(work) // (jobs * 16))))


def first_violation(seeds: Iterable[int], cfg: SimConfig | None = None) -> Outcome | None:
    """The first failing seed, in order, or None."""
    for seed in seeds:
        out = run_seed(seed, cfg)
        if not out.ok:
            return out
    return None
