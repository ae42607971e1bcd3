//! [`RunOptions`]: the one way to change how a single claim behaves (its policy, waiting for an in-flight
//! duplicate, the owner's heartbeat), taken by [`Store::begin_with`](crate::Store::begin_with) and
//! [`Store::run_once_with`](crate::Store::run_once_with) alike.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::Policy;

/// Keeps a live owner's lease from running out while its work takes longer than the lease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Heartbeat {
    /// Extend the lease every third of its length while the work runs.
    #[default]
    Auto,
    /// Never extend: work that outlives the lease may be taken over.
    Off,
}

/// Options of one claim.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub(crate) wait: Option<Duration>,
    pub(crate) heartbeat: Heartbeat,
    pub(crate) policy: Option<Arc<Policy>>,
}

impl RunOptions {
    /// Waits up to `wait` for an in-flight duplicate to finish, then replays its result (or, if its owner
    /// released the key, claims it), instead of answering "in flight" at once; "in flight" at the bound.
    ///
    /// The waiting claim is woken by the owner's settlement, in any process: the owner's completion or
    /// release publishes it on Redis (when the store was built with
    /// [`StoreBuilder::redis_url`](crate::StoreBuilder::redis_url)) or with Postgres `NOTIFY` (Postgres-only
    /// mode, a ready-made Redis pool, or Redis unavailable). Only records someone waits for pay for a
    /// notification. A lost notification costs at most a second: the claim also asks again every second,
    /// and when the owner's lease runs out.
    pub fn wait_in_flight(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Sets the owner's heartbeat (default [`Heartbeat::Auto`]).
    pub fn heartbeat(mut self, heartbeat: Heartbeat) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// Claims under `policy` instead of the store's policy for the operation. A record already claimed
    /// keeps the lease-expiry rule, retention and horizon it was claimed under.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(Arc::new(policy));
        self
    }
}
