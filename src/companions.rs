//! What runs beside a worker in its process: the console's pages on the
//! worker's HTTP address, and a pruner of the consume records. The CLI's
//! `worker --console --retention …` builds them from flags; a service's own
//! `main` builds the same from settings.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::commands::prune::{self, PruneSettings};
#[cfg(feature = "console")]
use crate::console::Console;
use crate::handler::Handler;
use crate::worker::{Worker, WorkerConfig, WorkerError};

/// A worker's companions: nothing until said otherwise.
///
/// ```no_run
/// # use std::{sync::Arc, time::Duration};
/// # async fn run<H: idem::Handler>(
/// #     config: idem::WorkerConfig,
/// #     handler: H,
/// #     retention: idem::commands::prune::PruneSettings,
/// # ) -> Result<(), idem::worker::WorkerError> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// idem::Companions::new()
///     .pruning(retention, Duration::from_secs(3600))
///     .run(config, Arc::new(handler), &shutdown)
///     .await
/// # }
/// ```
pub struct Companions<H> {
    /// Its pages join the worker's `/metrics` and health checks.
    #[cfg(feature = "console")]
    console: Option<Console<H>>,
    /// Pruned this often while the worker runs.
    pruning: Option<(PruneSettings, Duration)>,
    /// The handler type the console serves.
    handler: std::marker::PhantomData<fn() -> H>,
}

impl<H: Handler> Default for Companions<H> {
    fn default() -> Self {
        Self {
            #[cfg(feature = "console")]
            console: None,
            pruning: None,
            handler: std::marker::PhantomData,
        }
    }
}

impl<H: Handler> Companions<H> {
    /// None yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The console's pages, served beside the worker's `/metrics` on its
    /// HTTP address ([`WorkerConfig::http_addr`], which must be set).
    #[cfg(feature = "console")]
    pub fn console(self, console: Console<H>) -> Self {
        Self {
            console: Some(console),
            ..self
        }
    }

    /// A pass of [`prune::run`] every `interval` while the worker runs (a
    /// pass that fails is logged, and the next one tries again).
    pub fn pruning(self, settings: PruneSettings, interval: Duration) -> Self {
        Self {
            pruning: Some((settings, interval)),
            ..self
        }
    }

    /// Runs the worker of `config` with `handler` until `shutdown`, its
    /// companions beside it.
    pub async fn run(
        self,
        config: WorkerConfig,
        handler: Arc<H>,
        shutdown: &CancellationToken,
    ) -> Result<(), WorkerError> {
        let worker_shutdown = shutdown.clone();
        self.around(config, shutdown, |config| {
            Worker::new(config, handler).run(worker_shutdown)
        })
        .await
    }

    /// `config` with the console's pages among the routes it serves.
    fn routed(&self, config: WorkerConfig) -> WorkerConfig {
        #[cfg(feature = "console")]
        if let Some(console) = &self.console {
            return WorkerConfig {
                routes: Some(console.router()),
                ..config
            };
        }
        config
    }

    /// Runs `worker` (which starts a worker with the settings it is given)
    /// with its companions beside it: the console's routes added to the
    /// settings first, the pruner started first and stopped once `worker`
    /// returns.
    pub async fn around<F, Fut, T>(
        self,
        config: WorkerConfig,
        shutdown: &CancellationToken,
        worker: F,
    ) -> T
    where
        F: FnOnce(WorkerConfig) -> Fut,
        Fut: Future<Output = T>,
    {
        let config = self.routed(config);
        let pruner = self.pruning.map(|(settings, interval)| {
            let stop = shutdown.child_token();
            let task = tokio::spawn(prune::keep_pruning::<H>(settings, interval, stop.clone()));
            (task, stop)
        });
        let worked = worker(config).await;
        if let Some((task, stop)) = pruner {
            stop.cancel();
            // A pruner that panicked has logged it; the worker's outcome
            // is what counts.
            let _ = task.await;
        }
        worked
    }
}
