//! The run-once API: claim, run the work, store its result; or replay the stored result to a retry.
//! For queue consumers, webhook handlers, jobs and anything else that must not apply twice.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::PgConnection;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::options::RunOptions;
use crate::store::Begin;
use crate::store::Owner;
use crate::store::{COMMIT, Store};

/// What [`Store::run_once`] did, named as in every API ([`crate::Outcome`]).
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
    /// The work ran, and its result could not be serialized for storage ([`RunError::Encode`] told the
    /// call that ran it): it is not run again, and there is no result to replay.
    NotReplayable,
    /// The work completed, and [`RunOptions::replay_check`] refused to replay its result to this caller;
    /// nothing was executed or revealed.
    ReplayRefused,
    /// The tenant reached a limit of the policy's [`crate::Quota`]; nothing was executed (see
    /// [`Begin::QuotaExceeded`]).
    QuotaExceeded {
        /// The limit that was reached.
        limit: crate::QuotaLimit,
        /// When a place should free up (see [`Begin::QuotaExceeded`]).
        retry_after: Duration,
    },
}

impl<T> RunOutcome<T> {
    /// This answer in the vocabulary every API shares.
    pub fn outcome(&self) -> crate::Outcome {
        use crate::Outcome;
        match self {
            RunOutcome::Executed(_) => Outcome::Executed,
            RunOutcome::Replayed(_) => Outcome::Replayed,
            RunOutcome::InFlight { .. } => Outcome::InFlight,
            RunOutcome::Mismatch => Outcome::Mismatch,
            RunOutcome::Indeterminate => Outcome::Indeterminate,
            RunOutcome::Expired => Outcome::Expired,
            RunOutcome::NotReplayable => Outcome::NotReplayable,
            RunOutcome::ReplayRefused => Outcome::ReplayRefused,
            RunOutcome::QuotaExceeded { .. } => Outcome::QuotaExceeded,
        }
    }
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
    /// The work ran, and its result could not be serialized for storage: the key is stored as completed
    /// but not replayable, so retries get [`RunOutcome::NotReplayable`] and never run the work again.
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
    Owner(Owner),
    Answered(RunOutcome<T>),
}

