-- walsidecar: prepare a PostgreSQL 15+ primary. Idempotent: run it again after a restart.
--
--   psql -X -v ON_ERROR_STOP=1 -d "$DSN" -f sql/install.sql            (defaults below)
--   psql ... -v app=walsidecar -v slot=walsidecar -v role=walsidecar \
--            -v max_slot_wal_keep_size=10GB -v sync=auto -f sql/install.sql
--   or: walsidecar init-postgres --pg-dsn "$DSN"   (runs this file and says what needs a restart)
--
-- Needs a superuser (ALTER SYSTEM, CREATE ROLE). It never lowers a setting and never replaces
-- a synchronous_standby_names someone else set; `walsidecar check` reports what is left to do.

\if :{?app}
\else
\set app walsidecar
\endif
\if :{?slot}
\else
\set slot walsidecar
\endif
\if :{?role}
\else
\set role walsidecar
\endif
\if :{?max_slot_wal_keep_size}
\else
\set max_slot_wal_keep_size 10GB
\endif
-- on: name the sidecar in synchronous_standby_names now; off: never; auto: only if it already
-- streams (before that, every commit would wait for a sidecar that is not there).
\if :{?sync}
\else
\set sync auto
\endif
\if :{?standby_name}
\else
\set standby_name :app
\endif
\set ON_ERROR_STOP on
SET client_min_messages = warning;

-- 1. The sidecar's role: replication connections, slots, and pg_stat_activity of every role.
SELECT format('CREATE ROLE %I LOGIN REPLICATION', :'role')
 WHERE :'role' <> '' AND NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec
SELECT format('ALTER ROLE %I REPLICATION', :'role')
 WHERE :'role' <> '' AND EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role' AND NOT rolreplication) \gexec
SELECT format('GRANT pg_monitor TO %I', :'role') WHERE :'role' <> '' \gexec
-- Terminating commits that wait in SyncRep (--commit-wait terminate-after, a fenced-out primary).
SELECT format('GRANT pg_signal_backend TO %I', :'role') WHERE :'role' <> '' \gexec
SELECT format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), :'role') WHERE :'role' <> '' \gexec

-- 2. Settings. wal_level, max_wal_senders and max_replication_slots need a restart.
SELECT 'ALTER SYSTEM SET wal_level = replica' WHERE current_setting('wal_level') = 'minimal' \gexec
SELECT 'ALTER SYSTEM SET max_wal_senders = 10' WHERE current_setting('max_wal_senders')::int < 10 \gexec
SELECT 'ALTER SYSTEM SET max_replication_slots = 10' WHERE current_setting('max_replication_slots')::int < 10 \gexec
-- Bounds the WAL the primary keeps for a safekeeper that stays down (the default keeps it forever).
SELECT format('ALTER SYSTEM SET max_slot_wal_keep_size = %L', :'max_slot_wal_keep_size')
 WHERE current_setting('max_slot_wal_keep_size') = '-1' \gexec
SELECT format('ALTER SYSTEM SET synchronous_standby_names = %L', :'standby_name')
 WHERE current_setting('synchronous_standby_names') = ''
   AND (:'sync' = 'on'
        OR (:'sync' = 'auto' AND EXISTS (SELECT 1 FROM pg_stat_replication
                                          WHERE application_name = :'app' AND state = 'streaming'))) \gexec
SELECT pg_reload_conf() AS reloaded;

-- 3. Views an operator can query from psql with no sidecar tooling at hand.
CREATE SCHEMA IF NOT EXISTS walsidecar;
COMMENT ON SCHEMA walsidecar IS 'walsidecar monitoring views (sql/install.sql)';

