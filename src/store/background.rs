//! The tasks a store spawns, and how [`crate::Store::shutdown`] ends them.
//!
//! Two kinds, told apart because a shutdown treats them differently:
//! - **settlements**, work that outlives the call that started it because `Drop` cannot wait for I/O or
//!   a cancelled caller must not cut it short: a dropped owner's release, a response body settled after
//!   its client went away, a claim's statement (lone, shared or a transaction's `BEGIN`) and the give-back
//!   of a claim whose caller left before it heard. A shutdown waits for them: a process that exits first
//!   leaves the key in progress until its lease runs out.
//! - **followers**, which run as long as the store: the repair of Redis copies that may lag behind
//!   Postgres, and the subscriptions that wake claims waiting for an in-flight duplicate. A shutdown
//!   stops them (the repair's keys then expire with their lease).

use std::future::Future;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A store's tasks: one per clone of the store's handle, all clones share them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Background {
    tasks: TaskTracker,
    stop: CancellationToken,
}

impl Background {
    /// Runs `settlement` on the current runtime; a shutdown waits for it. `None` without a runtime (the
    /// process is ending): it is not run, and the record's lease runs out instead.
    pub(crate) fn settle<T: Send + 'static>(
        &self,
        settlement: impl Future<Output = T> + Send + 'static,
    ) -> Option<JoinHandle<T>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        Some(self.tasks.spawn_on(settlement, &runtime))
    }

    /// Runs `follower` until it ends or the store shuts down. `None` without a runtime, or once the store
    /// is shut down.
    pub(crate) fn follow(&self, follower: impl Future<Output = ()> + Send + 'static) -> Option<JoinHandle<()>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        if self.stop.is_cancelled() {
            return None;
        }
        let stop = self.stop.clone();
        Some(self.tasks.spawn_on(async move { stop.run_until_cancelled_owned(follower).await.unwrap_or(()) }, &runtime))
    }

    /// Stops the followers (and refuses new ones); settlements still run.
    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }

    /// Whether the followers were stopped.
    pub(crate) fn is_stopped(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Stops the followers and waits for every task started before this returns.
    pub(crate) async fn shutdown(&self) {
        self.stop();
        self.tasks.close();
        self.tasks.wait().await;
    }
}
