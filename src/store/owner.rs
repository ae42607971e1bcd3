//! [`Owner`]: the one lifecycle of a claimed key. Every caller that executes work (`run_once`,
//! `run_once_in_tx`, the inbox, the HTTP layer, your own middleware) goes begin -> `owner.run(work)` ->
//! `owner.complete(bytes)` or `owner.release()`, and a dropped owner is settled by its rule.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::Instrument as _;

use super::postgres_tier::Retained;
use super::{COMMIT, Store};
use crate::error::StoreError;
use crate::key::{IdempotencyKey, Scope};
use crate::options::Heartbeat;
use crate::policy::{LeaseExpiry, Policy};
use crate::record::{Lease, Record, State};

/// The caller owns a key ([`Begin::Acquired`](crate::Begin::Acquired)): run the work, then
/// [`complete`](Owner::complete) or [`release`](Owner::release).
///
/// An owner that is dropped without either (its task was cancelled, the handler panicked) gives the key
/// up under [`LeaseExpiry::TakeOver`], so a retry need not wait for the lease; under
/// [`LeaseExpiry::MarkIndeterminate`] its lease runs out and the record goes indeterminate, since the work
/// may have had effects. [`Owner::abandon`] leaves any owner to its lease.
#[must_use = "an owner that is dropped gives its key up; run the work, then complete or release"]
pub struct Owner {
    store: Store,
    lease: Lease,
    heartbeat: Heartbeat,
    /// The claim was made inside the caller's transaction: it is durable only once that commits.
    in_tx: bool,
    /// Completed, released or abandoned: nothing is left to do when dropped.
    settled: bool,
    /// Cleared when the owner goes, however it goes: a [`KeepAlive`] outliving it stops extending.
    alive: Arc<AtomicBool>,
    /// When the lease ends at the latest, as this owner last set it (claim or extension): a settlement
    /// that Postgres refuses for a while is retried until shortly before then.
    lease_ends: Arc<Mutex<tokio::time::Instant>>,
}

impl Owner {
    pub(crate) fn new(store: Store, lease: Lease, heartbeat: Heartbeat, in_tx: bool) -> Self {
        // Set by the claim that just returned, so it ends no later than a lease from now.
        let lease_ends = Arc::new(Mutex::new(tokio::time::Instant::now() + lease.policy.lease()));
        let alive = Arc::new(AtomicBool::new(true));
        Self { store, lease, heartbeat, in_tx, settled: false, alive, lease_ends }
    }

    /// The scope of the owned key.
    pub fn scope(&self) -> &Scope {
        &self.lease.scope
    }

