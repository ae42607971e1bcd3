//! [`IdempotencyLayer`]: the middleware's configuration, applied per router or per route.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method};
use tower::Layer;

use super::TenantResolver;
use super::capture::DEFAULT_REPLAYED_HEADERS;
use super::config::{Config, KeyRequirement, KeySpace, MismatchStatus, StoredStatuses};
use super::request_fingerprint::QueryComparison;
use super::service::IdempotencyService;
use crate::derived_key::DerivedKeys;
use crate::key::Scope;
use crate::options::RunOptions;
use crate::policy::Policy;
use crate::store::Store;

/// A tower [`Layer`] that makes the wrapped service idempotent per `Idempotency-Key`.
///
/// The operation of a request is the name set with [`IdempotencyLayer::with_operation`], else the
/// method and axum's matched route template (add the layer with `Router::route_layer`), else the
/// method and `unmatched` (`"POST unmatched"`): never the request path, which the client chooses. The
/// operation names the records' scope and labels the metrics, so outside axum's `route_layer` name it
/// per layer.
pub struct IdempotencyLayer<T> {
    pub(crate) config: Config<T>,
}

impl<T> Clone for IdempotencyLayer<T> {
    fn clone(&self) -> Self {
        Self { config: self.config.clone() }
    }
}

impl<T> fmt::Debug for IdempotencyLayer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("methods", &c.methods)
            .field("key", &c.key)
            .field("operation", &c.operation)
            .field("key_space", &c.key_space)
            .field("mismatch", &c.mismatch)
            .field("stored", &c.stored)
            .field("max_request_body", &c.max_request_body)
            .field("max_response_body", &c.max_response_body)
            .field("max_streaming", &c.max_streaming)
            .field("replay_check", &c.replay_check.is_some())
            .field("principal", &c.principal.is_some())
            .finish_non_exhaustive()
    }
}

impl<T: TenantResolver> IdempotencyLayer<T> {
    /// A layer over `store` that takes each request's tenant from `tenant`. Defaults: POST and PATCH,
    /// optional key, 1 MiB request and response bodies, 422 on mismatch, 2xx-4xx stored.
    pub fn new(store: Store, tenant: T) -> Self {
        Self {
            config: Config {
                store,
                tenant: Arc::new(tenant),
                methods: vec![Method::POST, Method::PATCH],
                key: KeyRequirement::Optional,
                operation: None,
                key_space: KeySpace::default(),
                options: RunOptions::default(),
                mismatch: MismatchStatus::default(),
                stored: StoredStatuses::default(),
                max_request_body: 1 << 20,
                max_response_body: 1 << 20,
                max_streaming: Duration::from_secs(600),
                replayed_headers: DEFAULT_REPLAYED_HEADERS.iter().map(|h| HeaderName::from_static(h)).collect(),
                query: QueryComparison::default(),
                replay_check: None,
                principal: None,
                in_claim_transaction: false,
                derived_keys: None,
            },
        }
    }

    /// The methods the layer applies to; other requests pass through.
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Answers 400 to requests without a key.
    pub fn with_key_required(mut self) -> Self {
        self.config.key = KeyRequirement::Required;
        self
    }

    /// Whether requests without a key are accepted.
    pub fn with_key(mut self, requirement: KeyRequirement) -> Self {
        self.config.key = requirement;
        self
    }

    /// Names the operation instead of deriving it from the route.
    pub fn with_operation(mut self, operation: impl Into<String>) -> Self {
        self.config.operation = Some(operation.into());
        self
    }

    /// Which requests share a key space (default [`KeySpace::Target`]: on a route with path parameters,
    /// each path has its own, so a client who can reach `/accounts/A/...` never squats or reads a key of
    /// `/accounts/B/...`).
    pub fn with_key_space(mut self, space: KeySpace) -> Self {
        self.config.key_space = space;
        self
    }

