# Shared by scripts/test and deploy/local/fleet: a throwaway PostgreSQL cluster.
#
# start_postgres: finds Debian's server binaries (installing the `postgresql` package when absent,
# which needs root), starts a cluster as the `postgres` user on a free loopback port in a fresh
# temp folder, and sets PG_DIR and PG_URL (and PG_BIN, PG_OPTS and PG_RUN_AS, for a caller that
# stops and starts it again as it was, as scripts/chaos does). stop_postgres removes it.
# Tests run it with fsync off (nothing to lose); PG_DURABLE=1 keeps PostgreSQL's durable defaults,
# as the benchmark's comparison with production commits needs.

find_pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/pg_ctl" ] && [ -x "$d/initdb" ] && [ -x "$d/postgres" ]; then
      echo "$d"
      return 0
    fi
  done
  return 1
}

start_postgres() {
  local bin
  if ! bin=$(find_pg_bin); then
    echo "postgres: no PostgreSQL server binaries; installing Debian's postgresql package" >&2
    if [ "$(id -u)" -ne 0 ]; then
      echo "postgres: need root to apt-get install postgresql (or set ORCA_PUSH_TEST_POSTGRES_URL)" >&2
      exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    bin=$(find_pg_bin) || { echo "postgres: postgresql installed but no server binaries found" >&2; exit 1; }
  fi

  local run_as=()
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    run_as=(runuser -u postgres --)
  fi

  PG_DIR=$(mktemp -d /tmp/orca-push-pg.XXXXXX)
  chmod 755 "$PG_DIR"
  [ "$(id -u)" -eq 0 ] && chown postgres "$PG_DIR"

  "${run_as[@]}" "$bin/initdb" -D "$PG_DIR/data" -U postgres --auth=trust --no-sync -E UTF8 >"$PG_DIR/initdb.log" 2>&1 \
    || { cat "$PG_DIR/initdb.log" >&2; exit 1; }

  # A free port: one nothing listens on, then let postgres bind it (retry on the rare race). In
  # bash alone: a minimal Debian has no python3.
  local port attempt
  local durability="-c fsync=off"
  [ "${PG_DURABLE:-0}" = 1 ] && durability="-c fsync=on -c synchronous_commit=on"
  for attempt in 1 2 3 4 5; do
    port=$(free_port)
    PG_OPTS="-p $port -k $PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=400 $durability -c shared_buffers=128MB"
    if "${run_as[@]}" "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 30 \
        -o "$PG_OPTS" start >/dev/null; then
      PG_URL="postgres://postgres@127.0.0.1:$port/postgres"
      PG_BIN=$bin
      PG_RUN_AS="${run_as[*]}"
      export PG_URL PG_BIN PG_OPTS PG_RUN_AS
      echo "PostgreSQL on 127.0.0.1:$port ($PG_DIR)" >&2
      return 0
    fi
  done
  cat "$PG_DIR/server.log" >&2
  echo "postgres: could not start PostgreSQL" >&2
  exit 1
}

# A loopback port in 20000-59999 that nothing answers on.
free_port() {
  local candidate _
  for _ in $(seq 1 100); do
    candidate=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$candidate") 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "postgres: no free loopback port found" >&2
  return 1
}

stop_postgres() {
  if [ -n "${PG_DIR:-}" ] && [ -d "$PG_DIR/data" ]; then
    local bin run_as=()
    bin=$(find_pg_bin) || true
    [ "$(id -u)" -eq 0 ] && run_as=(runuser -u postgres --)
    [ -n "$bin" ] && "${run_as[@]}" "$bin/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
  fi
}

