//! The retry policy: what becomes of a message whose transaction failed. How
//! many genuine failures it may have, how long it waits before each next
//! attempt, and what a permanent failure and an outage do. The worker
//! decides with it, the topology declares a wait queue per delay from it,
//! `status` looks at those queues, and `prune` keeps a record at least as
//! long as a message may still be retrying.

use std::time::Duration;

use backon::ExponentialBuilder;

use crate::handler::FailureKind;

/// How a consumer group retries a message whose transaction failed.
///
/// A policy is a value: the worker asks it what to do after each failure
/// ([`RetryPolicy::after`]) and does that, so that a group with other needs
/// (retries at once in a check, a schedule of its own) is another value,
/// not another branch of the worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// How long a message waits after its first failure, its second, …;
    /// the last repeats.
    delays: Vec<Duration>,
    /// Genuine failures after which a message is dead-lettered.
    attempts: u32,
    /// Longest wait between two tries of a transaction held through an
    /// outage.
    max_hold_backoff: Duration,
}

/// What becomes of a message after a failure, as [`RetryPolicy::after`]
/// decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Next {
    /// The database or the broker was unavailable: the delivery is held and
    /// its transaction tried again with exponential backoff and jitter, as
    /// long as it takes; the failure counts for nothing.
    Hold,
    /// Another attempt at once: the message goes back to its queue.
    Now,
    /// Another attempt after this delay, from the wait queue of that delay.
    Wait(Duration),
    /// No more attempts: the message goes to the dead-letter queue.
    DeadLetter(GiveUp),
}

/// Why a message gets no more attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GiveUp {
    /// The handler said it can never apply.
    Permanent,
    /// It failed as often as the policy allows.
    Spent {
        /// The policy's attempts.
        attempts: u32,
    },
}

/// A policy that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetryError {
    /// No attempt at all.
    #[error("a retry policy needs at least 1 attempt")]
    NoAttempt,
    /// A delay RabbitMQ cannot hold a message for.
    #[error(
        "a retry delay of {} is above the longest RabbitMQ allows ({}, x-message-ttl)",
        crate::duration::format(*.0),
        crate::duration::format(RetryPolicy::MAX_DELAY)
    )]
    DelayTooLong(Duration),
}

impl RetryPolicy {
    /// The delays unless said otherwise: a failure that time fixes (a row
    /// that arrives a moment later, a lock, a service restarting) gets
    /// about six minutes in all with five attempts; a message that can
    /// never apply is dead-lettered by then.
    pub const DEFAULT_DELAYS: [Duration; 4] = [
        Duration::from_secs(1),
        Duration::from_secs(10),
        Duration::from_secs(60),
        Duration::from_secs(300),
    ];

    /// Genuine failures after which a message is dead-lettered, unless said
    /// otherwise.
    pub const DEFAULT_ATTEMPTS: u32 = 5;

    /// The longest delay: RabbitMQ's `x-message-ttl` is at most 2³² − 1 ms.
    pub const MAX_DELAY: Duration = Duration::from_millis(u32::MAX as u64);

    /// Longest wait between two tries of a transaction held through an
    /// outage, unless said otherwise.
    pub const DEFAULT_MAX_HOLD_BACKOFF: Duration = Duration::from_secs(5);

    /// Waits of `delays` (after the first failure, the second, …; the last
    /// repeats; zero means at once) and at most `attempts` genuine
    /// failures.
    pub fn new(delays: impl Into<Vec<Duration>>, attempts: u32) -> Self {
        Self {
            delays: delays.into(),
            attempts,
            max_hold_backoff: Self::DEFAULT_MAX_HOLD_BACKOFF,
        }
    }

    /// Every attempt at once, at most `attempts` of them: no wait queue.
    pub fn at_once(attempts: u32) -> Self {
        Self::new([Duration::ZERO], attempts)
    }

    /// The same policy with these delays.
    pub fn with_delays(self, delays: impl Into<Vec<Duration>>) -> Self {
        Self {
            delays: delays.into(),
            ..self
        }
    }

    /// The same policy with at most `attempts` genuine failures.
    pub fn with_attempts(self, attempts: u32) -> Self {
        Self { attempts, ..self }
    }

    /// The delays, after the first failure, the second, …; the last
    /// repeats.
    pub fn delays(&self) -> &[Duration] {
        &self.delays
    }

    /// Genuine failures after which a message is dead-lettered.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Refuses a policy that cannot work: no attempt, or a delay above
    /// [`RetryPolicy::MAX_DELAY`].
    pub fn check(&self) -> Result<(), RetryError> {
        if self.attempts == 0 {
            return Err(RetryError::NoAttempt);
        }
        match self.delays.iter().find(|delay| **delay > Self::MAX_DELAY) {
            Some(delay) => Err(RetryError::DelayTooLong(*delay)),
            None => Ok(()),
        }
    }

