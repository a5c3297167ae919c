#!/usr/bin/env bash
# A private PostgreSQL server for the tests, on 127.0.0.1 only.
#   source ci/postgres.sh; postgres_start   -> exports SUPERLINEAR_OPS_TEST_POSTGRES_URL
#   postgres_stop                           -> stops the server and removes its data
PG_PORT="${PG_PORT:-55432}"
PG_DIR=""

postgres_install() {
    if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
        echo "installing PostgreSQL from Debian's packages..."
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
    fi
    PG_BIN="$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")"
}

postgres_start() {
    postgres_install
    local user=postgres
    id "$user" >/dev/null 2>&1 || useradd --system --no-create-home "$user"
    PG_DIR="$(mktemp -d /tmp/superlinear-ops-pg.XXXXXX)"
    chown "$user" "$PG_DIR"
    runuser -u "$user" -- "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres --auth=trust >/dev/null
    runuser -u "$user" -- "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w \
        -o "-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories=$PG_DIR" start >/dev/null
    runuser -u "$user" -- "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres superlinear_ops_test
    export SUPERLINEAR_OPS_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/superlinear_ops_test"
    echo "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') running on 127.0.0.1:$PG_PORT"
}

postgres_stop() {
    if [ -n "$PG_DIR" ] && [ -d "$PG_DIR/data" ]; then
        runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast -w stop >/dev/null || true
        rm -rf "$PG_DIR"
    fi
}
