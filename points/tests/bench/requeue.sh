#!/usr/bin/env bash
# Replays per second of `idem requeue`, for two builds of idem in one run.
#
#   points/tests/bench/requeue.sh OLD_BINARY NEW_BINARY [ROUNDS]
#
# Dead-letters N events (default 5000; a trigger makes every transaction
# fail, --max-attempts 1), then alternates: time one binary's `requeue` of
# all of them, dead-letter them again, time the other's. Uses a vhost and a
# schema of its own on the local servers, and removes both at the end.
set -euo pipefail
old=$(realpath "$1") new=$(realpath "$2") rounds=${3:-2}
N=${N:-5000}
vhost=idem-requeue-bench
export IDEM_SCHEMA=idem_requeue_bench RUST_LOG=error
export AMQP_URL="amqp://guest:guest@127.0.0.1:5672/$vhost"
export DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -q -X -v ON_ERROR_STOP=1 "$DATABASE_URL" "$@"; }

rabbitmqctl -q add_vhost "$vhost"
clean() {
  rabbitmqctl -q delete_vhost "$vhost" || true
  psql -c "DROP SCHEMA IF EXISTS $IDEM_SCHEMA CASCADE" || true
}
trap clean EXIT
rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*'
"$new" migrate >/dev/null
psql <<SQL
CREATE FUNCTION $IDEM_SCHEMA.fail() RETURNS trigger LANGUAGE plpgsql
  AS \$\$BEGIN RAISE EXCEPTION 'failing on purpose for the requeue bench'; END\$\$;
CREATE TRIGGER fail BEFORE INSERT OR UPDATE ON $IDEM_SCHEMA.user_points
  FOR EACH ROW EXECUTE FUNCTION $IDEM_SCHEMA.fail();
SQL

dead_letters() {
  rabbitmqctl -q list_queues -p "$vhost" --no-table-headers name messages_ready |
    awk '$1 == "points.payment-succeeded.dlq" { print $2 }'
}
# Runs a worker until all N messages are in the dead-letter queue.
dead_letter_all() {
  "$new" worker --max-attempts 1 &
  local worker=$!
  until [ "$(dead_letters)" = "$N" ]; do
    kill -0 "$worker" || { echo "the worker died" >&2; exit 1; }
    sleep 1
  done
  kill -TERM "$worker"
  wait "$worker"
}

# The worker declares the topology; publish needs the exchange.
"$new" worker --max-attempts 1 &
worker=$!
until [ -n "$(dead_letters)" ]; do sleep 1; done
kill -TERM "$worker"
wait "$worker"
"$new" publish --count "$N" --duplicate-ratio 0 --orders 100 --seed 1 >/dev/null
dead_letter_all

for round in $(seq "$rounds"); do
  for which in old new; do
    binary=${!which}
    start=$(date +%s.%N)
    "$binary" requeue >/dev/null
    end=$(date +%s.%N)
    rate=$(echo "$N / ($end - $start)" | bc -l)
    printf 'round %s, %s: %.0f replays/s\n' "$round" "$which" "$rate"
    dead_letter_all
  done
done
