//! The claim protocol, shared by both modes: Redis (when present) answers duplicates and marks claims in
//! flight; Postgres decides who executes and holds every result. Each step that could run on either
//! tier is written once, with the Redis half skipped in Postgres-only mode or when Redis is unavailable.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Store;
use sqlx::postgres::PgConnection;

/// A transaction for a claim that commits with the caller's work, begun only when Postgres is asked
/// ([`Store::begin_in`]).
pub(crate) type LazyTx = Option<sqlx::Transaction<'static, sqlx::Postgres>>;

use super::postgres_tier::{ClaimAnswer, Retained};
use super::redis_tier::{RedisTier, Takeback};
use super::scripts::RedisBegin;
use super::wakeup::{self, Watch};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::options::{Heartbeat, RunOptions};
use crate::policy::{LeaseExpiry, Policy, millis};
use crate::record::{Lease, Record, State, StoredResponse};
use crate::store::Begin;
use crate::store::Owner;
use crate::telemetry::{self, OperationCounters};
use tracing::Instrument;

impl Store {
    /// Claims `key` for a request with this `fingerprint`, or answers from what the key already holds.
    ///
    /// Work may run only on [`Begin::Acquired`], and then only after this returned: the claim is durable
    /// in Postgres by then. Finish with [`Owner::complete`] or [`Owner::release`].
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] when Postgres could not be asked; nothing may run then.
    pub async fn begin(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<Begin, StoreError> {
        self.begin_with(scope, key, fingerprint, &RunOptions::default()).await
    }

    /// [`Store::begin`] with options: another policy, a wait for an in-flight duplicate to finish (woken
    /// by the owner's settlement, see [`RunOptions::wait_in_flight`]), the owner's heartbeat.
    ///
    /// # Errors
    /// As [`Store::begin`].
    pub async fn begin_with(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        options: &RunOptions,
    ) -> Result<Begin, StoreError> {
        let counters = self.register(scope.operation());
        let counters = counters.as_deref();
        let span = telemetry::claim_span(scope.operation(), key.as_str());
        let policy = options.policy.clone().unwrap_or_else(|| self.shared_policy(scope.operation()));
        let answer = async {
            let claimant = || Claimant::new(scope, key, fingerprint, &policy);
            let Some(wait) = options.wait else {
                return self.claim(claimant(), options.heartbeat, None, None, counters).await;
            };
            let deadline = tokio::time::Instant::now() + wait;
            // Registered at the first "in flight" only: a claim that finds no owner pays nothing for waiting.
            let mut waiting: Option<Waiting> = None;
            let mut backoff = Duration::from_millis(5);
            loop {
                let answer = self.claim(claimant(), options.heartbeat, None, waiting.as_ref(), counters).await;
                let Ok(Begin::InFlight { retry_after }) = answer else { break answer };
                let now = tokio::time::Instant::now();
                if now >= deadline {
                    break answer;
                }
                let Some(waiting) = waiting.as_mut() else {
                    // Ask again at once, now flagged: a settlement from here on wakes this claim.
                    waiting = Some(self.waiting(scope, key, deadline).await);
                    continue;
                };
                // Zero: the owner just settled, or its claim is not visible yet; ask again soon.
                let pause = if retry_after.is_zero() {
                    let next = (backoff * 2).min(Duration::from_millis(200));
                    std::mem::replace(&mut backoff, next)
                } else {
                    retry_after.min(wakeup::RECHECK_EVERY)
                };
                let notified = waiting.watch.notified_before((now + pause).min(deadline)).await;
                telemetry::wait_wakeup(scope.operation(), notified);
            }
        }
        .instrument(span.clone())
        .await;
        record_outcome(counters, scope.operation(), &answer, &span);
        answer
    }

    /// [`Store::begin`] with the Postgres claim made inside a transaction that the caller commits (with
    /// the completion) or rolls back; under the policy of `options` (a wait does not apply). The
    /// transaction is begun only when Postgres is asked: a duplicate that Redis answers costs no `BEGIN`
    /// and no connection, and one that meets another transaction's lock on the key (which the claim
    /// takes) writes nothing and is answered at once from the record as committed. It is in `tx`
    /// afterwards (always, on [`Begin::Acquired`]).
    pub(crate) async fn begin_in(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        options: &RunOptions,
        tx: &mut LazyTx,
    ) -> Result<Begin, StoreError> {
        let counters = self.register(scope.operation());
        let counters = counters.as_deref();
        let span = telemetry::claim_span(scope.operation(), key.as_str());
        let policy = options.policy.clone().unwrap_or_else(|| self.shared_policy(scope.operation()));
        let claimant = Claimant::new(scope, key, fingerprint, &policy);
        let answer = self.claim(claimant, Heartbeat::Off, Some(tx), None, counters).instrument(span.clone()).await;
        record_outcome(counters, scope.operation(), &answer, &span);
        answer
    }

    /// Takes the Redis marker of a lease whose claim never committed (its transaction rolled back).
    pub(crate) async fn release_marker(&self, lease: &Lease) {
        if let Some(redis) = &self.inner.redis {
            let deleted = redis.release(&self.record_key(redis, lease), &lease.owner, Takeback::RolledBack).await;
            self.degrade(lease.scope.operation(), deleted);
        }
    }

    /// Mirrors a completion into Redis, after Postgres committed it, for no longer than Postgres keeps
    /// it: a replay from Redis never outlives the record. Then wakes the claims that wait for it.
    pub(crate) async fn cache_completion(&self, lease: &Lease, response: &[u8], retained: &Retained) {
        if let Some(redis) = &self.inner.redis {
            let ttl = redis_ttl(lease.policy.redis_ttl, retained.expires_in);
            let record_key = self.record_key(redis, lease);
            let put = redis.put(&record_key, State::Completed, lease.fingerprint.as_bytes(), "", response, millis(ttl));
            self.degrade(lease.scope.operation(), put.await);
        }
        if retained.waited {
            self.announce(lease).await;
        }
    }

    /// Tells the claims that asked Postgres to hear of this lease's settlement (see [`wakeup`]). Best
    /// effort: a waiter that misses it asks again within [`wakeup::RECHECK_EVERY`].
    async fn announce(&self, lease: &Lease) {
        if let Err(error) = self.inner.postgres.notify(crate::key::key_digest(&lease.scope, &lease.key).as_str()).await
        {
            tracing::debug!(%error, "could not announce a settlement; waiters ask again");
        }
    }

    /// Registers a claim that is about to wait (until `deadline`), and chooses how it asks to be woken:
    /// through Redis when this store's subscription there is open, else through Postgres.
    async fn waiting(&self, scope: &Scope, key: &IdempotencyKey, deadline: tokio::time::Instant) -> Waiting {
        let watch = self.inner.wakeups.watch(scope, key);
        let via_redis = match &self.inner.redis {
            Some(redis) => self.inner.wakeups.follows_redis(redis.budget()).await,
            None => false,
        };
        Waiting { watch, via_redis, deadline }
    }

    /// Flags the key's record in Postgres for a waiting claim; the pause before asking again:
    /// `retry_after`, or zero when the record is no longer in progress.
    async fn wait_in_postgres(
        &self,
        (scope, key): (&Scope, &IdempotencyKey),
        waiting: &Waiting,
        retry_after: Duration,
    ) -> Duration {
        let within =
            self.inner.postgres.timeout().min(waiting.deadline.saturating_duration_since(tokio::time::Instant::now()));
        if !self.inner.wakeups.follows_postgres(within).await {
            return retry_after;
        }
        match self.inner.postgres.wait(scope, key).await {
            Ok(false) => Duration::ZERO,
            Ok(true) | Err(_) => retry_after,
        }
    }

    /// Completes a lease claimed in `tx`; the caller commits, then calls [`Store::cache_completion`].
    pub(crate) async fn complete_in(
        &self,
        tx: &mut PgConnection,
        lease: &Lease,
        response: &[u8],
    ) -> Result<Retained, StoreError> {
        let stored = self.inner.postgres.complete(lease, response, Some(tx)).await;
        self.fenced_step(lease, "complete", stored)
    }

    /// Stores `response` as the result of the leased key ([`Owner::complete`]).
    /// Boxed, as [`Store::claim`] is: the caller's future does not nest the write's.
    pub(crate) fn complete<'a>(&'a self, lease: &'a Lease, response: &'a [u8]) -> Boxed<'a, Result<(), StoreError>> {
        let completing = async move {
            let stored = self.inner.postgres.complete(lease, response, None).await;
            let retained = self.fenced_step(lease, "complete", stored)?;
            // Fault tests: the process "dies" after the commit, before Redis hears of it.
            #[cfg(feature = "failpoints")]
            fail::fail_point!("complete-before-redis", |_| Ok(()));
            // Fault tests: the completion landed and its answer was lost (a connection broken after the commit).
            #[cfg(feature = "failpoints")]
            fail::fail_point!("complete-answer-lost", |_| Err(StoreError::StoreUnavailable {
                step: "complete",
                source: super::statement::timed_out(),
            }));
            self.cache_completion(lease, response, &retained).await;
            Ok(())
        };
        Box::pin(completing.instrument(lease.span("complete")))
    }

    /// Gives the key up ([`Owner::release`]).
    pub(crate) fn release<'a>(&'a self, lease: &'a Lease) -> Boxed<'a, Result<(), StoreError>> {
        let releasing = async move {
            let released = self.inner.postgres.release(lease).await;
            let waited = self.fenced_step(lease, "release", released)?;
            if let Some(redis) = &self.inner.redis {
                let deleted = redis.release(&self.record_key(redis, lease), &lease.owner, Takeback::Released).await;
                self.degrade(lease.scope.operation(), deleted);
            }
            if waited {
                self.announce(lease).await;
            }
            Ok(())
        };
        Box::pin(releasing.instrument(lease.span("release")))
    }

    /// Extends the lease by the policy's lease duration from now ([`Owner::extend`]).
    pub(crate) fn extend<'a>(&'a self, lease: &'a Lease) -> Boxed<'a, Result<(), StoreError>> {
        let extending = async move {
            let extended = self.inner.postgres.extend(lease).await;
            self.fenced_step(lease, "extend", extended.map(|matched| matched.then_some(())))?;
            if let Some(redis) = &self.inner.redis {
                let lease_ms = millis(lease.policy.lease);
                let extended = redis.extend(&self.record_key(redis, lease), &lease.owner, lease_ms).await;
                self.degrade(lease.scope.operation(), extended);
            }
            Ok(())
        };
        Box::pin(extending.instrument(lease.span("extend")))
    }

    /// A record as [`Admin::lookup`](crate::admin::Admin::lookup) reads it.
    pub(crate) async fn lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let record = self.lookup_stored(scope, key).await?.map(past_retention);
        let opened = record.map(|record| self.opened_record(scope, key, record)).transpose();
        if let Err(error) = &opened {
            telemetry::unreadable_response(scope.operation(), "postgres", error.reason());
        }
        Ok(opened?)
    }

    /// The record as Postgres stores it (its response sealed, with encryption).
    pub(crate) async fn lookup_stored(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, StoreError> {
        self.inner.postgres.lookup(scope, key).await
    }

    /// The claim, boxed: its state machine (Redis, Postgres, repair, waiting) is deep, and without the box
    /// every caller's future nests it, past the compiler's default query depth in applications that
    /// await `run_once` a few `async` layers down. The Postgres half is boxed apart: a request that Redis
    /// answers (a replay, a duplicate) builds and moves only the small Redis half.
    fn claim<'a>(
        &'a self,
        claimant: Claimant<'a>,
        heartbeat: Heartbeat,
        tx: Option<&'a mut LazyTx>,
        waiting: Option<&'a Waiting>,
        counters: Option<&'a OperationCounters>,
    ) -> Boxed<'a, Result<Begin, StoreError>> {
        Box::pin(async move {
            let mut tx = tx;
            let answer = self.claim_on_both_tiers(claimant, heartbeat, tx.as_deref_mut(), waiting, counters).await;
            if !matches!(answer, Ok(Begin::Expired)) || claimant.policy.tombstone != Some(Duration::ZERO) {
                return answer;
            }
            // The caller's policy keeps no tombstone: a record of it whose retention ended frees its key
            // (a window of key-less deduplication, see `DerivedKeys`). Renewed, the key is claimed again.
            let conn = tx.as_deref_mut().and_then(|lazy| lazy.as_deref_mut());
            if !self.inner.postgres.renew_expired(claimant.scope, claimant.key, conn).await? {
                // A transaction claims the key now, and will run it.
                return Ok(Begin::InFlight { retry_after: self.inner.postgres.lock_wait() });
            }
            self.claim_on_both_tiers(claimant, heartbeat, tx, waiting, counters).await
        })
    }

    /// One claim: Redis first when there is one, then Postgres.
    async fn claim_on_both_tiers(
        &self,
        claimant: Claimant<'_>,
        heartbeat: Heartbeat,
        tx: Option<&mut LazyTx>,
        waiting: Option<&Waiting>,
        counters: Option<&OperationCounters>,
    ) -> Result<Begin, StoreError> {
        let marked = match self.claim_in_redis(&claimant, waiting, counters).await {
            Ok(answer) => return answer,
            Err(marked) => marked,
        };
        self.claim_in_postgres(claimant.lease(), heartbeat, tx, waiting, marked).await
    }

    /// Redis's answer (`Ok`), or the way on to Postgres (`Err`), with the record key if the caller's
    /// marker is in Redis: Postgres then arbitrates, and Redis is repaired if it had lost what Postgres
    /// holds.
    async fn claim_in_redis<'a>(
        &'a self,
        claimant: &Claimant<'_>,
        waiting: Option<&Waiting>,
        counters: Option<&OperationCounters>,
    ) -> Result<Result<Begin, StoreError>, Marked<'a>> {
        let Claimant { scope, key, fingerprint, policy, owner } = claimant;
        let operation = scope.operation();
        let Some(redis) = &self.inner.redis else { return Err(None) };
        let record_key = redis.record_key(scope, key);
        let started = Instant::now();
        let lease_ms = millis(policy.lease);
        let waiter = waiting.filter(|waiting| waiting.via_redis).map(|waiting| waiting.watch.digest());
        // A caller that goes away while the script runs may leave its marker (the script runs anyway).
        let unanswered = Unanswered { store: self, marker: Some(&record_key), owner: owner.as_str(), operation };
        let begun = redis.begin(&record_key, fingerprint, owner.as_str(), lease_ms, waiter).await;
        unanswered.answered();
        match begun {
            Ok(answer) => {
                telemetry::claim_duration("redis", started.elapsed());
                let answer_is_claimed = answer == RedisBegin::Claimed;
                let answered = match answer {
                    RedisBegin::Claimed | RedisBegin::Unconfirmed => None,
                    RedisBegin::Completed(response) => {
                        match self.opened_for(fingerprint, scope, key, StoredResponse::new(response)) {
                            Ok(opened) => Some(Begin::Replayed(opened)),
                            // A copy that does not open is not trusted: it is dropped and Postgres, which
                            // holds the record, answers (the next request's miss repairs the copy).
                            Err(error) => {
                                telemetry::redis_lookup(counters, operation, "miss");
                                telemetry::unreadable_response(operation, "redis", error.reason());
                                self.evict_redis(scope, key).await;
                                return Err(None);
                            }
                        }
                    }
                    RedisBegin::InFlight { retry_after } => Some(Begin::InFlight { retry_after }),
                    RedisBegin::Mismatch => Some(Begin::Mismatch),
                    RedisBegin::Indeterminate => Some(Begin::Indeterminate),
                };
                if let Some(answer) = answered {
                    telemetry::redis_lookup(counters, operation, "hit");
                    return Ok(Ok(match answer {
                        // The marker could not carry the digest: the waiter asks Postgres instead.
                        Begin::InFlight { retry_after } if let Some(waiting) = waiting.filter(|_| waiter.is_none()) => {
                            Begin::InFlight {
                                retry_after: self.wait_in_postgres((scope, key), waiting, retry_after).await,
                            }
                        }
                        answer => answer,
                    }));
                }
                telemetry::redis_lookup(counters, operation, "miss");
                Err(answer_is_claimed.then_some((redis, record_key)))
            }
            Err(unavailable) => {
                telemetry::redis_lookup(counters, operation, "error");
                telemetry::redis_fallback(operation, unavailable.reason());
                Err(None)
            }
        }
    }

    /// The durable claim, and Redis repaired from what Postgres holds.
    fn claim_in_postgres<'a>(
        &'a self,
        candidate: Lease,
        heartbeat: Heartbeat,
        lazy: Option<&'a mut LazyTx>,
        waiting: Option<&'a Waiting>,
        marked: Marked<'a>,
    ) -> Boxed<'a, Result<Begin, StoreError>> {
        Box::pin(async move {
            let operation = candidate.scope.operation();
            let started = Instant::now();
            // Until Postgres answered and Redis holds what it said, a caller that goes away (a client
            // gone, a timeout, a wait for a pool connection cut short) must not leave its marker answering
            // "in flight" for work that never started, or whose claim is given back.
            let unanswered = Unanswered {
                store: self,
                marker: marked.as_ref().map(|(_, key)| key.as_str()),
                owner: &candidate.owner,
                operation,
            };
            // Only a claim that may acquire the key asks: Redis's answers (a replay, "in flight") write nothing.
            if let Err(refused) = self.refuse_clear_writes().await {
                unanswered.take_back().await;
                return Err(refused);
            }
            // The caller's transaction, begun now that Postgres is asked.
            let mut tx: Option<&mut PgConnection> = match lazy {
                None => None,
                Some(lazy) => {
                    if lazy.is_none() {
                        match self.begin_transaction(&candidate).await {
                            Ok(begun) => *lazy = Some(begun),
                            Err(error) => {
                                unanswered.take_back().await;
                                return Err(error);
                            }
                        }
                    }
                    lazy.as_deref_mut()
                }
            };
            // Redis missed the key, or there is no Redis: a new key is the common case, so the claim of a new
            // key goes first (in a shared statement, see `group_commit`), and the full claim only when the
            // key has a record. When Redis is out of reach, it says nothing of how likely a new key is.
            let likely_new = marked.is_some() || self.inner.redis.is_none();
            let claim = match self.inner.postgres.claim(&candidate, likely_new, tx.as_deref_mut()).await {
                Ok(ClaimAnswer::Claim(claim)) => claim,
                // Another transaction holds the key: nothing was written, and the answer is the record as
                // committed, at once, holding nothing while that transaction works.
                Ok(ClaimAnswer::Held(record)) => {
                    unanswered.take_back().await;
                    return self.answer_held(&candidate, record.as_ref()).await;
                }
                // Nothing runs and nothing is recorded: the marker goes too, so that a retry is not told
                // "in flight".
                Ok(ClaimAnswer::OverQuota { limit, retry_after }) => {
                    unanswered.take_back().await;
                    telemetry::quota_refusal(operation, limit);
                    return Ok(Begin::QuotaExceeded { limit, retry_after });
                }
                Err(error) => {
                    // Fail closed, and take the marker back so retries are not told "in flight" for work
                    // that never started.
                    unanswered.take_back().await;
                    // The row is locked past the lock timeout: an owner is working on it inside its own
                    // transaction (`run_once_in_tx`), which is what "in flight" means.
                    if is_lock_timeout(&error) {
                        return Ok(Begin::InFlight { retry_after: self.inner.postgres.lock_wait() });
                    }
                    return Err(error);
                }
            };
            telemetry::claim_duration("postgres", started.elapsed());

            if claim.acquired {
                if claim.took_over {
                    telemetry::lease_takeover(operation);
                }
                let policy = match claim.record.lease_expiry {
                    // The rule stored with the record wins over the caller's.
                    Some(rule) if rule != candidate.policy.lease_expiry => {
                        Arc::new(Policy { lease_expiry: rule, ..Policy::clone(&candidate.policy) })
                    }
                    _ => Arc::clone(&candidate.policy),
                };
                unanswered.answered();
                let lease = Lease { fence: claim.record.fence, policy, ..candidate };
                return Ok(Begin::Acquired(Owner::new(self.clone(), lease, heartbeat, tx.is_some())));
            }
            let mut answer = self.answer_from(&candidate, &claim.record, tx).await;
            if let (Some(waiting), Ok(Begin::InFlight { retry_after })) = (waiting, &mut answer)
                && claim.record.state == State::InProgress
                && !retry_after.is_zero()
            {
                *retry_after = self.wait_in_postgres((&candidate.scope, &candidate.key), waiting, *retry_after).await;
            }
            if let Some((redis, record_key)) = &marked {
                telemetry::reconciliation(operation);
                let state = match &answer {
                    Ok(Begin::Indeterminate) => State::Indeterminate,
                    Ok(_) => claim.record.state,
                    // Postgres failed while answering: no marker stays behind for a state nobody confirmed.
                    Err(_) => State::Released,
                };
                self.repair(redis, record_key, &candidate, &claim.record, state).await;
            }
            unanswered.answered();
            answer
        })
    }

    /// The answer for a key that Postgres holds and the caller did not acquire; on `tx` when the claim
    /// was made there.
    async fn answer_from(
        &self,
        candidate: &Lease,
        record: &Record,
        tx: Option<&mut PgConnection>,
    ) -> Result<Begin, StoreError> {
        if !record.matches(&candidate.fingerprint) {
            return Ok(Begin::Mismatch);
        }
        let remaining = record.lease_remaining.unwrap_or_default();
        let marks_indeterminate = record.lease_expiry == Some(LeaseExpiry::MarkIndeterminate);
        Ok(match record.state {
            State::Completed if record.expires_in == Some(Duration::ZERO) => Begin::Expired,
            State::Completed => {
                let stored = record.response.clone().unwrap_or_else(|| StoredResponse::new(Vec::new()));
                let (scope, key) = (&candidate.scope, &candidate.key);
                match self.opened(scope, key, &record.fingerprint, stored, true) {
                    Ok(opened) => Begin::Replayed(opened),
                    Err(error) => {
                        telemetry::unreadable_response(scope.operation(), "postgres", error.reason());
                        return Err(error.into());
                    }
                }
            }
            State::Expired => Begin::Expired,
            State::Indeterminate => Begin::Indeterminate,
            State::InProgress if remaining.is_zero() && marks_indeterminate => {
                let stale = Lease { fence: record.fence, ..candidate.clone() };
                let marked = self.inner.postgres.mark_indeterminate(&stale, tx).await;
                match marked? {
                    true => {
                        telemetry::indeterminate_marked();
                        Begin::Indeterminate
                    }
                    // The owner extended or finished meanwhile: a retry sees which.
                    false => Begin::InFlight { retry_after: Duration::ZERO },
                }
            }
            // A released record with this fingerprint is always re-acquired by the claim, so only an
            // owner that is still working (or one that just finished) lands here.
            State::InProgress | State::Released => Begin::InFlight { retry_after: remaining },
        })
    }

    /// The answer for a key whose lock another transaction holds, from its record as committed: a settled
    /// record answers as ever (a replay, a refusal), which writes nothing; a live lease is "in flight" (or
    /// refuses another payload); otherwise (no record, a released one, a lease that ran out) that
    /// transaction is claiming the key now, which is "in flight" too, whatever this payload.
    async fn answer_held(&self, candidate: &Lease, record: Option<&Record>) -> Result<Begin, StoreError> {
        match record {
            Some(record) if matches!(record.state, State::Completed | State::Expired | State::Indeterminate) => {
                self.answer_from(candidate, record, None).await
            }
            Some(record @ Record { state: State::InProgress, lease_remaining: Some(remaining), .. })
                if !remaining.is_zero() =>
            {
                Ok(match record.matches(&candidate.fingerprint) {
                    true => Begin::InFlight { retry_after: *remaining },
                    false => Begin::Mismatch,
                })
            }
            _ => Ok(Begin::InFlight { retry_after: self.inner.postgres.lock_wait() }),
        }
    }

    /// Writes into Redis what Postgres holds, replacing the caller's marker. `state` is the record's
    /// state after this request (it may just have been marked indeterminate).
    ///
    /// Another owner's in-progress marker is never written here: Postgres may have settled that lease
    /// since it was read (a release racing this repair would leave a marker answering "in flight" for a
    /// lease nobody holds). The caller's own marker is taken back instead, and duplicates ask Postgres
    /// until the owner completes and writes the result.
    async fn repair(&self, redis: &RedisTier, record_key: &str, candidate: &Lease, record: &Record, state: State) {
        let (response, ttl) = match state {
            State::Completed if record.expires_in != Some(Duration::ZERO) => {
                let response = record.response.as_ref().map_or(&[][..], StoredResponse::as_bytes);
                (response, redis_ttl(candidate.policy.redis_ttl, record.expires_in))
            }
            State::Indeterminate => (&[][..], candidate.policy.lease),
            _ => {
                let takeback = redis.release(record_key, &candidate.owner, Takeback::Unclaimed);
                self.degrade(candidate.scope.operation(), takeback.await);
                return;
            }
        };
        let put = redis.put(record_key, state, &record.fingerprint, "", response, millis(ttl));
        self.degrade(candidate.scope.operation(), put.await);
    }

    /// Maps a fenced Postgres write: no row matched means the lease was lost.
    /// Counted apart from the claim's outcome, which was counted when the key was claimed.
    fn fenced_step<T>(
        &self,
        lease: &Lease,
        step: &'static str,
        result: Result<Option<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let operation = lease.scope.operation();
        match result {
            Ok(Some(done)) => Ok(done),
            Ok(None) => {
                telemetry::settle_failure(operation, step, "lease_lost");
                Err(StoreError::LeaseLost { fence: lease.fence })
            }
            Err(error) => {
                telemetry::settle_failure(operation, step, "error");
                Err(error)
            }
        }
    }

    /// A Redis write that failed leaves Redis behind Postgres, which the next miss reconciles.
    fn degrade<T>(&self, operation: &str, result: Result<T, super::redis_tier::RedisUnavailable>) {
        if let Err(unavailable) = result {
            telemetry::redis_fallback(operation, unavailable.reason());
        }
    }

    /// Registers the operation's metric series at 0 the first time it is seen.
    pub(super) fn register(&self, operation: &str) -> Option<Arc<OperationCounters>> {
        self.inner.registered.operation(operation, self.inner.redis.is_some(), self.inner.encryption.is_some())
    }

    fn record_key(&self, redis: &RedisTier, lease: &Lease) -> String {
        redis.record_key(&lease.scope, &lease.key)
    }
}

