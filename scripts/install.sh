#!/usr/bin/env bash
# Install what walsidecar needs on Debian 12: PostgreSQL 15 server/client, a Java 17 runtime for the WAL
# analytics (PySpark), iproute2 (network namespaces for chaos partitions), and the package itself with its
# analytics and test extras.
# Idempotent; when everything is already present it only runs a few quick checks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd -P)"

PG_BIN=/usr/lib/postgresql/15/bin
NEEDED_BINS=(postgres pg_ctl initdb pgbench pg_waldump psql pg_receivewal pg_basebackup)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

missing_bin=""
for b in "${NEEDED_BINS[@]}"; do
    [ -x "$PG_BIN/$b" ] || { missing_bin="$b"; break; }
done

if [ -n "$missing_bin" ]; then
    echo "install.sh: $PG_BIN/$missing_bin missing; installing PostgreSQL 15" >&2
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends postgresql-15 postgresql-client-15
    # The package creates and may start a cluster "15 main" on 5432; we never use it.
    if command -v pg_lsclusters >/dev/null && pg_lsclusters -h 2>/dev/null | awk '$1=="15" && $2=="main" {f=1} END {exit !f}'; then
        as_root pg_dropcluster --stop 15 main
    fi
elif command -v pg_lsclusters >/dev/null && pg_lsclusters -h 2>/dev/null | awk '$1=="15" && $2=="main" && $4=="online" {f=1} END {exit !f}'; then
    echo "install.sh: note: Debian cluster '15 main' is running on its port; walsidecar does not use it" >&2
fi

# PySpark 4 (WAL analytics) runs on a Java 17+ runtime.
java_ok() {
    command -v java >/dev/null 2>&1 &&
        java -version 2>&1 | awk -F'"' '/version/ { split($2, v, "."); found = 1; exit !(v[1] >= 17) } END { if (!found) exit 1 }'
}
if ! java_ok; then
    echo "install.sh: no Java 17+ runtime; installing openjdk-17-jre-headless" >&2
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends openjdk-17-jre-headless
fi

# scripts/chaos.py --kinds partition runs safekeepers in network namespaces: `ip netns`, veth pairs.
if ! command -v ip >/dev/null 2>&1; then
    echo "install.sh: no ip command; installing iproute2" >&2
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -q
    as_root apt-get install -y -q --no-install-recommends iproute2
fi

if ! id -u postgres >/dev/null 2>&1; then
    as_root useradd --system --home-dir /var/lib/postgresql --create-home --shell /bin/bash postgres
fi

# Reinstall only when this checkout is not the installed one or pyproject.toml changed.
stamp_dir="${XDG_CACHE_HOME:-$HOME/.cache}/walsidecar"
stamp="$stamp_dir/install-$(printf '%s' "$REPO" | sha256sum | cut -c1-16)"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
installed_ok() {
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] || return 1
    python3 - "$REPO" <<'PY' 2>/dev/null
import importlib.metadata, os, sys
import sidecar, psycopg, psycopg_pool, click, tenacity, google_crc32c, structlog, pytest, pytest_timeout, prometheus_client, pydantic_settings
import pyspark, pyarrow, pandas, numba, matplotlib, boto3, lz4, zstandard, moto.server
import testcontainers, docker, hypothesis
importlib.metadata.version("walsidecar")
sys.exit(0 if os.path.realpath(sidecar.__file__).startswith(sys.argv[1] + os.sep) else 1)
PY
}
if ! installed_ok; then
    PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip install -q --root-user-action=ignore -e ".[test,analytics]"
    mkdir -p "$stamp_dir"
    printf '%s\n' "$want" > "$stamp"
fi
