#!/usr/bin/env bash
# How long `check` takes on COUNT events (default 10000), every run: the
# points handler (`idem check`, a tally: one statement a transaction) and
# examples/stock (`stock check`, the general path: claim, lock, update,
# commit), each on events generated here from a fixed seed, against the
# local servers. Prints each check's report and its wall time; exits 1 if
# a check does not pass.
#
#   cargo build --release --bins --examples
#   points/tests/bench/check.sh target/release [COUNT]
set -euo pipefail
release=$(realpath "$1")
count=${2:-10000}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 - "$work" "$count" <<'EOF'
import json, random, sys
work, count = sys.argv[1], int(sys.argv[2])
random.seed(11)
with open(f"{work}/payments.jsonl", "w") as f:
    for n in range(count):
        f.write(json.dumps({"eventId": f"payment-{n}", "orderId": f"order-{random.randrange(500)}",
                            "points": random.randrange(1, 100)}) + "\n")
with open(f"{work}/reservations.jsonl", "w") as f:
    for n in range(count):
        f.write(json.dumps({"eventId": f"reservation-{n}", "sku": f"SKU-{random.randrange(50)}",
                            "quantity": random.randrange(1, 5)}) + "\n")
with open(f"{work}/stock.sql", "w") as f:
    f.write("INSERT INTO stock SELECT 'SKU-' || n, 1000000 FROM generate_series(0, 49) n;\n")
EOF

timed() { # name, command…
  local name=$1 started ended
  shift
  started=$(date +%s.%N)
  "$@"
  ended=$(date +%s.%N)
  printf '%s: %.1f s for %s events\n\n' "$name" "$(echo "$ended - $started" | bc)" "$count"
}

timed "idem check" "$release/idem" check --events "$work/payments.jsonl" \
  --invariant "SELECT order_id FROM user_points WHERE points < 0"
timed "stock check" "$release/examples/stock" check --events "$work/reservations.jsonl" \
  --setup "$work/stock.sql" --invariant "SELECT sku FROM stock WHERE available < 0"
