//! The Idempotency-Key middleware and the payments demo, against real Redis and Postgres, in both modes:
//! in-process through `tower::ServiceExt::oneshot`, and end to end over a real listener.

use crate::support;
use support::payments;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use idemstore::http::{IdempotencyContext, IdempotencyLayer, KeySpace, MismatchStatus, problem_types};
use idemstore::{IdempotencyKey, Mode, Policy, Quota, Scope, State};
use payments::{PAYMENTS, charge, charges, demo, post_payment, problem_type, serve, wait_for_state, wait_in_flight};
use serde_json::{Value, json};
use support::{Harness, Servers};
use tower::ServiceExt;

suite!(
    quoted_and_bare_keys_name_one_key,
    invalid_or_missing_keys_get_400_and_run_nothing,
    mismatch_answers_422_or_as_configured,
    server_errors_release_and_client_errors_are_replayed,
    oversized_request_body_gets_413,
    concurrent_retry_gets_409_with_retry_after,
    replay_keeps_allowed_headers_only,
    oversized_response_is_never_run_again,
    streamed_response_keeps_its_lease_and_runs_once,
    client_gone_mid_body_still_settles_the_record,
    transient_and_permission_answers_are_not_stored,
    a_known_length_response_is_settled_before_the_client_has_it,
    a_stalled_body_of_known_length_is_bounded_like_a_stream,
    the_last_byte_waits_for_the_stored_response,
    handler_panic_releases_the_key,
    dropped_request_releases_the_key,
    store_unavailable_answers_503_and_runs_nothing,
    missing_tenant_gets_401,
    unmatched_paths_add_no_metric_series,
    one_key_on_two_targets_names_two_records,
    a_nested_router_compares_the_whole_target,
    one_request_in_any_encoding_names_one_record,
    a_response_bound_to_its_principal_is_refused_to_another,
    a_tenant_at_its_quota_still_gets_its_replays,
);

fn payment(key: Option<&str>, tenant: &str, body: &Value) -> Request<Body> {
    let mut request = Request::post("/payments")
        .header("authorization", format!("Bearer {tenant}"))
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.body(Body::from(body.to_string())).expect("request")
}

async fn send(router: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    (parts.status, parts.headers, body.collect().await.expect("body").to_bytes())
}

/// A router whose one handler, at `/payments`, counts its executions and answers what `respond` says.
fn counting(
    layer: IdempotencyLayer<fn(&axum::http::request::Parts) -> Option<String>>,
    respond: impl Fn(usize) -> axum::response::Response + Clone + Send + Sync + 'static,
) -> (Router, Arc<AtomicUsize>) {
    counting_at("/payments", layer, respond)
}

/// [`counting`], with the handler at `route`.
fn counting_at(
    route: &str,
    layer: IdempotencyLayer<fn(&axum::http::request::Parts) -> Option<String>>,
    respond: impl Fn(usize) -> axum::response::Response + Clone + Send + Sync + 'static,
) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let handler = move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        let response = respond(n);
        async move { response }
    };
    (Router::new().route(route, post(handler).route_layer(layer)), runs)
}

/// The demo's tenant of the bearer token, so that these routers and the demo's name one tenant.
fn bearer(parts: &axum::http::request::Parts) -> Option<String> {
    let value = parts.headers.get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(payments::app::tenant_of)
}

fn layer(h: &Harness) -> IdempotencyLayer<fn(&axum::http::request::Parts) -> Option<String>> {
    IdempotencyLayer::new(h.store.clone(), bearer as fn(&axum::http::request::Parts) -> Option<String>)
}

