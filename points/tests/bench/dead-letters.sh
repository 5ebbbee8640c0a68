#!/usr/bin/env bash
# What `idem status`, `idem dlq summary`, `idem prune` and `idem dlq sync`
# cost as the dead-letter queue grows: each size gets a vhost and a schema
# of its own on the local servers, filled with that many dead letters by
# the worker (fill-dead-letters.sh says how). Each
# command is timed ROUNDS times (median printed) against it; last, once, a
# replay of the failed events (`--error`) from among all the letters,
# checked to have moved exactly those to the work queue. Both are removed
# at the end.
#
#   points/tests/bench/dead-letters.sh BINARY [SIZE...]      (default sizes: 10 1000000)
#
# ROUNDS (default 3) sets the rounds; KEEP=1 leaves the vhosts and schemas
# (idem-dead-letter-bench-SIZE, idem_dead_letter_bench_SIZE) to look into.
set -euo pipefail
binary=$(realpath "$1")
shift
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(10 1000000)
rounds=${ROUNDS:-3}
export RUST_LOG=error DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -q -X -v ON_ERROR_STOP=1 "$DATABASE_URL" "$@"; }
# shellcheck source=fill-dead-letters.sh
. "$(dirname "$0")/fill-dead-letters.sh"

vhosts=() schemas=()
clean() {
  for vhost in "${vhosts[@]}"; do rabbitmqctl -q delete_vhost "$vhost" || true; done
  for schema in "${schemas[@]}"; do psql -c "DROP SCHEMA IF EXISTS $schema CASCADE" || true; done
}
[ -n "${KEEP:-}" ] || trap clean EXIT

ready() { # queue
  rabbitmqctl -q list_queues -p "$vhost" --no-table-headers name messages_ready |
    awk -v queue="$1" '$1 == queue { print $2 }'
}
dead_letters() { ready points.payment-succeeded.dlq; }

# Seconds `idem ARGS…` takes, the median of $rounds runs; its output must
# say what `expect` says, or the bench stops.
timed() {
  local expect=$1 times=() start end out
  shift
  for _ in $(seq "$rounds"); do
    start=$(date +%s.%N)
    out=$("$binary" "$@" 2>&1) || { echo "idem $*: $out" >&2; exit 1; }
    end=$(date +%s.%N)
    grep -qF -- "$expect" <<<"$out" || { echo "idem $*: expected '$expect' in: $out" >&2; exit 1; }
    times+=("$(echo "$end - $start" | bc -l)")
  done
  printf '%s\n' "${times[@]}" | sort -n | awk '{ t[NR] = $1 } END { printf "%.2f", t[int((NR + 1) / 2)] }'
}

columns='%12s %10s %10s %18s %10s %8s %18s\n'
printf "$columns" "dead letters" "status s" "summary s" "summary --error s" "prune s" "sync s" "replay --error s"
for size in "${sizes[@]}"; do
  vhost=idem-dead-letter-bench-$size
  export IDEM_SCHEMA=idem_dead_letter_bench_$size
  export AMQP_URL="amqp://guest:guest@127.0.0.1:5672/$vhost"
  vhosts+=("$vhost") schemas+=("$IDEM_SCHEMA")
  rabbitmqctl -q add_vhost "$vhost"
  rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*'
  fill_dead_letters "$binary" "$size"

  status=$(timed "dead letters       rejected $size (by the index" status)
  summary=$(timed "$size of $size dead-lettered message(s)" dlq summary)
  error="failing on purpose for the dead-letter bench"
  filtered=$(timed "$failing of $size dead-lettered message(s)" dlq summary --error="$error")
  prune=$(timed "removed" prune --older-than 8d)
  sync=$(timed "synced" dlq sync)
  # The statistics lag behind the queues by seconds.
  for _ in $(seq 60); do [ "$(dead_letters)" = "$size" ] && break; sleep 1; done
  [ "$(dead_letters)" = "$size" ] || { echo "the dead-letter queue holds $(dead_letters) letters, not $size" >&2; exit 1; }
  matching=$(psql -tA -c "SELECT coalesce(sum(copies), 0) FROM $IDEM_SCHEMA.mq_dead_letter WHERE last_error LIKE '%$error%'")
  [ "$matching" = "$failing" ] || { echo "the index holds $matching failed events, not $failing" >&2; exit 1; }
  start=$(date +%s.%N)
  out=$("$binary" dlq replay --error="$error" 2>&1) || { echo "idem dlq replay: $out" >&2; exit 1; }
  replay=$(printf '%.2f' "$(echo "$(date +%s.%N) - $start" | bc -l)")
  grep -qF "replayed $matching message(s)" <<<"$out" || { echo "expected $matching replays in: $out" >&2; exit 1; }
  # The statistics lag behind the queues by seconds.
  for _ in $(seq 60); do
    [ "$(dead_letters)" = "$((size - matching))" ] && [ "$(ready points.payment-succeeded)" = "$matching" ] && break
    sleep 1
  done
  [ "$(dead_letters)" = "$((size - matching))" ] || { echo "the replay left $(dead_letters) letters, not $((size - matching))" >&2; exit 1; }
  [ "$(ready points.payment-succeeded)" = "$matching" ] || { echo "the replay sent $(ready points.payment-succeeded), not $matching" >&2; exit 1; }
  printf "$columns" "$size" "$status" "$summary" "$filtered" "$prune" "$sync" "$replay ($matching)"
done
