//! The payments demo as the HTTP suites drive it: its router on a test's store, and reading back what it
//! did (charges, problem types, record states).

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use axum::Router;
use idemstore::{IdempotencyKey, Scope, State};
use serde_json::{Value, json};

use super::Harness;

#[path = "../../examples/payments/app.rs"]
pub mod app;

/// The demo's payments operation.
pub const PAYMENTS: &str = "POST /payments";

/// The demo's router on the harness's store, its migrations applied.
pub async fn demo(h: &Harness) -> Router {
    app::migrate(&h.store).await.expect("migrations");
    app::router(app::App {
        store: h.store.clone(),
        metrics: super::recorder().clone(),
        webhook_senders: app::WebhookSenders::demo(),
    })
}

/// The scope of the demo's payments for the account of bearer `acme`.
pub fn acme() -> Scope {
    Scope::new(app::tenant_of("acme"), PAYMENTS).expect("scope")
}

pub fn charge(amount: i64) -> Value {
    json!({"amount": amount, "currency": "EUR", "customer": "cus_1"})
}

/// The demo's charges for the account of bearer `token`.
pub async fn charges(h: &Harness, token: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges WHERE tenant = $1")
        .bind(app::tenant_of(token))
        .fetch_one(&h.pool)
        .await
        .expect("count charges")
}

pub fn problem_type(body: &[u8]) -> String {
    let problem: Value = serde_json::from_slice(body).expect("problem+json");
    problem["type"].as_str().expect("a type").to_owned()
}

/// Polls the store until the demo's record for `key` is in `state`.
pub async fn wait_for_state(h: &Harness, key: &str, state: State) {
    let scope = acme();
    let key = IdempotencyKey::new(key).expect("key");
    for _ in 0..500 {
        if h.store.admin().lookup(&scope, &key).await.expect("lookup").is_some_and(|r| r.state == state) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the record never reached {state:?}");
}

/// Polls until the demo's request for `key` is in flight: its record in progress, or (the demo's
/// transactional path, whose claim commits with the charge) a transaction that wrote and now waits on
/// its handler ("idle in transaction": its claim statement has finished, so the key is taken). A lock
/// alone is not enough: the claim takes its table lock when it starts, and a duplicate sent then can
/// still insert the key first (seen in CI, where the duplicate executed and the first was replayed).
pub async fn wait_in_flight(h: &Harness, key: &str) {
    let scope = acme();
    let key = IdempotencyKey::new(key).expect("key");
    for _ in 0..500 {
        if h.store.admin().lookup(&scope, &key).await.expect("lookup").is_some_and(|r| r.state == State::InProgress) {
            return;
        }
        if claim_open(h).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the request never got in flight");
}

/// Waits for a claim held in an open transaction (the transactional path's), at most 5 s.
pub async fn wait_for_open_claim(h: &Harness) {
    for _ in 0..500 {
        if claim_open(h).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no claim got in flight");
}

/// Whether a transaction of the test's database wrote and waits, as a claim does while its handler runs.
async fn claim_open(h: &Harness) -> bool {
    let open = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND state = 'idle in transaction' AND backend_xid IS NOT NULL)",
    );
    open.fetch_one(&h.pool).await.expect("pg_stat_activity")
}

/// Serves the demo on 127.0.0.1:0; returns its base URL.
pub async fn serve(h: &Harness) -> String {
    let router = demo(h).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}")
}

pub async fn post_payment(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    token: &str,
    body: &Value,
    delay_ms: u64,
) -> reqwest::Response {
    client
        .post(format!("{base}/payments"))
        .bearer_auth(token)
        .header("idempotency-key", key)
        .header("x-demo-delay-ms", delay_ms.to_string())
        .json(body)
        .send()
        .await
        .expect("HTTP request")
}
