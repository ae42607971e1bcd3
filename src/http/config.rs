//! What a layer is configured with: the options of [`IdempotencyLayer`](super::IdempotencyLayer), shared by
//! every request of the services it makes.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, StatusCode};

use super::request_fingerprint::QueryComparison;
use crate::derived_key::DerivedKeys;
use crate::key::Scope;
use crate::options::RunOptions;
use crate::policy::Policy;
use crate::store::Store;

/// The application's check before a stored response is replayed
/// ([`IdempotencyLayer::with_replay_check`](super::IdempotencyLayer::with_replay_check)).
pub(crate) type ReplayCheck = dyn Fn(&Parts, &Scope) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync;

/// Who made a request, for the principal binding
/// ([`IdempotencyLayer::with_principal`](super::IdempotencyLayer::with_principal)).
pub(crate) type PrincipalResolver = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Whether requests without an `Idempotency-Key` are accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRequirement {
    /// Requests without a key pass through untouched (the default).
    #[default]
    Optional,
    /// Requests without a key get 400 and do not reach the handler.
    Required,
}

/// The answer to a key reused with a different payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MismatchStatus {
    /// 422 Unprocessable Content, as the IETF draft recommends (the default).
    #[default]
    UnprocessableEntity,
    /// 400 Bad Request, as Stripe answers.
    BadRequest,
    /// 409 Conflict carrying the original stored response (problem+json if there is none yet).
    ConflictWithOriginal,
}

impl MismatchStatus {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            MismatchStatus::UnprocessableEntity => StatusCode::UNPROCESSABLE_ENTITY,
            MismatchStatus::BadRequest => StatusCode::BAD_REQUEST,
            MismatchStatus::ConflictWithOriginal => StatusCode::CONFLICT,
        }
    }
}

/// Which requests share a key space: a key answers only requests of the space it was first sent in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySpace {
    /// The request's target: on an axum route with path parameters (`/accounts/{id}/transfers`), each
    /// path (`/accounts/A/transfers`, `/accounts/B/transfers`, percent-encoding normalized) is a key space of its own, so a key
    /// sent to one is never answered with, or refused for, a record of another (the store keeps the key
    /// as [`IdempotencyKey::for_target`](crate::IdempotencyKey::for_target); a handler finds it in
    /// [`IdempotencyContext`](super::IdempotencyContext)). Metrics and policies still follow the route
    /// template. Without axum's matched route (a fallback, a service outside a `Router`) the operation
    /// is the key space. The default.
    #[default]
    Target,
    /// The operation (the route template, or the name set with `with_operation`): every path of a route
    /// shares one key space. For routes whose path parameters do not say what a request acts on.
    Operation,
}

/// Which handler responses are stored and replayed; the others release the key so a retry runs again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoredStatuses {
    /// Successes, redirects and the client errors a retry would get again (2xx, 3xx, 4xx); not the
    /// answers that are transient or depend on the caller's rights (401, 403, 407, 408, 425, 429), nor
    /// server errors (5xx): those release the key (the default).
    #[default]
    SuccessesAndClientErrors,
    /// Every response once the handler ran, as Stripe does.
    All,
}

impl StoredStatuses {
    pub(crate) fn stores(self, status: StatusCode) -> bool {
        let transient = matches!(status.as_u16(), 401 | 403 | 407 | 408 | 425 | 429);
        self == StoredStatuses::All || !(status.is_server_error() || transient)
    }

    /// The same rule for a gRPC status, in the headers of a trailers-only answer or in the trailers (a
    /// gRPC call answers HTTP 200 whatever happened): deterministic answers are stored (OK,
    /// INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, OUT_OF_RANGE, UNIMPLEMENTED);
    /// transient ones, and those that depend on the caller's rights, release the key.
    pub(crate) fn stores_grpc(self, fields: &HeaderMap) -> bool {
        let Some(code) = fields.get("grpc-status") else { return true };
        self == StoredStatuses::All || matches!(code.as_bytes(), b"0" | b"3" | b"5" | b"6" | b"9" | b"11" | b"12")
    }
}