/// The lease a new claim of `key` would hold, with an owner token of its own, before Postgres gave it a
/// fence (a batch claim's, [`Store::begin_many`]).
pub(super) fn candidate_lease(
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
    policy: &Arc<Policy>,
) -> Lease {
    Claimant::new(scope, key, fingerprint, policy).lease()
}

/// A protocol step's future behind a box, so that callers' futures do not nest its state machine.
type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A claim before Postgres is asked: borrowed from the caller, with its owner token on the stack, so that
/// a request Redis answers (a replay, a duplicate) builds nothing owned. Postgres's half makes the
/// [`Lease`] from it.
#[derive(Clone, Copy)]
struct Claimant<'a> {
    scope: &'a Scope,
    key: &'a IdempotencyKey,
    fingerprint: &'a Fingerprint,
    policy: &'a Arc<Policy>,
    owner: OwnerToken,
}

impl<'a> Claimant<'a> {
    fn new(scope: &'a Scope, key: &'a IdempotencyKey, fingerprint: &'a Fingerprint, policy: &'a Arc<Policy>) -> Self {
        Self { scope, key, fingerprint, policy, owner: OwnerToken::new() }
    }

    /// The lease this claim would hold, before Postgres gave it a fence.
    fn lease(&self) -> Lease {
        Lease {
            scope: self.scope.clone(),
            key: self.key.clone(),
            fingerprint: self.fingerprint.clone(),
            fence: 0,
            owner: self.owner.as_str().to_owned(),
            policy: Arc::clone(self.policy),
        }
    }
}