    /// The owned key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.lease.key
    }

    /// The fencing token: higher than that of every earlier owner of this key. Pass it to downstream
    /// systems that accept a fencing token.
    pub fn fence(&self) -> i64 {
        self.lease.fence
    }

    /// The derived key for one downstream call ([`IdempotencyKey::derive`]); the same for every owner of
    /// this key, so a takeover repeats the downstream call under the same key.
    pub fn derive_key(&self, label: &str) -> IdempotencyKey {
        self.lease.key.derive(&self.lease.scope, label)
    }

    /// The policy the key was claimed under (its lease-expiry rule is the record's).
    pub fn policy(&self) -> &Policy {
        &self.lease.policy
    }

    /// The lease this owner holds (a batch completion writes for it, [`Store::complete_many`]).
    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Whether the claim was made inside the caller's transaction.
    pub(crate) fn in_tx(&self) -> bool {
        self.in_tx
    }

    /// Settled by a write made for it (a batch completion): nothing is left to do when dropped.
    pub(crate) fn settled_elsewhere(mut self) {
        self.settled = true;
    }

    /// Where a settlement that must outlive its caller runs (a shutdown waits for it).
    #[cfg(feature = "http")]
    pub(crate) fn background(&self) -> super::Background {
        self.store.background().clone()
    }

    /// Runs `work`, extending the lease every third of its length until it finishes (unless the options
    /// the key was claimed with turned the heartbeat off).
    pub async fn run<F: Future>(&self, work: F) -> F::Output {
        let _beating = (self.heartbeat == Heartbeat::Auto).then(|| self.keep_alive());
        work.await
    }

    /// Extends the lease every third of its length until the returned guard is dropped, or the owner is
    /// gone (completed, released, abandoned or dropped): for work that goes on outside [`Owner::run`],
    /// such as a response body that streams after the handler returned.
    pub fn keep_alive(&self) -> KeepAlive {
        let (store, lease, alive) = (self.store.clone(), self.lease.clone(), Arc::clone(&self.alive));
        let lease_ends = Arc::clone(&self.lease_ends);
        KeepAlive(tokio::spawn(async move {
            let period = lease.policy.lease() / 3;
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            loop {
                ticks.tick().await;
                if !alive.load(Ordering::Acquire) {
                    return;
                }
                let asked = tokio::time::Instant::now();
                match store.extend(&lease).await {
                    Ok(()) => set_lease_end(&lease_ends, asked + lease.policy.lease()),
                    Err(StoreError::LeaseLost { .. }) => return,
                    Err(error) => tracing::warn!(%error, "lease heartbeat failed; retrying at the next tick"),
                }
            }
        }))
    }

    /// Extends the lease by the policy's lease duration from now.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] if another owner took the key over; [`StoreError::StoreUnavailable`] if
    /// Postgres failed.
    pub async fn extend(&self) -> Result<(), StoreError> {
        self.store.extend(&self.lease).await
    }

    /// Stores `response` as the key's result, replayed to every retry with the same payload.
    ///
    /// If Postgres cannot be reached (a restart, a failover, a cut connection), the write is asked again
    /// with backoff until shortly before the lease ends (as it stood at the first failure), and the lease
    /// is kept alive meanwhile: a blip of Postgres costs the caller latency, not a second execution by a
    /// takeover. The write runs in a task of its own, so a caller that stops waiting (a dropped request)
    /// does not leave it half done.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] if another owner took the key over (the response is not stored);
    /// [`StoreError::StoreUnavailable`] if Postgres failed otherwise, or stayed unreachable until
    /// shortly before the lease ends (the work ran; when the lease runs out, the rule applies).
    pub async fn complete(self, response: &[u8]) -> Result<(), StoreError> {
        let sealed = self.store.sealed(&self.lease, response).into_owned();
        self.settle(Goal::Complete(sealed)).await
    }

    /// Gives the key up after a failure that a retry may repair: the next request executes. Asked again
    /// through a blip of Postgres, as [`Owner::complete`] is.
    ///
    /// # Errors
    /// As [`Owner::complete`]. A release asked again through a blip whose first attempt landed, and that
    /// another claim already followed, is also [`StoreError::LeaseLost`]: from the record alone it cannot
    /// be told from a takeover before the release (the key was given up either way).
    pub async fn release(mut self) -> Result<(), StoreError> {
        if self.in_tx {
            self.settled = true;
            // The claim rolls back with the caller's transaction; only Redis's marker is left to take.
            self.store.release_marker(&self.lease).await;
            return Ok(());
        }
        self.settle(Goal::Release).await
    }

    /// Runs [`Owner::until_landed`] in a task of its own, and waits for it.
    async fn settle(mut self, goal: Goal) -> Result<(), StoreError> {
        self.settled = true;
        let step = goal.step();
        let background = self.store.background().clone();
        let landed = background.settle(async move { self.until_landed(&goal).await }.in_current_span());
        match landed.expect("a store runs on a Tokio runtime").await {
            Ok(settled) => settled,
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            // The runtime is shutting down: the lease runs out instead.
            Err(_) => Err(StoreError::StoreUnavailable { step, source: sqlx::Error::PoolClosed }),
        }
    }

    /// Runs a settling write until it lands, fails for good, or the lease is about to end: the last
    /// tenth of the lease as it stood at the first failure (at least a Postgres timeout) is left for the
    /// write in flight; the heartbeat that keeps the lease meanwhile never moves that deadline.
    ///
    /// A write whose answer was lost may have landed: a retry then finds the record already settled
    /// under this owner's fence with this owner's response (every takeover raises the fence), which is
    /// its own write, not a lost lease. Redis's marker is then taken back, and the next miss reads the
    /// record from Postgres.
    async fn until_landed(&self, goal: &Goal) -> Result<(), StoreError> {
        // Started at the first failure: a write that lands at once pays for no heartbeat.
        let mut alive: Option<KeepAlive> = None;
        let mut backoff = Duration::from_millis(50);
        let mut deadline: Option<tokio::time::Instant> = None;
        // The last failure that may pass on a retry: set once the write was asked at least once more.
        let mut unavailable: Option<StoreError> = None;
        loop {
            let settled = match goal {
                Goal::Complete(sealed) => self.store.complete(&self.lease, sealed).await,
                Goal::Release => self.store.release(&self.lease).await,
            };
            let error = match settled {
                Err(error) if error.is_retryable() => error,
                Err(lost @ StoreError::LeaseLost { .. }) => {
                    let Some(previous) = unavailable.take() else { return Err(lost) };
                    match self.landed_before(goal).await {
                        Some(Some(record)) => {
                            self.landed(goal, &record).await;
                            return Ok(());
                        }
                        Some(None) => return Err(lost),
                        // Postgres could not tell: the write may have landed, so not "lost" yet.
                        None => previous,
                    }
                }
                settled => return settled,
            };
            let deadline = *deadline.get_or_insert_with(|| {
                let lease_ends = *self.lease_ends.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                lease_ends - (self.lease.policy.lease() / 10).max(self.store.postgres_timeout())
            });
            let next = tokio::time::Instant::now() + backoff;
            if next >= deadline {
                return Err(error);
            }
            alive.get_or_insert_with(|| self.keep_alive());
            tracing::warn!(%error, fence = self.lease.fence, "could not settle the key; asking again while the lease lasts");
            crate::telemetry::settlement_retry(self.lease.scope.operation());
            unavailable = Some(error);
            tokio::time::sleep_until(next).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }

    /// The record, if it holds `goal` under this owner's fence (an earlier attempt landed); `None` if
    /// Postgres could not tell.
    async fn landed_before(&self, goal: &Goal) -> Option<Option<Record>> {
        let record = self.store.lookup_stored(&self.lease.scope, &self.lease.key).await.ok()?;
        let own = self.lease.fence;
        Some(record.filter(|record| match goal {
            Goal::Complete(sealed) => {
                let stored = record.response.as_ref().is_some_and(|r| r.as_bytes() == &sealed[..]);
                record.fence == own && record.state == State::Completed && stored
            }
            // A higher fence proves nothing: the lease may have run out and been taken over before the
            // first attempt (the model checker found it), so the write is reported lost. A release that
            // landed and was claimed again within the backoff is reported lost too: the key was given up
            // either way.
            Goal::Release => record.fence == own && record.state == State::Released,
        }))
    }

    /// Redis after a write that landed though its answer was lost: the completed copy, as after any
    /// completion (the marker Redis holds may not be this owner's: an indeterminate record's, written
    /// when another claim marked the lease that ran out, is replaced only so; the model checker found it
    /// answering "indeterminate" over the completed record); a release takes this owner's marker back.
    async fn landed(&self, goal: &Goal, record: &Record) {
        match goal {
            Goal::Complete(sealed) => {
                // Whether a claim waits is not known here: the announcement is one NOTIFY.
                let retained = Retained { expires_in: record.expires_in, waited: true };
                self.store.cache_completion(&self.lease, sealed, &retained).await;
            }
            Goal::Release => self.store.release_marker(&self.lease).await,
        }
    }

    /// Leaves the key to its lease, as a crashed process would: when the lease runs out, the record's
    /// lease-expiry rule decides (a takeover, or indeterminate). For work whose outcome is unknown.
    pub fn abandon(mut self) {
        self.settled = true;
    }

    /// Completes a key claimed in `tx`, in `tx`, and commits: the work's writes, the claim and the
    /// completion become durable together. Then Redis learns the result; on failure nothing was
    /// committed, and Redis's marker is taken back (by `Drop` if this is cancelled on the way).
    pub(crate) async fn complete_in(
        mut self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        response: &[u8],
    ) -> Result<(), StoreError> {
        let (store, lease) = (&self.store, &self.lease);
        let response = store.sealed(lease, response);
        let committed = match store.complete_in(&mut tx, lease, &response).await {
            Ok(retained) => store.bounded(&COMMIT, tx.commit()).await.map(|()| retained),
            Err(error) => {
                store.roll_back(tx).await;
                Err(error)
            }
        };
        let completed = match committed {
            Ok(retained) => {
                store.cache_completion(lease, &response, &retained).await;
                Ok(())
            }
            Err(error) => {
                store.release_marker(lease).await;
                Err(error)
            }
        };
        self.settled = true;
        completed
    }
}

