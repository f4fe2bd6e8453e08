#!/bin/bash
# PostgreSQL (the programs in $PGBIN), started the way the official `postgres` image's entrypoint documents it,
# for the settings docker-compose.yml uses: POSTGRES_USER, POSTGRES_PASSWORD_FILE, POSTGRES_DB,
# POSTGRES_INITDB_ARGS, POSTGRES_HOST_AUTH_METHOD, and /docker-entrypoint-initdb.d/*.sh run once, on the first
# start of an empty data folder, against a server that listens on its socket only. Then the server runs in the
# foreground as the `postgres` user, listening on every address of the container.
set -euo pipefail
PGBIN="${PGBIN:?the image sets PGBIN, the folder of the PostgreSQL programs}"
export PGDATA="${PGDATA:-/var/lib/postgresql/data}"

if [ "$(id -u)" = 0 ]; then
    install -d -m 0700 -o postgres -g postgres "$PGDATA"
    install -d -m 2775 -o postgres -g postgres /var/run/postgresql
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    POSTGRES_PASSWORD="$(cat "$POSTGRES_PASSWORD_FILE")"
fi
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres entrypoint: no POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE; refusing to start a database without one" >&2
    exit 1
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    # UTF-8, as the official image's (its LANG is en_US.utf8); without a locale initdb would pick SQL_ASCII,
    # where the event store cannot keep a non-ASCII character. POSTGRES_INITDB_ARGS come last and win.
    # shellcheck disable=SC2086  # POSTGRES_INITDB_ARGS is a list of arguments, as in the official image
    "$PGBIN/initdb" --username="$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --no-locale \
        ${POSTGRES_INITDB_ARGS:-} >/dev/null
    rm -f "$pwfile"
    printf '\nhost all all all %s\n' "${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}" >> "$PGDATA/pg_hba.conf"
    "$PGBIN/pg_ctl" -D "$PGDATA" -w -o "-c listen_addresses='' -p 5432 -c unix_socket_directories=/var/run/postgresql" start >/dev/null
    export PGPASSWORD="$POSTGRES_PASSWORD" PGHOST=/var/run/postgresql PGPORT=5432
    if [ "$POSTGRES_DB" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
             -c "CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null
    fi
    for script in /docker-entrypoint-initdb.d/*.sh; do
        [ -e "$script" ] || continue
        echo "postgres entrypoint: running $script" >&2
        bash "$script"
    done
    unset PGPASSWORD
    "$PGBIN/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi

exec "$PGBIN/postgres" -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql "$@"
