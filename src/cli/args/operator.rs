//! The flags of the operator's commands: `dlq`, `requeue`, `status`,
//! `prune` and `reconcile`.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::TypedValueParser;
use clap::{Args, Subcommand};

use super::{
    AmqpArgs, AttemptsArgs, DatabaseArgs, DeadLetterQueueArgs, Delays, GroupArgs, QueueArgs,
    RouteArgs, SettingError, Wait, WaitArgs,
};
use crate::broker::Topology;
use crate::commands::prune::PruneSettings;
use crate::commands::reconcile::ReconcileConfig;
use crate::dlq::{Action, DlqConfig, View};
use crate::retry::RetryPolicy;
use crate::store::Filter;
use crate::target::Target;
use crate::vars;

/// `reconcile`.
#[derive(Debug, Args)]
pub(crate) struct ReconcileArgs {
    /// The upstream's events: JSON lines (one body per line) or, for a name
    /// ending in .csv, CSV with a header whose columns are the body's fields.
    #[arg(long)]
    pub(crate) export: PathBuf,
    /// Also write a report here: a JSON line per event (its status, the last
    /// error) and per line that is none (why), then one per key whose
    /// points differ.
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    /// Publish the missing events again, with confirms (safe: the worker
    /// applies each once).
    #[arg(long)]
    pub(crate) republish_missing: bool,
    /// Events compared per query.
    #[arg(long, default_value_t = ReconcileConfig::DEFAULT_CHUNK, value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    pub(crate) chunk: usize,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
    #[command(flatten)]
    pub(crate) route: RouteArgs,
}

impl ReconcileArgs {
    /// Settings of `reconcile`.
    pub(crate) fn config(&self) -> Result<ReconcileConfig, SettingError> {
        Ok(ReconcileConfig {
            dlq: self.target.config(Filter::default(), None)?,
            // Where the missing events are published again, and where the
            // dead letters are; no queue of the group is looked at.
            topology: Topology {
                dead_letter_queue: self.target.dead_letters.dead_letter_queue.clone(),
                ..Topology::for_queue("").bound_to(&self.route.exchange, &self.route.routing_key)
            },
            export: self.export.clone(),
            report: self.report.clone(),
            republish_missing: self.republish_missing,
            chunk: self.chunk,
        })
    }
}

/// How the consume records are kept: the safety rule of a retention, and
/// the epochs.
#[derive(Debug, Args)]
#[command(next_help_heading = "Retention")]
pub(crate) struct RetentionArgs {
    /// Refuse a retention window shorter than this: a message that comes
    /// back (a retry, the broker's redelivery, an operator's replay, a
    /// recovery) after its event's record is removed applies again.
    #[arg(long, env = vars::MIN_RETENTION, default_value_t = Wait(PruneSettings::DEFAULT_MIN_RETENTION))]
    pub(crate) min_retention: Wait,
    /// How long an epoch of the consume records takes claims before the
    /// next is opened: longer means fewer epochs for a claim to look into,
    /// shorter a smaller one to insert into, and a finer removal
    /// [default: half the window].
    #[arg(long, env = vars::EPOCH_LENGTH)]
    pub(crate) epoch_length: Option<Wait>,
}

/// `prune`.
#[derive(Debug, Args)]
pub(crate) struct PruneArgs {
    /// Remove what is older than this (e.g. 7d): a closed epoch of consume
    /// records once even its newest record is older, and the ledger and
    /// sent outbox rows last written before it.
    #[arg(long)]
    pub(crate) older_than: Wait,
    /// Change nothing: say what would be removed, and what is kept and why.
    #[arg(long)]
    pub(crate) dry_run: bool,
    #[command(flatten)]
    pub(crate) retention: RetentionArgs,
    /// The group's retry delays (as the worker's --retry-delays): the
    /// window must be longer than a message takes through them all.
    #[arg(
        long,
        env = vars::RETRY_DELAYS,
        default_value_t = Delays(RetryPolicy::DEFAULT_DELAYS.to_vec())
    )]
    pub(crate) retry_delays: Delays,
    #[command(flatten)]
    pub(crate) attempts: AttemptsArgs,
    /// The group's work queue: while messages wait there and no worker
    /// consumes it, no epoch is dropped.
    #[arg(long, env = vars::QUEUE, help_heading = "Topology")]
    pub(crate) queue: String,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

impl PruneArgs {
    /// Settings of `prune`.
    pub(crate) fn config(&self) -> Result<PruneSettings, SettingError> {
        let topology = Topology {
            retry: self
                .attempts
                .applied(RetryPolicy::default().with_delays(self.retry_delays.0.clone())),
            ..Topology::for_queue(&self.queue)
        };
        Ok(PruneSettings {
            dry_run: self.dry_run,
            ..self
                .retention
                .settings(self.target.target(topology)?, self.older_than.0)
        })
    }
}

