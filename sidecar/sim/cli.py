"""`scripts/simulate.py` / `python -m sidecar.sim`: run many seeds, report violations, exit non-zero on any."""

from __future__ import annotations

import os
import sys
import time

import click

from sidecar.sim.runner import Outcome, run_seed, run_seeds
from sidecar.sim.profile import SimConfig

TRACE_TAIL = 60  # events printed for a failing seed
SHOWN = 5  # failing seeds printed in full; the rest are listed


def replay_command(seed: int, cfg: SimConfig) -> str:
    """The one command that replays `seed` under `cfg`, with its whole trace."""
    extra = ""
    default = SimConfig()
    if cfg.steps != default.steps:
        extra += f" --steps {cfg.steps}"
    if cfg.safekeepers != default.safekeepers:
        extra += f" --safekeepers {cfg.safekeepers}"
    return f"python3 scripts/simulate.py --seeds 1 --first-seed {seed}{extra} --trace"


def report_failure(out: Outcome, cfg: SimConfig, tail: int = TRACE_TAIL) -> str:
    """What broke, the replay command, and the last `tail` events of the schedule."""
    lines = [f"seed {out.seed}: violation of invariant {out.invariant} at step {out.steps}",
             f"  {out.detail}", f"  replay: {replay_command(out.seed, cfg)}"]
    if tail:
        events = out.trace[-tail:]
        lines.append(f"  last {len(events)} events (positions are bytes past the bootstrap LSN):")
        lines += ["  " + line for line in events]
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--seeds", type=click.IntRange(min=1), default=100, show_default=True, help="How many seeds to run.")
@click.option("--first-seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=SimConfig().steps, show_default=True,
              help="Scheduled events per seed.")
@click.option("--trace", is_flag=True, help="Print every event of every seed (meant for --seeds 1).")
@click.option("--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default="CPU count",
              help="Worker processes.")
@click.option("--safekeepers", type=click.IntRange(min=1), default=None,
              help="Cluster size (default: 3, or 5 for some seeds).")
def main(seeds: int, first_seed: int, steps: int, trace: bool, jobs: int, safekeepers: int | None) -> None:
    """Run the deterministic simulation on seeds FIRST-SEED .. FIRST-SEED+SEEDS-1."""
    cfg = SimConfig(steps=steps, safekeepers=safekeepers)
    began = time.monotonic()
    failures: list[Outcome] = []
    totals: dict[str, int] = {}
    if trace:
        outcomes = [run_seed(s, cfg, full_trace=True) for s in range(first_seed, first_seed + seeds)]
        for out in outcomes:
            click.echo(f"seed {out.seed}: {out.steps} steps")
            click.echo("\n".join(out.trace))
    else:
        outcomes = []
        stream = run_seeds(range(first_seed, first_seed + seeds), cfg, jobs=jobs)
        with click.progressbar(stream, length=seeds, label="simulating", file=sys.stderr,
                               show_pos=True, show_eta=True) as bar:
            for out in bar:
                outcomes.append(out)
    for out in sorted(outcomes, key=lambda o: o.seed):
        for k, v in out.stats.items():
            totals[k] = totals.get(k, 0) + v
        if not out.ok:
            failures.append(out)
    for out in failures[:SHOWN]:
        click.echo(report_failure(out, cfg, 0 if trace else TRACE_TAIL))  # --trace printed it all
    if len(failures) > SHOWN:
        click.echo("more failing seeds: " + " ".join(str(o.seed) for o in failures[SHOWN:]))
    elapsed = time.monotonic() - began
    click.echo("covered: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    click.echo(f"simulated {seeds} seeds ({first_seed}..{first_seed + seeds - 1}, {steps} steps each) "
               f"in {elapsed:.1f} s ({seeds / elapsed:.1f} seeds/s): {len(failures)} violation"
               f"{'' if len(failures) == 1 else 's'}")
    sys.exit(1 if failures else 0)