    /// The policy (tier, lease, fingerprint rules) for requests through this layer, instead of the
    /// store's policy for the operation.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.config.options = self.config.options.policy(policy);
        self
    }

    /// Holds a retry that arrives while the first request with its key is still running for up to
    /// `wait`, and answers it with that request's response once stored (woken when the owner settles,
    /// not by polling), instead of 409 `in-flight` at once. At the bound it gets the 409. If the first
    /// request fails and releases the key, the waiting retry runs the handler itself. A client may ask
    /// for a shorter wait with `Prefer: wait=N` (seconds, RFC 7240; `wait=0`: 409 at once), never a
    /// longer one. On the transactional path the retry ends its own transaction and attaches
    /// ([`Store::attach`](crate::Store::attach)), holding no connection while it waits.
    pub fn with_wait_in_flight(mut self, wait: Duration) -> Self {
        self.config.options = self.config.options.wait_in_flight(wait);
        self
    }

    /// Derives the key of a request that sends none, from its payload or named fields ([`DerivedKeys`]):
    /// its duplicates within the window are answered as a retry with a key would be. A key the client
    /// sends wins. The request's payload is then compared by the same fields (a retry that rewords
    /// what is not compared is the same request); a request with none of the fields, or no JSON body,
    /// gets 400 `invalid-body`. Every answer to a derived request carries the key in
    /// [`IDEMPOTENCY_KEY_DERIVED`](super::IDEMPOTENCY_KEY_DERIVED), and it is counted in
    /// `idemstore_derived_keys_total`. Its records are kept for the window (at most the policy's
    /// retention) and leave no tombstone: after it, the same payload is a new request.
    pub fn with_derived_keys(mut self, keys: DerivedKeys) -> Self {
        self.config.derived_keys = Some(keys);
        self
    }

    /// How the query string takes part in comparing a retry with the first request (default
    /// [`QueryComparison::Unordered`]: parameters in any order).
    pub fn with_query_comparison(mut self, query: QueryComparison) -> Self {
        self.config.query = query;
        self
    }

    /// The answer to a key reused with a different payload.
    pub fn with_mismatch_status(mut self, mismatch: MismatchStatus) -> Self {
        self.config.mismatch = mismatch;
        self
    }

    /// Which handler responses are stored.
    pub fn with_stored_statuses(mut self, stored: StoredStatuses) -> Self {
        self.config.stored = stored;
        self
    }

    /// Largest request body read, in bytes; larger ones get 413.
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// Largest response body stored, in bytes (default 1 MiB). A larger response is sent as it streams,
    /// but only its size is stored: retries get 409 `not-replayable` and never run the handler again.
    pub fn with_max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }

    /// Longest time a response body may stream while its key is held (default 10 minutes). The lease is
    /// extended while the body streams; past this bound (a client that stopped reading, an endless
    /// stream) the record is settled as completed but not replayable, as for a body over
    /// [the capture limit](Self::with_max_response_body): retries get 409 `not-replayable` and never run
    /// the handler again, and the body goes on to the client. A status that is not stored is left to its
    /// lease instead (no longer extended; the record's rule decides), never released while its body may
    /// still be producing. A gRPC stream's status comes in its trailers: one past the bound is settled as
    /// not replayable whatever status it ends with. A body known to fit the capture limit is read whole
    /// and settled before the response starts, within the same bound: one whose known length does not
    /// come within it (a handler passing on a stalled upstream's `Content-Length`) is settled as not
    /// replayable, and its response starts with what was read.
    pub fn with_max_streaming(mut self, bound: Duration) -> Self {
        self.config.max_streaming = bound;
        self
    }

    /// Binds every stored response to the principal that made its request, within the tenant: what
    /// `principal` returns (a 128-bit digest of it is stored with the response). A replay to another
    /// principal is refused (403 `replay-refused`; so is a "not replayable" answer), and a key reused
    /// with another payload never shows another principal the original
    /// ([`MismatchStatus::ConflictWithOriginal`] answers the plain refusal then).
    ///
    /// - Return a **stable** identity (a user id, an API key's id), never a session or token id: the
    ///   owner's own retry after a token refresh would be refused, and its work never runs again.
    /// - The layer must run **inside** the authentication that sets the identity (`route_layer` after
    ///   it): without it every request is anonymous. `None` is anonymous, which sees only responses to
    ///   anonymous requests.
    /// - Responses stored without the binding (before it was turned on, by a layer without it, or by an
    ///   operator's `resolve`) answer every principal; with the binding turned off, every response
    ///   answers every request.
    /// - It binds answers, not keys: another principal who sends a key first still claims it (the
    ///   owner then gets 403 or 422 for the record's life), and tells from 403 against 422 whether its
    ///   body matched. Where principals of a tenant must not share a key space at all, make the
    ///   principal part of the tenant (the [`TenantResolver`](super::TenantResolver)).
    pub fn with_principal<F>(mut self, principal: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.config.principal = Some(Arc::new(principal));
        self
    }

    /// Asks `check` before a stored response is shown to a request (a replay, or the original with
    /// [`MismatchStatus::ConflictWithOriginal`]); `false` answers 403 `replay-refused` (problem+json)
    /// and reveals nothing of the stored response. Off by default.
    ///
    /// A replay does not reach the handler, so it skips any authorization the handler does: a caller
    /// whose API key was revoked, or who lost access to the resource, could still read the stored
    /// answer by retrying. The check repeats that authorization with the request's parts (headers,
    /// extensions set by an authentication layer) and the record's tenant and operation (`scope`). It
    /// returns a future that owns what it needs; take it from `parts` before the `async` block.
    ///
    /// ```no_run
    /// # fn app(store: idemstore::Store) -> axum::Router {
    /// use idemstore::http::IdempotencyLayer;
    /// # #[derive(Clone)] struct Revoked(std::sync::Arc<std::collections::HashSet<String>>);
    /// # #[derive(Clone)] struct Caller { account_id: String, api_key_id: String }
    /// # let revoked = Revoked(Default::default());
    /// // Both from what the authentication layer found (never the secret itself, which would be stored).
    /// let tenant = |parts: &http::request::Parts| parts.extensions.get::<Caller>().map(|c| c.account_id.clone());
    /// let layer = IdempotencyLayer::new(store, tenant).with_replay_check(move |parts, _scope| {
    ///     let api_key_id = parts.extensions.get::<Caller>().map(|c| c.api_key_id.clone());
    ///     let revoked = revoked.clone();
    ///     async move { api_key_id.is_some_and(|id| !revoked.0.contains(&id)) }
    /// });
    /// # axum::Router::new().route_layer(layer)
    /// # }
    /// ```
    pub fn with_replay_check<F, Fut>(mut self, check: F) -> Self
    where
        F: Fn(&Parts, &Scope) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        self.config.replay_check = Some(Arc::new(move |parts, scope| Box::pin(check(parts, scope))));
        self
    }

    /// Runs the handler inside the claim's Postgres transaction: the claim, the handler's own writes
    /// (through [`ClaimTx`](super::ClaimTx), or the [`ClaimTransaction`](super::ClaimTransaction)
    /// extension outside axum) and the stored response commit together, once, before the client is
    /// answered. A crash, a Postgres restart or a failed commit at any point leaves all of it or none of
    /// it, so a retry replays the stored answer or executes once: never twice, never a success without
    /// its effect. A new key costs one commit instead of three.
    ///
    /// Use it when the handler's effects live in the store's database (the order, the charge, the ledger
    /// entry, an outbox row). Effects elsewhere (another API, an e-mail) are not undone by a rollback:
    /// for those, keep the default path, pass [`Owner::derive_key`](crate::Owner::derive_key)-style keys
    /// downstream, or write an outbox row in the transaction and send from it.
    ///
    /// What changes: the handler is bounded by the policy's lease (past it: rollback, 503); a released
    /// status (5xx, 401, 429...) rolls the handler's writes back too; a duplicate waits on the claim's row
    /// lock in Postgres (at most the lock timeout) or meets the Redis marker, then gets 409 in flight or,
    /// with [`with_wait_in_flight`](Self::with_wait_in_flight), waits for the first answer outside any
    /// transaction; the handler's statements run on
    /// the store's connection, under its statement timeout. The transaction holds a pool connection and
    /// the key's row lock while the handler runs: size the pool for the handlers in flight.
    ///
    /// ```no_run
    /// use axum::{Router, routing::post};
    /// use idemstore::http::{ClaimTx, IdempotencyLayer};
    ///
    /// async fn pay(mut tx: ClaimTx, body: String) -> (http::StatusCode, String) {
    ///     let id: i64 = sqlx::query_scalar("INSERT INTO charges (body) VALUES ($1) RETURNING id")
    ///         .bind(body)
    ///         .fetch_one(&mut *tx)
    ///         .await
    ///         .expect("a charge");
    ///     (http::StatusCode::CREATED, format!("charge {id}"))
    /// }
    ///
    /// # fn app(store: idemstore::Store) -> Router {
    /// let tenant = |_: &http::request::Parts| Some("acme".to_owned());
    /// Router::new()
    ///     .route("/payments", post(pay))
    ///     .route_layer(IdempotencyLayer::new(store, tenant).with_claim_transaction())
    /// # }
    /// ```
    pub fn with_claim_transaction(mut self) -> Self {
        self.config.in_claim_transaction = true;
        self
    }

    /// Adds a response header (or trailer) field to those stored and replayed: trailers go through the
    /// same list, so a replay carries only the fields it names. Never a credential or a session
    /// (`Set-Cookie`, `Authorization`, `Proxy-Authorization`, `Cookie`, `Proxy-Authenticate`,
    /// `WWW-Authenticate`): a replay goes to whoever holds the key, so those are not added (and a
    /// warning is logged).
    pub fn with_replayed_header(mut self, name: HeaderName) -> Self {
        use http::header::{
            AUTHORIZATION, COOKIE, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, SET_COOKIE, WWW_AUTHENTICATE,
        };
        if [SET_COOKIE, AUTHORIZATION, PROXY_AUTHORIZATION, COOKIE, PROXY_AUTHENTICATE, WWW_AUTHENTICATE]
            .contains(&name)
        {
            tracing::warn!(header = %name, "a credential header is never stored for replay; not added");
            return self;
        }
        self.config.replayed_headers.push(name);
        self
    }
}

impl<S, T> Layer<S> for IdempotencyLayer<T> {
    type Service = IdempotencyService<S, T>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::new(self.config.clone()))
    }
}
