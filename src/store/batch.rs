//! Batch claims for bulk APIs: many keys of one scope claimed in one statement and completed in one
//! more, each item with a verdict of its own ([`Store::begin_many`], [`Store::complete_many`]).
//!
//! Why: a bulk request of a hundred items claimed one by one pays a hundred round trips and commits; the
//! claim of new keys and the fenced completion already exist as one statement over arrays (group
//! commit's [`CLAIM_NEW_BATCH`] and [`COMPLETE_BATCH`]), so a batch sends those, now, for its own items.
//! What they cannot answer on their own (a key that has a record: a replay, a mismatch, a duplicate in
//! flight, a released key to re-acquire; a row another transaction holds) each item asks as a single
//! claim does, so every item keeps every guarantee of [`Store::begin`]: nothing runs before its claim is
//! durable, one winner per key, another payload refused.
//!
//! The batch writes Postgres only: its new keys have no Redis marker (a concurrent single claim meets
//! their records in Postgres), and its completions reach Redis as single ones do.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::future::join_all;
use tokio::sync::oneshot;

use super::awaiting::Awaiting;
use super::group_commit::{self, Completion, Job as _, NewClaim, out_of_reach};
use super::postgres_tier::{CLAIM_NEW_BATCH, COMPLETE_BATCH, Retained};
use super::protocol::candidate_lease;
use super::{Begin, Owner, Store, statement};
use crate::error::{InputError, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope, key_digest};
use crate::options::Heartbeat;
use crate::record::{Lease, Record};
use crate::telemetry;

/// The most items one batch claims: its arrays travel as one message to Postgres.
pub const MAX_BATCH_ITEMS: usize = 1000;

/// What [`Store::begin_many`] answered one item.
#[derive(Debug)]
#[non_exhaustive]
pub enum BatchBegin {
    /// The item's claim, as [`Store::begin`] answers it: acquired (run it, then complete), replayed, in
    /// flight, refused.
    Begun(Begin),
    /// The item repeats the key and payload of an earlier item of the batch (at index `of`): it is not
    /// claimed, and the earlier item's verdict is the key's. The key with another payload is
    /// `Begun(Begin::Mismatch)`.
    Duplicate {
        /// The index of the key's first item in the batch.
        of: usize,
    },
}

