//! [`Owner`]: the one lifecycle of a claimed key. Every caller that executes work (`run_once`,
//! `run_once_in_tx`, the inbox, the HTTP layer, your own middleware) goes begin -> `owner.run(work)` ->
//! `owner.complete(bytes)` or `owner.release()`, and a dropped owner is settled by its rule.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::task::JoinHandle;

use crate::error::StoreError;
use crate::key::{IdempotencyKey, Scope};
use crate::options::Heartbeat;
use crate::policy::{LeaseExpiry, Policy};
use crate::record::Lease;
use crate::store::COMMIT;
use crate::store::Store;

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
}

impl Owner {
    pub(crate) fn new(store: Store, lease: Lease, heartbeat: Heartbeat, in_tx: bool) -> Self {
        Self { store, lease, heartbeat, in_tx, settled: false, alive: Arc::new(AtomicBool::new(true)) }
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
        KeepAlive(tokio::spawn(async move {
            let period = lease.policy.lease() / 3;
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            loop {
                ticks.tick().await;
                if !alive.load(Ordering::Acquire) {
                    return;
                }
                match store.extend(&lease).await {
                    Ok(()) => {}
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
    /// # Errors
    /// [`StoreError::LeaseLost`] if another owner took the key over (the response is not stored);
    /// [`StoreError::StoreUnavailable`] if Postgres failed (the lease runs out, then the rule applies).
    pub async fn complete(mut self, response: &[u8]) -> Result<(), StoreError> {
        self.settled = true;
        let sealed = self.store.sealed(&self.lease, response);
        self.store.complete(&self.lease, &sealed).await
    }

    /// Gives the key up after a failure that a retry may repair: the next request executes.
    ///
    /// # Errors
    /// As [`Owner::complete`].
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.settled = true;
        if self.in_tx {
            // The claim rolls back with the caller's transaction; only Redis's marker is left to take.
            self.store.release_marker(&self.lease).await;
            return Ok(());
        }
        self.store.release(&self.lease).await
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
            Err(error) => Err(error),
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
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (store, lease) = (self.store.clone(), self.lease.clone());
        runtime.spawn(async move {
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

/// Extends an owner's lease until dropped ([`Owner::keep_alive`]).
#[derive(Debug)]
pub struct KeepAlive(JoinHandle<()>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}
