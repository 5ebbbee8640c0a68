//! The flags of `publish`.

use std::path::PathBuf;

use clap::Args;

use super::{AmqpArgs, RouteArgs, WaitArgs};
use crate::broker::PublishOptions;
use crate::commands::publish::PublishConfig;
use crate::vars;

/// `publish`: the events of `--file`, or of the service's own flags.
#[derive(Debug, Args)]
pub(crate) struct PublishArgs<P: Args> {
    /// The events: a file of JSON lines, one body a line (`-` for standard
    /// input), or a file `dlq discard --to` wrote; as `check --events`
    /// reads them.
    #[arg(long)]
    pub(crate) file: Option<PathBuf>,
    /// With --file: send the lines the handler does not decode as they are
    /// (they are dead-lettered: to exercise that path) instead of refusing
    /// the whole file.
    #[arg(long, requires = "file")]
    pub(crate) allow_invalid: bool,
    /// Most publishes awaiting their confirm at once.
    #[arg(
        long,
        env = vars::CONFIRM_WINDOW,
        default_value_t = PublishOptions::DEFAULT_WINDOW as u32,
        value_parser = clap::value_parser!(u32).range(1..=65_535)
    )]
    pub(crate) window: u32,
    #[command(flatten)]
    pub(crate) own: P,
    #[command(flatten)]
    pub(crate) amqp: AmqpArgs,
    #[command(flatten)]
    pub(crate) route: RouteArgs,
    #[command(flatten)]
    pub(crate) wait: WaitArgs,
}

impl<P: Args> PublishArgs<P> {
    /// Where and how `publish` sends.
    pub(crate) fn config(&self) -> PublishConfig {
        PublishConfig {
            amqp: self.amqp.config(),
            exchange: self.route.exchange().to_owned(),
            routing_key: self.route.routing_key().to_owned(),
            options: PublishOptions {
                window: self.window as usize,
                patience: self.wait.startup_timeout(),
            },
        }
    }
}
