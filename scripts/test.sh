#!/usr/bin/env bash
# Install dependencies, then run pytest with any extra arguments (e.g. -k NAME).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
# pytest's own exit code; 5 (no tests collected) is non-zero and so fails too.
exec python3 -m pytest "$@"