/// A claim's owner token: 128 random bits as 32 hex digits, which no other claim has. A record and its
/// Redis marker name their owner by it.
#[derive(Clone, Copy)]
struct OwnerToken([u8; 32]);

impl OwnerToken {
    fn new() -> Self {
        let mut digits = [0; 32];
        crate::fingerprint::write_hex(&rand::random::<u128>().to_be_bytes(), &mut digits);
        Self(digits)
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

/// The Redis tier and record key when the caller's marker is in Redis.
type Marked<'a> = Option<(&'a RedisTier, String)>;

/// A claim's marker in Redis while the caller has not heard its claim's answer: dropped before
/// [`Unanswered::answered`] (the caller went away while Redis or Postgres was asked), it takes the marker
/// back in a task of the store's, which a shutdown waits for. Whatever Postgres then does with the claim
/// (it is given back if it was acquired for nobody), no retry is told "in flight" by this marker. Costs
/// nothing unless dropped so: it only borrows.
struct Unanswered<'a> {
    store: &'a Store,
    /// The record key, while the caller's marker may be in Redis.
    marker: Option<&'a str>,
    owner: &'a str,
    operation: &'a str,
}

impl Unanswered<'_> {
    /// The caller has its answer, and Redis what it says: nothing to take back.
    fn answered(mut self) {
        self.marker = None;
    }

    /// The caller gets an answer that leaves nothing for its marker to say: the marker goes now, before
    /// the answer (cancelled meanwhile, the guard still takes it back).
    async fn take_back(mut self) {
        if let (Some(record_key), Some(redis)) = (self.marker, &self.store.inner.redis) {
            let released = redis.release(record_key, self.owner, Takeback::Unclaimed).await;
            self.store.degrade(self.operation, released);
        }
        self.marker = None;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        let Some(record_key) = self.marker.take() else { return };
        let (store, record_key) = (self.store.clone(), record_key.to_owned());
        let (owner, operation) = (self.owner.to_owned(), self.operation.to_owned());
        // Sent after the script, most often on its connection, where a script that runs at all runs first;
        // the take-back deletes only a marker with this owner's token. (On a connection replaced in between,
        // or a script a cluster client sends again, the take-back may come first: the marker then stays for
        // its lease, as a marker of a process that died there does.)
        let taking_back = async move {
            if let Some(redis) = &store.inner.redis {
                store.degrade(&operation, redis.release(&record_key, &owner, Takeback::Unclaimed).await);
            }
        };
        self.store.inner.background.settle(taking_back.in_current_span());
    }
}

