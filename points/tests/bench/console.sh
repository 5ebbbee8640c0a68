#!/usr/bin/env bash
# How long each of the console's pages takes with SIZE dead letters in the
# queue: a vhost and a schema of its own on the local servers, filled by
# the worker (fill-dead-letters.sh says how: one failed event in a
# thousand, bodies that are not events for the rest, so two failure
# groups), then `idem console` on a free port, each page asked ROUNDS
# times with curl (the median printed) and checked to say what it must.
# Both are removed at the end.
#
#   points/tests/bench/console.sh BINARY [SIZE]      (default size: 1000000)
#
# ROUNDS (default 5); KEEP=1 leaves the vhost and schema
# (idem-console-bench-SIZE, idem_console_bench_SIZE) to look into.
set -euo pipefail
binary=$(realpath "$1")
size=${2:-1000000}
rounds=${ROUNDS:-5}
export RUST_LOG=error DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -q -X -v ON_ERROR_STOP=1 "$DATABASE_URL" "$@"; }
# shellcheck source=fill-dead-letters.sh
. "$(dirname "$0")/fill-dead-letters.sh"

vhost=idem-console-bench-$size
export IDEM_SCHEMA=idem_console_bench_$size
export AMQP_URL="amqp://guest:guest@127.0.0.1:5672/$vhost"
export IDEM_CONSOLE_TOKEN=console-bench-token
console=
clean() {
  [ -z "$console" ] || kill -TERM "$console" 2>/dev/null || true
  if [ -z "${KEEP:-}" ]; then
    rabbitmqctl -q delete_vhost "$vhost" || true
    psql -c "DROP SCHEMA IF EXISTS $IDEM_SCHEMA CASCADE" || true
  fi
}
trap clean EXIT
ready() { # queue
  rabbitmqctl -q list_queues -p "$vhost" --no-table-headers name messages_ready |
    awk -v queue="$1" '$1 == queue { print $2 }'
}

rabbitmqctl -q add_vhost "$vhost"
rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*'
fill_dead_letters "$binary" "$size"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$binary" console --http-addr "127.0.0.1:$port" &
console=$!
base=http://127.0.0.1:$port
until curl -fs -o /dev/null "$base/"; do kill -0 "$console"; sleep 0.2; done

# Seconds a page takes, the median of $rounds; its answer must hold
# `expect`, or the bench stops. curl's further arguments follow the URL.
timed() { # expect url [curl arguments...]
  local expect=$1 url=$2 times=() out
  shift 2
  for _ in $(seq "$rounds"); do
    out=$(curl -fsS -w '\n%{time_total}' "$@" "$url") || { echo "$url failed" >&2; exit 1; }
    grep -qF -- "$expect" <<<"$out" || { echo "$url: expected '$expect' in: ${out:0:2000}" >&2; exit 1; }
    times+=("$(tail -n 1 <<<"$out")")
  done
  printf '%s\n' "${times[@]}" | sort -n | awk '{ t[NR] = $1 } END { printf "%.0f", 1000 * t[int((NR + 1) / 2)] }'
}

big=$(psql -tA -c "SELECT group_id FROM $IDEM_SCHEMA.mq_dead_letter_group ORDER BY letters DESC LIMIT 1")
small=$(psql -tA -c "SELECT group_id FROM $IDEM_SCHEMA.mq_dead_letter_group ORDER BY letters LIMIT 1")
failing_id=$(psql -tA -c "SELECT event_id FROM $IDEM_SCHEMA.mq_dead_letter WHERE event_id IS NOT NULL LIMIT 1")
invalid_key=$(psql -tA -c "SELECT letter_key FROM $IDEM_SCHEMA.mq_dead_letter WHERE invalid ORDER BY dead_at LIMIT 1")
middle=$(psql -tA -c "SELECT (extract(epoch FROM dead_at) * 1e6)::bigint || '|' || letter_key FROM $IDEM_SCHEMA.mq_dead_letter WHERE md5(fingerprint)::uuid = '$big' ORDER BY dead_at DESC, letter_key DESC OFFSET $((size / 2)) LIMIT 1")
enc() { python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$1"; }
invalid=$((size - failing))
bearer=(-H "Authorization: Bearer $IDEM_CONSOLE_TOKEN")
form=(-H 'Content-Type: application/x-www-form-urlencoded')

printf '%-58s %8s\n' "page ($size dead letters)" "ms"
measure() { # what expect url [curl arguments...]
  local what=$1 ms
  shift
  ms=$(timed "$@")
  printf '%-58s %8s\n' "$what" "$ms"
}
measure "overview" "$size" "$base/"
measure "failure groups" "$invalid" "$base/groups"
measure "the big group, first page" "$invalid" "$base/groups/$big"
measure "the big group, a page half-way down" "Next page" "$base/groups/$big?after=$(enc "$middle")"
measure "the failed events' group, by event id" "$failing_id" "$base/groups/$small?event_id=$(enc "$failing_id")"
measure "the big group, by time (its last hour)" "$invalid" "$base/groups/$big?from=$(date -u -d '-1 hour' +%Y-%m-%dT%H:%M:%S)"
measure "the big group, error text found at once" "leaves it" "$base/groups/$big?error=not+a+JSON+object"
measure "one letter (body and headers)" "not an event" "$base/letter?key=$(enc "$invalid_key")"
measure "dry run: replay the big group" "$invalid" "$base/actions/preview" "${bearer[@]}" "${form[@]}" --data "action=discard&group=$big"
measure "dry run: replay the failed events' group" "$failing" "$base/actions/preview" "${bearer[@]}" "${form[@]}" --data "action=replay&group=$small"
measure "audit" "Audit" "$base/audit"
# A search that no letter matches looks at 100,000 letters a page, and
# says so; the dry run of an action on a search counts every letter it
# matches.
if [ "$invalid" -gt 100000 ]; then none="looked at 100000 letters"; else none="No letter matches"; fi
measure "the big group, error text no letter has" "$none" "$base/groups/$big?error=no+such+text"
measure "dry run: replay what an error search matches (counts all)" "$invalid" "$base/actions/preview" "${bearer[@]}" "${form[@]}" --data "action=discard&group=$big&error=not+a+JSON+object"