impl Store {
    /// Claims the items of a batch (their keys under one `scope`), each with a verdict of its own, in
    /// their order: new keys in one statement, the rest as [`Store::begin`] claims them. Work may run
    /// for each [`Begin::Acquired`] item, as after `begin`; settle the owners with
    /// [`Store::complete_many`] (one statement) or one by one. An item whose key an earlier item holds is
    /// [`BatchBegin::Duplicate`]. Under a policy with a [`crate::Quota`] every item is claimed alone
    /// (the quota counts claims one by one).
    ///
    /// ```no_run
    /// # async fn bulk(store: idemstore::Store, scope: idemstore::Scope,
    /// #               items: Vec<(idemstore::IdempotencyKey, idemstore::Fingerprint)>) -> Result<(), idemstore::StoreError> {
    /// use idemstore::{BatchBegin, Begin};
    /// let mut owners = Vec::new();
    /// for verdict in store.begin_many(&scope, &items).await? {
    ///     match verdict {
    ///         BatchBegin::Begun(Begin::Acquired(owner)) => owners.push((owner, b"done".to_vec())),
    ///         other => println!("{other:?}"),
    ///     }
    /// }
    /// // ... the items' work, then one statement for all of them ...
    /// for stored in store.complete_many(owners).await {
    ///     stored?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`InputError::BatchTooLarge`] past [`MAX_BATCH_ITEMS`]; [`StoreError::StoreUnavailable`] when
    /// Postgres could not be asked (nothing may run then, for any item; items already answered are
    /// given back).
    pub async fn begin_many(
        &self,
        scope: &Scope,
        items: &[(IdempotencyKey, Fingerprint)],
    ) -> Result<Vec<BatchBegin>, StoreError> {
        if items.len() > MAX_BATCH_ITEMS {
            return Err(InputError::BatchTooLarge { items: items.len(), max: MAX_BATCH_ITEMS }.into());
        }
        let mut verdicts: Vec<Option<BatchBegin>> = items.iter().map(|_| None).collect();
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(items.len());
        for (at, (key, fingerprint)) in items.iter().enumerate() {
            if let Some(&of) = first.get(key.as_str()) {
                // Another payload under a key already in the batch is refused, as a claim would refuse it.
                let same = items[of].1.as_bytes() == fingerprint.as_bytes();
                verdicts[at] =
                    Some(if same { BatchBegin::Duplicate { of } } else { BatchBegin::Begun(Begin::Mismatch) });
            } else {
                first.insert(key.as_str(), at);
            }
        }
        let policy = self.shared_policy(scope.operation());
        let unique: Vec<usize> = (0..items.len()).filter(|&at| verdicts[at].is_none()).collect();
        if policy.quota.is_off() && !unique.is_empty() {
            self.refuse_clear_writes().await?;
            let jobs: Vec<NewClaim> = unique
                .iter()
                .map(|&at| {
                    let (key, fingerprint) = &items[at];
                    NewClaim {
                        lease: candidate_lease(scope, key, fingerprint, &policy),
                        digest: key_digest(scope, key),
                    }
                })
                .collect();
            let claimed = self.claim_together(jobs).await?;
            let counters = self.register(scope.operation());
            for (&at, acquired) in unique.iter().zip(claimed) {
                if let Some(lease) = acquired {
                    telemetry::outcome(counters.as_deref(), scope.operation(), crate::Outcome::Executed.label());
                    let owner = Owner::new(self.clone(), lease, Heartbeat::Auto, false);
                    verdicts[at] = Some(BatchBegin::Begun(Begin::Acquired(owner)));
                }
            }
        }
        // What one statement could not answer, each item asks as a single claim. The keys acquired so
        // far are held by a guard meanwhile: should the caller leave, or an item fail, they are given up
        // (nothing ran for them), whatever the lease-expiry rule.
        let mut acquired = GiveUp { owners: Vec::new(), store: self.clone() };
        for (at, verdict) in verdicts.iter_mut().enumerate() {
            if matches!(verdict, Some(BatchBegin::Begun(Begin::Acquired(_))))
                && let Some(BatchBegin::Begun(Begin::Acquired(owner))) = verdict.take()
            {
                acquired.owners.push((at, owner));
            }
        }
        let alone: Vec<usize> = (0..items.len()).filter(|&at| verdicts[at].is_none() && !acquired.holds(at)).collect();
        let answers = join_all(alone.iter().map(|&at| self.begin(scope, &items[at].0, &items[at].1))).await;
        for (at, answer) in alone.into_iter().zip(answers) {
            // An item that failed fails the batch: the guard gives up what was acquired.
            verdicts[at] = Some(BatchBegin::Begun(answer?));
        }
        for (at, owner) in std::mem::take(&mut acquired.owners) {
            verdicts[at] = Some(BatchBegin::Begun(Begin::Acquired(owner)));
        }
        Ok(verdicts.into_iter().map(|verdict| verdict.expect("every item has a verdict")).collect())
    }

    /// Stores each owner's response (the results of [`Store::begin_many`]'s work, or of any claims) in
    /// one statement; an answer per owner, in their order, as [`Owner::complete`] answers. A response
    /// the statement cannot store on its own (one too large for it, a row another transaction holds,
    /// a lease lost or a statement that failed) is stored by [`Owner::complete`], which says why not.
    ///
    /// The writes run in a task of their own, as [`Owner::complete`]'s do: a caller that stops waiting
    /// (a client gone) does not drop owners whose work already ran.
    pub async fn complete_many(&self, completions: Vec<(Owner, Vec<u8>)>) -> Vec<Result<(), StoreError>> {
        let count = completions.len();
        let store = self.clone();
        let Some(settling) = self.background().settle(async move { store.complete_together(completions).await }) else {
            return (0..count).map(|_| Err(COMPLETE_BATCH.failed(sqlx::Error::WorkerCrashed))).collect();
        };
        match settling.await {
            Ok(stored) => stored,
            Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
            Err(_) => (0..count).map(|_| Err(COMPLETE_BATCH.failed(sqlx::Error::WorkerCrashed))).collect(),
        }
    }

    /// [`Store::complete_many`]'s writes.
    async fn complete_together(&self, completions: Vec<(Owner, Vec<u8>)>) -> Vec<Result<(), StoreError>> {
        let sealed: Vec<Vec<u8>> =
            completions.iter().map(|(owner, response)| self.sealed(owner.lease(), response).into_owned()).collect();
        let jobs: Vec<Completion> = completions
            .iter()
            .zip(&sealed)
            .map(|((owner, _), sealed)| Completion { lease: owner.lease().clone(), response: sealed.clone() })
            .collect();
        let mut sent: Vec<Option<Retained>> = jobs.iter().map(|_| None).collect();
        let fit: Vec<usize> =
            (0..jobs.len()).filter(|&at| !completions[at].0.in_tx() && Completion::fits(&jobs[at].response)).collect();
        if !fit.is_empty() {
            let refs: Vec<&Completion> = fit.iter().map(|&at| &jobs[at]).collect();
            let pool = self.pg_pool();
            let stored =
                statement::bounded(self.postgres_timeout(), &COMPLETE_BATCH, Completion::send(pool, &refs)).await;
            if let Ok(answers) = stored {
                for (&at, answer) in fit.iter().zip(answers) {
                    sent[at] = answer;
                }
            }
        }
        let settled =
            completions.into_iter().zip(sealed).zip(sent).map(|(((owner, response), sealed), retained)| async move {
                let Some(retained) = retained else { return owner.complete(&response).await };
                let lease = owner.lease().clone();
                owner.settled_elsewhere();
                self.cache_completion(&lease, &sealed, &retained).await;
                Ok(())
            });
        join_all(settled).await
    }

