//! Key-less deduplication (`DerivedKeys`, `IdempotencyLayer::with_derived_keys`): a request without an
//! `Idempotency-Key` gets one derived from its payload or named fields, its duplicates within the window
//! are answered from the record, and after the window the same payload is a new request. Real Redis and
//! Postgres, both modes.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use idemstore::http::{
    ClaimTransaction, IDEMPOTENCY_KEY_DERIVED, IDEMPOTENT_REPLAYED, IdempotencyContext, IdempotencyLayer, problem_types,
};
use idemstore::{Begin, DerivedKeys, Fingerprint, FingerprintOptions, IdempotencyKey, Mode, Policy, RunOptions};
use serde_json::{Value, json};
use support::{Harness, key};
use tower::ServiceExt;

suite!(
    a_request_without_a_key_runs_once_in_its_window_and_again_after_it,
    named_fields_decide_and_a_reworded_retry_is_replayed,
    each_principal_derives_keys_of_its_own,
    a_transactional_route_derives_keys_too,
    a_policy_without_tombstones_frees_only_its_own_records,
);

const DERIVED: &str = "idemstore_derived_keys_total";

type Tenant = fn(&axum::http::request::Parts) -> Option<String>;

fn acme(_: &axum::http::request::Parts) -> Option<String> {
    Some("acme".into())
}

/// A router whose handler at `/transfers` counts its runs, behind a layer deriving keys by `keys`, in
/// the harness's operation (so that `h.scope` names its records).
fn router(h: &Harness, keys: DerivedKeys) -> (Router, Arc<AtomicUsize>) {
    router_with(h, keys, |layer| layer)
}

/// [`router`], its layer configured further by `configure`.
fn router_with(
    h: &Harness,
    keys: DerivedKeys,
    configure: impl FnOnce(IdempotencyLayer<Tenant>) -> IdempotencyLayer<Tenant>,
) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = move || {
        let run = counted.fetch_add(1, Ordering::SeqCst) + 1;
        async move { (StatusCode::CREATED, format!("transfer {run}")) }
    };
    let layer = IdempotencyLayer::new(h.store.clone(), acme as Tenant)
        .with_operation(h.scope("acme").operation())
        .with_derived_keys(keys);
    (Router::new().route("/transfers", post(handler).route_layer(configure(layer))), runs)
}

async fn send(router: &Router, body: &str, key: Option<&str>) -> (StatusCode, HeaderMap, Bytes) {
    send_as(router, body, key, "ana").await
}

/// [`send`] by the user `user` (header `x-user`).
async fn send_as(router: &Router, body: &str, key: Option<&str>, user: &str) -> (StatusCode, HeaderMap, Bytes) {
    let mut request = Request::post("/transfers").header("content-type", "application/json").header("x-user", user);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = router.clone().oneshot(request.body(Body::from(body.to_owned())).expect("request")).await;
    let (parts, body) = response.expect("infallible").into_parts();
    (parts.status, parts.headers, body.collect().await.expect("body").to_bytes())
}

/// The derived key an answer names, as the store keeps it.
fn derived_key(headers: &HeaderMap) -> IdempotencyKey {
    let quoted = headers[IDEMPOTENCY_KEY_DERIVED].to_str().expect("ASCII");
    IdempotencyKey::new(quoted.trim_matches('"')).expect("a valid key")
}

