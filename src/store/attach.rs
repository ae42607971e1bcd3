//! Attach by key: a retry that meets its request still running waits for that request's answer instead
//! of claiming, or asks what the key holds, without ever executing anything ([`Store::attach`]).
//!
//! An attach claims nothing and holds no connection while it waits: it reads the record (one statement),
//! and while an owner works it flags the record for a notification, as a waiting claim does
//! ([`wakeup`]), and sleeps until the owner's settlement wakes it or its deadline passes. An owner inside
//! a transaction (the HTTP layer's claim transaction, [`Store::run_once_in_tx`]) writes its record only
//! with its commit: there is nothing to flag, so an attach to one asks again with a backoff (from
//! [`FIRST_PAUSE`] up to [`wakeup::RECHECK_EVERY`]) until the key's lock is free.

use std::time::Duration;

use super::Store;
use super::wakeup::{self, Watch};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::options::MAX_WAIT;
use crate::outcome::Outcome;
use crate::record::{Record, State, StoredResponse};
use crate::telemetry;

/// The first pause of an attach to a transactional owner, doubled at each round.
const FIRST_PAUSE: Duration = Duration::from_millis(10);

/// What [`Store::attach`] found for a request: its stored answer, its owner still at work, or nothing a
/// retry could attach to.
#[derive(Debug)]
#[non_exhaustive]
pub enum Attached {
    /// The request completed: its stored response (the same a claim would replay).
    Replayed(StoredResponse),
    /// An owner is executing the request now; ask again after roughly `retry_after` (what is left of its
    /// lease; the store's lock wait for an owner inside a transaction, whose lease nobody reads).
    InFlight {
        /// Time left on the owner's lease.
        retry_after: Duration,
    },
    /// Nothing holds the key: never claimed, given back, released, or its owner's lease ran out (under
    /// [`crate::LeaseExpiry::TakeOver`]). A claim ([`Store::begin`]) would execute the request.
    Vacant,
    /// The key holds a request with another payload.
    Mismatch,
    /// The owner's lease ran out without an answer, under [`crate::LeaseExpiry::MarkIndeterminate`]: nothing
    /// runs until an operator resolves it.
    Indeterminate,
    /// The request completed long ago and its response was purged; a tombstone remembers that it ran.
    Expired,
}

impl Attached {
    /// This answer in the vocabulary every API shares; `None` for [`Attached::Vacant`], which no claim
    /// answers (a claim would execute).
    pub fn outcome(&self) -> Option<Outcome> {
        Some(match self {
            Attached::Replayed(_) => Outcome::Replayed,
            Attached::InFlight { .. } => Outcome::InFlight,
            Attached::Vacant => return None,
            Attached::Mismatch => Outcome::Mismatch,
            Attached::Indeterminate => Outcome::Indeterminate,
            Attached::Expired => Outcome::Expired,
        })
    }

    /// The metric label of this answer.
    fn label(&self) -> &'static str {
        self.outcome().map_or("vacant", Outcome::label)
    }
}

