//! The record state machine and what the store hands back: the lease an [`Owner`](crate::Owner) holds
//! while it works, the [`StoredResponse`] replayed to retries, and a [`Record`] as Postgres holds it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::policy::{LeaseExpiry, Policy};

/// Where a record is in its life.
///
/// ```text
///             ┌──────────── lease ran out, LeaseExpiry::TakeOver (fence + 1) ───┐
///             v                                                                 │
/// (absent) ─> InProgress ──complete──> Completed                                │
///             │     │ ^────────────────────────── retry (fence + 1) ── Released │
///             │     └──release──────────────────────────────────────────^       │
///             └── lease ran out, LeaseExpiry::MarkIndeterminate ──> Indeterminate
///
/// Completed ── retention ran out, purged ──> Expired (a tombstone) ── horizon ran out ──> (absent)
/// ```
///
/// The lease-expiry rule, retention and tombstone horizon a record was claimed under stay with it: a
/// caller holding another policy never changes what happens to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum State {
    /// An owner holds a lease and may be executing the work.
    InProgress,
    /// The work finished and its response is stored for replay.
    Completed,
    /// The work failed in a retryable way; the next request executes it again.
    Released,
    /// An owner's lease ran out without an answer; nothing re-executes until it is resolved.
    Indeterminate,
    /// The key completed and its record was purged after the retention: a tombstone (fingerprint and
    /// last fence) refuses retries until its horizon ends, instead of executing them again.
    Expired,
}

impl State {
    /// The state's name, as operators read it (both tiers store a one-letter code instead).
    pub fn as_str(self) -> &'static str {
        match self {
            State::InProgress => "in_progress",
            State::Completed => "completed",
            State::Released => "released",
            State::Indeterminate => "indeterminate",
            State::Expired => "expired",
        }
    }

    /// The one-byte code both tiers store (a Postgres `"char"`, the Redis `s` field).
    pub(crate) fn code(self) -> u8 {
        match self {
            State::InProgress => b'p',
            State::Completed => b'c',
            State::Released => b'r',
            State::Indeterminate => b'i',
            State::Expired => b'e',
        }
    }

    /// The state of a stored code; `None` for a code this version does not know.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [State::InProgress, State::Completed, State::Released, State::Indeterminate, State::Expired]
            .into_iter()
            .find(|state| state.code() == code)
    }
}

/// The bytes stored when work completes and replayed, unchanged, to every retry.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredResponse(Vec<u8>);

impl StoredResponse {
    /// Wraps response bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The stored bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The stored bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoredResponse({} bytes)", self.0.len())
    }
}

/// What an [`Owner`](crate::Owner) holds: proof of ownership of one key, valid until the lease runs out
/// or another owner takes over. The `fence` increases on every takeover; completions and releases carry
/// it, so an owner whose lease was taken over can no longer write.
#[derive(Clone)]
pub(crate) struct Lease {
    pub(crate) scope: Scope,
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) fence: i64,
    pub(crate) owner: String,
    pub(crate) policy: Arc<Policy>,
}

impl Lease {
    /// The digest that names the lease's record ([`key_digest`](crate::key::key_digest)).
    pub(crate) fn digest(&self) -> crate::key::KeyDigest {
        crate::key::key_digest(&self.scope, &self.key)
    }

    /// The span of a write of this lease (`complete`, `release`, `extend`).
    pub(crate) fn span(&self, step: &'static str) -> tracing::Span {
        crate::telemetry::write_span(step, self.scope.operation(), self.key.as_str(), self.fence)
    }
}

/// A record as Postgres holds it, for operators and tests ([`crate::admin::Admin::lookup`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// Where the record is in its life.
    pub state: State,
    /// The fence of the latest owner.
    pub fence: i64,
    /// SHA-256 of the canonical payload that claimed the key (32 bytes; the first 8, for an
    /// [`State::Expired`] tombstone).
    pub fingerprint: Vec<u8>,
    /// Time left on the owner's lease (zero once it ran out); `None` unless in progress.
    pub lease_remaining: Option<Duration>,
    /// Time until Postgres may purge the record (for a tombstone, until it goes); `None` if it is kept
    /// forever.
    pub expires_in: Option<Duration>,
    /// The stored response, once completed.
    pub response: Option<StoredResponse>,
    /// The tier (policy name) the record was stored under; `None` for a tombstone.
    pub tier: Option<String>,
    /// The lease-expiry rule the record was claimed under; it decides, whatever a caller's policy says.
    /// `None` for a tombstone.
    pub lease_expiry: Option<LeaseExpiry>,
}

impl Record {
    /// Whether a claim with `fingerprint` would take this record over: a released record, or one whose
    /// lease ran out under [`LeaseExpiry::TakeOver`], of the same payload, or of any once its retention
    /// ended.
    pub(crate) fn is_reacquired_by(&self, fingerprint: &Fingerprint) -> bool {
        let reusable = self.expires_in == Some(std::time::Duration::ZERO) || self.matches(fingerprint);
        let lease_ran_out = self.lease_remaining == Some(std::time::Duration::ZERO);
        reusable
            && match self.state {
                State::Released => true,
                State::InProgress => lease_ran_out && self.lease_expiry == Some(LeaseExpiry::TakeOver),
                _ => false,
            }
    }

    /// Whether a request with `fingerprint` is the one this record holds (a tombstone keeps a prefix).
    pub(crate) fn matches(&self, fingerprint: &Fingerprint) -> bool {
        match self.state {
            State::Expired => fingerprint.starts_with(&self.fingerprint),
            _ => fingerprint.is(&self.fingerprint),
        }
    }
}