impl RetentionArgs {
    /// A prune's settings over `target`, for a window of `older_than`.
    pub(super) fn settings(&self, target: Target, older_than: Duration) -> PruneSettings {
        PruneSettings {
            target,
            older_than,
            min_retention: self.min_retention.0,
            epoch_length: PruneSettings::epoch_length(
                older_than,
                self.epoch_length.as_ref().map(|length| length.0),
            ),
            lock_timeout: PruneSettings::DEFAULT_LOCK_TIMEOUT,
            dry_run: false,
        }
    }
}

/// The dead-letter queue of a consumer group, and its failure ledger.
#[derive(Debug, Args)]
pub(crate) struct DlqTargetArgs {
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) dead_letters: DeadLetterQueueArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// `requeue`.
#[derive(Debug, Args)]
pub(crate) struct RequeueArgs {
    /// Replay at most this many messages.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
    /// List what would be replayed (event, reason, count, time); move nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

/// `dlq`.
#[derive(Debug, Args)]
pub(crate) struct DlqArgs {
    #[command(subcommand)]
    pub(crate) action: DlqAction,
}

/// What to do with the dead letters that match.
#[derive(Debug, Subcommand)]
pub(crate) enum DlqAction {
    /// Count them per reason and per last error, oldest and newest; move nothing.
    Summary(FilterArgs),
    /// List them, each with what a replay would do and the ledger's count
    /// and last error; move nothing.
    List(FilterArgs),
    /// Send them back to the queue each died in, with a fresh budget;
    /// bodies the handler cannot decode stay, unless --include-invalid.
    Replay(ReplayArgs),
    /// Remove them, each written first to a JSON-lines file that is synced
    /// before the message is acked.
    Discard(DiscardArgs),
    /// Set the dead-letter index to what the queue holds (browsing every
    /// letter and giving it back): for letters that came by other ways than
    /// idem's worker, or after an upgrade; summary, status and prune say
    /// when the queue holds letters the index does not count, and name this.
    Sync(DlqTargetArgs),
}

/// Which dead letters (every filter given must hold), and where they are.
#[derive(Debug, Args)]
pub(crate) struct FilterArgs {
    /// The reason of the latest death: rejected, delivery_limit, expired…
    #[arg(long)]
    pub(crate) reason: Option<String>,
    /// This event only.
    #[arg(long)]
    pub(crate) event_id: Option<String>,
    /// Part of the failure ledger's last error (or of why the body is invalid).
    #[arg(long)]
    pub(crate) error: Option<String>,
    /// Died longer ago than this (e.g. 1h).
    #[arg(long)]
    pub(crate) older_than: Option<Wait>,
    /// Died within this (e.g. 10m).
    #[arg(long)]
    pub(crate) newer_than: Option<Wait>,
    /// Only bodies the handler cannot decode, which can never apply.
    #[arg(long)]
    pub(crate) invalid: bool,
    /// The failure group (as the console shows it): letters whose last
    /// error, numbers, ids and quoted values taken out, is the group's.
    #[arg(long, value_name = "ID")]
    pub(crate) group: Option<uuid::Uuid>,
    /// Act on at most this many of those that match.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
    /// Look at every letter in the queue; by default a pass stops once it
    /// found as many matches as the dead-letter index counts, when the
    /// index counts every letter in the queue.
    #[arg(long)]
    pub(crate) every_letter: bool,
    #[command(flatten)]
    pub(crate) target: DlqTargetArgs,
}

/// `dlq replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// At most this many replays per second.
    #[arg(long, value_parser = parse_rate)]
    pub(crate) rate: Option<f64>,
    /// Replay bodies the handler cannot decode too (they die again at once).
    #[arg(long)]
    pub(crate) include_invalid: bool,
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
}

/// `dlq discard`.
#[derive(Debug, Args)]
pub(crate) struct DiscardArgs {
    /// The JSON-lines file the discarded messages are appended to.
    #[arg(long)]
    pub(crate) to: PathBuf,
    #[command(flatten)]
    pub(crate) filter: FilterArgs,
}

/// `status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) queues: QueueArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

impl StatusArgs {
    /// Settings of `status`.
    pub(crate) fn config(&self) -> Result<Target, SettingError> {
        Ok(Target::new(
            self.amqp.config(),
            self.database.config(2),
            self.queues.looked_at(),
            self.group.consumer_group()?,
            self.wait.startup_timeout.0,
        ))
    }
}

/// `parked`.
#[derive(Debug, Args)]
pub(crate) struct ParkedArgs {
    #[command(subcommand)]
    pub(crate) action: ParkedCommand,
}

/// The servers and the group a `parked` command works on.
#[derive(Debug, Args)]
pub(crate) struct ParkedOn {
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) database: DatabaseArgs,
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

