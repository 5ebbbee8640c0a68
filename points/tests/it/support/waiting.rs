//! Waiting on conditions instead of sleeping, with deadlines a slow host
//! can stretch (`IDEM_TEST_SLACK`).

use super::*;

/// How much slower than a quiet machine this run may be: `IDEM_TEST_SLACK`
/// (a factor, 1 unless set; `.ci/run` sets more, for a shared machine whose
/// speed can drop tenfold). Every deadline of the suite is `patient(d)`.
pub fn slack() -> f64 {
    std::env::var("IDEM_TEST_SLACK")
        .ok()
        .and_then(|factor| factor.parse::<f64>().ok())
        .filter(|factor| factor.is_finite() && *factor >= 1.0)
        .unwrap_or(1.0)
}

/// A deadline that was right on a quiet machine, stretched by [`slack`].
pub fn patient(deadline: Duration) -> Duration {
    deadline.mul_f64(slack())
}

/// Polls `condition` until it holds, failing after `patient(timeout)`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let timeout = patient(timeout);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition()
            .await
            .with_context(|| format!("while waiting for {what}"))?
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
