//! Waiting for a server that does not answer: exponential backoff with
//! jitter (so that many workers recovering at once do not retry in step),
//! up to a deadline or for as long as it takes. What becomes of a message
//! that failed is the retry policy's ([`crate::retry`]).

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio::time::Instant;

/// How long a long-running process (the worker, a relay) keeps trying to
/// reconnect after its first connection: as long as it takes.
pub(crate) const RECONNECT_PATIENCE: Duration = Duration::from_secs(365 * 24 * 3600);

/// Waiting for a service to come up: 200 ms to 5 s between attempts, the
/// last one at `patience` after the first, not before (the last wait is cut
/// to what is left).
pub(crate) fn until(patience: Duration) -> Until {
    Until { patience }
}

/// Holding work while a service is down: 100 ms up to `max_delay` between
/// attempts, for as long as it takes.
pub(crate) fn forever(max_delay: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(max_delay)
        .with_jitter()
        .without_max_times()
}

/// Builds a [`Deadline`]: the clock starts when it is built, that is when
/// the first attempt is made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Until {
    patience: Duration,
}

impl BackoffBuilder for Until {
    type Backoff = Deadline;

    fn build(self) -> Deadline {
        Deadline {
            waits: ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(5))
                .with_jitter()
                .without_max_times()
                .build(),
            deadline: Instant::now() + self.patience,
        }
    }
}

/// Exponential waits up to a deadline; the last wait ends on it.
#[derive(Debug)]
pub(crate) struct Deadline {
    waits: ExponentialBackoff,
    deadline: Instant,
}

impl Iterator for Deadline {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        self.waits.next().map(|wait| wait.min(left))
    }
}

/// The end of a log line about a wait: `retrying in 0.6s, for 27s more`,
/// the second half only when there is a `deadline` worth saying (the
/// patience of a long-running process is a year).
pub(crate) fn retrying(wait: Duration, deadline: Instant) -> String {
    let left = deadline.saturating_duration_since(Instant::now());
    let wait = format!("retrying in {:.1}s", wait.as_secs_f64());
    if left > Duration::from_secs(24 * 3600) {
        return wait;
    }
    format!(
        "{wait}, for {} more",
        crate::duration::format(round_up(left))
    )
}

/// `left` to the second above, for a figure a reader takes in at a glance.
fn round_up(left: Duration) -> Duration {
    Duration::from_secs(left.as_secs() + u64::from(left.subsec_nanos() > 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn the_last_attempt_comes_at_the_deadline() {
        let started = Instant::now();
        for wait in until(Duration::from_secs(2)).build() {
            tokio::time::sleep(wait).await;
        }
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_retry_line_says_how_long_the_waiting_goes_on() {
        let now = Instant::now();
        let wait = Duration::from_millis(600);
        assert_eq!(
            retrying(wait, now + Duration::from_millis(26_200)),
            "retrying in 0.6s, for 27s more"
        );
        assert_eq!(retrying(wait, now + RECONNECT_PATIENCE), "retrying in 0.6s");
    }
}
