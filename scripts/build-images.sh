#!/usr/bin/env bash
# Build walsidecar's container images without any container registry:
#
#   walsidecar/pg15-base:local     root filesystem made from this machine's postgresql-15 (docker import)
#   walsidecar/python-base:local   this machine's Python, walsidecar's dependencies and pip (docker import)
#   walsidecar/postgres:local      docker/postgres/Dockerfile on pg15-base: the primary
#   walsidecar/walsidecar:local    docker/Dockerfile on python-base: safekeeper, start, check, status
#
# Needs a reachable Docker engine (DOCKER_HOST), postgresql-15 and the Python dependencies installed
# (scripts/install.sh). Uses the legacy builder (DOCKER_BUILDKIT=0): no BuildKit/buildx needed.
# Env: PYTHON (interpreter to copy, default python3), WALSIDECAR_IMAGE_TAG (default local).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
TAG=${WALSIDECAR_IMAGE_TAG:-local}
export DOCKER_BUILDKIT=0

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

if ! docker version >/dev/null 2>&1; then
    echo "build-images.sh: no Docker engine reachable (DOCKER_HOST=${DOCKER_HOST:-unset})" >&2
    exit 1
fi
start=$(now)

# The two base root filesystems are independent: assemble and import them side by side.
import_rootfs() {   # KIND IMAGE ENV...
    local kind=$1 image=$2 changes=()
    shift 2
    for e in "$@"; do changes+=(-c "ENV $e"); done
    "$PYTHON" docker/rootfs.py "$kind" - | docker import "${changes[@]}" - "$image" >/dev/null
}
t0=$(now)
import_rootfs postgres "walsidecar/pg15-base:$TAG" \
    "PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/bin:/bin" "LANG=C.UTF-8" &
pg_job=$!
import_rootfs python "walsidecar/python-base:$TAG" "PATH=/usr/local/bin:/usr/bin:/bin" "LANG=C.UTF-8" &
py_job=$!
rc=0
wait "$pg_job" || rc=$?
wait "$py_job" || rc=$?
[ "$rc" -eq 0 ] || { echo "build-images.sh: assembling a base root filesystem failed" >&2; exit "$rc"; }
echo "build-images.sh: base images imported in $(since "$t0") s"

t0=$(now)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
docker build --build-arg "BASE=walsidecar/pg15-base:$TAG" -t "walsidecar/postgres:$TAG" \
    docker/postgres >"$logs/postgres.log" 2>&1 &
pg_job=$!
docker build --build-arg "BASE=walsidecar/python-base:$TAG" --build-arg "PIP_ARGS=--no-index" \
    -f docker/Dockerfile -t "walsidecar/walsidecar:$TAG" . >"$logs/walsidecar.log" 2>&1 &
py_job=$!
wait "$pg_job" || { rc=$?; cat "$logs/postgres.log" >&2; }
wait "$py_job" || { rc=$?; cat "$logs/walsidecar.log" >&2; }
[ "$rc" -eq 0 ] || { echo "build-images.sh: docker build failed" >&2; exit "$rc"; }
echo "build-images.sh: project images built in $(since "$t0") s"
docker image ls --filter "reference=walsidecar/*:$TAG" --format '  {{.Repository}}:{{.Tag}} {{.Size}}'
echo "build-images.sh: done in $(since "$start") s"
