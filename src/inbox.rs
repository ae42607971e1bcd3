//! The webhook inbox: consumers of at-least-once deliveries (webhooks, queue messages) run their
//! handler once per event, however often the provider re-delivers it.

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{InputError, StoreError};
use crate::key::{IdempotencyKey, Scope};
use crate::options::RunOptions;
use crate::policy::{Policy, Tier};
use crate::run_once::{RunError, RunOutcome};
use crate::store::Store;

/// One consumer's inbox (for example `"stripe"`), on the same store as everything else.
#[derive(Clone, Debug)]
pub struct Inbox {
    store: Store,
    scope: Scope,
    /// The webhook tier, unless [`Inbox::with_policy`] says otherwise.
    options: RunOptions,
}

/// What [`Inbox::receive`] did with a delivery.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Received<T> {
    /// First delivery of this event: the handler ran and its outcome is recorded.
    Handled(T),
    /// The event was handled before: acknowledge it; `outcome` is what the handler answered then.
    Duplicate {
        /// The recorded outcome.
        outcome: T,
        /// The provider's sequence number of the first delivery, if it sent one.
        sequence: Option<i64>,
    },
    /// Another delivery of this event is being handled now: ask the provider to retry later.
    InProgress {
        /// Time left on that delivery's lease.
        retry_after: Duration,
    },
    /// The same event id arrived with a different payload: not handled; look into it.
    Conflict,
    /// An earlier delivery ended without an answer (`MarkIndeterminate`); an operator must resolve it.
    Indeterminate,
    /// The event was handled so long ago that its record was purged; a tombstone says it ran. Acknowledge it.
    Expired,
}

/// What the store keeps for each event: the handler's outcome and the provider's sequence number.
/// Out-of-order deliveries are the handler's concern; the sequence is kept for it to compare.
#[derive(Serialize, Deserialize)]
struct Entry<T> {
    sequence: Option<i64>,
    outcome: T,
}

impl Store {
    /// The inbox of `consumer` (a provider name). Its records live under the operation `inbox` of the
    /// tenant `consumer`, with the [`Tier::Webhook`] policy (7 days, since providers retry for days)
    /// unless [`Inbox::with_policy`] says otherwise.
    ///
    /// # Errors
    /// [`InputError::InvalidScope`] if `consumer` is not a valid tenant name.
    pub fn inbox(&self, consumer: impl Into<String>) -> Result<Inbox, InputError> {
        let options = RunOptions::default().policy(Policy::tier(Tier::Webhook));
        Ok(Inbox { store: self.clone(), scope: Scope::new(consumer, "inbox")?, options })
    }
}

impl Inbox {
    /// Uses `policy` instead of the webhook tier.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.options = self.options.policy(policy);
        self
    }

    /// Runs `handler` for the first delivery of `event_id` and records its outcome; later deliveries
    /// are acknowledged from the record. A handler `Err` records nothing, so the next delivery runs it
    /// again.
    ///
    /// # Errors
    /// [`InputError`] for an event id that is not a valid key; otherwise as [`Store::run_once`].
    pub async fn receive<P, T, E, F, Fut>(
        &self,
        event_id: &str,
        sequence: Option<i64>,
        payload: &P,
        handler: F,
    ) -> Result<Received<T>, RunError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let key = IdempotencyKey::new(event_id).map_err(StoreError::from)?;
        let work = || async move { handler().await.map(|outcome| Entry { sequence, outcome }) };
        let outcome = self.store.run_once_with(&self.scope, &key, payload, &self.options, work).await?;
        Ok(match outcome {
            RunOutcome::Executed(entry) => Received::Handled(entry.outcome),
            RunOutcome::Replayed(entry) => Received::Duplicate { outcome: entry.outcome, sequence: entry.sequence },
            RunOutcome::InFlight { retry_after } => Received::InProgress { retry_after },
            RunOutcome::Mismatch => Received::Conflict,
            RunOutcome::Indeterminate => Received::Indeterminate,
            RunOutcome::Expired => Received::Expired,
        })
    }
}