/// A layer's configuration (see the setters of [`IdempotencyLayer`](super::IdempotencyLayer)).
pub(crate) struct Config<T> {
    pub(crate) store: Store,
    pub(crate) tenant: Arc<T>,
    pub(crate) methods: Vec<Method>,
    pub(crate) key: KeyRequirement,
    pub(crate) operation: Option<String>,
    pub(crate) key_space: KeySpace,
    /// The layer's policy, if it has one; the owner's heartbeat is always on.
    pub(crate) options: RunOptions,
    pub(crate) mismatch: MismatchStatus,
    pub(crate) stored: StoredStatuses,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    /// How long a response body may stream while its key is held.
    pub(crate) max_streaming: Duration,
    pub(crate) replayed_headers: Vec<HeaderName>,
    pub(crate) query: QueryComparison,
    pub(crate) replay_check: Option<Arc<ReplayCheck>>,
    pub(crate) principal: Option<Arc<PrincipalResolver>>,
    /// Claim, handler writes and completion in one transaction ([`super::transaction`]).
    pub(crate) in_claim_transaction: bool,
    /// How a request without a key gets one, if it does ([`super::IdempotencyLayer::with_derived_keys`]).
    pub(crate) derived_keys: Option<DerivedKeys>,
}

impl<T> Config<T> {
    /// Whether this answer would show the caller a stored response: a replay, or a mismatch answered
    /// with the original.
    pub(crate) fn reveals(&self, answer: &crate::store::Begin) -> bool {
        use crate::store::Begin;
        matches!(answer, Begin::Replayed(_))
            || (matches!(answer, Begin::Mismatch) && self.mismatch == MismatchStatus::ConflictWithOriginal)
    }

    /// How long this request waits for a duplicate in flight: the route's bound, shortened to the
    /// client's `Prefer: wait` ([`super::prefer`]); `None` where the route does not wait.
    pub(crate) fn wait_in_flight(&self, headers: &HeaderMap) -> Option<Duration> {
        let bound = self.options.wait?;
        Some(super::prefer::preferred_wait(headers).map_or(bound, |preferred| preferred.min(bound)))
    }

    /// The options this request is claimed under: the layer's, with the client's shorter wait, and the
    /// policy of a derived key (`derived`) where the layer derived it.
    pub(crate) fn options_for(&self, headers: &HeaderMap, derived: Option<&Arc<Policy>>) -> Cow<'_, RunOptions> {
        let wait = self.wait_in_flight(headers);
        if wait == self.options.wait && derived.is_none() {
            return Cow::Borrowed(&self.options);
        }
        let mut options = self.options.clone();
        options.wait = wait;
        if let Some(derived) = derived {
            options.policy = Some(Arc::clone(derived));
        }
        Cow::Owned(options)
    }

    /// Whether the application lets this request see the stored response of `scope`'s key.
    pub(crate) async fn allows_replay(&self, parts: &Parts, scope: &Scope) -> bool {
        let allowed = match &self.replay_check {
            Some(check) => check(parts, scope).await,
            None => true,
        };
        if !allowed {
            crate::telemetry::replay_refused(scope.operation());
        }
        allowed
    }
}

impl<T> Clone for Config<T> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            tenant: Arc::clone(&self.tenant),
            methods: self.methods.clone(),
            key: self.key,
            operation: self.operation.clone(),
            key_space: self.key_space,
            options: self.options.clone(),
            mismatch: self.mismatch,
            stored: self.stored,
            max_request_body: self.max_request_body,
            max_response_body: self.max_response_body,
            max_streaming: self.max_streaming,
            replayed_headers: self.replayed_headers.clone(),
            query: self.query,
            replay_check: self.replay_check.clone(),
            principal: self.principal.clone(),
            in_claim_transaction: self.in_claim_transaction,
            derived_keys: self.derived_keys.clone(),
        }
    }
}
