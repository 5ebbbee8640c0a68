# Sourced by the dead-letter benches: `fill_dead_letters BINARY SIZE` fills
# the dead-letter queue of the vhost in AMQP_URL and the index of the
# schema in IDEM_SCHEMA (both made by the caller, migrated here) with SIZE
# dead letters, by the worker: one event in a thousand (at least one) that
# failed (a trigger fails every transaction, --max-attempts 1), published
# first, and bodies that are not events for the rest (the worker
# dead-letters those in batches, where each failed event costs transactions
# of its own). Sets `failing` to the number of failed events. Needs `psql`
# and `ready QUEUE` of the caller.
fill_dead_letters() {
  local binary=$1 size=$2 worker filled
  "$binary" migrate >/dev/null
  psql <<SQL
CREATE FUNCTION $IDEM_SCHEMA.fail() RETURNS trigger LANGUAGE plpgsql
  AS \$\$BEGIN RAISE EXCEPTION 'failing on purpose for the dead-letter bench, order %', NEW.order_id; END\$\$;
CREATE TRIGGER fail BEFORE INSERT OR UPDATE ON $IDEM_SCHEMA.user_points
  FOR EACH ROW EXECUTE FUNCTION $IDEM_SCHEMA.fail();
SQL
  # The worker declares the topology, then dead-letters every event.
  "$binary" worker --max-attempts 1 &
  worker=$!
  until [ -n "$(ready points.payment-succeeded.dlq)" ]; do kill -0 "$worker"; sleep 1; done
  filled=$(date +%s)
  failing=$(((size + 999) / 1000))
  "$binary" publish --count "$failing" --duplicate-ratio 0 --orders 1000 --seed 1 >/dev/null
  seq -f 'not an event %.0f' 1 "$((size - failing))" |
    "$binary" publish --file - --allow-invalid --window 1024 >/dev/null
  until [ "$(ready points.payment-succeeded.dlq)" = "$size" ]; do
    kill -0 "$worker" || { echo "the worker died" >&2; exit 1; }
    sleep 1
  done
  kill -TERM "$worker"
  wait "$worker"
  echo "$size dead letters made in $(($(date +%s) - filled)) s" >&2
}
