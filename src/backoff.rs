//! The retry schedules idem uses, in one place: exponential backoff with
//! jitter, so that many workers recovering at once do not retry in step.

use std::time::Duration;

use backon::ExponentialBuilder;

/// Waiting for a service to come up: 200 ms to 5 s between attempts, giving
/// up once the waits add up to `patience`.
pub fn until(patience: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .with_total_delay(Some(patience))
}

/// Holding work while a service is down: 100 ms up to `max_delay` between
/// attempts, for as long as it takes.
pub fn forever(max_delay: Duration) -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(max_delay)
        .with_jitter()
        .without_max_times()
}