/// How a claim that waits for an in-flight duplicate asks to be woken.
struct Waiting {
    watch: Watch,
    /// This store follows Redis: the claim's marker lookups carry the key's digest.
    via_redis: bool,
    /// When the wait ends: no step of it waits past that.
    deadline: tokio::time::Instant,
}

/// Whether Postgres gave up waiting for a row lock (`lock_timeout`, SQLSTATE 55P03).
fn is_lock_timeout(error: &StoreError) -> bool {
    let StoreError::StoreUnavailable { source, .. } = error else { return false };
    source.as_database_error().and_then(|e| e.code()).is_some_and(|code| code == "55P03")
}

/// How long Redis may keep a completed record: its TTL, never past the record's expiry in Postgres.
fn redis_ttl(ttl: Duration, expires_in: Option<Duration>) -> Duration {
    expires_in.map_or(ttl, |expires_in| ttl.min(expires_in))
}

/// Counts the answer of a claim by operation, and records it in the claim's span.
fn record_outcome(
    counters: Option<&OperationCounters>,
    operation: &str,
    answer: &Result<Begin, StoreError>,
    span: &tracing::Span,
) {
    let outcome = answer.as_ref().map_or(crate::Outcome::Error, Begin::outcome).label();
    span.record("outcome", outcome);
    if let Ok(Begin::Acquired(owner)) = answer {
        span.record("fence", owner.fence());
    }
    telemetry::outcome(counters, operation, outcome);
}

/// A completed record past its retention, as it is answered: expired, its response no longer shown.
fn past_retention(mut record: Record) -> Record {
    if record.state == State::Completed && record.expires_in == Some(Duration::ZERO) {
        record.state = State::Expired;
        record.response = None;
    }
    record
}