impl Store {
    /// Attaches to the request (`scope`, `key`, `fingerprint`): its stored answer, or, while an owner
    /// executes it, a wait of at most `wait` for that answer (zero: answer at once). Claims nothing and
    /// executes nothing, whatever it finds: [`Attached::Vacant`] says a claim would execute. Reads
    /// Postgres, the source of truth, not Redis. A replay check ([`crate::RunOptions::replay_check`]) is
    /// the caller's to ask before it hands out [`Attached::Replayed`].
    ///
    /// The wait holds no connection: it is woken by the owner's settlement (Postgres `NOTIFY`, in any
    /// process) and asks again at least every second, or, for an owner inside a transaction, with a
    /// backoff. At most a day. Answers count in `idemstore_attaches_total{answer}`.
    ///
    /// In two-tier mode a claim that has set its Redis marker but not yet written its Postgres record
    /// reads as [`Attached::Vacant`]: attach, then claim, when what is wanted is "the answer, whoever
    /// computes it".
    ///
    /// ```no_run
    /// # async fn retry(store: idemstore::Store, scope: idemstore::Scope, key: idemstore::IdempotencyKey,
    /// #                fingerprint: idemstore::Fingerprint) -> Result<(), idemstore::StoreError> {
    /// use idemstore::Attached;
    /// match store.attach(&scope, &key, &fingerprint, std::time::Duration::from_secs(10)).await? {
    ///     Attached::Replayed(response) => println!("{} bytes", response.as_bytes().len()),
    ///     Attached::InFlight { retry_after } => println!("still running; ask in {retry_after:?}"),
    ///     Attached::Vacant => println!("nothing runs: claim it to run it"),
    ///     other => println!("{other:?}"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] when Postgres could not be asked; [`StoreError::Encryption`] when
    /// the stored response does not open.
    pub async fn attach(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        wait: Duration,
    ) -> Result<Attached, StoreError> {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        // Registered at the first "in flight" only: an answer at once pays nothing for waiting.
        let mut watch: Option<Watch> = None;
        let mut backoff = FIRST_PAUSE;
        let answer = loop {
            let (held, record) = self.inner.postgres.attach(scope, key).await?;
            let answer = self.attached(scope, key, fingerprint, held, record.as_ref())?;
            let Attached::InFlight { retry_after } = answer else { break answer };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break answer;
            }
            let watch = match &mut watch {
                Some(watch) => watch,
                None => watch.insert(self.inner.wakeups.watch(scope, key)),
            };
            let live = record.as_ref().is_some_and(|record| record.state == State::InProgress) && !held;
            let pause = if live && self.flag_for_wakeup(scope, key, deadline).await {
                retry_after.min(wakeup::RECHECK_EVERY)
            } else {
                // A transactional owner, or no notification to count on: ask again soon, then less often.
                let next = (backoff * 2).min(wakeup::RECHECK_EVERY);
                std::mem::replace(&mut backoff, next)
            };
            let notified = watch.notified_before((now + pause).min(deadline)).await;
            telemetry::wait_wakeup(scope.operation(), notified);
        };
        telemetry::attached(scope.operation(), answer.label());
        Ok(answer)
    }

    /// Flags the key's live record so that its owner's settlement is announced; whether the record is
    /// flagged and this store hears the announcements.
    async fn flag_for_wakeup(&self, scope: &Scope, key: &IdempotencyKey, deadline: tokio::time::Instant) -> bool {
        let within = self.inner.postgres.timeout().min(deadline.saturating_duration_since(tokio::time::Instant::now()));
        self.inner.wakeups.follows_postgres(within).await
            && matches!(self.inner.postgres.wait(scope, key).await, Ok(true))
    }

    /// The answer of what the key holds: `record` as committed, `held` when an open transaction holds
    /// the key's lock (claiming it now, or working as its owner).
    fn attached(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        held: bool,
        record: Option<&Record>,
    ) -> Result<Attached, StoreError> {
        let in_tx = Attached::InFlight { retry_after: self.inner.postgres.lock_wait() };
        let vacant = if held { in_tx } else { Attached::Vacant };
        let Some(record) = record else { return Ok(vacant) };
        // A record a claim would take over (another payload's too, once its retention ended): free,
        // unless an open transaction is taking it now. Asked before the payload: a transaction taking
        // over another payload's record changes it only with its commit.
        if record.is_reacquired_by(fingerprint) {
            return Ok(vacant);
        }
        let remaining = record.lease_remaining.unwrap_or_default();
        if !record.matches(fingerprint) {
            return Ok(Attached::Mismatch);
        }
        Ok(match record.state {
            State::Completed if record.expires_in == Some(Duration::ZERO) => Attached::Expired,
            State::Completed => {
                let stored = record.response.clone().unwrap_or_else(|| StoredResponse::new(Vec::new()));
                match self.opened(scope, key, &record.fingerprint, stored, true) {
                    Ok(opened) => Attached::Replayed(opened),
                    Err(error) => {
                        telemetry::unreadable_response(scope.operation(), "postgres", error.reason());
                        return Err(error.into());
                    }
                }
            }
            State::Expired => Attached::Expired,
            State::InProgress if !remaining.is_zero() => Attached::InFlight { retry_after: remaining },
            // Its lease ran out under MarkIndeterminate (TakeOver was answered above): a claim marks it.
            State::Indeterminate | State::InProgress => Attached::Indeterminate,
            // Released with this payload was answered above.
            State::Released => Attached::Vacant,
        })
    }
}
