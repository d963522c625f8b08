#!/usr/bin/env python3
"""Run the deterministic simulation: `scripts/simulate.py --seeds N [--first-seed S] [--steps K] [--trace]`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.sim.cli import main

if __name__ == "__main__":
    main()
