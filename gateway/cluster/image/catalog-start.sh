#!/bin/sh
# The catalog image's entry point (catalog.Dockerfile), run as the postgres user: on first start
# (no PG_VERSION in the data volume) initdb makes the cluster with the superuser `sandkernel`,
# its password read from the Docker secret file (never from the environment or a command line),
# scram-sha-256 for every login, local or remote, and the database `sandkernel`; then PostgreSQL
# runs in the foreground on port 5432 of every address of the container. On later starts the
# volume's cluster is used as it is (the password is the one set at initdb: change it with
# ALTER ROLE, then the stack's catalog URL secret).
set -eu
umask 077
: "${PGDATA:=/var/lib/postgresql/data}"
PASSWORD_FILE="${SANDKERNEL_CATALOG_PASSWORD_FILE:-/run/secrets/catalog_password}"
USER_NAME=sandkernel
DATABASE=sandkernel

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ ! -r "$PASSWORD_FILE" ] || [ ! -s "$PASSWORD_FILE" ]; then
        echo "sandkernel-catalog: no readable password in $PASSWORD_FILE: give the service the secret" \
             "sandkernel_catalog_password (uid 999, mode 0400; see \`sandkernel cluster stack\`)" >&2
        exit 2
    fi
    echo "sandkernel-catalog: first start, initdb in $PGDATA"
    initdb --pgdata="$PGDATA" --username="$USER_NAME" --pwfile="$PASSWORD_FILE" --auth=scram-sha-256 \
        --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    # Remote logins (the gateways, from the nodes' addresses): scram-sha-256 only, as local ones.
    printf '%s\n' "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "CREATE DATABASE $DATABASE" | postgres --single -D "$PGDATA" -j postgres >/dev/null
    echo "sandkernel-catalog: database $DATABASE made, owned by $USER_NAME"
fi

exec postgres -D "$PGDATA" -c listen_addresses='*' -c port=5432 -c password_encryption=scram-sha-256 -c jit=off