    /// Sends the claims of `jobs` as one statement, on a settlement: a caller cancelled meanwhile has
    /// what was claimed for it given back. The acquired leases (with their fences) in the jobs' order,
    /// `None` where a key was not new; every `None` when the statement failed on some row's account.
    async fn claim_together(&self, jobs: Vec<NewClaim>) -> Result<Vec<Option<Lease>>, StoreError> {
        let (pool, timeout) = (self.pg_pool().clone(), self.postgres_timeout());
        let count = jobs.len();
        let jobs = Arc::new(jobs);
        let (reply, answer) = oneshot::channel::<Result<Vec<Option<Record>>, StoreError>>();
        let sending = {
            let (pool, jobs) = (pool.clone(), Arc::clone(&jobs));
            async move {
                // In the order of their keys, as every batch writes, so that two never wait in a circle.
                let mut order: Vec<usize> = (0..jobs.len()).collect();
                order.sort_by(|&a, &b| group_commit::order(&jobs[a].lease).cmp(&group_commit::order(&jobs[b].lease)));
                let sorted: Vec<&NewClaim> = order.iter().map(|&at| &jobs[at]).collect();
                let sent = statement::bounded(timeout, &CLAIM_NEW_BATCH, NewClaim::send(&pool, &sorted)).await;
                let claimed = sent.map(|answers| {
                    let mut claimed: Vec<Option<Record>> = (0..jobs.len()).map(|_| None).collect();
                    for (at, answer) in order.into_iter().zip(answers) {
                        claimed[at] = answer.flatten();
                    }
                    claimed
                });
                if let Err(Ok(unheard)) = reply.send(claimed) {
                    give_back_all(&jobs, unheard, &pool, timeout).await;
                }
            }
        };
        if self.background().settle(sending).is_none() {
            return Err(CLAIM_NEW_BATCH.failed(sqlx::Error::WorkerCrashed));
        }
        let undo = |answered: Result<Vec<Option<Record>>, StoreError>| {
            let Ok(unheard) = answered else { return };
            let (pool, jobs) = (pool.clone(), Arc::clone(&jobs));
            self.background().settle(async move { give_back_all(&jobs, unheard, &pool, timeout).await });
        };
        let mut awaiting = Awaiting::new(answer, undo);
        let claimed = match (&mut awaiting.answer).await {
            Ok(Ok(claimed)) => claimed,
            // Each item would fail the same way alone.
            Ok(Err(error)) if out_of_reach(&error).is_some() => return Err(error),
            // The statement failed on some row's account: every item asks alone.
            Ok(Err(_)) => return Ok((0..count).map(|_| None).collect()),
            Err(_) => return Err(CLAIM_NEW_BATCH.failed(sqlx::Error::WorkerCrashed)),
        };
        Ok(jobs
            .iter()
            .zip(claimed)
            .map(|(job, record)| record.map(|record| Lease { fence: record.fence, ..job.lease.clone() }))
            .collect())
    }
}

/// Gives back every claim of `jobs` that was acquired for a caller who left.
async fn give_back_all(
    jobs: &[NewClaim],
    unheard: Vec<Option<Record>>,
    pool: &sqlx::PgPool,
    timeout: std::time::Duration,
) {
    for (job, record) in jobs.iter().zip(unheard) {
        if record.is_some() {
            job.unheard(record, pool, timeout).await;
        }
    }
}

/// The owners a batch acquired while its other items are still being asked; dropped holding any (the
/// caller left, an item failed), it gives their keys up in a settlement.
struct GiveUp {
    owners: Vec<(usize, Owner)>,
    store: Store,
}

impl GiveUp {
    fn holds(&self, at: usize) -> bool {
        self.owners.iter().any(|(held, _)| *held == at)
    }
}

impl Drop for GiveUp {
    fn drop(&mut self) {
        let owners = std::mem::take(&mut self.owners);
        if owners.is_empty() {
            return;
        }
        self.store.background().settle(async move {
            for (_, owner) in owners {
                if let Err(error) = owner.release().await {
                    tracing::debug!(%error, "could not give up a batch's key; its lease runs out instead");
                }
            }
        });
    }
}