/// The claim's answer, a replay asked of the options' check first.
async fn claimed<T: DeserializeOwned, E>(
    answer: Begin,
    options: &RunOptions,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Result<Claimed<T>, RunError<E>> {
    Ok(match answer {
        Begin::Acquired(owner) => Claimed::Owner(owner),
        Begin::Replayed(stored) if stored.as_bytes() == NOT_REPLAYABLE => Claimed::Answered(RunOutcome::NotReplayable),
        Begin::Replayed(_) if !options.allows_replay(scope, key).await => Claimed::Answered(RunOutcome::ReplayRefused),
        Begin::Replayed(stored) => Claimed::Answered(RunOutcome::Replayed(
            serde_json::from_slice(stored.as_bytes()).map_err(RunError::Decode)?,
        )),
        Begin::InFlight { retry_after } => Claimed::Answered(RunOutcome::InFlight { retry_after }),
        Begin::Mismatch => Claimed::Answered(RunOutcome::Mismatch),
        Begin::Indeterminate => Claimed::Answered(RunOutcome::Indeterminate),
        Begin::Expired => Claimed::Answered(RunOutcome::Expired),
        Begin::QuotaExceeded { limit, retry_after } => {
            Claimed::Answered(RunOutcome::QuotaExceeded { limit, retry_after })
        }
    })
}

/// What is stored for a work that ran and whose result did not serialize: not JSON (serde_json never
/// writes a NUL byte outside a string), so no result can be mistaken for it.
const NOT_REPLAYABLE: &[u8] = b"\0idemstore:not-replayable";

/// How a work's run is settled.
enum Settled<T, E> {
    /// Stored for replay, and returned.
    Value(T, Vec<u8>),
    /// The work ran; its result did not serialize: stored as not replayable, the error returned.
    Unencodable(serde_json::Error),
    /// The work failed: the key is released.
    Failed(E),
}

fn encode<T: Serialize, E>(result: Result<T, E>) -> Settled<T, E> {
    match result {
        Ok(value) => match serde_json::to_vec(&value) {
            Ok(bytes) => Settled::Value(value, bytes),
            Err(error) => Settled::Unencodable(error),
        },
        Err(error) => Settled::Failed(error),
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
        let fingerprint = self.fingerprint_under(scope, payload, options)?;
        self.run_fingerprinted(scope, key, &fingerprint, options, work).await
    }

    /// The payload's fingerprint under the options' policy, else the operation's.
    fn fingerprint_under<P: Serialize + ?Sized>(
        &self,
        scope: &Scope,
        payload: &P,
        options: &RunOptions,
    ) -> Result<Fingerprint, StoreError> {
        let policy = options.policy.as_deref().unwrap_or_else(|| self.policy(scope.operation()));
        Ok(Fingerprint::of_serialize(payload, policy.fingerprint())?)
    }

    /// [`Store::run_once_with`] for a payload already fingerprinted.
    pub(crate) async fn run_fingerprinted<T, E, F, Fut>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        options: &RunOptions,
        work: F,
    ) -> Result<RunOutcome<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let answer = self.begin_with(scope, key, fingerprint, options).await?;
        let owner = match claimed(answer, options, scope, key).await? {
            Claimed::Owner(owner) => owner,
            Claimed::Answered(outcome) => return Ok(outcome),
        };
        match encode(owner.run(work()).await) {
            Settled::Value(value, bytes) => {
                owner.complete(&bytes).await?;
                Ok(RunOutcome::Executed(value))
            }
            Settled::Unencodable(error) => {
                owner.complete(NOT_REPLAYABLE).await?;
                Err(RunError::Encode(error))
            }
            Settled::Failed(error) => {
                if let Err(release) = owner.release().await {
                    // The lease runs out instead, and the record's rule decides what the next request does.
                    tracing::warn!(error = %release, "could not release the key after a failure");
                }
                Err(RunError::Work(error))
            }
        }
    }

    /// Runs `work` once, exactly once for its effects in this Postgres database: the claim, the work's
    /// statements (on the transaction handed to `work`) and the completion commit together, or not at all.
    ///
    /// A concurrent duplicate (through this method, `run_once` or `begin`) is told "in flight" at once, by
    /// Redis or by the key's lock in Postgres, which this claim's transaction holds; its retry replays the
    /// result. The claim itself writes nothing: the record is written once, completed, in the commit
    /// (in a transaction above read committed, or under a quota, the claim writes it in progress first). If `work` fails, or the process dies before the commit, nothing was
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
        self.run_once_in_tx_with(scope, key, payload, &RunOptions::default(), work).await
    }

    /// [`Store::run_once_in_tx`] with options: the policy and the
    /// [replay check](RunOptions::replay_check). The claim never waits for an in-flight duplicate (its row
    /// lock does) and the work has no heartbeat (its transaction holds the claim), whatever `options` say.
    ///
    /// # Errors
    /// As [`Store::run_once_in_tx`].
    pub async fn run_once_in_tx_with<P, T, E, F>(
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
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T, E>,
    {
        let fingerprint = self.fingerprint_under(scope, payload, options)?;
        self.run_fingerprinted_in_tx(scope, key, &fingerprint, options, work).await
    }

    /// [`Store::run_once_in_tx`] for a payload already fingerprinted, under the policy of `options`.
    pub(crate) async fn run_fingerprinted_in_tx<T, E, F>(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        options: &RunOptions,
        work: F,
    ) -> Result<RunOutcome<T>, RunError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T, E>,
    {
        let mut tx = None;
        let answer = self.begin_in(scope, key, fingerprint, options, &mut tx).await;
        let claimed = match answer {
            Ok(answer) => claimed(answer, options, scope, key).await,
            Err(error) => Err(error.into()),
        };
        let owner = match claimed {
            Ok(Claimed::Owner(owner)) => owner,
            Ok(Claimed::Answered(outcome)) => {
                // The answer may have marked the record indeterminate, in this transaction: keep it.
                if let Some(tx) = tx
                    && let Err(error) = self.bounded(&COMMIT, tx.commit()).await
                {
                    tracing::warn!(%error, "could not commit the answer's writes; the next request repeats them");
                }
                return Ok(outcome);
            }
            // Rolled back before the error goes out: the transaction may hold the key's lock.
            Err(error) => {
                if let Some(tx) = tx {
                    self.roll_back(tx).await;
                }
                return Err(error);
            }
        };
        let Some(mut tx) = tx else { return Err(RunError::Store(Store::no_transaction())) };
        match encode(work(&mut tx).await) {
            Settled::Value(value, bytes) => {
                owner.complete_in(tx, &bytes).await?;
                Ok(RunOutcome::Executed(value))
            }
            // The work's writes commit with the record that says it ran.
            Settled::Unencodable(error) => {
                owner.complete_in(tx, NOT_REPLAYABLE).await?;
                Err(RunError::Encode(error))
            }
            Settled::Failed(error) => {
                // Rolled back before the answer: no claim was ever durable, so no retry may be told "in
                // flight" for it.
                self.roll_back(tx).await;
                let _ = owner.release().await;
                Err(RunError::Work(error))
            }
        }
    }
}
