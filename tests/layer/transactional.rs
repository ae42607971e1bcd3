//! The transactional path (`with_claim_transaction`): the handler writes its effect through the claim's
//! transaction, and the effect, the claim and the stored response commit together. Each test counts the
//! effect rows, which only a commit of that transaction can leave.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idemstore::http::{ClaimTransaction, ClaimTx, IDEMPOTENT_REPLAYED, IdempotencyLayer, RequestBody, problem_types};
use idemstore::{Mode, Policy};
use tokio::sync::{Notify, oneshot};
use tower::{BoxError, Layer, ServiceExt};

use super::support::{Harness, Servers, key};

suite!(
    a_new_key_commits_its_effect_with_the_claim_and_replays,
    a_released_status_rolls_the_handlers_writes_back,
    a_duplicate_while_the_handler_runs_is_in_flight_and_never_runs,
    a_failed_commit_answers_503_and_the_retry_runs_once,
    a_cancelled_request_leaves_neither_claim_nor_effect,
    a_response_over_the_capture_limit_is_committed_as_not_replayable,
    the_axum_extractor_writes_in_the_claims_transaction,
    a_failed_statement_the_handler_ignored_rolls_back_with_500,
);

/// The handler's statement fails (its transaction is then aborted) and it answers 201 anyway: nothing
/// commits and the client gets 500 `response-failed`, not 503 "retry" (before: the completion failed on
/// the aborted transaction and every retry was told the store was unavailable).
async fn a_failed_statement_the_handler_ignored_rolls_back_with_500(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, calls) = service(&h, Script { failing_statement: true, ..Script::default() }, 1 << 20);
    let answer = answer(&service, "tx-aborted").await;
    assert_eq!((answer.0, answer.2.as_str()), (StatusCode::INTERNAL_SERVER_ERROR, problem_types::RESPONSE_FAILED));
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-aborted")).await), (1, 0));
    assert!(h.store.admin().lookup(&h.scope("acme"), &key("tx-aborted")).await.expect("lookup").is_none());
}

/// How the test handler behaves.
#[derive(Clone, Default)]
struct Script {
    /// Told once the handler wrote its effect (before it answers).
    written: Option<Arc<std::sync::Mutex<Option<oneshot::Sender<()>>>>>,
    /// Waited for after the effect was written, by the first call only.
    gate: Option<Arc<Notify>>,
    /// Answered with this status for the first N calls, then 201.
    fail_first: Option<(StatusCode, usize)>,
    /// The 201's body length.
    body_len: Option<usize>,
    /// A statement that fails (and is ignored) after the effect.
    failing_statement: bool,
}

type Service = tower::util::BoxCloneSyncService<
    Request<Full<Bytes>>,
    Response<idemstore::http::ResponseBody<Full<Bytes>>>,
    BoxError,
>;

/// The layer, transactional, over a handler that inserts one effect row through the claim's
/// transaction (the `ClaimTransaction` extension, as any tower service reaches it).
fn service(h: &Harness, script: Script, max_response_body: usize) -> (Service, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let handler = tower::service_fn(move |request: Request<RequestBody<Full<Bytes>>>| {
        let (script, call) = (script.clone(), counted.fetch_add(1, Ordering::SeqCst));
        async move {
            let transaction = request.extensions().get::<ClaimTransaction>().cloned().expect("the claim's transaction");
            let key = request.headers()["idempotency-key"].to_str()?.to_owned();
            let mut tx = transaction.lock().expect("not taken back yet");
            let id: i64 = sqlx::query_scalar("INSERT INTO effects (tenant, key) VALUES ('acme', $1) RETURNING id")
                .bind(&key)
                .fetch_one(&mut *tx)
                .await?;
            if script.failing_statement {
                // Ignored, as a handler that catches a constraint violation and answers 422 would.
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
            }
            drop(tx);
            if let Some(written) = script.written.as_ref().and_then(|w| w.lock().expect("lock").take()) {
                let _ = written.send(());
            }
            if let Some(gate) = script.gate.as_ref().filter(|_| call == 0) {
                gate.notified().await;
            }
            let status = match script.fail_first {
                Some((status, n)) if call < n => status,
                _ => StatusCode::CREATED,
            };
            let body = match script.body_len {
                Some(len) => "x".repeat(len),
                None => format!("charge {id}"),
            };
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            Ok::<_, BoxError>(response)
        }
    });
    let layer = IdempotencyLayer::new(h.store.clone(), |_: &http::request::Parts| Some("acme".to_owned()))
        .with_operation(h.operation.clone())
        .with_max_response_body(max_response_body)
        .with_claim_transaction();
    (tower::util::BoxCloneSyncService::new(layer.layer(handler)), calls)
}

