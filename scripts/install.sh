#!/usr/bin/env bash
# Install what walsidecar needs on Debian 12: PostgreSQL 15 server/client, iproute2 (network namespaces
# for chaos partitions) and the package itself in its own virtual environment, /opt/walsidecar/venv,
# made from the system Python (/usr/bin/python3, which refuses `pip install` into the system: PEP 668);
# /usr/local/bin/walsidecar links to the venv's command.
#
#   bash scripts/install.sh            the package with its test and analytics extras (editable: the
#                                      checkout's code) and a Java 17 runtime for the analytics (PySpark)
#   WALSIDECAR_EXTRAS= bash scripts/install.sh    the core only: services and operator commands
#
# Env: WALSIDECAR_VENV (default /opt/walsidecar/venv), WALSIDECAR_EXTRAS (default test,analytics).
# Idempotent; when everything is already present it only runs a few quick checks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd -P)"

VENV="${WALSIDECAR_VENV:-/opt/walsidecar/venv}"
EXTRAS="${WALSIDECAR_EXTRAS-test,analytics}"
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

# A C compiler builds scripts/bench.py's walsidecar-floor stand-in (scripts/floor_safekeeper.c).
if ! command -v gcc >/dev/null 2>&1; then
    echo "install.sh: no C compiler; installing gcc" >&2
    apt_install gcc libc6-dev
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
if ! "$PY" -c 'import pip' 2>/dev/null; then
    echo "install.sh: making the virtual environment $VENV" >&2
    as_root rm -rf "$VENV"
    as_root "$SYSTEM_PYTHON" -m venv "$VENV"
fi

# Reinstall only when this checkout is not the installed one, its build files changed or extras are missing.
# The stamp holds the hash of pyproject.toml (the editable install's build file) and the extras installed
# from this checkout.
stamp="$VENV/walsidecar-install-$(printf '%s' "$REPO" | sha256sum | cut -c1-16)"
want="$(sha256sum < pyproject.toml | cut -d' ' -f1)"
installed_ok() {
    local have_sha have_extras
    [ -f "$stamp" ] && read -r have_sha have_extras < "$stamp" || return 1
    [ "$have_sha" = "$want" ] && [[ ",$have_extras," == *",$EXTRAS,"* || -z "$EXTRAS" ]] || return 1
    # -P: the checkout in the working directory must not stand in for the installed package.
    "$PY" -P - "$REPO" "$EXTRAS" <<'PY' 2>/dev/null
# Every requirement of walsidecar and of the extras asked for is installed, in a version it allows.
import importlib.metadata as md, os, sys
from pip._vendor.packaging.requirements import Requirement
extras = [""] + [e for e in sys.argv[2].split(",") if e]
for spec in md.requires("walsidecar") or []:
    req = Requirement(spec)
    if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
        if not req.specifier.contains(md.version(req.name), prereleases=True):
            sys.exit(1)
import sidecar
sys.exit(0 if os.path.realpath(sidecar.__file__).startswith(sys.argv[1] + os.sep) else 1)
PY
}
if ! installed_ok; then
    as_root env PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
    printf '%s %s\n' "$want" "$EXTRAS" | as_root tee "$stamp" >/dev/null
fi
if [ "$(readlink /usr/local/bin/walsidecar 2>/dev/null)" != "$VENV/bin/walsidecar" ]; then
    as_root ln -sfn "$VENV/bin/walsidecar" /usr/local/bin/walsidecar
fi