CREATE OR REPLACE VIEW walsidecar.replication AS
SELECT r.application_name, r.pid, r.client_addr, r.state, r.sync_state, r.sync_priority,
       pg_current_wal_flush_lsn() AS primary_flush_lsn,
       r.sent_lsn, r.write_lsn, r.flush_lsn, r.replay_lsn,
       pg_wal_lsn_diff(pg_current_wal_flush_lsn(), r.sent_lsn)::bigint AS sent_lag_bytes,
       pg_wal_lsn_diff(pg_current_wal_flush_lsn(), r.write_lsn)::bigint AS write_lag_bytes,
       pg_wal_lsn_diff(pg_current_wal_flush_lsn(), r.flush_lsn)::bigint AS flush_lag_bytes,
       pg_wal_lsn_diff(pg_current_wal_flush_lsn(), r.replay_lsn)::bigint AS replay_lag_bytes,
       r.write_lag, r.flush_lag, r.replay_lag, r.reply_time, clock_timestamp() - r.reply_time AS reply_age
  FROM pg_stat_replication r
 WHERE r.application_name = :'app';
COMMENT ON VIEW walsidecar.replication IS
  'The sidecar''s pg_stat_replication row: write = any safekeeper, flush = a quorum, replay = every safekeeper; lags in bytes behind the primary''s flush position';

CREATE OR REPLACE VIEW walsidecar.slots AS
SELECT s.slot_name,
       CASE WHEN s.slot_name = :'slot' THEN 'stream' ELSE 'horizon' END AS purpose,
       s.active, s.active_pid, s.restart_lsn, s.wal_status, s.safe_wal_size,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_bytes
  FROM pg_replication_slots s
 WHERE s.slot_name IN (:'slot', :'slot' || '_horizon');
COMMENT ON VIEW walsidecar.slots IS
  'The sidecar''s slots: stream (follows the quorum) and horizon (WAL every safekeeper has, at most --primary-retention below the commit position); both dropped by uninstall.sql; wal_status other than reserved means WAL is at risk';

CREATE OR REPLACE VIEW walsidecar.waiting_commits AS
SELECT a.pid, a.usename, a.datname, a.application_name, a.client_addr, a.backend_xid,
       a.xact_start, a.query_start, clock_timestamp() - a.query_start AS waiting, a.query
  FROM pg_stat_activity a
 WHERE a.wait_event_type = 'IPC' AND a.wait_event = 'SyncRep'
 ORDER BY a.query_start;
COMMENT ON VIEW walsidecar.waiting_commits IS
  'Backends whose commit waits for the safekeeper quorum (wait_event SyncRep); waiting counts from the start of the statement that commits';

CREATE OR REPLACE VIEW walsidecar.status AS
SELECT coalesce(r.state = 'streaming' AND r.sync_state IN ('sync', 'quorum'), false) AS protecting_commits,
       r.state, r.sync_state, current_setting('synchronous_standby_names') AS synchronous_standby_names,
       pg_current_wal_flush_lsn() AS primary_flush_lsn, r.flush_lsn AS quorum_flush_lsn, r.flush_lag_bytes,
       (SELECT count(*) FROM walsidecar.waiting_commits) AS commits_waiting,
       (SELECT max(waiting) FROM walsidecar.waiting_commits) AS oldest_wait,
       (SELECT wal_status FROM walsidecar.slots WHERE purpose = 'stream') AS slot_wal_status
  FROM (SELECT 1) AS one LEFT JOIN walsidecar.replication r ON true;
COMMENT ON VIEW walsidecar.status IS 'One row: is the sidecar protecting commits, and what waits';

GRANT USAGE ON SCHEMA walsidecar TO pg_monitor;
GRANT SELECT ON ALL TABLES IN SCHEMA walsidecar TO pg_monitor;

-- 4. The slots (the sidecar creates them too). Once created they keep WAL until the sidecar
-- streams, bounded by max_slot_wal_keep_size. Skipped until a restart allows slots.
SELECT pg_create_physical_replication_slot(name, true)
  FROM unnest(ARRAY[:'slot', :'slot' || '_horizon']) AS name
 WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = name)
   AND current_setting('wal_level') <> 'minimal'
   AND current_setting('max_replication_slots')::int
       >= (SELECT count(*) FROM pg_replication_slots) + 2;
