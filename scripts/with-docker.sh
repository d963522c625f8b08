#!/usr/bin/env bash
# Run a command (the test suite) next to a private Docker engine that holds walsidecar's images:
#
#     bash scripts/with-docker.sh python3 -m pytest ...
#
# As root, with unshare(1), it
#   * installs Debian's docker.io when dockerd is missing;
#   * enters a new network namespace whose only interface is lo (and private mount and PID
#     namespaces, so that nothing it starts can outlive it);
#   * starts its own dockerd there: --bridge=none --iptables=false --ip-masq=false, a private data
#     root, exec root and socket, and HTTP(S)_PROXY at a closed loopback port, so that an accidental
#     image pull fails at once instead of leaving the machine;
#   * builds the images (scripts/build-images.sh) and runs the command in the same namespace: the
#     containers use host networking, so the tests reach them on 127.0.0.1;
#   * removes leftover test containers by label, stops its dockerd by PID, unmounts what dockerd left
#     and removes its directory.
# Not root: an engine that `docker info` already reaches is used as it is.
# If no engine can be had, the command still runs, with WALSIDECAR_DOCKER_UNAVAILABLE set to the
# reason: the container tests are then reported as skipped with it. If the engine runs but the
# images do not build, WALSIDECAR_IMAGES_ERROR makes the container tests fail.
# WALSIDECAR_CONTAINERS=0 skips all of this (container tests skip).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SELF="$(pwd -P)/scripts/with-docker.sh"

log() { echo "with-docker: $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

alive() {   # PID: a live process (a zombie is not)
    local state
    state=$(awk '/^State:/ { print $2 }' "/proc/$1/status" 2>/dev/null)
    [ -n "$state" ] && [ "$state" != Z ]
}

run_without() {
    export WALSIDECAR_DOCKER_UNAVAILABLE="$1"
    log "container tests will be skipped: $1"
    exec "${@:2}"
}

build_images() {
    local t0 rc
    t0=$(now)
    bash scripts/build-images.sh
    rc=$?
    if [ "$rc" -ne 0 ]; then
        export WALSIDECAR_IMAGES_ERROR="scripts/build-images.sh failed (exit $rc); its output is above"
        log "$WALSIDECAR_IMAGES_ERROR"
    else
        log "images built in $(since "$t0") s"
    fi
}

if [ "${1:-}" != --inside ]; then
    [ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
    if [ "${WALSIDECAR_CONTAINERS:-1}" = 0 ]; then
        run_without "container tests turned off (WALSIDECAR_CONTAINERS=0)" "$@"
    fi
    if [ "$(id -u)" -ne 0 ]; then
        if docker info >/dev/null 2>&1; then
            export WALSIDECAR_REQUIRE_CONTAINERS=1
            build_images
            exec "$@"
        fi
        run_without "no Docker engine: not root, so no private one, and \`docker info\` reaches none" "$@"
    fi
    command -v unshare >/dev/null || run_without "no Docker engine: unshare(1) is missing" "$@"
    NS=(--net --mount --propagation private --pid --mount-proc --fork --kill-child)
    unshare "${NS[@]}" -- true 2>/dev/null ||
        run_without "no Docker engine: cannot create private namespaces here (unshare ${NS[*]})" "$@"
    if ! command -v dockerd >/dev/null; then
        log "installing Debian's docker.io"
        t0=$(now)
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
               DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io; } \
               >/tmp/walsidecar-docker-install.log 2>&1; then
            tail -n 20 /tmp/walsidecar-docker-install.log >&2
            run_without "no Docker engine: installing docker.io failed (see /tmp/walsidecar-docker-install.log)" "$@"
        fi
        log "docker.io installed in $(since "$t0") s"
    fi
    # Directories of earlier runs that were killed before their cleanup (their owner is gone).
    for old in /tmp/wsdk.*/owner; do
        [ -f "$old" ] || continue
        dir=${old%/owner}
        if ! alive "$(cat "$old")" && ! grep -q " $dir" /proc/self/mounts; then
            rm -rf "$dir"
        fi
    done
    # A fresh network namespace (only lo, down until we raise it), a private mount namespace and a
    # PID namespace: if this script is killed, every process in it (dockerd, containerd, shims)
    # dies with it and whatever dockerd mounted disappears with the mount namespace.
    export WALSIDECAR_DOCKER_OWNER=$$   # exec keeps the PID: it is unshare's
    exec unshare "${NS[@]}" -- bash "$SELF" --inside "$@"
fi

# ---- inside the private namespaces ----
shift
if command -v ip >/dev/null; then
    ip link set lo up
else
    python3 -c 'import fcntl, socket, struct
s = socket.socket(); req = struct.pack("16sH", b"lo", 0)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req))[1]       # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))'        # SIOCSIFFLAGS |= IFF_UP
fi

DK=$(mktemp -d /tmp/wsdk.XXXXXX)   # short: containerd's socket path lives under the exec root
echo "${WALSIDECAR_DOCKER_OWNER:-}" >"$DK/owner"
unset WALSIDECAR_DOCKER_OWNER
DOCKERD_PID=""
export DOCKER_HOST="unix://$DK/docker.sock"

cleanup() {
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        # Containers the tests left (a killed pytest): testcontainers' label and the suite's own.
        { docker ps -aq --filter label=org.testcontainers=true
          docker ps -aq --filter label=org.walsidecar.tests; } | sort -u | xargs -r docker rm -f -v >/dev/null 2>&1
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 1 200); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$DOCKERD_PID" 2>/dev/null; then
            log "dockerd (pid $DOCKERD_PID) did not stop; killing it"
            kill -KILL "$DOCKERD_PID" 2>/dev/null
        fi
    fi
    # dockerd's own containerd, if dockerd could not stop it.
    if [ -f "$DK/x/containerd/containerd.pid" ]; then
        local cpid
        cpid=$(cat "$DK/x/containerd/containerd.pid")
        [ -n "$cpid" ] && kill -0 "$cpid" 2>/dev/null && kill -KILL "$cpid" 2>/dev/null
    fi
    # e.g. exec-root/netns/default and overlay mounts. Never rm -rf over a live mount.
    grep -o " $DK[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    if grep -q " $DK" /proc/self/mounts; then
        log "mounts under $DK remain; leaving it in place"
    else
        rm -rf "$DK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo '{}' >"$DK/daemon.json"   # ignore any /etc/docker/daemon.json
t0=$(now)
HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
https_proxy=http://127.0.0.1:9 NO_PROXY= no_proxy= \
    dockerd --config-file "$DK/daemon.json" --data-root "$DK/data" --exec-root "$DK/x" \
        --pidfile "$DK/dockerd.pid" -H "$DOCKER_HOST" \
        --bridge=none --iptables=false --ip-masq=false --log-level=warn >"$DK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 1 300); do
    docker version >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.1
done
if ! docker version >/dev/null 2>&1; then
    reason="no Docker engine: dockerd did not start: $(grep -v '^$' "$DK/dockerd.log" | tail -n 3 | tr '\n' ' ')"
    export WALSIDECAR_DOCKER_UNAVAILABLE="$reason"
    log "container tests will be skipped: $reason"
else
    log "private dockerd (pid $DOCKERD_PID) ready in $(since "$t0") s at $DOCKER_HOST"
    export WALSIDECAR_REQUIRE_CONTAINERS=1
    build_images
fi
"$@"
rc=$?
exit "$rc"
