#!/usr/bin/env bash
# Install what walsidecar needs on Debian 12: PostgreSQL 15 server/client, iproute2 (network namespaces
# for chaos partitions) and the package itself in its own virtual environment, /opt/walsidecar/venv,
# made from the system Python (/usr/bin/python3, which refuses `pip install` into the system: PEP 668);
# /usr/local/bin/walsidecar links to the default venv's command. Rerun it after changing the code
# (scripts/test.sh does): it reinstalls when any file of the package changed.
#
#   bash scripts/install.sh            the package with its test, analytics and ha extras (installed, not
#                                      editable: a copy of the checkout's code) and a Java 17 runtime for
#                                      the analytics (PySpark)
#   WALSIDECAR_EXTRAS= bash scripts/install.sh    the core only: services and operator commands
#
# Env: WALSIDECAR_VENV (default /opt/walsidecar/venv; another one leaves /usr/local/bin/walsidecar alone),
# WALSIDECAR_EXTRAS (default test,analytics,ha; ha is Patroni, for `walsidecar up --ha` and tests/integration/test_ha.py).
# Idempotent; when everything is already present it only runs a few quick checks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd -P)"

VENV="${WALSIDECAR_VENV:-/opt/walsidecar/venv}"
EXTRAS="${WALSIDECAR_EXTRAS-test,analytics,ha}"
SYSTEM_PYTHON=/usr/bin/python3
PG_BIN=/usr/lib/postgresql/15/bin
NEEDED_BINS=(postgres pg_ctl initdb pgbench pg_waldump psql pg_receivewal pg_basebackup)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

apt_updated=""
apt_install() {   # PACKAGE...
    export DEBIAN_FRONTEND=noninteractive
    [ -n "$apt_updated" ] || { as_root apt-get update -q; apt_updated=1; }
    as_root apt-get install -y -q --no-install-recommends "$@"
}

missing_bin=""
for b in "${NEEDED_BINS[@]}"; do
    [ -x "$PG_BIN/$b" ] || { missing_bin="$b"; break; }
done

if [ -n "$missing_bin" ]; then
    echo "install.sh: $PG_BIN/$missing_bin missing; installing PostgreSQL 15" >&2
    apt_install postgresql-15 postgresql-client-15
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
if [[ ",$EXTRAS," == *,analytics,* ]] && ! java_ok; then
    echo "install.sh: no Java 17+ runtime; installing openjdk-17-jre-headless" >&2
    apt_install openjdk-17-jre-headless
fi

# The tests start their own etcd (the broker, --broker) from Debian's etcd-server on free loopback ports;
# etcdctl shows the keys. On a host with systemd the package also enables a default etcd service on 2379.
if [[ ",$EXTRAS," == *,test,* ]] && ! command -v etcd >/dev/null 2>&1; then
    echo "install.sh: no etcd; installing etcd-server and etcd-client" >&2
    apt_install etcd-server etcd-client
fi

# scripts/chaos.py --kinds partition runs safekeepers in network namespaces: `ip netns`, veth pairs.
if ! command -v ip >/dev/null 2>&1; then
    echo "install.sh: no ip command; installing iproute2" >&2
    apt_install iproute2
fi

# A C compiler and Python's headers build the safekeeper's compiled stream loop (csrc/streamloop.c; without
# them the package installs with the Python reference alone), and scripts/bench.py's stand-ins
# (scripts/floor_safekeeper.c, scripts/floor_proposer.c), which also need the headers of OpenSSL and libpq.
if ! command -v gcc >/dev/null 2>&1; then
    echo "install.sh: no C compiler; installing gcc" >&2
    apt_install gcc libc6-dev
fi
if [ ! -f /usr/include/openssl/ssl.h ] || ! command -v pg_config >/dev/null 2>&1 ||
        [ ! -f "$(pg_config --includedir)/libpq-fe.h" ]; then
    echo "install.sh: no headers for OpenSSL or libpq (the benchmark's stand-ins); installing libssl-dev libpq-dev" >&2
    apt_install libssl-dev libpq-dev
fi
if ! "$SYSTEM_PYTHON" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
        2>/dev/null; then
    echo "install.sh: no headers for $SYSTEM_PYTHON; installing python3-dev" >&2
    apt_install python3-dev
fi

if ! id -u postgres >/dev/null 2>&1; then
    as_root useradd --system --home-dir /var/lib/postgresql --create-home --shell /bin/bash postgres
fi

# The venv is made by Debian's python3 with python3-venv (ensurepip); walsidecar needs 3.11+.
# Debian's pip checks PyPI's certificate against the system's CA bundle (ca-certificates).
if ! "$SYSTEM_PYTHON" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
        [ ! -s /etc/ssl/certs/ca-certificates.crt ]; then
    echo "install.sh: $SYSTEM_PYTHON with venv or the CA certificates missing; installing them" >&2
    apt_install python3 python3-venv ca-certificates
    "$SYSTEM_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        { echo "install.sh: walsidecar needs Python 3.11+; $SYSTEM_PYTHON is $("$SYSTEM_PYTHON" -V 2>&1)" >&2; exit 1; }
fi
PY="$VENV/bin/python"
# Everything installed must be readable by the postgres OS user: PostgreSQL runs
# `restore_command = 'walsidecar restore-wal ...'` as postgres.
umask 022
if ! "$PY" -c 'import pip' 2>/dev/null; then
    echo "install.sh: making the virtual environment $VENV" >&2
    as_root rm -rf "$VENV"
    as_root "$SYSTEM_PYTHON" -m venv "$VENV"
fi

