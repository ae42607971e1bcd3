//! The run-once API: claim, run the work, store its result; or replay the stored result to a retry.
//! For queue consumers, webhook handlers, jobs and anything else that must not apply twice.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::PgConnection;
use tokio::time::Instant;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::policy::Policy;
use crate::record::{Begin, Lease};
use crate::store::Store;

/// What [`Store::run_once`] did.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunOutcome<T> {
    /// This call executed the work; its result is stored for retries.
    Executed(T),
    /// An earlier call executed the work; this is its stored result.
    Replayed(T),
    /// Another call is executing the work now (and did not finish within the wait, if one was set).
    InFlight {
        /// Time left on the owner's lease.
        retry_after: Duration,
    },
    /// The key was used before with a different payload; nothing was executed.
    Mismatch,
    /// An owner's lease ran out without an answer; nothing executes until the record is resolved.
    Indeterminate,
    /// The work completed long ago and its stored result was purged after the retention; nothing was
    /// executed (see [`Begin::Expired`]).
    Expired,
}

/// Why [`Store::run_once`] could not give an outcome.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// The store failed or refused the input (see [`StoreError`]). When it is
    /// [`StoreError::LeaseLost`], the work ran but another owner had taken the key over, so its
    /// result was not stored.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The work failed; the key was released, so a retry executes it again.
    #[error("the work failed")]
    Work(#[source] E),
    /// The work's result could not be serialized for storage; the key was released.
    #[error("the work's result could not be serialized")]
    Encode(#[source] serde_json::Error),
    /// A stored result could not be deserialized as the requested type.
    #[error("the stored result could not be deserialized")]
    Decode(#[source] serde_json::Error),
}

/// The future a [`Store::run_once_in_tx`] work returns, borrowing the transaction.
pub type TxFuture<'c, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>;

/// What a claim answered: ownership, or the outcome to return.
enum Claimed<T> {
    Owner(Lease),
    Answered(RunOutcome<T>),
}

fn claimed<T: DeserializeOwned, E>(answer: Begin) -> Result<Claimed<T>, RunError<E>> {
    Ok(match answer {
        Begin::Acquired(lease) => Claimed::Owner(lease),
        Begin::Completed(stored) => Claimed::Answered(RunOutcome::Replayed(
            serde_json::from_slice(stored.as_bytes()).map_err(RunError::Decode)?,
        )),
        Begin::InFlight { retry_after } => Claimed::Answered(RunOutcome::InFlight { retry_after }),
        Begin::Mismatch => Claimed::Answered(RunOutcome::Mismatch),
        Begin::Indeterminate => Claimed::Answered(RunOutcome::Indeterminate),
        Begin::Expired => Claimed::Answered(RunOutcome::Expired),
    })
}

/// The work's value with its stored form, or the error to return after releasing the key.
fn encode<T: Serialize, E>(result: Result<T, E>) -> Result<(T, Vec<u8>), RunError<E>> {
    match result {
        Ok(value) => serde_json::to_vec(&value).map(|bytes| (value, bytes)).map_err(RunError::Encode),
        Err(error) => Err(RunError::Work(error)),
    }
}

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

/// Options of one [`Store::run_once_with`] call.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    wait: Option<Duration>,
    heartbeat: Heartbeat,
}

impl RunOptions {
    /// Waits up to `wait` for an in-flight duplicate to finish, then replays its result, instead of
    /// answering [`RunOutcome::InFlight`] at once.
    pub fn wait_in_flight(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Sets the heartbeat (default [`Heartbeat::Auto`]).
    pub fn heartbeat(mut self, heartbeat: Heartbeat) -> Self {
        self.heartbeat = heartbeat;
        self
    }
}

impl Store {
    /// Runs `work` once for (`scope`, `key`), however often it is called: the first call executes
    /// and stores the result, later calls with the same payload replay it, and a call with another
    /// payload is refused. If `work` fails, the key is released so a retry runs it again; to store a
    /// failure for replay, return it inside `Ok`.
    ///
    /// # Errors
    /// See [`RunError`]: store failures (Postgres unavailable fails closed: `work` does not run),
    /// bad input, the work's own error, or a result that does not serialize.
    pub async fn run_once<P, T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        payload: &P,
        work: F,
    ) -> Result<RunOutcome<T>, RunError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_once_with(scope, key, payload, &RunOptions::default(), work).await
    }

    /// [`Store::run_once`] with options.
    ///
    /// # Errors
    /// As [`Store::run_once`].
    pub async fn run_once_with<P, T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        payload: &P,
        options: &RunOptions,
        work: F,
    ) -> Result<RunOutcome<T>, RunError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_once_under(scope, key, payload, options, self.shared_policy(scope.operation()), work).await
    }

    /// [`Store::run_once_with`] under `policy` instead of the operation's configured one.
    pub(crate) async fn run_once_under<P, T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        payload: &P,
        options: &RunOptions,
        policy: Arc<Policy>,
        work: F,
    ) -> Result<RunOutcome<T>, RunError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let fingerprint = Fingerprint::of_serialize(payload, policy.fingerprint()).map_err(StoreError::from)?;
        let deadline = options.wait.map(|wait| Instant::now() + wait);
        let mut backoff = Duration::from_millis(5);
        let lease = loop {
            match claimed(self.begin_under(scope, key, &fingerprint, Arc::clone(&policy)).await?)? {
                Claimed::Owner(lease) => break lease,
                Claimed::Answered(RunOutcome::InFlight { retry_after })
                    if deadline.is_some_and(|deadline| Instant::now() < deadline) =>
                {
                    // Poll with a growing interval, never past the deadline or the owner's lease.
                    let pause = backoff.min(retry_after.max(Duration::from_millis(1)));
                    let deadline = deadline.unwrap_or_else(Instant::now);
                    tokio::time::sleep_until((Instant::now() + pause).min(deadline)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Claimed::Answered(outcome) => return Ok(outcome),
            }
        };

        let result = self.with_heartbeat(&lease, options.heartbeat, work()).await;
        match encode(result) {
            Ok((value, bytes)) => {
                self.complete(&lease, &bytes).await?;
                Ok(RunOutcome::Executed(value))
            }
            Err(error) => {
                if let Err(release) = self.release(&lease).await {
                    // The lease runs out instead, and the policy decides what the next request does.
                    tracing::warn!(error = %release, "could not release the key after a failure");
                }
                Err(error)
            }
        }
    }

    /// Runs `work` once, exactly once for its effects in this Postgres database: the claim, the work's
    /// statements (on the transaction handed to `work`) and the completion commit together, or not at all.
    ///
    /// A concurrent duplicate is told "in flight" by Redis, or waits on the claim's row lock in Postgres
    /// and then replays the result. If `work` fails, or the process dies before the commit, nothing was
    /// written (the claim included) and a retry executes cleanly. One commit per new key instead of two.
    /// Effects outside this database (an e-mail, another API) are not covered: pass them a
    /// [derived key](IdempotencyKey::derive) or put them in an outbox row written by `work`.
    /// `work` may borrow only the transaction: move (clone) into it what else it needs.
    ///
    /// ```no_run
    /// # async fn demo(store: idemstore::Store, scope: idemstore::Scope, key: idemstore::IdempotencyKey)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// let outcome = store
    ///     .run_once_in_tx(&scope, &key, &serde_json::json!({"amount": 1200}), |tx| {
    ///         Box::pin(async move {
    ///             let id: i64 = sqlx::query_scalar("INSERT INTO charges (amount) VALUES (1200) RETURNING id")
    ///                 .fetch_one(&mut *tx)
    ///                 .await?;
    ///             Ok::<_, sqlx::Error>(id)
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Store::run_once`]; a failed commit is [`StoreError::StoreUnavailable`].
    pub async fn run_once_in_tx<P, T, E, F>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        payload: &P,
        work: F,
    ) -> Result<RunOutcome<T>, RunError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T, E>,
    {
        let policy = self.policy(scope.operation());
        let fingerprint = Fingerprint::of_serialize(payload, policy.fingerprint()).map_err(StoreError::from)?;
        let mut tx = self.bounded("begin transaction", self.pg_pool().begin()).await?;
        let lease = match claimed(self.begin_in(scope, key, &fingerprint, &mut tx).await?)? {
            Claimed::Owner(lease) => lease,
            Claimed::Answered(outcome) => {
                // The answer may have marked the record indeterminate, in this transaction: keep it.
                if let Err(error) = self.bounded("commit", tx.commit()).await {
                    tracing::warn!(%error, "could not commit the answer's writes; the next request repeats them");
                }
                return Ok(outcome);
            }
        };
        let finished = match encode(work(&mut tx).await) {
            Ok((value, bytes)) => match self.complete_in(&mut tx, &lease, &bytes).await {
                Ok(retained) => {
                    let committed = self.bounded("commit", tx.commit()).await;
                    committed.map(|()| (value, bytes, retained)).map_err(RunError::from)
                }
                Err(error) => Err(error.into()),
            },
            Err(error) => Err(error),
        };
        match finished {
            Ok((value, bytes, retained)) => {
                self.cache_completion(&lease, &bytes, &retained).await;
                Ok(RunOutcome::Executed(value))
            }
            Err(error) => {
                // Rolled back (the transaction is dropped): no claim was ever durable, so no retry may be
                // told "in flight" for it.
                self.release_marker(&lease).await;
                Err(error)
            }
        }
    }

    /// Runs `work`, extending the lease every third of its length until it finishes.
    pub(crate) async fn with_heartbeat<F: Future>(&self, lease: &Lease, heartbeat: Heartbeat, work: F) -> F::Output {
        if heartbeat == Heartbeat::Off {
            return work.await;
        }
        let period = lease.policy().lease() / 3;
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        tokio::pin!(work);
        let mut beating = true;
        loop {
            tokio::select! {
                output = &mut work => return output,
                _ = ticks.tick(), if beating => match self.extend(lease).await {
                    Ok(()) => {}
                    Err(StoreError::LeaseLost { .. }) => beating = false,
                    Err(error) => tracing::warn!(%error, "lease heartbeat failed; retrying at the next tick"),
                },
            }
        }
    }
}
