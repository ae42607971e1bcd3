//! The five apps under comparison: one axum handler, the same for all, behind each library (or none).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use fred::prelude::{ClientLike, Config, ReconnectPolicy};
use idemstore::http::IdempotencyLayer;
use idemstore::{Policy, Store};
use ruts::store::Ttl;
use ruts::store::redis::RedisStore;
use ruts::{CookieOptions, Session, SessionLayer};
use sqlx::PgPool;
use tokio::sync::Notify;
use tower_cookies::CookieManagerLayer;

use crate::Error;
use crate::idempotent_layer::{self, IdempotentStore};

/// A library under comparison, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Subject {
    /// The handler alone: every request runs it.
    NoLayer,
    /// idemstore's `IdempotencyLayer` over Redis and Postgres.
    TwoTier,
    /// idemstore's `IdempotencyLayer` over Postgres alone.
    PostgresOnly,
    /// `axum-idempotent` 0.6 with `ruts`'s Redis session store.
    AxumIdempotent,
    /// `idempotent` 0.3's Valkey/Redis store, in the harness's own middleware (0.3 has none).
    Idempotent,
}

impl Subject {
    pub const ALL: [Subject; 5] =
        [Subject::NoLayer, Subject::TwoTier, Subject::PostgresOnly, Subject::AxumIdempotent, Subject::Idempotent];

    pub fn name(self) -> &'static str {
        match self {
            Subject::NoLayer => "no layer",
            Subject::TwoTier => "idemstore two-tier",
            Subject::PostgresOnly => "idemstore Postgres-only",
            Subject::AxumIdempotent => "axum-idempotent 0.6",
            Subject::Idempotent => "idempotent 0.3",
        }
    }

    /// Whether the app needs a session cookie before it deduplicates anything.
    pub fn needs_session(self) -> bool {
        self == Subject::AxumIdempotent
    }
}

/// How long every library keeps a completed answer.
pub const RETENTION: Duration = Duration::from_secs(24 * 3600);
/// How long a claim holds a key for its owner: idemstore's lease, idempotent's in-progress TTL.
/// axum-idempotent takes no claim. Short, so that the owner-crash scenario can wait it out.
pub const LEASE: Duration = Duration::from_secs(2);

/// ruts's Redis store over one fred client, as its README builds it.
type SessionStore = RedisStore<fred::clients::Client>;

pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS peer_charges (
    id BIGSERIAL PRIMARY KEY, subject TEXT NOT NULL, tenant TEXT NOT NULL, idempotency_key TEXT,
    body TEXT NOT NULL)";

/// A running app and what the scenarios watch in it.
pub struct App {
    pub subject: Subject,
    pub address: SocketAddr,
    pub inflight: Arc<InFlight>,
}

/// Requests inside the app, so that a scenario can wait until a request its client gave up on has
/// finished on the server (it may still run the handler).
#[derive(Default)]
pub struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

