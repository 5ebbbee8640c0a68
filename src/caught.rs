//! Panics in code idem runs for its user (a handler) or in idem itself,
//! caught at the boundaries of idem's tasks and turned into outcomes: a
//! panic must never stop a worker silently.
//!
//! Where idem catches a panic it reports it once, with its location; the
//! hook [`install_hook`] keeps the standard one from printing it a second
//! time, and logs the panics nobody catches as one line.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, PanicHookInfo};

use futures::FutureExt;

thread_local! {
    /// How many catching scopes this thread is inside.
    static CATCHING: Cell<usize> = const { Cell::new(0) };
    /// Where the last caught panic happened, as the hook saw it.
    static LOCATION: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// A panic, caught.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Panic {
    message: String,
    location: Option<String>,
}

impl fmt::Display for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.location {
            Some(location) => write!(f, "panicked at {location}: {}", self.message),
            None => write!(f, "panicked: {}", self.message),
        }
    }
}

impl Panic {
    fn from_payload(payload: &(dyn std::any::Any + Send)) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|text| (*text).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(a panic without a message)".into());
        Self {
            message,
            location: LOCATION.with(|location| location.borrow_mut().take()),
        }
    }
}

/// Marks the thread as inside a catching scope for as long as it lives,
/// unwinding included.
struct Scope;

impl Scope {
    fn enter() -> Self {
        CATCHING.with(|depth| depth.set(depth.get() + 1));
        Scope
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        CATCHING.with(|depth| depth.set(depth.get().saturating_sub(1)));
    }
}

/// Calls `f`, turning a panic into an error.
pub(crate) fn call<T>(f: impl FnOnce() -> T) -> Result<T, Panic> {
    let scope = Scope::enter();
    let result = std::panic::catch_unwind(AssertUnwindSafe(f));
    drop(scope);
    result.map_err(|payload| Panic::from_payload(&*payload))
}

/// Runs `future`, turning a panic in any of its polls into an error.
pub(crate) async fn future<F: Future>(future: F) -> Result<F::Output, Panic> {
    let mut future = std::pin::pin!(future);
    let scoped = std::future::poll_fn(move |cx| {
        let _scope = Scope::enter();
        future.as_mut().poll(cx)
    });
    AssertUnwindSafe(scoped)
        .catch_unwind()
        .await
        .map_err(|payload| Panic::from_payload(&*payload))
}

/// Installs a panic hook: a panic that idem catches is reported where it is
/// caught (the hook only notes its location); any other is logged as one
/// line at `error`. For binaries; call it after the subscriber is set.
pub(crate) fn install_hook() {
    std::panic::set_hook(Box::new(|info: &PanicHookInfo<'_>| {
        let location = info
            .location()
            .map(|location| format!("{}:{}", location.file(), location.line()));
        if CATCHING.with(Cell::get) > 0 {
            LOCATION.with(|caught| *caught.borrow_mut() = location);
            return;
        }
        let panic = Panic {
            message: Panic::from_payload(info.payload()).message,
            location,
        };
        tracing::error!("{panic}");
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_with_its_message() {
        let caught = call(|| -> u32 { panic!("boom {}", 7) });
        assert_eq!(
            caught.map_err(|panic| panic.message),
            Err("boom 7".to_owned())
        );
        assert_eq!(call(|| 3), Ok(3));
        assert_eq!(CATCHING.with(Cell::get), 0, "the scope ended with the call");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_future_that_panics_after_a_wait_becomes_an_error() {
        let caught = future(async {
            tokio::task::yield_now().await;
            panic!("later");
        })
        .await;
        assert_eq!(
            caught.map_err(|panic| panic.message),
            Err::<(), _>("later".to_owned())
        );
        assert_eq!(future(async { 5 }).await, Ok(5));
    }
}
