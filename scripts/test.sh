#!/usr/bin/env bash
# Install everything (scripts/install.sh: the venv /opt/walsidecar/venv, or WALSIDECAR_VENV, with the
# test and analytics extras and this checkout's package, reinstalled whenever a file of it changed), then
# run pytest with the venv's python and any extra arguments (e.g. -k NAME). The tests import this
# checkout's code, and the commands PostgreSQL runs as the postgres user (restore_command) are the
# installed package's: the same code right after the install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
# The tests import this checkout's code: its compiled stream loop is built here too (build_ext skips an
# up-to-date one). The suite runs the safekeepers on it (WALSIDECAR_IMPL=compiled, so that one that did not
# build fails the run); WALSIDECAR_IMPL=python runs them on the Python reference (.ci/run does both).
"${WALSIDECAR_VENV:-/opt/walsidecar/venv}/bin/python" setup.py -q build_ext --inplace >/dev/null 2>&1 ||
    echo "test.sh: the compiled stream loop could not be built in the checkout" >&2
export WALSIDECAR_IMPL="${WALSIDECAR_IMPL:-compiled}"
VENV="${WALSIDECAR_VENV:-/opt/walsidecar/venv}"
# The venv first on PATH: the tests' child processes and the image build (python3) use it too.
export PATH="$VENV/bin:$PATH"
# pytest runs next to a private Docker engine holding freshly built images, for the container
# tests (tests/containers, marker `containers`); without one they are skipped, saying why.
# WALSIDECAR_CONTAINERS=0 skips the engine and the image build. See scripts/with-docker.sh.
# Two pytest-xdist workers (WALSIDECAR_TEST_WORKERS, or -n N among the arguments, which wins; -n 0 runs in
# this process): every test makes its own directories, ports and servers, and most of a test's time is
# waiting for processes, so two run side by side on two cores; an idle worker takes tests queued for the other.
# pytest's own exit code; 5 (no tests collected) is non-zero and so fails too.
exec bash scripts/with-docker.sh "$VENV/bin/python" -m pytest -n "${WALSIDECAR_TEST_WORKERS:-2}" --dist worksteal "$@"
