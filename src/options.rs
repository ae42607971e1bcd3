//! [`RunOptions`]: the one way to change how a single claim behaves (its policy, waiting for an in-flight
//! duplicate, the owner's heartbeat), taken by [`Store::begin_with`](crate::Store::begin_with) and
//! [`Store::run_once_with`](crate::Store::run_once_with) alike.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::key::{IdempotencyKey, Scope};
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
    pub(crate) replay_check: Option<ReplayCheck>,
}

type CheckFn = dyn Fn(&Scope, &IdempotencyKey) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync;

/// The application's check before a stored result is replayed ([`RunOptions::replay_check`]).
#[derive(Clone)]
pub(crate) struct ReplayCheck(Arc<CheckFn>);

impl fmt::Debug for ReplayCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReplayCheck")
    }
}

/// The longest wait for an in-flight duplicate: a day (a deadline further out could overflow the clock).
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

impl RunOptions {
    /// Waits up to `wait` for an in-flight duplicate to finish, then replays its result (or, if its owner
    /// released the key, claims it), instead of answering "in flight" at once; "in flight" at the bound.
    ///
    /// The waiting claim is woken by the owner's settlement, in any process: the owner's completion or
    /// release publishes it on Redis (when the store was built with
    /// [`StoreBuilder::redis_url`](crate::StoreBuilder::redis_url)) or with Postgres `NOTIFY` (Postgres-only
    /// mode, a ready-made Redis pool, or Redis unavailable). Only records someone waits for pay for a
    /// notification. A lost notification costs at most a second: the claim also asks again every second,
    /// and when the owner's lease runs out. At most a day: a longer `wait` (`Duration::MAX` included)
    /// waits a day.
    pub fn wait_in_flight(mut self, wait: Duration) -> Self {
        self.wait = Some(wait.min(MAX_WAIT));
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

    /// Asks `check` before a stored result is replayed; `false` answers
    /// [`RunOutcome::ReplayRefused`](crate::RunOutcome::ReplayRefused) and reveals nothing of it.
    ///
    /// A replay skips the work, and with it any authorization the work does: a caller whose access was
    /// revoked after the first call could read its result by retrying. The check repeats that
    /// authorization (the record's tenant and operation are in the scope). It is not asked for new
    /// work, which authorizes itself. [`Store::run_once_with`](crate::Store::run_once_with) and
    /// [`Store::run_once_in_tx_with`](crate::Store::run_once_in_tx_with) ask it;
    /// [`Store::begin_with`](crate::Store::begin_with) hands [`Begin::Replayed`](crate::Begin::Replayed)
    /// to its caller, whose check it is (as the HTTP layer's
    /// [`with_replay_check`](crate::http::IdempotencyLayer::with_replay_check)). Refusals count in
    /// `idemstore_replays_refused_total`.
    pub fn replay_check<F, Fut>(mut self, check: F) -> Self
    where
        F: Fn(&Scope, &IdempotencyKey) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        self.replay_check = Some(ReplayCheck(Arc::new(move |scope, key| Box::pin(check(scope, key)))));
        self
    }

    /// Whether a stored result of (`scope`, `key`) may be replayed to this caller.
    pub(crate) async fn allows_replay(&self, scope: &Scope, key: &IdempotencyKey) -> bool {
        let allowed = match &self.replay_check {
            Some(ReplayCheck(check)) => check(scope, key).await,
            None => true,
        };
        if !allowed {
            crate::telemetry::replay_refused(scope.operation());
        }
        allowed
    }
}