fn request(name: &str) -> Request<Full<Bytes>> {
    Request::post("/charges")
        .header("idempotency-key", name)
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

/// Status, replay mark, and body (or problem type).
async fn answer(service: &Service, name: &str) -> (StatusCode, bool, String) {
    let response = service.clone().oneshot(request(name)).await.expect("answered");
    read(response).await
}

async fn read<B: http_body::Body>(response: Response<B>) -> (StatusCode, bool, String)
where
    B::Error: std::fmt::Debug,
{
    let (status, replayed) = (response.status(), response.headers().contains_key(IDEMPOTENT_REPLAYED));
    let body = response.into_body().collect().await.expect("body").to_bytes();
    let text = String::from_utf8_lossy(&body).into_owned();
    let kind =
        serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| v["type"].as_str().map(str::to_owned));
    (status, replayed, kind.unwrap_or(text))
}

/// A new key: the effect and the stored 201 commit together; the retry is its replay, byte for byte,
/// and the handler ran once.
async fn a_new_key_commits_its_effect_with_the_claim_and_replays(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, calls) = service(&h, Script::default(), 1 << 20);
    let first = answer(&service, "tx-1").await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false), "{first:?}");
    let retry = answer(&service, "tx-1").await;
    assert_eq!(retry, (StatusCode::CREATED, true, first.2.clone()));
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-1")).await), (1, 1));
    let record = h.store.admin().lookup(&h.scope("acme"), &key("tx-1")).await.expect("lookup").expect("a record");
    assert_eq!(record.state, idemstore::State::Completed);
}

/// A 500 after the handler wrote its effect: the effect rolls back with the claim, the 500 goes out, and
/// the retry runs the handler once more, leaving one effect.
async fn a_released_status_rolls_the_handlers_writes_back(mode: Mode) {
    let h = Harness::start(mode).await;
    let script = Script { fail_first: Some((StatusCode::INTERNAL_SERVER_ERROR, 1)), ..Script::default() };
    let (service, calls) = service(&h, script, 1 << 20);
    let failed = answer(&service, "tx-500").await;
    assert_eq!(failed.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(h.effects("acme", &key("tx-500")).await, 0, "rolled back with the claim");
    assert!(h.store.admin().lookup(&h.scope("acme"), &key("tx-500")).await.expect("lookup").is_none(), "no claim left");
    let retry = answer(&service, "tx-500").await;
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, false));
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-500")).await), (2, 1));
}

/// A duplicate while the handler holds its transaction open: 409 in flight (from Redis's marker, or
/// after waiting on the claim's row lock in Postgres), never a second run; then the replay.
async fn a_duplicate_while_the_handler_runs_is_in_flight_and_never_runs(mode: Mode) {
    let h = Harness::start(mode).await;
    let (written, was_written) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let script = Script {
        written: Some(Arc::new(std::sync::Mutex::new(Some(written)))),
        gate: Some(Arc::clone(&gate)),
        ..Script::default()
    };
    let (service, calls) = service(&h, script, 1 << 20);
    let first = tokio::spawn(service.clone().oneshot(request("tx-dup")));
    was_written.await.expect("the handler wrote its effect");
    let duplicate = answer(&service, "tx-dup").await;
    assert_eq!((duplicate.0, duplicate.2.as_str()), (StatusCode::CONFLICT, problem_types::IN_FLIGHT), "{duplicate:?}");
    gate.notify_one();
    let first = read(first.await.expect("no panic").expect("answered")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let replay = answer(&service, "tx-dup").await;
    assert_eq!(replay, (StatusCode::CREATED, true, first.2));
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-dup")).await), (1, 1));
}

/// Every Postgres connection is cut after the handler wrote its effect and before the commit: the client
/// gets 503 (never the handler's 201), nothing of the request stands, and the retry runs once.
async fn a_failed_commit_answers_503_and_the_retry_runs_once(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Proxied).await;
    let (written, was_written) = oneshot::channel();
    let gate = Arc::new(Notify::new());
    let script = Script {
        written: Some(Arc::new(std::sync::Mutex::new(Some(written)))),
        gate: Some(Arc::clone(&gate)),
        ..Script::default()
    };
    let (service, calls) = service(&h, script, 1 << 20);
    let first = tokio::spawn(service.clone().oneshot(request("tx-cut")));
    was_written.await.expect("the handler wrote its effect");
    h.postgres_proxy.as_ref().expect("proxied").cut();
    gate.notify_one();
    let first = read(first.await.expect("no panic").expect("answered")).await;
    assert_eq!((first.0, first.2.as_str()), (StatusCode::SERVICE_UNAVAILABLE, problem_types::UNAVAILABLE), "{first:?}");
    assert_eq!(h.effects("acme", &key("tx-cut")).await, 0, "the effect went with the connection");
    // The cut closed every pooled connection, and one used less than 100 ms before is handed out again
    // without a ping (`idemstore::pool_options`): a retry may meet such a connection, once per pooled
    // connection, and is answered 503 without running (seen in CI).
    let mut retry = answer(&service, "tx-cut").await;
    for _ in 0..16 {
        if retry.0 != StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert_eq!(retry.2.as_str(), problem_types::UNAVAILABLE, "{retry:?}");
        retry = answer(&service, "tx-cut").await;
    }
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, false), "{retry:?}");
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-cut")).await), (2, 1));
}

