#!/bin/sh
# Initialise $PGDATA on first start, then exec postgres in the foreground.
#
#   walsidecar-pg-entrypoint [postgres] [-c name=value ...]   run the server (extra args go to postgres)
#   walsidecar-pg-entrypoint init                              only initialise $PGDATA, then exit
#   walsidecar-pg-entrypoint COMMAND ...                       run any other command (psql, pg_waldump, ...)
#
# Environment (names as in the official postgres image):
#   PGDATA             data directory (default /var/lib/postgresql/data)
#   PGPORT             port (default 5432)
#   PGLISTEN           listen_addresses (default '*'; 127.0.0.1 keeps a host-network container on loopback)
#   POSTGRES_USER      superuser (default postgres)
#   POSTGRES_PASSWORD  its password; scram-sha-256 for TCP connections. Unset: trust (tests only)
#   POSTGRES_DB        a database to create besides "postgres"
#   POSTGRES_INITDB_ARGS  extra initdb arguments, e.g. --no-sync
# Replication connections are allowed from anywhere with the same method as other connections:
# the walsidecar proposer streams WAL over the replication protocol.
set -eu
BIN=/usr/lib/postgresql/15/bin
: "${PGDATA:=/var/lib/postgresql/data}" "${PGPORT:=5432}" "${PGLISTEN:=*}" "${POSTGRES_USER:=postgres}"
export PGDATA PGPORT

case "${1:-}" in
    init) mode=init; shift ;;
    postgres) mode=run; shift ;;
    "" | -*) mode=run ;;
    *) exec "$@" ;;
esac

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -n "${POSTGRES_PASSWORD:-}" ]; then
        auth=scram-sha-256
        # The password reaches initdb on stdin: no file to write and remove.
        printf '%s\n' "$POSTGRES_PASSWORD" | "$BIN/initdb" -D "$PGDATA" -U "$POSTGRES_USER" -E UTF8 \
            --locale=C.UTF-8 --auth-local=trust --auth-host=$auth --pwfile=/dev/stdin --no-instructions \
            ${POSTGRES_INITDB_ARGS:-} >/dev/null
    else
        auth=trust
        "$BIN/initdb" -D "$PGDATA" -U "$POSTGRES_USER" -E UTF8 --locale=C.UTF-8 --auth=trust \
            --no-instructions ${POSTGRES_INITDB_ARGS:-} >/dev/null
    fi
    {
        echo "host all all all $auth"
        echo "host replication all all $auth"
    } >>"$PGDATA/pg_hba.conf"
    if [ -n "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != postgres ]; then
        echo "CREATE DATABASE \"$POSTGRES_DB\";" |
            "$BIN/postgres" --single -D "$PGDATA" -c fsync=off -c listen_addresses= postgres >/dev/null
    fi
fi
[ "$mode" = init ] && exit 0

sockdir=/run/postgresql
[ -d "$sockdir" ] && [ -w "$sockdir" ] || sockdir=/tmp
exec "$BIN/postgres" -D "$PGDATA" -p "$PGPORT" -c listen_addresses="$PGLISTEN" \
    -c unix_socket_directories="$sockdir" "$@"
