#!/usr/bin/env bash
# Demo: bring up a primary + sidecar + 3 safekeepers + a standby with `walsidecar up --standby`, run
# pgbench against it and show pg_stat_replication; then kill -9 the primary under load, run
# `walsidecar failover` and count that every acknowledged transaction is on the new primary.
# Usage: scripts/demo.sh [DIR]
# Env: WALSIDECAR (the executable), SCALE (pgbench -s, default 10), DURATION (seconds, default 30), READY_TIMEOUT (default 120).
# On exit, also on failure or Ctrl-C, it stops what it started. It removes DIR and its log after a run that
# ended well (KEEP=1 keeps them); after a failure it keeps them, says where, and prints the lines of the logs
# that carry the cause (refusals and errors of the standby, the safekeepers, the sidecar and failover).
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
RESUMED_PID=""
WRITER_PIDS=()
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
# The lines that say why a run failed: refusals and errors, not the last lines of a log.
CAUSE='FATAL|ERROR|\[error|\[warning|refus|not stored here|not restored|cannot|failed|stopped:|Traceback'
NOISE='the database system is (starting up|not yet accepting connections|shutting down)|terminating walreceiver process due to administrator command'
show_causes() {
    echo "demo: FAILED; the lines of its logs that carry the cause:" >&2
    local f
    for f in "$DIR/failover.out" "$DIR/standby.log" "$DIR"/safekeeper*.log "$DIR/proposer.log" "$DIR/postgres.log" \
             "$DIR/resumed-sidecar.log" "$UP_LOG"; do
        [ -s "$f" ] || continue
        grep -E "$CAUSE" "$f" | grep -vE "$NOISE" | tail -n 12 | sed "s|^|  ${f##*/}: |" >&2 || true
    done
}
cleanup() {
    local status=$?
    for pid in "${WRITER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    stop_up
    if [ -n "$RESUMED_PID" ]; then
        kill -TERM "$RESUMED_PID" 2>/dev/null || true
        wait "$RESUMED_PID" 2>/dev/null || true
    fi
    if [ "$status" -ne 0 ]; then
        show_causes
        echo "demo: kept $DIR (every process's log is there) and $UP_LOG for a look; remove them when done" >&2
    elif [ "${KEEP:-0}" = 1 ]; then
        echo "demo: kept $DIR and $UP_LOG (KEEP=1)"
    else
        rm -rf "$DIR" "$UP_LOG"
        echo "demo: removed $DIR and $UP_LOG (KEEP=1 keeps them)"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "demo: starting walsidecar up --standby --dir $DIR (log: $UP_LOG)"
# Background jobs of a script start with SIGINT ignored; restore it so SIGINT can stop `up`.
env --default-signal=INT "$WALSIDECAR" up --standby --dir "$DIR" >>"$UP_LOG" 2>&1 </dev/null &
UP_PID=$!

deadline=$((SECONDS + READY_TIMEOUT))
until [ -s "$DIR/ready" ]; do
    if ! kill -0 "$UP_PID" 2>/dev/null; then
        echo "demo: walsidecar up exited before it was ready" >&2
        exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "demo: timed out after ${READY_TIMEOUT}s waiting for $DIR/ready" >&2
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

# ---- failover: the primary's machine is gone; every acknowledged commit must survive ----------
STANDBY_DSN="$(sed -n 's/^standby_dsn = "\(.*\)"$/\1/p' "$DIR/walsidecar.toml")"
pg_tool psql -X -q "$DSN" -c "CREATE TABLE demo_ledger (id bigint PRIMARY KEY)"
# Writers insert ids one commit at a time and record each id whose COMMIT returned: the ledger of
# acknowledged transactions.
writer() {
    local w=$1 i=0
    while :; do
        i=$((i + 1))
        pg_tool psql -X -q "$DSN" -c "INSERT INTO demo_ledger VALUES ($((w * 1000000 + i)))" >/dev/null 2>&1 || return 0
        echo $((w * 1000000 + i)) >>"$DIR/acked.$w"
    done
}
: >"$DIR/acked.1"; : >"$DIR/acked.2"
writer 1 & WRITER_PIDS+=($!)
writer 2 & WRITER_PIDS+=($!)
echo "demo: pgbench -c 4 and 2 ledger writers against the primary; kill -9 of the primary in 5s"
pg_tool pgbench -c 4 -j 2 -T 600 "$DSN" >"$DIR/pgbench-failover.log" 2>&1 &
PGBENCH_PID=$!
sleep 5
PRIMARY_PID="$(head -n 1 "$DIR/pg/postmaster.pid")"
KILLED_AT=$(date +%s.%N)
kill -9 "$PRIMARY_PID"
echo "demo: kill -9 $PRIMARY_PID (the primary's postmaster)"
wait "$PGBENCH_PID" 2>/dev/null || true
for pid in "${WRITER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
WRITER_PIDS=()
ACKED=$(cat "$DIR"/acked.* | wc -l)
echo "demo: $ACKED ledger transactions were acknowledged before the primary died"

echo "demo: walsidecar failover --config $DIR/walsidecar.toml"
"$WALSIDECAR" failover --config "$DIR/walsidecar.toml" | tee "$DIR/failover.out"
RESUME="$(sed -n 's/^    walsidecar start /start /p' "$DIR/failover.out")"
echo "demo: resuming: walsidecar $RESUME"
eval "exec env --default-signal=INT \"\$WALSIDECAR\" $RESUME" >>"$DIR/resumed-sidecar.log" 2>&1 </dev/null &
RESUMED_PID=$!
deadline=$((SECONDS + READY_TIMEOUT))
until pg_tool psql -X -q "$STANDBY_DSN" -c "INSERT INTO demo_ledger VALUES (0)" >/dev/null 2>&1; do
    kill -0 "$RESUMED_PID" 2>/dev/null || { echo "demo: the sidecar on the new primary exited" >&2; exit 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "demo: no commit acknowledged on the new primary within ${READY_TIMEOUT}s" >&2; exit 1; }
    sleep 0.05
done
RESUMED_AT=$(date +%s.%N)
echo "demo: first acknowledged commit on the new primary $(awk "BEGIN { printf \"%.2f\", $RESUMED_AT - $KILLED_AT }")s after the kill -9"

cat "$DIR"/acked.* >"$DIR/acked.all"
chmod 0644 "$DIR/acked.all"
MISSING=$(pg_tool psql -X -q -At "$STANDBY_DSN" \
    -c "CREATE TEMP TABLE acked (id bigint)" -c "\\copy acked FROM '$DIR/acked.all'" \
    -c "SELECT count(*) FROM acked a WHERE NOT EXISTS (SELECT 1 FROM demo_ledger l WHERE l.id = a.id)" | tail -n 1)
PRESENT=$((ACKED - MISSING))
echo "demo: $PRESENT of $ACKED acknowledged ledger transactions are on the new primary ($MISSING missing)"
pg_tool psql -X "$STANDBY_DSN" -c "SELECT application_name, state, sync_state, flush_lsn FROM pg_stat_replication"
[ "$MISSING" -eq 0 ] || { echo "demo: LOST acknowledged transactions" >&2; exit 1; }

stop_up
echo "demo: done"
