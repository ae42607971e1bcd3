//! The webhook inbox: consumers of at-least-once deliveries (webhooks, queue messages) run their
//! handler once per event, however often the provider re-delivers it.
//!
//! A delivery's identity is (consumer, event id); its body is not. Providers re-deliver an event with
//! bookkeeping changed (Stripe counts `pending_webhooks` down), so comparing whole bodies would refuse
//! every re-delivery after a failed first attempt, for as long as the record is kept. By default the
//! body is not compared at all; [`Inbox::compare_fields`] names the fields whose change is a conflict.
//!
//! A delivery's id must come from the provider: [`Inbox::verify`] checks its signature (see
//! [`WebhookVerifier`]) and takes the id from what was signed. Give each sender its own inbox, with its
//! own verifier and secret: an inbox with a verifier takes only the [`VerifiedDelivery`] that verifier
//! checked, never a bare id or another verifier's delivery, so code that verified with one sender's
//! verifier cannot record the event in another's inbox. (A secret shared by two senders still lets a
//! delivery of one verify at the other's endpoint: only separate secrets prevent that.)

mod signature;

pub use signature::{
    DEFAULT_TOLERANCE, DeliveryHeaders, EventId, MAX_TOLERANCE, SignatureScheme, VerifiedDelivery, WebhookVerifier,
};

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use sqlx::postgres::PgConnection;

use crate::error::{InputError, SignatureError, StoreError};
use crate::fingerprint::{Fingerprint, FingerprintOptions};
use crate::key::{IdempotencyKey, Scope};
use crate::options::RunOptions;
use crate::policy::{Policy, Tier};
use crate::run_once::{RunError, RunOutcome, TxFuture};
use crate::store::Store;

/// One consumer's inbox (for example `"stripe"`), on the same store as everything else.
#[derive(Clone, Debug)]
pub struct Inbox {
    store: Store,
    scope: Scope,
    /// The webhook tier, unless [`Inbox::with_policy`] says otherwise.
    options: RunOptions,
    /// The fields compared between deliveries of one event; none by default.
    compared: Option<FingerprintOptions>,
    /// The provider's signature check, for [`Inbox::verify`].
    verifier: Option<WebhookVerifier>,
}

/// What [`Inbox::receive`] did with a delivery, named as in every API ([`crate::Outcome`]).
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Received<T> {
    /// First delivery of this event: the handler ran and its outcome is recorded.
    Executed(T),
    /// The event was handled before: acknowledge it; `result` is what the handler answered then.
    Replayed {
        /// What the handler answered then.
        result: T,
        /// The provider's sequence number of the first delivery, if it sent one.
        sequence: Option<i64>,
    },
    /// Another delivery of this event is being handled now: ask the provider to retry later.
    InFlight {
        /// Time left on that delivery's lease.
        retry_after: Duration,
    },
    /// The same event id arrived with a different payload: not handled; look into it.
    Mismatch,
    /// An earlier delivery ended without an answer (`MarkIndeterminate`); an operator must resolve it.
    Indeterminate,
    /// The event was handled so long ago that its record was purged; a tombstone says it ran. Acknowledge it.
    Expired,
    /// The event was handled, and its outcome could not be recorded (it did not serialize): acknowledge
    /// it; it is not handled again.
    NotReplayable,
    /// The sender (the inbox's tenant) reached a limit of the policy's [`crate::Quota`]: not handled,
    /// nothing recorded; ask the provider to retry after `retry_after`.
    QuotaExceeded {
        /// The limit that was reached.
        limit: crate::QuotaLimit,
        /// When a place should free up (see [`crate::Begin::QuotaExceeded`]).
        retry_after: Duration,
    },
}

impl<T> Received<T> {
    /// This answer in the vocabulary every API shares.
    pub fn outcome(&self) -> crate::Outcome {
        use crate::Outcome;
        match self {
            Received::Executed(_) => Outcome::Executed,
            Received::Replayed { .. } => Outcome::Replayed,
            Received::InFlight { .. } => Outcome::InFlight,
            Received::Mismatch => Outcome::Mismatch,
            Received::Indeterminate => Outcome::Indeterminate,
            Received::Expired => Outcome::Expired,
            Received::NotReplayable => Outcome::NotReplayable,
            Received::QuotaExceeded { .. } => Outcome::QuotaExceeded,
        }
    }
}

/// The handler of [`Inbox::receive_in_tx`], its outcome wrapped in an [`Entry`].
fn recorded_with<T, E, F>(
    sequence: Option<i64>,
    handler: F,
) -> impl for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, Entry<T>, E>
where
    T: Send + 'static,
    E: Send + 'static,
    F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T, E>,
{
    move |tx| {
        let handled = handler(tx);
        Box::pin(async move { handled.await.map(|outcome| Entry { sequence, outcome }) })
    }
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
        Ok(Inbox {
            store: self.clone(),
            scope: Scope::new(consumer, "inbox")?,
            options,
            compared: None,
            verifier: None,
        })
    }
}

