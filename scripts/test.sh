#!/usr/bin/env bash
# Install dependencies, then run pytest with any extra arguments (e.g. -k NAME).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
# pytest runs next to a private Docker engine holding freshly built images, for the container
# tests (tests/containers, marker `containers`); without one they are skipped, saying why.
# WALSIDECAR_CONTAINERS=0 skips the engine and the image build. See scripts/with-docker.sh.
# pytest's own exit code; 5 (no tests collected) is non-zero and so fails too.
exec bash scripts/with-docker.sh python3 -m pytest "$@"
