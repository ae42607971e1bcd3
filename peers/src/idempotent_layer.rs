//! `idempotent` 0.3 as an axum middleware. The crate's 0.3 releases ship a store and no middleware (its
//! tower layer came with 2.x, which needs a newer Rust than ours), so this file is the harness's own,
//! written as its README's example runs: claim, run, complete with the claim's fencing token; an
//! existing entry is compared by fingerprint and answered from the store. What the README leaves open is
//! decided as a careful user would, and listed in docs/peers.md: the claim lives for the lease and the
//! answer for the retention (the entry's `ttl` is public), keys are scoped by tenant (the crate has no
//! tenant), 409 while in flight, 422 on another payload, 503 when the store fails (nothing runs),
//! every status stored.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idempotent::entry::ExistingEntry;
use idempotent::fingerprint::{DefaultFingerprintStrategy, Fingerprint, FingerprintStrategy};
use idempotent::store::valkey::ValkeyStore;
use idempotent::store::{IdempotencyStore, InsertResult};
use idempotent::{CachedResponse, IdempotencyEntry, IdempotencyKey, Metadata};

use crate::Error;
use crate::subjects::tenant_of;

/// Request and response bodies the middleware buffers, as idemstore's layer (1 MiB).
const MAX_BODY: usize = 1 << 20;

/// The crate's Valkey/Redis store with the two lifetimes an entry gets.
pub struct IdempotentStore {
    store: ValkeyStore,
    /// How long a claim keeps the key while its owner runs (no renewal in 0.3).
    claim_ttl: Duration,
    /// How long a completed answer is kept.
    answer_ttl: Duration,
}

impl IdempotentStore {
    pub async fn connect(redis_url: &str, claim_ttl: Duration, answer_ttl: Duration) -> Result<Self, Error> {
        let client = redis::Client::open(redis_url)?;
        // The prefix its docs offer for services sharing a server (here, with the other subjects).
        let store = ValkeyStore::with_prefix(client, Some("idempotent")).await?;
        Ok(Self { store, claim_ttl, answer_ttl })
    }
}

/// The middleware: requests without an `Idempotency-Key` pass through.
pub async fn middleware(State(store): State<Arc<IdempotentStore>>, request: Request, next: Next) -> Response {
    let Some(key) = request.headers().get("idempotency-key") else { return next.run(request).await };
    let tenant = tenant_of(request.headers()).unwrap_or_default();
    let scoped = key.to_str().ok().and_then(|key| IdempotencyKey::new(format!("{tenant}:{key}")).ok());
    let Some(key) = scoped else {
        return (StatusCode::BAD_REQUEST, "malformed Idempotency-Key").into_response();
    };
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "request body too large").into_response();
    };
    let fingerprint = DefaultFingerprintStrategy.compute(&format!("{} {}", parts.method, parts.uri.path()), &body);
    let entry = IdempotencyEntry::new(fingerprint, store.claim_ttl);
    let fencing_token = match store.store.try_insert(&key, entry.clone()).await {
        Ok(InsertResult::Claimed { fencing_token }) => fencing_token,
        Ok(InsertResult::Exists(existing)) => return answer_existing(existing, fingerprint),
        Err(error) => return (StatusCode::SERVICE_UNAVAILABLE, error.to_string()).into_response(),
    };
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    let (parts, body) = response.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return (StatusCode::INTERNAL_SERVER_ERROR, "response body unreadable").into_response();
    };
    let cached =
        CachedResponse { status_code: parts.status.as_u16(), metadata: Metadata::default(), body: body.clone() };
    let mut completed = entry.complete(cached);
    completed.ttl = store.answer_ttl;
    if let Err(error) = store.store.complete(&key, completed, fencing_token).await {
        // The work ran: the client still gets its answer; a retry finds the key in flight until the claim
        // runs out, then runs the work again.
        eprintln!("idempotent: completing {key} failed: {error}");
    }
    Response::from_parts(parts, Body::from(body))
}

fn answer_existing(existing: ExistingEntry, fingerprint: Fingerprint) -> Response {
    match existing {
        ExistingEntry::Processing(entry) if entry.fingerprint_matches(fingerprint) => {
            (StatusCode::CONFLICT, "a request with this key is in flight").into_response()
        }
        ExistingEntry::Completed(entry) if entry.fingerprint_matches(fingerprint) => {
            let cached = entry.into_response();
            let status = StatusCode::from_u16(cached.status_code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = (status, cached.body).into_response();
            // 0.3's metadata cannot be filled from outside the crate: the handler's one content type.
            response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response.headers_mut().insert("idempotency-replayed", HeaderValue::from_static("true"));
            response
        }
        _ => (StatusCode::UNPROCESSABLE_ENTITY, "this key was used with another payload").into_response(),
    }
}