/// The draft's quoted form and the bare form that Stripe clients send name the same key: the second
/// request is a byte-identical replay, marked `Idempotent-Replayed`.
async fn quoted_and_bare_keys_name_one_key(mode: Mode) {
    let h = Harness::start(mode).await;
    let router = demo(&h).await;
    let (status, first_headers, first) = send(&router, payment(Some("order-1"), "acme", &charge(100))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(first_headers.get("idempotent-replayed").is_none());
    let (status, headers, replay) = send(&router, payment(Some("\"order-1\""), "acme", &charge(100))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["location"], first_headers["location"]);
    assert_eq!(replay, first);
    assert_eq!(charges(&h, "acme").await, 1);
}

/// Empty, oversized, non-ASCII, badly quoted and repeated keys get 400 invalid-key; a missing key on a
/// required route gets 400 missing-key; none of them reaches the handler.
async fn invalid_or_missing_keys_get_400_and_run_nothing(mode: Mode) {
    let h = Harness::start(mode).await;
    let router = demo(&h).await;
    let long = "k".repeat(256);
    for bad in ["", long.as_str(), "a b", "\"a\\qb\"", "\"a\"b\"", "\"\""] {
        let (status, _, body) = send(&router, payment(Some(bad), "acme", &charge(1))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(problem_type(&body), problem_types::INVALID_KEY, "{bad:?}");
    }
    let mut non_ascii = payment(None, "acme", &charge(1));
    non_ascii
        .headers_mut()
        .insert("idempotency-key", axum::http::HeaderValue::from_bytes(b"k\xc3\xa9").expect("obs-text"));
    let (status, _, _) = send(&router, non_ascii).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let mut repeated = payment(Some("k1"), "acme", &charge(1));
    repeated.headers_mut().append("idempotency-key", "k2".parse().expect("value"));
    let (status, _, body) = send(&router, repeated).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::BAD_REQUEST, problem_types::INVALID_KEY.to_owned()));
    let (status, _, body) = send(&router, payment(None, "acme", &charge(1))).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::BAD_REQUEST, problem_types::MISSING_KEY.to_owned()));
    assert_eq!(charges(&h, "acme").await, 0);

    // On an optional route, a request without a key passes through (and is not deduplicated).
    let (router, runs) = counting(layer(&h), |_| StatusCode::CREATED.into_response());
    for _ in 0..2 {
        assert_eq!(send(&router, payment(None, "acme", &charge(1))).await.0, StatusCode::CREATED);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A key reused with another payload gets 422 by default and runs nothing; Stripe's 400 and 409 with the
/// original response are configurable.
async fn mismatch_answers_422_or_as_configured(mode: Mode) {
    let h = Harness::start(mode).await;
    let router = demo(&h).await;
    send(&router, payment(Some("m1"), "acme", &charge(100))).await;
    let (status, headers, body) = send(&router, payment(Some("m1"), "acme", &charge(999))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers["content-type"], "application/problem+json");
    assert_eq!(problem_type(&body), problem_types::KEY_REUSED);
    assert_eq!(charges(&h, "acme").await, 1);

    let (router, _) = counting(layer(&h).with_mismatch_status(MismatchStatus::BadRequest), ok_body);
    send(&router, payment(Some("m2"), "acme", &charge(1))).await;
    assert_eq!(send(&router, payment(Some("m2"), "acme", &charge(2))).await.0, StatusCode::BAD_REQUEST);

    let with_original = layer(&h).with_mismatch_status(MismatchStatus::ConflictWithOriginal);
    let (router, runs) = counting(with_original, ok_body);
    let (_, _, original) = send(&router, payment(Some("m3"), "acme", &charge(1))).await;
    let (status, headers, body) = send(&router, payment(Some("m3"), "acme", &charge(2))).await;
    assert_eq!((status, body), (StatusCode::CONFLICT, original));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Past the retention (before the purge), nothing of the response is shown any more: the same
    // payload gets 410, another payload 409 without the original (before: 409 with the original body).
    h.pass_retention(&payments::acme(), &support::key("m3")).await;
    let (status, headers, body) = send(&router, payment(Some("m3"), "acme", &charge(2))).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::CONFLICT, problem_types::KEY_REUSED.to_owned()));
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, _, body) = send(&router, payment(Some("m3"), "acme", &charge(1))).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::GONE, problem_types::EXPIRED.to_owned()));
}

fn ok_body(n: usize) -> axum::response::Response {
    axum::Json(json!({ "run": n })).into_response()
}

/// A 5xx releases the key so the retry executes; a 4xx is stored and the retry replays it.
async fn server_errors_release_and_client_errors_are_replayed(mode: Mode) {
    let h = Harness::start(mode).await;
    let router = demo(&h).await;
    let mut failing = payment(Some("e5"), "acme", &charge(5));
    failing.headers_mut().insert("x-demo-fail", "500".parse().expect("value"));
    assert_eq!(send(&router, failing).await.0, StatusCode::INTERNAL_SERVER_ERROR);
    let (status, headers, _) = send(&router, payment(Some("e5"), "acme", &charge(5))).await;
    assert_eq!(status, StatusCode::CREATED, "the retry executes");
    assert!(headers.get("idempotent-replayed").is_none());

    let mut refused = payment(Some("e4"), "acme", &charge(4));
    refused.headers_mut().insert("x-demo-fail", "400".parse().expect("value"));
    let (status, _, first) = send(&router, refused).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, headers, replay) = send(&router, payment(Some("e4"), "acme", &charge(4))).await;
    assert_eq!((status, replay), (StatusCode::BAD_REQUEST, first));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(charges(&h, "acme").await, 1);
}

/// A request body over the limit (here 100 MB against the default 1 MiB) gets 413 and runs nothing.
async fn oversized_request_body_gets_413(mode: Mode) {
    let h = Harness::start(mode).await;
    let router = demo(&h).await;
    let mut huge = payment(Some("big"), "acme", &charge(1));
    *huge.body_mut() = Body::from(vec![b' '; 100 << 20]);
    let (status, _, body) = send(&router, huge).await;
    assert_eq!(
        (status, problem_type(&body)),
        (StatusCode::PAYLOAD_TOO_LARGE, problem_types::BODY_TOO_LARGE.to_owned())
    );
    assert_eq!(charges(&h, "acme").await, 0);
}

