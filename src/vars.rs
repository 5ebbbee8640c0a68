//! The environment variables the `idem` binary reads, in one place: its
//! flags fall back to them, and whatever starts `idem` as a child process
//! (the bench, the tests) sets them.

use crate::broker::Topology;

/// `--amqp-url`.
pub const AMQP_URL: &str = "AMQP_URL";
/// `--amqp-ca-file`.
pub const AMQP_CA_FILE: &str = "IDEM_AMQP_CA_FILE";
/// `--database-url`.
pub const DATABASE_URL: &str = "DATABASE_URL";
/// `--database-ca-file`.
pub const DATABASE_CA_FILE: &str = "IDEM_DATABASE_CA_FILE";
/// `lab --redis-url`.
pub const REDIS_URL: &str = "REDIS_URL";
/// `--schema`.
pub const SCHEMA: &str = "IDEM_SCHEMA";
/// `--lock-timeout`.
pub const LOCK_TIMEOUT: &str = "IDEM_LOCK_TIMEOUT";
/// `--statement-timeout`.
pub const STATEMENT_TIMEOUT: &str = "IDEM_STATEMENT_TIMEOUT";
/// `--startup-timeout`.
pub const STARTUP_TIMEOUT: &str = "IDEM_STARTUP_TIMEOUT";
/// `--consumer-group`.
pub const CONSUMER_GROUP: &str = "IDEM_CONSUMER_GROUP";
/// `--log-format`.
pub const LOG_FORMAT: &str = "IDEM_LOG_FORMAT";
/// `--exchange`.
pub const EXCHANGE: &str = "IDEM_EXCHANGE";
/// `--routing-key`.
pub const ROUTING_KEY: &str = "IDEM_ROUTING_KEY";
/// `--queue`.
pub const QUEUE: &str = "IDEM_QUEUE";
/// `--dead-letter-exchange`.
pub const DEAD_LETTER_EXCHANGE: &str = "IDEM_DEAD_LETTER_EXCHANGE";
/// `--dead-letter-queue`.
pub const DEAD_LETTER_QUEUE: &str = "IDEM_DEAD_LETTER_QUEUE";
/// `--delivery-limit`.
pub const DELIVERY_LIMIT: &str = "IDEM_DELIVERY_LIMIT";
/// `--retry-delays`.
pub const RETRY_DELAYS: &str = "IDEM_RETRY_DELAYS";
/// `worker --retention`.
pub const RETENTION: &str = "IDEM_RETENTION";
/// `worker --prune-interval`.
pub const PRUNE_INTERVAL: &str = "IDEM_PRUNE_INTERVAL";
/// `--min-retention`.
pub const MIN_RETENTION: &str = "IDEM_MIN_RETENTION";
/// `--epoch-length`.
pub const EPOCH_LENGTH: &str = "IDEM_EPOCH_LENGTH";
/// `worker --epoch-records`.
pub const EPOCH_RECORDS: &str = "IDEM_EPOCH_RECORDS";
/// `worker --filter-memory-mib`.
pub const FILTER_MEMORY_MIB: &str = "IDEM_FILTER_MEMORY_MIB";
/// `--quorum-size`.
pub const QUORUM_SIZE: &str = "IDEM_QUORUM_SIZE";
/// The slot queues of an ordered queue (`--slots`).
pub const SLOTS: &str = "IDEM_SLOTS";
/// `worker --max-attempts`.
pub const MAX_ATTEMPTS: &str = "IDEM_MAX_ATTEMPTS";
/// `worker --mode`.
pub const MODE: &str = "IDEM_MODE";
/// `worker --prefetch`.
pub const PREFETCH: &str = "IDEM_PREFETCH";
/// `worker --batch-size`.
pub const BATCH_SIZE: &str = "IDEM_BATCH_SIZE";
/// `worker --batch-wait`.
pub const BATCH_WAIT: &str = "IDEM_BATCH_WAIT";
/// `worker --max-in-flight`.
pub const MAX_IN_FLIGHT: &str = "IDEM_MAX_IN_FLIGHT";
/// `worker --pool-size`.
pub const POOL_SIZE: &str = "IDEM_POOL_SIZE";
/// `worker --lanes`.
pub const LANES: &str = "IDEM_LANES";
/// `worker --ack-after-standbys`.
pub const ACK_AFTER_STANDBYS: &str = "IDEM_ACK_AFTER_STANDBYS";
/// `worker --max-body-bytes`.
pub const MAX_BODY_BYTES: &str = "IDEM_MAX_BODY_BYTES";
/// `worker --max-parked-per-key`.
pub const MAX_PARKED_PER_KEY: &str = "IDEM_MAX_PARKED_PER_KEY";
/// `worker --max-parked-keys`.
pub const MAX_PARKED_KEYS: &str = "IDEM_MAX_PARKED_KEYS";
/// `--kept-body-bytes` of `worker`.
pub const KEPT_BODY_BYTES: &str = "IDEM_KEPT_BODY_BYTES";
/// `worker --shutdown-timeout`.
pub const SHUTDOWN_TIMEOUT: &str = "IDEM_SHUTDOWN_TIMEOUT";
/// `worker --http-addr`.
pub const HTTP_ADDR: &str = "IDEM_HTTP_ADDR";
/// `worker --summary-interval`.
pub const SUMMARY_INTERVAL: &str = "IDEM_SUMMARY_INTERVAL";
/// `idem worker --credits-exchange`: send `points.credited` there, through the outbox.
pub const CREDITS_EXCHANGE: &str = "IDEM_CREDITS_EXCHANGE";
/// `idem worker --no-relay`: leave the outbox to `idem relay`.
pub const NO_RELAY: &str = "IDEM_NO_RELAY";
/// `publish --window`.
pub const CONFIRM_WINDOW: &str = "IDEM_CONFIRM_WINDOW";

/// The variables that point an `idem` child process at `topology`.
pub fn topology(topology: &Topology) -> Vec<(&'static str, String)> {
    vec![
        (EXCHANGE, topology.exchange.clone()),
        (ROUTING_KEY, topology.routing_key.clone()),
        (QUEUE, topology.queue.clone()),
        (DEAD_LETTER_EXCHANGE, topology.dead_letter_exchange.clone()),
        (DEAD_LETTER_QUEUE, topology.dead_letter_queue.clone()),
        (DELIVERY_LIMIT, topology.delivery_limit.to_string()),
        (
            RETRY_DELAYS,
            crate::duration::format_list(topology.retry.delays()),
        ),
        (QUORUM_SIZE, topology.quorum_size.to_string()),
        (SLOTS, topology.slots.to_string()),
    ]
}
/// The token the console's actions need (`console`, `worker --console`).
pub const CONSOLE_TOKEN: &str = "IDEM_CONSOLE_TOKEN";
/// `--console-token-file`.
pub const CONSOLE_TOKEN_FILE: &str = "IDEM_CONSOLE_TOKEN_FILE";
/// `--allow-edits` of `console` and `worker --console`.
pub const CONSOLE_ALLOW_EDITS: &str = "IDEM_CONSOLE_ALLOW_EDITS";
/// `--tls-cert` of `console`.
pub const CONSOLE_TLS_CERT: &str = "IDEM_CONSOLE_TLS_CERT";
/// `--tls-key` of `console`.
pub const CONSOLE_TLS_KEY: &str = "IDEM_CONSOLE_TLS_KEY";
/// `--console-addr` of `console`.
pub const CONSOLE_ADDR: &str = "IDEM_CONSOLE_ADDR";
