#!/usr/bin/env bash
# Demo: bring up a primary + sidecar + 3 safekeepers with `walsidecar up`, run pgbench
# against it and show pg_stat_replication.  Usage: scripts/demo.sh [DIR]
# Env: WALSIDECAR (the executable), SCALE (pgbench -s, default 10), DURATION (seconds, default 30), READY_TIMEOUT (default 120).
# On exit, also on failure or Ctrl-C, it stops what it started and removes DIR and its log (KEEP=1 keeps them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DIR="${1:-/tmp/walsidecar-demo}"
SCALE="${SCALE:-10}"
DURATION="${DURATION:-30}"
READY_TIMEOUT="${READY_TIMEOUT:-120}"
PG_BIN=/usr/lib/postgresql/15/bin
UP_LOG="${DIR%/}-up.log"

# The core package only: the demo needs neither the analytics (PySpark, Java) nor the test tools.
WALSIDECAR_EXTRAS= bash scripts/install.sh
WALSIDECAR="${WALSIDECAR:-${WALSIDECAR_VENV:-/opt/walsidecar/venv}/bin/walsidecar}"

# Client tools run as the postgres OS user when we are root (the server refuses root anyway).
pg_tool() {
    if [ "$(id -u)" -eq 0 ]; then
        (cd / && runuser -u postgres -- "$PG_BIN/$1" "${@:2}")
    else
        "$PG_BIN/$1" "${@:2}"
    fi
}

rm -rf "$DIR"
: > "$UP_LOG"

UP_PID=""
stop_up() {
    [ -n "$UP_PID" ] || return 0
    if kill -0 "$UP_PID" 2>/dev/null; then
        echo "demo: stopping walsidecar up (pid $UP_PID)"
        kill -INT "$UP_PID" 2>/dev/null || true
        for _ in $(seq 1 600); do
            kill -0 "$UP_PID" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$UP_PID" 2>/dev/null; then
            echo "demo: walsidecar up did not exit after SIGINT; sending SIGKILL" >&2
            kill -KILL "$UP_PID" 2>/dev/null || true
        fi
    fi
    wait "$UP_PID" 2>/dev/null || true
    UP_PID=""
}
cleanup() {
    local status=$?
    stop_up
    if [ "${KEEP:-0}" = 1 ]; then
        echo "demo: kept $DIR and $UP_LOG (KEEP=1)"
    else
        [ "$status" -eq 0 ] || [ ! -s "$UP_LOG" ] || { echo "demo: the end of $UP_LOG:" >&2; tail -n 20 "$UP_LOG" >&2; }
        rm -rf "$DIR" "$UP_LOG"
        echo "demo: removed $DIR and $UP_LOG"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "demo: starting walsidecar up --dir $DIR (log: $UP_LOG)"
# Background jobs of a script start with SIGINT ignored; restore it so SIGINT can stop `up`.
env --default-signal=INT "$WALSIDECAR" up --dir "$DIR" >>"$UP_LOG" 2>&1 </dev/null &
UP_PID=$!

deadline=$((SECONDS + READY_TIMEOUT))
until [ -s "$DIR/ready" ]; do
    if ! kill -0 "$UP_PID" 2>/dev/null; then
        echo "demo: walsidecar up exited before it was ready; its log:" >&2
        tail -n 50 "$UP_LOG" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "demo: timed out after ${READY_TIMEOUT}s waiting for $DIR/ready; log tail:" >&2
        tail -n 50 "$UP_LOG" >&2
        exit 1
    fi
    sleep 0.2
done
DSN="$(head -n 1 "$DIR/ready")"
echo "demo: ready; primary DSN: $DSN"
# `up`'s banner (its stdout is in the log): how to connect, status, check and ctl while the demo runs.
sed -n '/^walsidecar is up/,/^Press Ctrl-C/p' "$UP_LOG" | sed '$d'


echo "demo: pgbench -i -s $SCALE"
pg_tool pgbench -i -s "$SCALE" -q "$DSN"

echo "demo: pgbench -c 8 -j 2 -T $DURATION (every commit waits for 2 of 3 safekeepers)"
BENCH_OUT="$(pg_tool pgbench -c 8 -j 2 -T "$DURATION" "$DSN")"
printf '%s\n' "$BENCH_OUT" | grep -E '^(number of transactions actually processed|latency average|tps)'
QUORUM_TPS="$(printf '%s\n' "$BENCH_OUT" | sed -n 's/^tps = \([0-9.]*\).*/\1/p')"

# The same run with commits that wait only for the local flush: what quorum durability costs.
echo "demo: the same pgbench with synchronous_commit=local (no wait for the safekeepers)"
LOCAL_OUT="$(PGOPTIONS='-c synchronous_commit=local' pg_tool pgbench -c 8 -j 2 -T "$DURATION" "$DSN")"
printf '%s\n' "$LOCAL_OUT" | grep -E '^(latency average|tps)'
LOCAL_TPS="$(printf '%s\n' "$LOCAL_OUT" | sed -n 's/^tps = \([0-9.]*\).*/\1/p')"
echo "demo: TPS quorum-durable ${QUORUM_TPS} vs local-only ${LOCAL_TPS}"

echo "demo: pg_stat_replication"
pg_tool psql -X "$DSN" -c "SELECT application_name, state, sync_state, sent_lsn, flush_lsn, replay_lsn FROM pg_stat_replication"

stop_up
echo "demo: done"