/// A retry while the first request is still running gets 409 with Retry-After.
async fn concurrent_retry_gets_409_with_retry_after(mode: Mode) {
    let h = Harness::start(mode).await;
    let router = demo(&h).await;
    let mut slow = payment(Some("slow"), "acme", &charge(7));
    slow.headers_mut().insert("x-demo-delay-ms", "1500".parse().expect("value"));
    let first = tokio::spawn(router.clone().oneshot(slow));
    wait_in_flight(&h, "slow").await;
    let (status, headers, body) = send(&router, payment(Some("slow"), "acme", &charge(7))).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(problem_type(&body), problem_types::IN_FLIGHT);
    let retry_after: u64 = headers["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!(retry_after >= 1);
    assert_eq!(first.await.expect("join").expect("infallible").status(), StatusCode::CREATED);
    assert_eq!(charges(&h, "acme").await, 1);
}

/// The replay carries the allow-listed headers (Location, Content-Type) and never Set-Cookie.
async fn replay_keeps_allowed_headers_only(mode: Mode) {
    let h = Harness::start(mode).await;
    let (router, _) = counting(layer(&h), |n| {
        let headers = [("location", format!("/payments/{n}")), ("set-cookie", "session=secret".to_owned())];
        (StatusCode::CREATED, headers, "created").into_response()
    });
    let (_, first, _) = send(&router, payment(Some("h1"), "acme", &charge(1))).await;
    assert!(first.get("set-cookie").is_some());
    let (status, replay, body) = send(&router, payment(Some("h1"), "acme", &charge(1))).await;
    assert_eq!((status, &body[..]), (StatusCode::CREATED, &b"created"[..]));
    assert_eq!(replay["location"], "/payments/1");
    assert!(replay.get("set-cookie").is_none());

    // Asking for Set-Cookie to be replayed does not make it so (before: it was stored and replayed to
    // whoever held the key).
    let asked = layer(&h).with_operation("cookies").with_replayed_header(http::header::SET_COOKIE);
    let (router, _) =
        counting(asked, |n| (StatusCode::CREATED, [("set-cookie", format!("session={n}"))], "created").into_response());
    send(&router, payment(Some("h2"), "acme", &charge(1))).await;
    let (_, replay, _) = send(&router, payment(Some("h2"), "acme", &charge(1))).await;
    assert_eq!(replay["idempotent-replayed"], "true");
    assert!(replay.get("set-cookie").is_none());
}

/// A response over the capture limit (5 MB against the default 1 MiB), served over a real connection
/// with its `Content-Length`, is sent whole but stored only as "completed, not replayable", before the
/// client has its last byte: the retry gets 409 `not-replayable` and never runs the handler again
/// (before: the key was released, and the retry ran the payment a second time).
async fn oversized_response_is_never_run_again(mode: Mode) {
    let h = Harness::start(mode).await;
    let (router, runs) = counting(layer(&h).with_operation("big-response"), |_| "x".repeat(5 << 20).into_response());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    let client = reqwest::Client::new();
    let post = || {
        let request = client.post(format!("{base}/payments")).bearer_auth("acme").header("idempotency-key", "r1");
        request.json(&charge(1)).send()
    };
    let first = post().await.expect("HTTP");
    assert_eq!(first.status(), reqwest::StatusCode::OK);
    assert_eq!(first.bytes().await.expect("body").len(), 5 << 20);
    let record = h
        .store
        .admin()
        .lookup(&Scope::new(payments::app::tenant_of("acme"), "big-response").expect("scope"), &support::key("r1"))
        .await;
    assert_eq!(record.expect("lookup").expect("record").state, State::Completed, "settled before the last byte");
    let retry = post().await.expect("HTTP");
    assert_eq!(retry.status(), reqwest::StatusCode::CONFLICT);
    assert_eq!(problem_type(&retry.bytes().await.expect("body")), problem_types::NOT_REPLAYABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body that sends its first chunk, then waits for the test to open a gate before the other four,
/// under a 1 s lease: more than a lease passes while it streams, so only the heartbeat keeps the owner's
/// key, and a retry then is told "in flight" (before: the body was buffered without a heartbeat, and the
/// retry took a live owner over). Once the body ended, the retry replays all of it. One execution.
async fn streamed_response_keeps_its_lease_and_runs_once(mode: Mode) {
    let h = Harness::start(mode).await;
    let lease = Policy::builder().lease(Duration::from_secs(1)).build().expect("policy");
    let gate = Gate::default();
    let opened = gate.clone();
    let (router, runs) = counting(layer(&h).with_operation(PAYMENTS).with_policy(lease), move |_| opened.body());
    let first = tokio::spawn(send_owned(router.clone(), payment(Some("s1"), "acme", &charge(1))));
    wait_for_state(&h, "s1", State::InProgress).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // A retry that took the key over would run the handler again, and wait at the gate with it.
    let retry = send(&router, payment(Some("s1"), "acme", &charge(1)));
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(5), retry).await.expect("answered at once");
    assert_eq!((status, problem_type(&body)), (StatusCode::CONFLICT, problem_types::IN_FLIGHT.to_owned()));
    gate.open();
    let (status, _, streamed) = first.await.expect("join");
    assert_eq!((status, streamed.as_ref()), (StatusCode::OK, b"0 1 2 3 4 ".as_ref()));
    let (status, headers, replayed) = send(&router, payment(Some("s1"), "acme", &charge(1))).await;
    assert_eq!((status, replayed), (StatusCode::OK, streamed));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The client reads the first chunk and goes away while the body waits at the gate: once the gate
/// opens, the rest is drained and the record settled with all of it (before: the layer buffered the
/// whole body before answering, so the client got nothing and its dropped request left the record in
/// progress until its lease ran out); the retry replays it.
async fn client_gone_mid_body_still_settles_the_record(mode: Mode) {
    let h = Harness::start(mode).await;
    let gate = Gate::default();
    let opened = gate.clone();
    let (router, runs) = counting(layer(&h).with_operation(PAYMENTS), move |_| opened.body());
    let request = router.clone().oneshot(payment(Some("g1"), "acme", &charge(1)));
    let response = tokio::time::timeout(Duration::from_secs(5), request).await.expect("the head comes at once");
    let mut body = response.expect("infallible").into_body();
    let first = body.frame().await.expect("a frame").expect("no error").into_data().expect("data");
    assert_eq!(first, Bytes::from_static(b"0 "));
    drop(body);
    gate.open();
    wait_for_state(&h, "g1", State::Completed).await;
    // Redis hears of the completion one round trip after Postgres: a retry in between is told "in flight".
    assert_eq!(retry_while_in_flight(&router, "g1").await, StatusCode::OK);
    let (status, _, replayed) = send(&router, payment(Some("g1"), "acme", &charge(1))).await;
    assert_eq!((status, replayed.as_ref()), (StatusCode::OK, b"0 1 2 3 4 ".as_ref()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Over a real connection, a response of known length (the demo's JSON) is settled by the time the client
/// has it, and a retry right after the answer replays it. (That the client gets nothing before the record
/// is stored, which this cannot tell from a settlement right after: `the_last_byte_waits_for_the_stored_response`.)
async fn a_known_length_response_is_settled_before_the_client_has_it(mode: Mode) {
    let h = Harness::start(mode).await;
    let base = serve(&h).await;
    let client = reqwest::Client::new();
    for n in 0..5 {
        let key = format!("known-{n}");
        let first = post_payment(&client, &base, &key, "acme", &charge(1), 0).await;
        assert_eq!(first.status(), reqwest::StatusCode::CREATED);
        first.bytes().await.expect("body");
        let scope = payments::acme();
        let record =
            h.store.admin().lookup(&scope, &IdempotencyKey::new(key.clone()).expect("key")).await.expect("lookup");
        assert_eq!(record.map(|r| r.state), Some(State::Completed), "settled before the client had the body");
        let retry = post_payment(&client, &base, &key, "acme", &charge(1), 0).await;
        assert_eq!(retry.headers()["idempotent-replayed"], "true");
    }
}

/// The order itself, not only its outcome: the handler's response is ready, then Postgres stops answering
/// the store (the handler stalls the store's connection on its way out), and the client, over a real
/// connection, does not have its whole answer while the record cannot be stored (for a body settled
/// whole, not even the status); once Postgres answers again, the answer comes and the record is
/// completed. (The check of
/// `a_known_length_response_is_settled_before_the_client_has_it` looks after the client had the body,
/// which a settlement right after the last byte would pass too.) Both ways an answer is sent: a body
/// settled whole before the response starts, and one over the capture limit whose last frame is held.
async fn the_last_byte_waits_for_the_stored_response(mode: Mode) {
    let h = Arc::new(Harness::with(mode, Policy::default(), Servers::Proxied).await);
    let stall = |h: Arc<Harness>, body: fn() -> axum::response::Response| {
        move || {
            h.postgres_proxy.as_ref().expect("proxied").set(idemstore_testkit::ProxyMode::Blackhole);
            async move { body() }
        }
    };
    let small = || (StatusCode::CREATED, axum::Json(json!({"charge": 1}))).into_response();
    // Over the capture limit: streamed through, its last frame held until the record is settled.
    let large = || "x".repeat(2 << 20).into_response();
    let router = Router::new()
        .route("/payments", post(stall(h.clone(), small)))
        .route("/exports", post(stall(h.clone(), large)))
        .route_layer(layer(&h).with_operation(PAYMENTS));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    // The small body is settled whole before the response starts: not even the status may come first.
    for (path, key, length, status_first) in [("payments", "held", 12, false), ("exports", "held-large", 2 << 20, true)]
    {
        let url = format!("{base}/{path}");
        let (head_tx, mut head) = tokio::sync::oneshot::channel();
        let mut answer = tokio::spawn(async move {
            let request = reqwest::Client::new().post(url).bearer_auth("acme").header("idempotency-key", key);
            let first = request.json(&charge(1)).send().await.expect("HTTP");
            let _ = head_tx.send(first.status());
            first.bytes().await.expect("body").len()
        });
        // A bound on something that must not happen, not a wait for something that will.
        let early = tokio::time::timeout(Duration::from_secs(1), &mut answer).await;
        assert!(early.is_err(), "/{path}: the client had its answer while the record could not be stored: {early:?}");
        if !status_first {
            assert!(head.try_recv().is_err(), "/{path}: the client had the status before the record was stored");
        }
        h.postgres_proxy.as_ref().expect("proxied").set(idemstore_testkit::ProxyMode::Pass);
        let received = answer.await.expect("the client's task");
        let status = head.await.expect("the status");
        assert!(status.is_success(), "/{path}: {status}");
        assert_eq!(received, length, "/{path}");
        let record = h.store.admin().lookup(&payments::acme(), &support::key(key)).await.expect("lookup");
        assert_eq!(record.map(|r| r.state), Some(State::Completed), "/{path}");
    }
}

/// 429 and 403 answers depend on the moment or on the caller's rights: they are not stored, and the
/// retry runs the handler (before: they were replayed to every retry).
async fn transient_and_permission_answers_are_not_stored(mode: Mode) {
    let h = Harness::start(mode).await;
    let (router, runs) = counting(layer(&h).with_operation(PAYMENTS), |n| match n {
        1 => StatusCode::TOO_MANY_REQUESTS.into_response(),
        2 => StatusCode::FORBIDDEN.into_response(),
        _ => StatusCode::CREATED.into_response(),
    });
    for expected in [StatusCode::TOO_MANY_REQUESTS, StatusCode::FORBIDDEN, StatusCode::CREATED, StatusCode::CREATED] {
        assert_eq!(send(&router, payment(Some("t1"), "acme", &charge(1))).await.0, expected);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3, "the 201 was stored and replayed");
}

/// Holds a streamed body after its first chunk until the test opens it.
#[derive(Clone, Default)]
struct Gate(Arc<tokio::sync::Notify>, Arc<std::sync::atomic::AtomicBool>);

impl Gate {
    fn open(&self) {
        self.1.store(true, Ordering::SeqCst);
        self.0.notify_waiters();
    }

    /// Five chunks, "0 " to "4 "; the last four once the gate is open.
    fn body(&self) -> axum::response::Response {
        let gate = self.clone();
        let chunks = futures::stream::unfold(0, move |n| {
            let gate = gate.clone();
            async move {
                if n == 5 {
                    return None;
                }
                if n == 1 {
                    let opened = gate.0.notified();
                    tokio::pin!(opened);
                    // Registered before the check, so an `open` in between is not missed.
                    opened.as_mut().enable();
                    if !gate.1.load(Ordering::SeqCst) {
                        opened.await;
                    }
                }
                Some((Ok::<_, std::io::Error>(Bytes::from(format!("{n} "))), n + 1))
            }
        });
        Body::from_stream(chunks).into_response()
    }
}

async fn send_owned(router: Router, request: Request<Body>) -> (StatusCode, HeaderMap, Bytes) {
    send(&router, request).await
}

/// A handler that panics does not leave its key stuck: it is released and the retry executes.
async fn handler_panic_releases_the_key(mode: Mode) {
    let h = Harness::start(mode).await;
    let (router, runs) = counting(layer(&h).with_operation(PAYMENTS), |n| {
        assert!(n > 1, "the first run panics");
        StatusCode::CREATED.into_response()
    });
    let crashed = tokio::spawn(router.clone().oneshot(payment(Some("p1"), "acme", &charge(1)))).await;
    assert!(crashed.expect_err("the handler panicked").is_panic());
    wait_for_state(&h, "p1", State::Released).await;
    assert_eq!(retry_while_in_flight(&router, "p1").await, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Sends the request until it is not answered 409: the release reaches Postgres first and Redis a round
/// trip later, so a retry in between may still be told "in flight".
async fn retry_while_in_flight(router: &Router, key: &str) -> StatusCode {
    for _ in 0..100 {
        let (status, _, _) = send(router, payment(Some(key), "acme", &charge(1))).await;
        if status != StatusCode::CONFLICT {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    StatusCode::CONFLICT
}

/// A request whose future is dropped mid-handler (the client went away) releases its key.
async fn dropped_request_releases_the_key(mode: Mode) {
    let h = Harness::start(mode).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let running = Arc::new(tokio::sync::Notify::new());
    let (counter, started) = (runs.clone(), running.clone());
    let handler = move || {
        let first = counter.fetch_add(1, Ordering::SeqCst) == 0;
        started.notify_one();
        async move {
            if first {
                std::future::pending::<()>().await;
            }
            StatusCode::CREATED
        }
    };
    let router = Router::new().route("/payments", post(handler).route_layer(layer(&h).with_operation(PAYMENTS)));
    let abandoned = tokio::spawn(router.clone().oneshot(payment(Some("d1"), "acme", &charge(1))));
    // Dropped while its handler runs (the record in progress alone is not enough: a request cancelled
    // after Postgres committed its claim but before it read the answer leaves the claim to its lease).
    running.notified().await;
    abandoned.abort();
    wait_for_state(&h, "d1", State::Released).await;
    assert_eq!(retry_while_in_flight(&router, "d1").await, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// With Postgres down the layer answers 503 with Retry-After and the handler never runs.
async fn store_unavailable_answers_503_and_runs_nothing(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    let (router, runs) = counting(layer(&h), |_| StatusCode::CREATED.into_response());
    // A first request while Postgres is up: the failure below is then the claim's own.
    assert_eq!(send(&router, payment(Some("u0"), "acme", &charge(1))).await.0, StatusCode::CREATED);
    h.postgres.as_ref().expect("owned").stop().expect("stop Postgres");
    let (status, headers, body) = send(&router, payment(Some("u1"), "acme", &charge(1))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "1");
    assert_eq!(problem_type(&body), problem_types::UNAVAILABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the first request ran");
}

/// A request without a tenant, or with one the store cannot hold (here 300 bytes long), gets 401
/// missing-tenant and runs nothing (before: an invalid name was answered 400 invalid-body).
async fn missing_tenant_gets_401(mode: Mode) {
    let h = Harness::start(mode).await;
    // The token itself is the tenant here, so that a 300-byte one is a tenant the store refuses.
    let token = |parts: &axum::http::request::Parts| {
        parts.headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned)
    };
    let raw = IdempotencyLayer::new(h.store.clone(), token as fn(&axum::http::request::Parts) -> Option<String>);
    let (router, runs) = counting(raw, |_| StatusCode::CREATED.into_response());
    let mut anonymous = payment(Some("a1"), "acme", &charge(1));
    anonymous.headers_mut().remove("authorization");
    let invalid = payment(Some("a2"), &"t".repeat(300), &charge(1));
    for request in [anonymous, invalid] {
        let (status, _, body) = send(&router, request).await;
        let answer = (status, problem_type(&body));
        assert_eq!(answer, (StatusCode::UNAUTHORIZED, problem_types::MISSING_TENANT.to_owned()));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// Outside a matched route (`Router::layer`, a plain tower stack) the operation is "POST unmatched", never
/// the path the client chose: 1,000 distinct paths add one operation's series, not 1,000 (before: one per
/// path).
async fn unmatched_paths_add_no_metric_series(mode: Mode) {
    let h = Harness::start(mode).await;
    let layer = IdempotencyLayer::new(h.store.clone(), bearer as fn(&axum::http::request::Parts) -> Option<String>);
    let router = Router::new().fallback(post(|| async { "ok" })).layer(layer);
    let tenant = format!("unmatched-{}", h.id());
    for n in 0..1000 {
        let (status, _, _) = send(&router, unmatched(&tenant, n)).await;
        assert_eq!(status, StatusCode::OK);
    }
    let page = support::recorder().render();
    assert!(!page.contains("/anything/"), "a series named after a client's path:\n{page}");
    let executed = support::counter("POST unmatched", "idemstore_outcomes_total", &[("outcome", "executed")]);
    assert!(executed >= 1000.0, "{executed}");
}

fn unmatched(tenant: &str, n: usize) -> Request<Body> {
    Request::post(format!("/anything/{n}"))
        .header("authorization", format!("Bearer {tenant}"))
        .header("idempotency-key", format!("k-{n}"))
        .body(Body::empty())
        .expect("request")
}

/// A transfer from `account` with `key`, by tenant `acme`.
fn transfer(account: &str, key: &str, body: &Value) -> Request<Body> {
    post_to(&format!("/accounts/{account}/transfers"), key, body)
}

/// One key sent to two accounts' paths of one route names two records: the second account's request
/// runs (before: the path is part of the payload, so it was refused as the key reused, and under
/// `ConflictWithOriginal` shown the first account's response), another body there is shown its own
/// original, never the other account's, and each path's retry replays its own answer.
/// `KeySpace::Operation` keeps one key space for the whole route (the other path is refused).
async fn one_key_on_two_targets_names_two_records(mode: Mode) {
    let h = Harness::start(mode).await;
    let route = "/accounts/{id}/transfers";
    let with_original = layer(&h).with_mismatch_status(MismatchStatus::ConflictWithOriginal);
    let (router, runs) = counting_at(route, with_original, ok_body);
    let (_, _, to_a) = send(&router, transfer("A", "t1", &charge(1))).await;
    let (status, headers, to_b) = send(&router, transfer("B", "t1", &charge(1))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none(), "B's request ran: {:?}", String::from_utf8_lossy(&to_b));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let (status, _, original) = send(&router, transfer("B", "t1", &charge(2))).await;
    assert_eq!((status, &original), (StatusCode::CONFLICT, &to_b), "B's original, never A's");
    let (_, headers, again) = send(&router, transfer("A", "t1", &charge(1))).await;
    assert_eq!((headers["idempotent-replayed"].to_str().expect("ascii"), again), ("true", to_a));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // A key spelled as B's stored form, sent to the template spelled literally (a path the router
    // matches), is qualified too: it never reaches B's record.
    let literal = Request::post("/accounts/{id}/transfers")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", "/accounts/B/transfers#t1");
    let (status, headers, _) = send(&router, literal.body(Body::from(charge(2).to_string())).expect("request")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    let scope = Scope::new(payments::app::tenant_of("acme"), format!("POST {route}")).expect("scope");
    let stored = support::key("t1").for_target("/accounts/A/transfers");
    assert_eq!(stored.as_str(), "/accounts/A/transfers#t1");
    let record = h.store.admin().lookup(&scope, &stored).await.expect("lookup").expect("A's record");
    assert_eq!(record.state, State::Completed);

    // The handler finds the stored key (to derive downstream keys from) in the request's extensions.
    let context = |Extension(context): Extension<IdempotencyContext>| async move { context.key().as_str().to_owned() };
    let router = Router::new().route(route, post(context).route_layer(layer(&h)));
    let (_, _, body) = send(&router, transfer("A", "t3", &charge(1))).await;
    assert_eq!(body, "/accounts/A/transfers#t3");

    // A static route keeps the bare key, nested under a prefix too (the router sees only its part of
    // the path; the template is whole).
    let (inner, _) = counting(layer(&h), ok_body);
    let nested = Router::new().nest("/api", inner);
    let request = Request::post("/api/payments").header("authorization", "Bearer acme").header("idempotency-key", "n1");
    send(&nested, request.body(Body::from(charge(1).to_string())).expect("request")).await;
    let scope = Scope::new(payments::app::tenant_of("acme"), "POST /api/payments").expect("scope");
    assert!(h.store.admin().lookup(&scope, &support::key("n1")).await.expect("lookup").is_some(), "the bare key");

    let shared = layer(&h).with_key_space(KeySpace::Operation);
    let (router, runs) = counting_at(route, shared, ok_body);
    send(&router, transfer("A", "t2", &charge(1))).await;
    let (status, _, body) = send(&router, transfer("B", "t2", &charge(1))).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::UNPROCESSABLE_ENTITY, problem_types::KEY_REUSED.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one key space for the route");
}

/// The user who made a request, as an authentication layer would have put it.
fn user(parts: &axum::http::request::Parts) -> Option<String> {
    parts.headers.get("x-user")?.to_str().ok().map(str::to_owned)
}

/// With a principal binding, a stored response answers only the principal that made its request: the
/// same key and body from another user of the tenant gets 403 (before: the first user's response,
/// replayed), a body of its own under `ConflictWithOriginal` the plain refusal, never the original;
/// the first user's retry replays, and the handler ran once.
async fn a_response_bound_to_its_principal_is_refused_to_another(mode: Mode) {
    let h = Harness::start(mode).await;
    let bound = layer(&h).with_principal(user).with_mismatch_status(MismatchStatus::ConflictWithOriginal);
    let (router, runs) = counting(bound, ok_body);
    let as_user = |name: &str, body: &Value| {
        let mut request = payment(Some("p1"), "acme", body);
        request.headers_mut().insert("x-user", name.parse().expect("a header value"));
        request
    };
    let (status, _, first) = send(&router, as_user("alice", &charge(1))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = send(&router, as_user("mallory", &charge(1))).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::FORBIDDEN, problem_types::REPLAY_REFUSED.to_owned()));
    let (status, headers, body) = send(&router, as_user("mallory", &charge(2))).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::CONFLICT, problem_types::KEY_REUSED.to_owned()));
    assert!(headers.get("idempotent-replayed").is_none(), "nothing of alice's response");
    let (_, headers, again) = send(&router, as_user("alice", &charge(1))).await;
    assert_eq!((headers["idempotent-replayed"].to_str().expect("ascii"), again), ("true", first));
    let anonymous = payment(Some("p1"), "acme", &charge(1));
    assert_eq!(send(&router, anonymous).await.0, StatusCode::FORBIDDEN, "an anonymous request is another principal");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Replays charge nothing: a tenant at its new-key quota gets 429 for a new key, and still the replay of
/// a completed one, re-authorized by the principal binding (another user of the tenant gets 403, not
/// 429 and not the response); the handler ran once.
async fn a_tenant_at_its_quota_still_gets_its_replays(mode: Mode) {
    let h = Harness::start(mode).await;
    let one_new_key = Policy::builder().quota(Quota::default().new_keys(1, Duration::from_secs(3600))).build();
    let limited = layer(&h).with_principal(user).with_policy(one_new_key.expect("policy"));
    let (router, runs) = counting(limited, ok_body);
    let as_user = |name: &str, key: &str| {
        let mut request = payment(Some(key), "acme", &charge(1));
        request.headers_mut().insert("x-user", name.parse().expect("a header value"));
        request
    };
    let (status, _, first) = send(&router, as_user("alice", "q1")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = send(&router, as_user("alice", "q2")).await;
    assert_eq!(
        (status, problem_type(&body)),
        (StatusCode::TOO_MANY_REQUESTS, problem_types::QUOTA_EXCEEDED.to_owned())
    );
    for _ in 0..3 {
        let (status, headers, again) = send(&router, as_user("alice", "q1")).await;
        assert_eq!(
            (status, headers["idempotent-replayed"].to_str().expect("ascii"), &again),
            (StatusCode::OK, "true", &first)
        );
    }
    let (status, _, body) = send(&router, as_user("mallory", "q1")).await;
    assert_eq!((status, problem_type(&body)), (StatusCode::FORBIDDEN, problem_types::REPLAY_REFUSED.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body that says it has 10 bytes, sends 3, and never the rest: a handler passing on an upstream's
/// `Content-Length` while the upstream stalls.
struct Stalled {
    sent: bool,
}

impl http_body::Body for Stalled {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if std::mem::replace(&mut self.sent, true) {
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(b"abc")))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(10)
    }
}

/// A body of known length within the capture limit that stalls is bounded as a streamed body is: past
/// the layer's streaming bound its response starts with what was read and the record is settled as not
/// replayable, so a retry is told so and the handler never runs again. Before the fix the layer read it
/// whole with the lease extended and no bound: no response ever started and the key stayed in flight.
async fn a_stalled_body_of_known_length_is_bounded_like_a_stream(mode: Mode) {
    let h = Harness::start(mode).await;
    let bounded = layer(&h).with_operation("stalled").with_max_streaming(Duration::from_millis(300));
    let (router, runs) = counting(bounded, |_| axum::response::Response::new(Body::new(Stalled { sent: false })));
    let request = || payment(Some("stalled-1"), "acme", &charge(1));
    let started = router.clone().oneshot(request());
    let response = tokio::time::timeout(Duration::from_secs(20), started)
        .await
        .expect("the response started")
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.expect("a frame").expect("data").into_data().expect("data");
    assert_eq!(first, "abc", "what was read goes out first");
    // The settlement runs beside the body: "in flight" until it has reached both tiers.
    let started = std::time::Instant::now();
    let (status, retry) = loop {
        let (status, _, retry) = send(&router, request()).await;
        if status != StatusCode::CONFLICT || problem_type(&retry) != problem_types::IN_FLIGHT {
            break (status, retry);
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the record was never settled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!((status, problem_type(&retry)), (StatusCode::CONFLICT, problem_types::NOT_REPLAYABLE.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A request to `path` with `key` and `body`, by tenant `acme`.
fn post_to(path: &str, key: &str, body: &Value) -> Request<Body> {
    let request = Request::post(path)
        .header("authorization", "Bearer acme")
        .header("content-type", "application/json")
        .header("idempotency-key", key);
    request.body(Body::from(body.to_string())).expect("request")
}

/// A nested router's requests are compared by the whole target the client sent, the one the key space
/// names: one router mounted under `/v1` and `/v2` with one operation name refuses a `/v2` request that
/// reuses a `/v1` key, and under `KeySpace::Operation` a router nested under `/accounts/{id}` refuses
/// account B's request that reuses account A's key. Before the fix the fingerprint read the nested part
/// of the path (`/payments`, `/transfers`), the same for both: `/v2` was answered with `/v1`'s stored
/// response, and B with A's, while B's transfer never ran.
async fn a_nested_router_compares_the_whole_target(mode: Mode) {
    let h = Harness::start(mode).await;
    let (inner, runs) = counting(layer(&h).with_operation("nested-versions"), ok_body);
    let versions = Router::new().nest("/v1", inner.clone()).nest("/v2", inner);
    let (status, _, _) = send(&versions, post_to("/v1/payments", "n1", &charge(1))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, headers, body) = send(&versions, post_to("/v2/payments", "n1", &charge(1))).await;
    assert!(headers.get("idempotent-replayed").is_none(), "/v2 answered with /v1's response");
    assert_eq!((status, problem_type(&body)), (StatusCode::UNPROCESSABLE_ENTITY, problem_types::KEY_REUSED.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let shared = layer(&h).with_operation("nested-accounts").with_key_space(KeySpace::Operation);
    let (transfers, runs) = counting_at("/transfers", shared, ok_body);
    let accounts = Router::new().nest("/accounts/{id}", transfers);
    send(&accounts, post_to("/accounts/A/transfers", "t1", &charge(1))).await;
    let (status, headers, body) = send(&accounts, post_to("/accounts/B/transfers", "t1", &charge(1))).await;
    assert!(headers.get("idempotent-replayed").is_none(), "B answered with A's response");
    assert_eq!((status, problem_type(&body)), (StatusCode::UNPROCESSABLE_ENTITY, problem_types::KEY_REUSED.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// One request's retries name one record and are its replays, however the client, a proxy or an SDK
/// encodes the target: `%41` or `A` in the path or the query, `%2B` or `+` in a path (axum's `Path`
/// decodes both to `+`). Before the fix the key space normalized `%41` but the fingerprint did not, so
/// the retry was refused 422 `key-reused` by its own record; and `+` and `%2B` named two records, so the
/// retry ran the work again.
async fn one_request_in_any_encoding_names_one_record(mode: Mode) {
    let h = Harness::start(mode).await;
    let (router, runs) = counting_at("/accounts/{id}/transfers", layer(&h), ok_body);
    let spellings = [
        ("/accounts/%41/transfers", "/accounts/A/transfers", "e1"),
        ("/accounts/A/transfers?ref=%41", "/accounts/A/transfers?ref=A", "e2"),
        ("/accounts/a+b/transfers", "/accounts/a%2Bb/transfers", "e3"),
    ];
    for (n, (first, retry, key)) in spellings.into_iter().enumerate() {
        let (status, _, original) = send(&router, post_to(first, key, &charge(1))).await;
        assert_eq!(status, StatusCode::OK, "{first}");
        let (status, headers, replay) = send(&router, post_to(retry, key, &charge(1))).await;
        assert_eq!(
            (status, headers.get("idempotent-replayed").is_some()),
            (StatusCode::OK, true),
            "{retry}: {replay:?}"
        );
        assert_eq!(replay, original);
        assert_eq!(runs.load(Ordering::SeqCst), n + 1, "{retry} ran the work again");
    }
}