impl Drop for Owner {
    /// Settling takes I/O, which `Drop` cannot wait for, and a dropped owner's task is gone (cancelled or
    /// panicked): nothing else will run after it. So a task releases the key; without a runtime (the
    /// process is shutting down) the lease runs out instead.
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
        let in_tx = self.in_tx;
        if self.settled || !(in_tx || self.lease.policy.lease_expiry() == LeaseExpiry::TakeOver) {
            return;
        }
        let (store, lease) = (self.store.clone(), self.lease.clone());
        self.store.background().settle(async move {
            if in_tx {
                store.release_marker(&lease).await;
            } else if let Err(error) = store.release(&lease).await {
                tracing::warn!(%error, fence = lease.fence, "could not release the key of a dropped owner");
            }
        });
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Owner")
            .field("scope", &self.lease.scope)
            .field("key", &self.lease.key)
            .field("fence", &self.lease.fence)
            .finish_non_exhaustive()
    }
}

/// What a settlement writes.
enum Goal {
    /// The stored response, sealed as both tiers keep it.
    Complete(Vec<u8>),
    Release,
}

impl Goal {
    fn step(&self) -> &'static str {
        match self {
            Goal::Complete(_) => "complete",
            Goal::Release => "release",
        }
    }
}

/// Moves the lease's end later (never earlier: an extension that answered late says less).
fn set_lease_end(lease_ends: &Mutex<tokio::time::Instant>, ends: tokio::time::Instant) {
    let mut current = lease_ends.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *current = (*current).max(ends);
}

/// Extends an owner's lease until dropped ([`Owner::keep_alive`]).
#[derive(Debug)]
pub struct KeepAlive(JoinHandle<()>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}