/// Two identical key-less requests run the handler once: the second is the stored response, replayed,
/// and both answers name the same derived key; another payload is another request, and a key the client
/// sends wins (no derived key). Redis losing its copy between them changes nothing (Postgres answers). Once the
/// window has passed, the same payload runs again, under a new fence.
async fn a_request_without_a_key_runs_once_in_its_window_and_again_after_it(mode: Mode) {
    let h = Harness::start(mode).await;
    let (router, runs) = router(&h, DerivedKeys::of_payload(Duration::from_secs(300)));
    let body = json!({"to": "ana", "amount": 5}).to_string();
    let (status, first, first_body) = send(&router, &body, None).await;
    assert_eq!((status, &first_body[..]), (StatusCode::CREATED, &b"transfer 1"[..]));
    assert!(first.get(IDEMPOTENT_REPLAYED).is_none());
    let derived = derived_key(&first);
    assert!(derived.as_str().starts_with(DerivedKeys::PREFIX), "{derived:?}");

    if h.redis_url.is_some() {
        let (mut redis, copies) = (h.redis_connection().await, h.redis_keys().await);
        assert!(!copies.is_empty(), "the response is in Redis");
        let _: i64 = redis::cmd("DEL").arg(copies).query_async(&mut redis).await.expect("Redis loses the copy");
    }
    let (status, again, replayed) = send(&router, &json!({"amount": 5, "to": "ana"}).to_string(), None).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, first_body));
    assert_eq!((&again[IDEMPOTENT_REPLAYED], derived_key(&again)), (&"true".parse().expect("value"), derived.clone()));

    let (_, other, other_body) = send(&router, &json!({"to": "ana", "amount": 6}).to_string(), None).await;
    assert_eq!(&other_body[..], b"transfer 2");
    assert_ne!(derived_key(&other), derived);
    let (_, keyed, keyed_body) = send(&router, &body, Some("client-key")).await;
    assert_eq!(&keyed_body[..], b"transfer 3", "a client key names its own record");
    assert!(keyed.get(IDEMPOTENCY_KEY_DERIVED).is_none());
    assert_eq!(h.counter(DERIVED, &[]), 3.0);

    let scope = h.scope("acme");
    let fence = |record: Option<idemstore::Record>| record.expect("a record").fence;
    let before = fence(h.store.admin().lookup(&scope, &derived).await.expect("lookup"));
    h.pass_retention(&scope, &derived).await;
    let (status, after, after_body) = send(&router, &body, None).await;
    assert_eq!((status, &after_body[..]), (StatusCode::CREATED, &b"transfer 4"[..]), "a new request");
    assert!(after.get(IDEMPOTENT_REPLAYED).is_none());
    assert!(fence(h.store.admin().lookup(&scope, &derived).await.expect("lookup")) > before);
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// Keys from `/to` and `/amount`: a retry that rewords its memo is the same request (replayed, not
/// refused as another payload); a body with neither field, or not JSON, is refused with 400 and runs
/// nothing.
async fn named_fields_decide_and_a_reworded_retry_is_replayed(mode: Mode) {
    let h = Harness::start(mode).await;
    let keys = DerivedKeys::of_fields(["/to", "/amount"], Duration::from_secs(300)).expect("pointers");
    let (router, runs) = router(&h, keys);
    let (_, first, _) = send(&router, &json!({"to": "ana", "amount": 5, "memo": "for lunch"}).to_string(), None).await;
    let reworded = json!({"to": "ana", "amount": 5, "memo": "lunch money"}).to_string();
    let (status, again, body) = send(&router, &reworded, None).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"transfer 1"[..]));
    assert_eq!(derived_key(&again), derived_key(&first));
    for refused in [json!({"memo": "no fields"}).to_string(), "not json".to_owned()] {
        let (status, headers, body) = send(&router, &refused, None).await;
        let problem: Value = serde_json::from_slice(&body).expect("problem+json");
        assert_eq!((status, problem["type"].as_str()), (StatusCode::BAD_REQUEST, Some(problem_types::INVALID_BODY)));
        assert!(headers.get(IDEMPOTENCY_KEY_DERIVED).is_none());
    }
    let (status, _, body) = send(&router, &reworded, Some("idem-d-chosen-by-the-client")).await;
    let problem: Value = serde_json::from_slice(&body).expect("problem+json");
    assert_eq!((status, problem["type"].as_str()), (StatusCode::BAD_REQUEST, Some(problem_types::INVALID_KEY)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Under a principal binding, two users of one tenant sending one payload are two requests (before: the
/// second user was answered with the first one's response, or refused for the window); each user's
/// retry is still its own replay.
async fn each_principal_derives_keys_of_its_own(mode: Mode) {
    let h = Harness::start(mode).await;
    let user = |parts: &axum::http::request::Parts| parts.headers.get("x-user")?.to_str().ok().map(str::to_owned);
    let (router, runs) = router_with(&h, DerivedKeys::of_payload(Duration::from_secs(300)), |l| l.with_principal(user));
    let body = json!({"to": "cy", "amount": 9}).to_string();
    let (_, ana, _) = send_as(&router, &body, None, "ana").await;
    let (status, bo, bo_body) = send_as(&router, &body, None, "bo").await;
    assert_eq!((status, &bo_body[..]), (StatusCode::CREATED, &b"transfer 2"[..]), "bo's own request");
    assert_ne!(derived_key(&ana), derived_key(&bo));
    let (_, again, _) = send_as(&router, &body, None, "bo").await;
    assert_eq!(again[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// On the transactional path the handler's effect commits with the derived key's claim once; the
/// duplicate replays, and after the window (the record renewed inside the claim's transaction) the
/// effect is written a second time.
async fn a_transactional_route_derives_keys_too(mode: Mode) {
    let h = Harness::start(mode).await;
    let handler = |request: Request<Body>| async move {
        let context = request.extensions().get::<IdempotencyContext>().cloned().expect("the key");
        let transaction = request.extensions().get::<ClaimTransaction>().cloned().expect("the transaction");
        let mut tx = transaction.lock().expect("the claim's transaction");
        sqlx::query("INSERT INTO effects (tenant, key) VALUES ('acme', $1)")
            .bind(context.key().as_str())
            .execute(&mut *tx)
            .await
            .expect("the effect");
        StatusCode::CREATED
    };
    let layer = IdempotencyLayer::new(h.store.clone(), acme as Tenant)
        .with_operation(h.scope("acme").operation())
        .with_claim_transaction()
        .with_derived_keys(DerivedKeys::of_payload(Duration::from_secs(300)));
    let router = Router::new().route("/transfers", post(handler).route_layer(layer));
    let body = json!({"to": "bo", "amount": 7}).to_string();
    let (status, first, _) = send(&router, &body, None).await;
    assert_eq!(status, StatusCode::CREATED);
    let derived = derived_key(&first);
    let (status, again, _) = send(&router, &body, None).await;
    assert_eq!((status, again.get(IDEMPOTENT_REPLAYED).is_some()), (StatusCode::CREATED, true));
    assert_eq!(h.effects("acme", &derived).await, 1);
    h.pass_retention(&h.scope("acme"), &derived).await;
    let (status, after, _) = send(&router, &body, None).await;
    assert_eq!((status, after.get(IDEMPOTENT_REPLAYED).is_none()), (StatusCode::CREATED, true));
    assert_eq!(h.effects("acme", &derived).await, 2);
}

/// Through the library: a record claimed under a policy without tombstones is free once its retention
/// ended, purged or not; a record claimed under a policy that keeps them stays expired, whatever the
/// policy of the caller who asks (another caller's policy never frees a key).
async fn a_policy_without_tombstones_frees_only_its_own_records(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let windowed =
        RunOptions::default().policy(DerivedKeys::of_payload(Duration::from_secs(300)).policy(&Policy::default()));
    let fingerprint = Fingerprint::of_json(br#"{"n":1}"#, &FingerprintOptions::default()).expect("fingerprint");
    let run = |k: IdempotencyKey, options: RunOptions| {
        let (store, scope, fingerprint) = (h.store.clone(), scope.clone(), fingerprint.clone());
        async move { store.begin_with(&scope, &k, &fingerprint, &options).await.expect("claim") }
    };
    for (name, first, second, freed) in
        [("windowed", &windowed, &windowed, true), ("kept", &RunOptions::default(), &windowed, false)]
    {
        let k = key(name);
        let Begin::Acquired(owner) = run(k.clone(), first.clone()).await else { panic!("{name}: a new key") };
        owner.complete(b"done").await.expect("complete");
        h.pass_retention(&scope, &k).await;
        let answer = run(k.clone(), second.clone()).await;
        assert_eq!(matches!(answer, Begin::Acquired(_)), freed, "{name}: {answer:?}");
        if !freed {
            assert!(matches!(answer, Begin::Expired), "{name}: {answer:?}");
        }
    }
    // Purged: the record leaves a tombstone that is already past its horizon.
    let purged = key("purged");
    let Begin::Acquired(owner) = run(purged.clone(), windowed.clone()).await else { panic!("a new key") };
    owner.complete(b"done").await.expect("complete");
    h.pass_retention(&scope, &purged).await;
    h.store.admin().purge_expired(100).next_batch().await.expect("purge");
    assert!(matches!(run(purged, windowed.clone()).await, Begin::Acquired(_)));
}