/// The request is dropped while the handler holds its transaction (the client went away, the process
/// was stopping): no claim and no effect stay, and a retry runs once.
async fn a_cancelled_request_leaves_neither_claim_nor_effect(mode: Mode) {
    let h = Harness::start(mode).await;
    let (written, was_written) = oneshot::channel();
    let script = Script {
        written: Some(Arc::new(std::sync::Mutex::new(Some(written)))),
        gate: Some(Arc::new(Notify::new())),
        ..Script::default()
    };
    let (service, calls) = service(&h, script, 1 << 20);
    let first = tokio::spawn(service.clone().oneshot(request("tx-gone")));
    was_written.await.expect("the handler wrote its effect");
    first.abort();
    assert!(first.await.expect_err("cancelled").is_cancelled());
    // The retry may meet the marker or the row lock while the rollback lands: a client retries 409s.
    let retry = loop {
        let retry = answer(&service, "tx-gone").await;
        if retry.0 != StatusCode::CONFLICT {
            break retry;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!((retry.0, retry.1), (StatusCode::CREATED, false), "{retry:?}");
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-gone")).await), (2, 1));
}

/// A 201 larger than the capture limit: sent whole, committed as "completed, not replayable" with its
/// effect; the retry is told so and never runs it again.
async fn a_response_over_the_capture_limit_is_committed_as_not_replayable(mode: Mode) {
    let h = Harness::start(mode).await;
    let script = Script { body_len: Some(4096), ..Script::default() };
    let (service, calls) = service(&h, script, 1024);
    let first = answer(&service, "tx-big").await;
    assert_eq!((first.0, first.2.len()), (StatusCode::CREATED, 4096));
    let retry = answer(&service, "tx-big").await;
    assert_eq!((retry.0, retry.2.as_str()), (StatusCode::CONFLICT, problem_types::NOT_REPLAYABLE), "{retry:?}");
    assert_eq!((calls.load(Ordering::SeqCst), h.effects("acme", &key("tx-big")).await), (1, 1));
}

/// Through axum: `ClaimTx` writes in the claim's transaction behind a transactional layer; behind a
/// plain layer it is refused with 500 and writes nothing.
async fn the_axum_extractor_writes_in_the_claims_transaction(mode: Mode) {
    async fn charge(mut tx: ClaimTx, headers: http::HeaderMap) -> (StatusCode, String) {
        let key = headers["idempotency-key"].to_str().expect("ASCII").to_owned();
        let id: i64 = sqlx::query_scalar("INSERT INTO effects (tenant, key) VALUES ('acme', $1) RETURNING id")
            .bind(key)
            .fetch_one(&mut *tx)
            .await
            .expect("insert");
        (StatusCode::CREATED, format!("charge {id}"))
    }
    let h = Harness::start(mode).await;
    let layer = IdempotencyLayer::new(h.store.clone(), |_: &http::request::Parts| Some("acme".to_owned()))
        .with_operation(h.operation.clone());
    let transactional =
        Router::new().route("/charges", post(charge)).route_layer(layer.clone().with_claim_transaction());
    let plain = Router::new().route("/charges", post(charge)).route_layer(layer);

    let first = read(transactional.clone().oneshot(request("ax-1")).await.expect("infallible")).await;
    let retry = read(transactional.oneshot(request("ax-1")).await.expect("infallible")).await;
    assert_eq!((first.0, retry), (StatusCode::CREATED, (StatusCode::CREATED, true, first.2.clone())));
    assert_eq!(h.effects("acme", &key("ax-1")).await, 1);

    let refused = read(plain.oneshot(request("ax-2")).await.expect("infallible")).await;
    assert_eq!(refused.0, StatusCode::INTERNAL_SERVER_ERROR, "{refused:?}");
    assert_eq!(h.effects("acme", &key("ax-2")).await, 0);
}