impl Inbox {
    /// Uses `policy` instead of the webhook tier.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.options = self.options.policy(policy);
        self
    }

    /// Checks deliveries with `verifier` in [`Inbox::verify`].
    pub fn verified_by(mut self, verifier: WebhookVerifier) -> Self {
        self.verifier = Some(verifier);
        self
    }

    /// Checks a delivery's signature, before anything is read or written, and returns its event id
    /// (from the signed material only) for [`Inbox::receive`], which takes it only from this inbox's
    /// verifier. A refused delivery must not be acknowledged: its sender was not the provider, or it
    /// was captured and sent again too late.
    ///
    /// ```
    /// # async fn handle(store: idemstore::Store, headers: http::HeaderMap, body: bytes::Bytes) -> Result<(), Box<dyn std::error::Error>> {
    /// use idemstore::{SignatureScheme, WebhookVerifier};
    ///
    /// let secret = std::env::var("STRIPE_WEBHOOK_SECRET")?;
    /// let inbox = store.inbox("stripe")?.verified_by(WebhookVerifier::new(SignatureScheme::Stripe, [secret])?);
    /// let delivery = inbox.verify(&headers, &body)?; // Err: answer 400, or 401 if `is_unauthorized()`
    /// let event: serde_json::Value = serde_json::from_slice(&body)?;
    /// inbox.receive(&delivery, None, &event, || async { Ok::<_, std::io::Error>(()) }).await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`SignatureError::NoVerifier`] without [`Inbox::verified_by`]; otherwise as
    /// [`WebhookVerifier::verify`].
    pub fn verify<H: DeliveryHeaders + ?Sized>(
        &self,
        headers: &H,
        body: &[u8],
    ) -> Result<VerifiedDelivery, SignatureError> {
        self.verifier.as_ref().ok_or(SignatureError::NoVerifier)?.verify(headers, body)
    }

    /// Refuses a delivery as [`Received::Mismatch`] when one of these fields (JSON pointers, such as
    /// `/type` or `/data/object/amount`) differs from the first delivery's; all other fields may change.
    /// Without it, deliveries of one event are never compared.
    ///
    /// # Errors
    /// [`InputError::InvalidPointer`] for a pointer that does not start with `/`.
    pub fn compare_fields<'p>(mut self, pointers: impl IntoIterator<Item = &'p str>) -> Result<Self, InputError> {
        let options = pointers
            .into_iter()
            .try_fold(FingerprintOptions::default(), |options, pointer| options.compare_only(pointer))?;
        self.compared = Some(options);
        Ok(self)
    }

    /// Runs `handler` for the first delivery of `event` and records its outcome; later deliveries
    /// are acknowledged from the record. A handler `Err` records nothing, so the next delivery runs it
    /// again, whatever changed in the body (unless a [compared field](Inbox::compare_fields) did).
    /// `event` is the [`VerifiedDelivery`] of [`Inbox::verify`], or, for an inbox without a verifier
    /// (messages no signature vouches for), a bare id.
    ///
    /// # Errors
    /// [`InputError`] for an event id that is not a valid key, or [`InputError::UnverifiedDelivery`]
    /// for a bare id or another verifier's delivery given to an inbox with a verifier; otherwise as
    /// [`Store::run_once`].
    pub async fn receive<'e, P, T, E, F, Fut>(
        &self,
        event: impl Into<EventId<'e>>,
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
        let (key, identity) = self.identify(event.into(), payload)?;
        let work = || async move { handler().await.map(|outcome| Entry { sequence, outcome }) };
        let outcome = self.store.run_fingerprinted(&self.scope, &key, &identity, &self.options, work).await?;
        Ok(received(outcome))
    }

    /// [`Inbox::receive`] with the handler's statements in the transaction that records the event: they
    /// commit together or not at all, so the handler's database effects happen exactly once, even if the
    /// process dies between them (see [`Store::run_once_in_tx`]).
    ///
    /// # Errors
    /// As [`Inbox::receive`].
    pub async fn receive_in_tx<'e, P, T, E, F>(
        &self,
        event: impl Into<EventId<'e>>,
        sequence: Option<i64>,
        payload: &P,
        handler: F,
    ) -> Result<Received<T>, RunError<E>>
    where
        P: Serialize + ?Sized,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T, E>,
    {
        let (key, identity) = self.identify(event.into(), payload)?;
        let work = recorded_with(sequence, handler);
        let outcome = self.store.run_fingerprinted_in_tx(&self.scope, &key, &identity, &self.options, work).await?;
        Ok(received(outcome))
    }

    /// The event's key, and what its deliveries are compared by.
    fn identify<P: Serialize + ?Sized>(
        &self,
        event: EventId<'_>,
        payload: &P,
    ) -> Result<(IdempotencyKey, Fingerprint), StoreError> {
        if let Some(verifier) = &self.verifier
            && event.verifier != Some(verifier.id)
        {
            return Err(InputError::UnverifiedDelivery.into());
        }
        let key = IdempotencyKey::new(event.id)?;
        let identity = match &self.compared {
            Some(options) => Fingerprint::of_serialize(payload, options)?,
            // One value for every delivery: the event id alone is the identity.
            None => Fingerprint::of_bytes(b"", &FingerprintOptions::default())?,
        };
        Ok((key, identity))
    }
}

/// What a delivery's run means for the inbox.
fn received<T>(outcome: RunOutcome<Entry<T>>) -> Received<T> {
    match outcome {
        RunOutcome::Executed(entry) => Received::Executed(entry.outcome),
        RunOutcome::Replayed(entry) => Received::Replayed { result: entry.outcome, sequence: entry.sequence },
        RunOutcome::InFlight { retry_after } => Received::InFlight { retry_after },
        RunOutcome::Mismatch => Received::Mismatch,
        RunOutcome::Indeterminate => Received::Indeterminate,
        RunOutcome::Expired => Received::Expired,
        RunOutcome::NotReplayable => Received::NotReplayable,
        RunOutcome::QuotaExceeded { limit, retry_after } => Received::QuotaExceeded { limit, retry_after },
        // An inbox asks no replay check: this is never answered.
        RunOutcome::ReplayRefused => Received::Mismatch,
    }
}
