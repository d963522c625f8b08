-- walsidecar: undo sql/install.sql on a primary.
--
--   psql -X -v ON_ERROR_STOP=1 -d "$DSN" -f sql/uninstall.sql   (same -v app/slot/role as install)
--   or: walsidecar init-postgres --uninstall --pg-dsn "$DSN"
--
-- Stop `walsidecar start` first: an active slot is not dropped. wal_level, max_wal_senders,
-- max_replication_slots and max_slot_wal_keep_size stay as they are (other replication may
-- rely on them); reset them by hand with ALTER SYSTEM RESET if nothing does.

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
\if :{?standby_name}
\else
\set standby_name :app
\endif
\set ON_ERROR_STOP on
SET client_min_messages = warning;

-- First, so that no commit waits for a sidecar that is going away. A value that also names
-- other standbys is left for the operator to edit.
SELECT 'ALTER SYSTEM RESET synchronous_standby_names'
 WHERE lower(trim(both '"' from current_setting('synchronous_standby_names'))) IN (lower(:'standby_name'), lower(:'app')) \gexec
SELECT pg_reload_conf() AS reloaded;

DROP SCHEMA IF EXISTS walsidecar CASCADE;

SELECT pg_drop_replication_slot(slot_name) AS dropped
  FROM pg_replication_slots
 WHERE slot_name IN (:'slot', :'slot' || '_horizon') AND NOT active;

SELECT format('REVOKE CONNECT ON DATABASE %I FROM %I', current_database(), :'role')
 WHERE :'role' <> '' AND EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec
SELECT format('REVOKE pg_monitor FROM %I', :'role')
 WHERE :'role' <> '' AND EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec
SELECT format('REVOKE pg_signal_backend FROM %I', :'role')
 WHERE :'role' <> '' AND EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec
SELECT format('DROP ROLE %I', :'role')
 WHERE :'role' <> '' AND EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role') \gexec