/// What `parked` does.
#[derive(Debug, Subcommand)]
pub(crate) enum ParkedCommand {
    /// The parked keys, oldest first: each with its head, why it failed and
    /// how many events it holds.
    List {
        /// Only this key.
        #[arg(long)]
        key: Option<String>,
        /// At most this many keys.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[command(flatten)]
        on: ParkedOn,
    },
    /// Let a key's parked events apply, in their order, without its
    /// dead-lettered head (discard the head with `dlq discard` first, or
    /// replay it instead to apply it before them).
    Release {
        /// The ordering key.
        key: String,
        /// Say what it would do; do nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        on: ParkedOn,
    },
    /// Remove a key and its parked events, each written first to a
    /// JSON-lines file (appended, synced before anything is removed).
    Discard {
        /// The ordering key.
        key: String,
        /// The file the events go to.
        #[arg(long)]
        to: PathBuf,
        /// Say what it would do; do nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        on: ParkedOn,
    },
}

impl ParkedArgs {
    /// The servers and the group, on `topology`'s queues, and the action.
    pub(crate) fn config(
        &self,
        topology: Topology,
    ) -> Result<(Target, crate::commands::parked::ParkedAction), SettingError> {
        use crate::commands::parked::ParkedAction;
        let (on, action) = match &self.action {
            ParkedCommand::List { key, limit, on } => (
                on,
                ParkedAction::List {
                    key: key.clone(),
                    limit: (*limit).max(1),
                },
            ),
            ParkedCommand::Release { key, dry_run, on } => (
                on,
                ParkedAction::Release {
                    key: key.clone(),
                    dry_run: *dry_run,
                },
            ),
            ParkedCommand::Discard {
                key,
                to,
                dry_run,
                on,
            } => (
                on,
                ParkedAction::Discard {
                    key: key.clone(),
                    file: to.clone(),
                    dry_run: *dry_run,
                },
            ),
        };
        let target = Target::new(
            on.amqp.config(),
            on.database.config(2),
            topology,
            on.group.consumer_group()?,
            on.wait.startup_timeout.0,
        );
        Ok((target, action))
    }
}

impl DlqTargetArgs {
    /// The servers, the group and its dead-letter queue, with `topology`'s
    /// other names.
    pub(super) fn target(&self, topology: Topology) -> Result<Target, SettingError> {
        Ok(Target::new(
            self.amqp.config(),
            self.database.config(2),
            Topology {
                dead_letter_queue: self.dead_letters.dead_letter_queue.clone(),
                ..topology
            },
            self.group.consumer_group()?,
            self.wait.startup_timeout.0,
        ))
    }

    /// The dead-letter queue, with `filter` and `limit`. A pass needs no
    /// other queue: a replay goes to the queue each letter died in.
    pub(super) fn config(
        &self,
        filter: Filter,
        limit: Option<usize>,
    ) -> Result<DlqConfig, SettingError> {
        let topology = Topology::for_queue(&self.dead_letters.dead_letter_queue);
        Ok(DlqConfig {
            filter,
            limit,
            ..DlqConfig::new(self.target(topology)?)
        })
    }
}

impl RequeueArgs {
    /// Settings of `requeue`: every dead letter, invalid ones too.
    pub(crate) fn config(&self) -> Result<(DlqConfig, Action, View), SettingError> {
        let action = if self.dry_run {
            Action::List
        } else {
            Action::Replay {
                rate: None,
                include_invalid: true,
            }
        };
        let config = self.target.config(Filter::default(), self.limit)?;
        Ok((config, action, View::Listing))
    }
}

impl DlqArgs {
    /// Settings of `dlq`.
    pub(crate) fn config(&self) -> Result<(DlqConfig, Action, View), SettingError> {
        let (filter, action, view) = match &self.action {
            DlqAction::Sync(target) => {
                return Ok((
                    target.config(Filter::default(), None)?,
                    Action::Sync,
                    View::Listing,
                ));
            }
            DlqAction::Summary(filter) => (filter, Action::List, View::Summary),
            DlqAction::List(filter) => (filter, Action::List, View::Listing),
            DlqAction::Replay(replay) => (
                &replay.filter,
                Action::Replay {
                    rate: replay.rate,
                    include_invalid: replay.include_invalid,
                },
                View::Listing,
            ),
            DlqAction::Discard(discard) => (
                &discard.filter,
                Action::Discard {
                    file: discard.to.clone(),
                },
                View::Listing,
            ),
        };
        let config = DlqConfig {
            every_letter: filter.every_letter,
            ..filter.target.config(
                Filter {
                    reason: filter.reason.clone(),
                    event_id: filter.event_id.clone(),
                    error: filter.error.clone(),
                    older_than: filter.older_than.map(|wait| wait.0),
                    newer_than: filter.newer_than.map(|wait| wait.0),
                    invalid: filter.invalid,
                    group: filter.group,
                    keys: Vec::new(),
                },
                filter.limit,
            )?
        };
        Ok((config, action, view))
    }
}

pub(super) fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate > 0.0 && rate.is_finite() => Ok(rate),
        _ => Err(format!(
            "'{text}' is not a rate above 0 (messages per second)"
        )),
    }
}
