//! The HTTP `Idempotency-Key` middleware (feature `http`, on by default), for any tower service over
//! `http::Request` (axum routers, tonic servers, hyper services), following
//! draft-ietf-httpapi-idempotency-key-header and the behaviour of Stripe's API.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idemstore::http::IdempotencyLayer;
//! use idemstore::Store;
//!
//! # fn app(store: Store) -> Router {
//! // The tenant comes from the authenticated caller, never from a header the client picks freely.
//! let tenant = |request: &http::request::Parts| {
//!     request.extensions.get::<Principal>().map(|p| p.account_id.clone())
//! };
//! Router::new()
//!     .route("/payments", post(|| async { "charged" }))
//!     // `route_layer` runs after routing, so the operation is the route template ("POST /payments").
//!     .route_layer(IdempotencyLayer::new(store, tenant).with_key_required())
//! # }
//! # #[derive(Clone)] struct Principal { account_id: String }
//! ```
//!
//! | situation | answer |
//! |---|---|
//! | first request with a key | the handler runs; its response is stored (see [`StoredStatuses`]) |
//! | retry after completion | the stored response, byte-identical, with `Idempotent-Replayed: true` |
//! | retry while the first is running (its body still streaming included) | 409, `Retry-After` |
//! | retry after a response too large to store, or one that streamed past [`IdempotencyLayer::with_max_streaming`] | 409 `not-replayable`; the handler does not run again |
//! | retry after the retention | 410 `expired`, until the tombstone's horizon ends |
//! | same key, different payload | 422 (or 400, or 409 with the original: [`MismatchStatus`]) |
//! | missing key on a required route; invalid or repeated key | 400 |
//! | request body over the limit | 413 |
//! | store unavailable | 503, `Retry-After`; the handler does not run |
//! | stored response unreadable (encryption key gone, bytes changed) | 500 `unreadable-response`; the handler does not run |
//! | record awaiting an operator (indeterminate) | 409 |
//! | a replay the application's check refuses ([`IdempotencyLayer::with_replay_check`]) | 403 `replay-refused` |
//! | a replay to another principal than the stored response's ([`IdempotencyLayer::with_principal`]) | 403 `replay-refused` |
//!
//! Errors are `application/problem+json` with a stable `type` per case (see [`problem_types`]).
//! The response body streams to the client as the handler produces it, with a copy kept up to the
//! capture limit and the lease extended until it ends; the record is settled before the client sees the
//! end. A larger response is stored as "completed, not replayable" (retries never run it again), and a
//! client that goes away mid-body leaves a settled record, as does one that stops reading (past the
//! streaming bound, 10 minutes by default, the record is settled as not replayable). A handler that panics or is cancelled (the client went away) releases its key when the
//! operation's policy is [`crate::LeaseExpiry::TakeOver`]; under `MarkIndeterminate` its lease runs out
//! and the record goes indeterminate.

mod admission;
mod answer;
mod body;
mod boxed;
mod capture;
mod config;
mod key_header;
mod layer;
mod prefer;
mod problem;
mod request_fingerprint;
mod service;
mod transaction;

pub use admission::IdempotencyContext;
pub use capture::stored_response;
pub use config::{KeyRequirement, KeySpace, MismatchStatus, StoredStatuses};
#[cfg(fuzzing)]
#[doc(hidden)]
pub use key_header::fuzz_read_key;
pub use layer::IdempotencyLayer;
pub use problem::problem_types;
pub use request_fingerprint::QueryComparison;
pub use service::{IdempotencyService, RequestBody, ResponseBody, UnsyncBoxBody};
pub use transaction::{ClaimTransaction, ClaimTx};

/// Finds the tenant of a request, typically from the authenticated principal that an earlier layer put
/// in the request's extensions. `None` answers 401 and runs nothing.
///
/// Implemented for closures `Fn(&http::request::Parts) -> Option<String>`.
pub trait TenantResolver: Send + Sync + 'static {
    /// The tenant of this request, or `None` if it has none.
    fn tenant(&self, request: &::http::request::Parts) -> Option<String>;
}

impl<F> TenantResolver for F
where
    F: Fn(&::http::request::Parts) -> Option<String> + Send + Sync + 'static,
{
    fn tenant(&self, request: &::http::request::Parts) -> Option<String> {
        self(request)
    }
}

/// The response header that marks a replay.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The response header that answers a request whose key the layer derived
/// ([`IdempotencyLayer::with_derived_keys`]): the key, as a structured-field string (`"idem-d-..."`).
pub const IDEMPOTENCY_KEY_DERIVED: &str = "idempotency-key-derived";