# The package is installed, not linked (no editable install): nothing is read from the checkout at run
# time, so a checkout the postgres user cannot read (e.g. under /root) still serves its restore_command.
# What goes into it: every file of sidecar/ (modules and package data), sql/ and pyproject.toml. Their hash
# is the stamp; the installed copy must also equal the checkout's, file for file.
package_files() {   # NUL-separated, sorted: the files the package is built from
    find sidecar sql csrc pyproject.toml setup.py -type f ! -name '*.pyc' ! -name '*.so' ! -path '*/__pycache__/*' \
        -print0 | LC_ALL=C sort -z
}
content_hash() {   # DIR FIND-ARGS...: the hash of the files under DIR, by relative path and content (not what a build made)
    (cd "$1" && shift && find "$@" -type f ! -name '*.pyc' ! -name '*.so' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
        xargs -0r sha256sum) | sha256sum | cut -d' ' -f1
}
stamp="$VENV/walsidecar-install.stamp"
want="$(content_hash . sidecar sql csrc pyproject.toml setup.py)"
SQL_DIR="$VENV/share/walsidecar/sql"

deps_ok() {   # every requirement in pyproject.toml, with the extras asked for, is installed in a version it allows
    "$PY" -P - pyproject.toml "$EXTRAS" <<'PY' 2>/dev/null
import importlib.metadata as md, sys, tomllib
from pip._vendor.packaging.requirements import Requirement
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
specs = list(project["dependencies"])
for extra in filter(None, sys.argv[2].split(",")):
    specs += project["optional-dependencies"][extra]
for spec in specs:
    req = Requirement(spec)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        try:
            if not req.specifier.contains(md.version(req.name), prereleases=True):
                sys.exit(1)
        except md.PackageNotFoundError:
            sys.exit(1)
PY
}
installed_dir() {   # the installed package's directory, as the venv imports it outside the checkout
    (cd / && env -u PYTHONPATH "$PY" -P -c 'import os, sidecar; print(os.path.dirname(os.path.realpath(sidecar.__file__)))') 2>/dev/null
}
content_ok() {   # the installed package is not the checkout's and holds exactly its files
    local dir f
    dir="$(installed_dir)" && [ -n "$dir" ] && [[ "$dir/" != "$REPO/"* ]] || return 1
    [ "$(content_hash "$(dirname "$dir")" "$(basename "$dir")")" = "$(content_hash . sidecar)" ] || return 1
    for f in sql/*.sql; do cmp -s "$f" "$SQL_DIR/$(basename "$f")" || return 1; done
}
builds_here() {   # the venv's own setuptools builds the package: 61+ reads pyproject.toml, before 70.1 it needs wheel
    "$PY" - <<'PY' 2>/dev/null
import importlib.util, sys, setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
sys.exit(not (v >= (70, 1) or v >= (61, 0) and importlib.util.find_spec("wheel")))
PY
}
installed_ok() {
    local have_sha have_extras
    [ -f "$stamp" ] && read -r have_sha have_extras < "$stamp" || return 1
    [ "$have_sha" = "$want" ] && [[ ",$have_extras," == *",$EXTRAS,"* || -z "$EXTRAS" ]] && deps_ok && content_ok
}
if ! installed_ok; then
    began=$(date +%s.%N)
    # Built from a copy of exactly the hashed files: the checkout gets no build/ or egg-info, and no stale
    # build output can reach the wheel. Built with the venv's setuptools when it can (no download of a
    # build environment each time).
    stage="$(mktemp -d)"
    trap 'rm -rf "$stage"' EXIT
    package_files | tar --null -T - -cf - | tar -xf - --no-same-owner --no-same-permissions -C "$stage"
    chmod 755 "$stage"
    pip=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install -q)
    if ! builds_here; then   # once per venv: the wheel package, which the venv's setuptools may need
        as_root "${pip[@]}" wheel || true
    fi
    if builds_here; then
        pip+=(--no-build-isolation)
    fi
    if deps_ok; then
        # Only walsidecar's own files changed: replace the package alone.
        as_root "${pip[@]}" --no-deps --force-reinstall "$stage"
    else
        as_root env PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip uninstall -q -y walsidecar 2>/dev/null || true
        as_root "${pip[@]}" "$stage${EXTRAS:+[$EXTRAS]}"
    fi
    if ! content_ok; then
        echo "install.sh: the package installed in $VENV is not this checkout's sidecar/ and sql/*.sql;" \
             "a file missing from the wheel needs [tool.setuptools.package-data] or data-files in pyproject.toml" >&2
        exit 1
    fi
    if ! (cd / && "$PY" -P -c 'import sidecar.safekeeper._streamloop' 2>/dev/null); then
        echo "install.sh: note: the compiled stream loop was not built; the safekeepers use the Python reference" >&2
    fi
    # As production runs it: the postgres OS user, outside any checkout.
    if ! out="$(cd / && as_root runuser -u postgres -- env -u PYTHONPATH "$VENV/bin/walsidecar" --help 2>&1)"; then
        echo "install.sh: the postgres OS user cannot run $VENV/bin/walsidecar (its restore_command would fail):" >&2
        echo "$out" | tail -5 >&2
        exit 1
    fi
    printf '%s %s\n' "$want" "$EXTRAS" | as_root tee "$stamp" >/dev/null
    echo "install.sh: installed walsidecar into $VENV in $(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s" >&2
fi
# The system's command is the default venv's: a venv made for testing (WALSIDECAR_VENV) leaves it alone.
if [ "$VENV" = /opt/walsidecar/venv ] && [ "$(readlink /usr/local/bin/walsidecar 2>/dev/null)" != "$VENV/bin/walsidecar" ]; then
    as_root ln -sfn "$VENV/bin/walsidecar" /usr/local/bin/walsidecar
fi