    /// What becomes of a message whose transaction failed with `kind`, its
    /// `failures`-th genuine failure (this one counted; an outage counts
    /// none).
    pub fn after(&self, kind: FailureKind, failures: u32) -> Next {
        match kind {
            FailureKind::Infrastructure => Next::Hold,
            FailureKind::Permanent => Next::DeadLetter(GiveUp::Permanent),
            FailureKind::Message if self.spent(failures) => Next::DeadLetter(GiveUp::Spent {
                attempts: self.attempts,
            }),
            FailureKind::Message => match self.delay_after(failures) {
                Duration::ZERO => Next::Now,
                delay => Next::Wait(delay),
            },
        }
    }

    /// Whether `failures` genuine failures use up the attempts.
    pub fn spent(&self, failures: u32) -> bool {
        failures >= self.attempts
    }

    /// How long a message waits after its `failures`-th failure (1 for the
    /// first): zero means at once.
    fn delay_after(&self, failures: u32) -> Duration {
        let index = (failures.max(1) - 1) as usize;
        self.delays
            .get(index)
            .or(self.delays.last())
            .copied()
            .unwrap_or_default()
    }

    /// The distinct delays above zero, shortest first: one wait queue each.
    pub fn waits(&self) -> Vec<Duration> {
        let mut waits: Vec<Duration> = self
            .delays
            .iter()
            .copied()
            .filter(|delay| !delay.is_zero())
            .collect();
        waits.sort();
        waits.dedup();
        waits
    }

    /// The longest a message spends waiting between its first failure and
    /// its last attempt: a message may come back that long after its first
    /// delivery (and longer, while nothing consumes).
    pub fn longest_wait(&self) -> Duration {
        (1..self.attempts)
            .map(|failures| self.delay_after(failures))
            .sum()
    }

    /// How a transaction held through an outage is tried again:
    /// exponential backoff with jitter, from 100 ms up to the policy's
    /// longest hold, for as long as it takes.
    pub(crate) fn hold(&self) -> ExponentialBuilder {
        crate::backoff::forever(self.max_hold_backoff)
    }

    /// Longest wait between two tries of a held transaction.
    pub(crate) fn max_hold_backoff(&self) -> Duration {
        self.max_hold_backoff
    }
}

impl Default for RetryPolicy {
    /// [`RetryPolicy::DEFAULT_DELAYS`] and [`RetryPolicy::DEFAULT_ATTEMPTS`].
    fn default() -> Self {
        Self::new(Self::DEFAULT_DELAYS, Self::DEFAULT_ATTEMPTS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn millis(delays: &[u64]) -> Vec<Duration> {
        delays.iter().map(|ms| Duration::from_millis(*ms)).collect()
    }

    #[test]
    fn the_last_delay_repeats_and_zero_means_at_once() {
        let policy = RetryPolicy::new(millis(&[1000, 10_000]), 9);
        let after: Vec<Next> = (1..=4)
            .map(|failures| policy.after(FailureKind::Message, failures))
            .collect();
        let waits = millis(&[1000, 10_000, 10_000, 10_000]);
        assert_eq!(after, waits.into_iter().map(Next::Wait).collect::<Vec<_>>());
        let at_once = RetryPolicy::at_once(5);
        assert_eq!(at_once.after(FailureKind::Message, 3), Next::Now);
        let none = RetryPolicy::new(Vec::new(), 5);
        assert_eq!(none.after(FailureKind::Message, 1), Next::Now);
    }

    #[test]
    fn the_last_attempt_dead_letters_and_a_permanent_failure_the_first() {
        let policy = RetryPolicy::default().with_attempts(3);
        assert_eq!(
            policy.after(FailureKind::Message, 3),
            Next::DeadLetter(GiveUp::Spent { attempts: 3 })
        );
        assert_eq!(
            policy.after(FailureKind::Permanent, 1),
            Next::DeadLetter(GiveUp::Permanent)
        );
        assert_eq!(policy.after(FailureKind::Infrastructure, 99), Next::Hold);
    }

    #[test]
    fn each_distinct_delay_above_zero_is_one_wait() {
        let policy = RetryPolicy::new(millis(&[0, 1000, 60_000, 1000, 250]), 5);
        assert_eq!(policy.waits(), millis(&[250, 1000, 60_000]));
    }

    #[test]
    fn the_longest_wait_adds_the_delays_before_the_last_attempt() {
        // Five attempts wait after the first four failures: 1 + 10 + 60 + 300 s.
        assert_eq!(
            RetryPolicy::default().longest_wait(),
            Duration::from_secs(371)
        );
        // Two attempts wait once; the last delay repeats past the list.
        let policy = RetryPolicy::new(millis(&[1000]), 4);
        assert_eq!(policy.longest_wait(), Duration::from_secs(3));
        assert_eq!(
            policy.with_attempts(2).longest_wait(),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn a_policy_without_attempts_or_with_a_delay_rabbitmq_cannot_hold_is_refused() {
        assert_eq!(
            RetryPolicy::default().with_attempts(0).check(),
            Err(RetryError::NoAttempt)
        );
        let long = RetryPolicy::MAX_DELAY + Duration::from_millis(1);
        assert_eq!(
            RetryPolicy::default().with_delays([long]).check(),
            Err(RetryError::DelayTooLong(long))
        );
        assert_eq!(RetryPolicy::default().check(), Ok(()));
    }
}
