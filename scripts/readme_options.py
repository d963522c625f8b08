"""Rewrite the option tables in docs/options.md from the settings classes (sidecar/config.py).

Run after adding or changing an option: `python3 scripts/readme_options.py`. With `--check` it only
says whether the tables are up to date (exit status 1 if not), as tests/unit/test_options.py does.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.config import ALL_SETTINGS, options_table  # noqa: E402

OPTIONS = ROOT / "docs" / "options.md"
TABLE = re.compile(r"(<!-- options (\S+) -->\n)(.*?)(<!-- end options -->)", re.DOTALL)


def rewritten(text: str) -> str:
    tables = {cls.command: options_table(cls) for cls in ALL_SETTINGS}
    return TABLE.sub(lambda m: m[1] + tables.get(m[2], m[3]) + m[4], text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a table is out of date")
    args = parser.parse_args()
    text = OPTIONS.read_text()
    new = rewritten(text)
    if new == text:
        print("docs/options.md option tables are up to date")
        return 0
    if args.check:
        print("docs/options.md option tables are out of date: run python3 scripts/readme_options.py")
        return 1
    OPTIONS.write_text(new)
    print("docs/options.md option tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