impl InFlight {
    pub async fn wait_idle(&self) {
        loop {
            let idle = self.idle.notified();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }
}

#[derive(Clone)]
struct Handler {
    pg: PgPool,
    subject: Subject,
}

/// Signalled by a request with `x-crash` once it is inside the handler, where it stays until the
/// process is killed ([`crate::crash`]).
pub static CRASH_POINT: Notify = Notify::const_new();

/// The handler every subject shares: one durable insert into `peer_charges`, which has no unique
/// constraint, so every extra execution is a row. `x-delay-ms` holds it first; `x-crash` stops in it.
async fn create_charge(State(handler): State<Handler>, headers: HeaderMap, body: Bytes) -> Response {
    if headers.contains_key("x-crash") {
        CRASH_POINT.notify_one();
        std::future::pending::<()>().await;
    }
    if let Some(delay) = headers.get("x-delay-ms").and_then(|v| v.to_str().ok()?.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let tenant = tenant_of(&headers).unwrap_or_default();
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
    let inserted = sqlx::query_scalar::<_, i64>(
        "INSERT INTO peer_charges (subject, tenant, idempotency_key, body) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(handler.subject.name())
    .bind(&tenant)
    .bind(key)
    .bind(String::from_utf8_lossy(&body).as_ref())
    .fetch_one(&handler.pg)
    .await;
    match inserted {
        Ok(id) => (StatusCode::CREATED, charge_json(id, &tenant)).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

fn charge_json(id: i64, tenant: &str) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "id": id, "object": "charge", "tenant": tenant, "amount": 1250, "currency": "eur",
        "status": "succeeded", "created": 1_796_000_000,
    }))
}

/// What a replay should cost at best: the same bytes without the insert (the no-layer replay row).
async fn static_charge() -> Response {
    (StatusCode::CREATED, charge_json(1, "bench")).into_response()
}

/// The tenant is the bearer token (a stand-in for an authenticated principal).
pub fn tenant_of(headers: &HeaderMap) -> Option<String> {
    let value = headers.get("authorization")?.to_str().ok()?;
    Some(value.strip_prefix("Bearer ")?.to_owned())
}

/// Counts the requests inside the app, whether they end with an answer or are cancelled (hyper drops a
/// request whose client went away). Outermost, so that it sees every request whole.
async fn count_in_flight(State(inflight): State<Arc<InFlight>>, request: Request, next: Next) -> Response {
    let _inside = Inside::enter(inflight);
    next.run(request).await
}

struct Inside(Arc<InFlight>);

impl Inside {
    fn enter(inflight: Arc<InFlight>) -> Self {
        inflight.count.fetch_add(1, Ordering::SeqCst);
        Inside(inflight)
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Builds and serves the app of `subject` on a free loopback port.
pub async fn start(subject: Subject, pg: &PgPool, redis_url: &str) -> Result<App, Error> {
    let handler = Handler { pg: pg.clone(), subject };
    let charges = post(create_charge);
    let router = match subject {
        Subject::NoLayer => Router::new().route("/charges", charges),
        Subject::TwoTier | Subject::PostgresOnly => {
            let mut store = Store::builder().postgres(pg.clone()).key_prefix("idemstore");
            if subject == Subject::TwoTier {
                let pool =
                    deadpool_redis::Config::from_url(redis_url).create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
                store = store.redis(pool);
            }
            let store = store.build()?;
            store.migrate().await?;
            let policy = Policy::builder().lease(LEASE).retention(Some(RETENTION)).build()?;
            let layer = IdempotencyLayer::new(store, |parts: &Parts| tenant_of(&parts.headers)).with_policy(policy);
            Router::new().route("/charges", charges.route_layer(layer))
        }
        Subject::AxumIdempotent => {
            // ruts's README: a fred client, connected, behind `RedisStore` (one multiplexed connection,
            // as idemstore and idempotent use), plus a reconnect policy, without which fred never comes
            // back after a Redis restart (docs/peers.md).
            let policy = Some(ReconnectPolicy::default());
            let client = fred::clients::Client::new(Config::from_url(redis_url)?, None, None, policy);
            client.init().await?;
            let store = Arc::new(SessionStore::new(Arc::new(client)).await?);
            // axum-idempotent's README: the client's `Idempotency-Key` header, required.
            let options = IdempotentOptions::default()
                .use_idempotency_key_header(Some("Idempotency-Key"), true)
                .expire_after(RETENTION.as_secs() as i64);
            // Plain HTTP on loopback: not `Secure` (the clients send the cookie themselves either way).
            let cookie = CookieOptions::build()
                .name("session")
                .http_only(true)
                .secure(false)
                .path("/")
                .max_age(RETENTION.as_secs());
            Router::new()
                .route("/charges", charges.layer(IdempotentLayer::<SessionStore>::new(options)))
                .route("/login", post(login))
                .layer(SessionLayer::new(store).with_cookie_options(cookie))
                .layer(CookieManagerLayer::new())
        }
        Subject::Idempotent => {
            let store = IdempotentStore::connect(redis_url, LEASE, RETENTION).await?;
            Router::new().route(
                "/charges",
                charges.route_layer(middleware::from_fn_with_state(Arc::new(store), idempotent_layer::middleware)),
            )
        }
    };
    let inflight = Arc::new(InFlight::default());
    let app = router
        .route("/static", post(static_charge))
        .with_state(handler)
        .layer(middleware::from_fn_with_state(inflight.clone(), count_in_flight));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(App { subject, address, inflight })
}

/// Opens a session for the bearer's tenant: axum-idempotent caches answers only inside a session that
/// the application already established (its README), so every client logs in first.
async fn login(session: Session<SessionStore>, headers: HeaderMap) -> Response {
    let tenant = tenant_of(&headers).unwrap_or_default();
    let Ok(ttl) = Ttl::new(RETENTION.as_secs() as i64) else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "RETENTION is no session TTL").into_response();
    };
    match session.set("tenant", &tenant, ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}
