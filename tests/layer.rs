//! The layer as a plain tower middleware: the transactional path (`transactional.rs`), trailers, a request cancelled while the response body
//! is read, and an inner service that fails. Real Redis and Postgres, both modes.

use crate::support;
#[path = "layer/transactional.rs"]
mod transactional;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use idemstore::http::{IdempotencyLayer, RequestBody, problem_types};
use idemstore::{LeaseExpiry, Mode, Policy};
use support::{Harness, Servers};
use tower::{BoxError, Layer, ServiceExt};

suite!(
    trailers_reach_the_first_caller_and_every_replay,
    request_cancelled_while_the_body_is_read_never_runs_again,
    shutdown_waits_for_the_settlement_of_an_abandoned_body,
    a_body_that_streams_past_the_bound_is_settled_not_replayable,
    inner_errors_follow_the_records_rule,
    a_revoked_caller_cannot_read_a_stored_answer_by_retrying,
    a_tenant_over_its_quota_gets_429_and_nothing_runs,
);

fn tenant(_: &http::request::Parts) -> Option<String> {
    Some("acme".into())
}

fn request(key: &str) -> Request<Full<Bytes>> {
    Request::post("/charges")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request")
}

fn layer(h: &Harness, policy: Policy) -> IdempotencyLayer<fn(&http::request::Parts) -> Option<String>> {
    IdempotencyLayer::new(h.store.clone(), tenant as fn(&http::request::Parts) -> Option<String>)
        .with_operation(h.operation.clone())
        .with_policy(policy)
}

/// A response's trailers reach the client that ran the handler, all of them, and every replay, those
/// the replay allow-list names (here a checksum added to it; before: only replays had trailers, and then
/// every one of them, a debugging token included).
async fn trailers_reach_the_first_caller_and_every_replay(mode: Mode) {
    let h = Harness::start(mode).await;
    let layer = layer(&h, Policy::default()).with_replayed_header(http::HeaderName::from_static("x-checksum"));
    let service = layer.layer(tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("abc"));
        trailers.insert("x-debug-token", HeaderValue::from_static("secret"));
        let body = Full::new(Bytes::from_static(b"abc")).with_trailers(async { Some(Ok(trailers)) });
        Ok::<_, Infallible>(Response::new(body))
    }));
    for attempt in ["first", "replay"] {
        let response = service.clone().oneshot(request("with-trailers")).await.expect("infallible");
        let collected = response.into_body().collect().await.expect("body");
        let trailer = |name| collected.trailers().and_then(|t| t.get(name)).cloned();
        assert_eq!(trailer("x-checksum"), Some(HeaderValue::from_static("abc")), "{attempt}");
        let debug = trailer("x-debug-token");
        assert_eq!(debug.is_some(), attempt == "first", "{attempt}: only the first caller gets {debug:?}");
        assert_eq!(collected.to_bytes().as_ref(), b"abc", "{attempt}");
    }
}

/// A 10-byte body (its length known, so the layer settles it whole before answering) that never comes;
/// it tells `reading` when the layer starts to read it.
struct Unending(Arc<tokio::sync::Notify>);

impl http_body::Body for Unending {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.notify_one();
        Poll::Pending
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(10)
    }
}

/// The handler answered, and the request is cancelled while its (known-length) body is still being
/// read: the work ran, so the retry is told the response is not replayable and the handler does not run
/// again (before: the dropped owner released the key and the retry ran it a second time).
async fn request_cancelled_while_the_body_is_read_never_runs_again(mode: Mode) {
    let h = Harness::start(mode).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let reading = Arc::new(tokio::sync::Notify::new());
    let (counted, body_read) = (Arc::clone(&runs), Arc::clone(&reading));
    let service = layer(&h, Policy::default()).layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let body = Unending(Arc::clone(&body_read));
        async { Ok::<_, Infallible>(Response::new(body)) }
    }));
    // Cancelled once the layer reads the body, whatever the machine's load (a timeout could fire before
    // the handler was even called).
    tokio::select! {
        _ = service.clone().oneshot(request("cut")) => panic!("answered though its body never came"),
        () = reading.notified() => {}
    }
    let answer = loop {
        // A retry that ran the handler again would read its unending body: bounded, so that fails too.
        let retry = tokio::time::timeout(Duration::from_secs(10), service.clone().oneshot(request("cut")));
        let response = retry.await.expect("the retry is answered, not run").expect("infallible");
        let status = response.status();
        let body = response.into_body().collect().await.expect("body").to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        if problem["type"] != problem_types::IN_FLIGHT {
            break (status, problem["type"].clone());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(answer, (StatusCode::CONFLICT, problem_types::NOT_REPLAYABLE.into()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The client goes away after the head of a streamed response: a task drains the rest of the body and
/// settles the record. `Store::shutdown` waits for that task, so a process that stops once it returns
/// leaves the key replayable, not in progress for a lease.
async fn shutdown_waits_for_the_settlement_of_an_abandoned_body(mode: Mode) {
    use futures::StreamExt as _;

    let h = Harness::start(mode).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let second_half = Arc::new(tokio::sync::Notify::new());
    let (counted, released) = (Arc::clone(&runs), Arc::clone(&second_half));
    let service = layer(&h, Policy::default()).layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        // No length, so the head goes out before the body; its second half comes when the test says.
        let released = Arc::clone(&released);
        let halves = futures::stream::iter([&b"first "[..], &b"second"[..]]).then(move |half| {
            let released = Arc::clone(&released);
            async move {
                if half == b"second" {
                    released.notified().await;
                }
                Ok::<_, Infallible>(Frame::data(Bytes::from_static(half)))
            }
        });
        async { Ok::<_, Infallible>(Response::new(http_body_util::StreamBody::new(halves))) }
    }));
    let head = service.clone().oneshot(request("abandoned")).await.expect("infallible");
    assert_eq!(head.status(), StatusCode::OK);
    drop(head);
    let store = h.store.clone();
    let mut shutdown = tokio::spawn(async move { store.shutdown().await });
    let early = tokio::time::timeout(Duration::from_millis(200), &mut shutdown).await;
    assert!(early.is_err(), "the shutdown waits for the settlement under way");
    second_half.notify_one();
    shutdown.await.expect("the shutdown ends once the body is settled");
    // A retry is the replay of the whole body.
    let replay = service.clone().oneshot(request("abandoned")).await.expect("infallible");
    let status = replay.status();
    let body = replay.into_body().collect().await.expect("body").to_bytes();
    assert_eq!((status, body.as_ref()), (StatusCode::OK, &b"first second"[..]));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A client that takes a streamed response's head and never reads its body: the heartbeat would extend
/// the lease for as long as the connection stays open. Past the layer's streaming bound the record is
/// settled as not replayable (before: it stayed in progress, its lease extended, for as long as the
/// client liked), a retry is told so without running the handler, and the body still goes on. A 500,
/// which is not stored, is not released at the bound either (a retry would run the handler while the
/// first body may still produce): its lease runs out under its rule, here `MarkIndeterminate`.
async fn a_body_that_streams_past_the_bound_is_settled_not_replayable(mode: Mode) {
    let h = Harness::start(mode).await;
    for (status, answer) in [
        (StatusCode::OK, problem_types::NOT_REPLAYABLE),
        (StatusCode::INTERNAL_SERVER_ERROR, problem_types::INDETERMINATE),
    ] {
        past_the_bound(&h, status, answer).await;
    }
}

async fn past_the_bound(h: &Harness, status: StatusCode, answer: &str) {
    use futures::StreamExt as _;

    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    // A 1 s lease: the bound's 300 ms plus the wait below span several heartbeats.
    let rule = LeaseExpiry::MarkIndeterminate;
    let policy = Policy::builder().lease(Duration::from_secs(1)).lease_expiry(rule).build().expect("policy");
    let layer = layer(h, policy).with_max_streaming(Duration::from_millis(300));
    let service = layer.layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        // No length, so the head goes out before the body; one frame, then nothing ever again.
        let frames = futures::stream::iter([Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"tick")))])
            .chain(futures::stream::pending());
        let mut response = Response::new(http_body_util::StreamBody::new(frames));
        *response.status_mut() = status;
        async { Ok::<_, Infallible>(response) }
    }));
    let name = format!("stalled-{}", status.as_u16());
    let head = service.clone().oneshot(request(&name)).await.expect("infallible");
    assert_eq!(head.status(), status);
    // A retry is told "in flight" until the record is settled (in Redis too, in two-tier mode).
    let answered = async {
        loop {
            let retry = service.clone().oneshot(request(&name)).await.expect("infallible");
            let (status, body) = (retry.status(), retry.into_body().collect().await.expect("body").to_bytes());
            let problem: serde_json::Value = serde_json::from_slice(&body).expect("problem+json");
            if problem["type"] != problem_types::IN_FLIGHT {
                break (status, problem["type"].clone());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let settled = tokio::time::timeout(Duration::from_secs(10), answered).await.expect("settled within the bound");
    assert_eq!(settled, (StatusCode::CONFLICT, answer.into()), "{status}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{status}");
    // The client that stopped reading still gets its body when it reads.
    let mut body = head.into_body();
    let frame = body.frame().await.expect("a frame").expect("data");
    assert_eq!(frame.into_data().expect("data").as_ref(), b"tick");
}

/// An inner service that fails (here after acting, as a handler cut by a timeout layer does) leaves the
/// record to its rule: under MarkIndeterminate the retry does not run it again; under TakeOver the key is
/// released and the retry runs it (before: released under both).
async fn inner_errors_follow_the_records_rule(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Any).await;
    for (rule, runs_after_retry) in [(LeaseExpiry::MarkIndeterminate, 1), (LeaseExpiry::TakeOver, 2)] {
        let policy = Policy::builder().lease_expiry(rule).build().expect("policy");
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let service = layer(&h, policy).layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err::<Response<Full<Bytes>>, BoxError>("timed out after acting".into());
                }
                Ok(Response::new(Full::new(Bytes::from_static(b"done"))))
            }
        }));
        let key = format!("failing-{}", rule.as_str());
        assert!(service.clone().oneshot(request(&key)).await.is_err(), "the inner error passes through");
        let retry = service.clone().oneshot(request(&key)).await.expect("an answer");
        assert_eq!(runs.load(Ordering::SeqCst), runs_after_retry, "{rule:?}: {}", retry.status());
    }
}

/// The replay check: a caller whose API key was revoked after the first request gets 403
/// `replay-refused` and not a byte of the stored response (nor the original on a mismatch answered with
/// it); the handler ran once; a caller still allowed gets the replay. `run_once_with` and
/// `run_once_in_tx_with` do the same with `RunOptions::replay_check`.
async fn a_revoked_caller_cannot_read_a_stored_answer_by_retrying(mode: Mode) {
    let h = Harness::start(mode).await;
    let revoked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let checked = Arc::clone(&revoked);
    let service = layer(&h, Policy::default())
        .with_mismatch_status(idemstore::http::MismatchStatus::ConflictWithOriginal)
        .with_replay_check(move |parts, scope| {
            assert_eq!(scope.tenant(), "acme");
            let api_key = parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let allowed = !checked.lock().expect("lock").contains(&api_key);
            async move { allowed }
        });
    let counted = Arc::clone(&runs);
    let service = service.layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"card ending 4242")))) }
    }));
    let send = |api_key: &str, body: &'static [u8]| {
        let mut request = request("revocable");
        request.headers_mut().insert("x-api-key", HeaderValue::from_str(api_key).expect("header"));
        *request.body_mut() = Full::new(Bytes::from_static(body));
        service.clone().oneshot(request)
    };
    let first = send("key-1", b"{}").await.expect("infallible");
    assert_eq!(first.status(), StatusCode::OK);
    revoked.lock().expect("lock").push("key-1".into());
    for (case, body) in [("replay", &b"{}"[..]), ("mismatch with the original", b"{\"other\":1}")] {
        let refused = send("key-1", body).await.expect("infallible");
        assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{case}");
        let bytes = refused.into_body().collect().await.expect("body").to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&bytes).expect("problem+json");
        assert_eq!(problem["type"], problem_types::REPLAY_REFUSED, "{case}");
        assert!(!String::from_utf8_lossy(&bytes).contains("4242"), "{case}: nothing of the stored answer");
    }
    let allowed = send("key-2", b"{}").await.expect("infallible");
    assert_eq!(allowed.headers()["idempotent-replayed"], "true");
    assert_eq!(allowed.into_body().collect().await.expect("body").to_bytes().as_ref(), b"card ending 4242");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let (scope, key) = (h.scope("acme"), support::key("run-once-revocable"));
    let payload = serde_json::json!({"n": 1});
    let first = h.store.run_once(&scope, &key, &payload, || h.charge("acme", &key)).await.expect("run");
    assert!(matches!(first, idemstore::RunOutcome::Executed(_)));
    let refusing = idemstore::RunOptions::default().replay_check(|_, _| async { false });
    let refused = h.store.run_once_with(&scope, &key, &payload, &refusing, || h.charge("acme", &key)).await;
    assert_eq!(refused.expect("answer"), idemstore::RunOutcome::ReplayRefused);
    let in_tx = h
        .store
        .run_once_in_tx_with(&scope, &key, &payload, &refusing, |_tx| {
            Box::pin(async { Ok::<_, std::io::Error>(serde_json::json!("ran again")) })
        })
        .await;
    assert_eq!(in_tx.expect("answer"), idemstore::RunOutcome::ReplayRefused);
    assert_eq!(h.effects("acme", &key).await, 1);
    assert_eq!(h.counter("idemstore_replays_refused_total", &[]), 4.0);
}

/// A tenant past its policy's quota gets 429 `quota-exceeded` with Retry-After, and the handler does not
/// run; its stored answers still replay.
async fn a_tenant_over_its_quota_gets_429_and_nothing_runs(mode: Mode) {
    let h = Harness::start(mode).await;
    let quota = idemstore::Quota::default().new_keys(1, std::time::Duration::from_secs(600));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let policy = Policy::builder().quota(quota).build().expect("policy");
    let service = layer(&h, policy).layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"charged")))) }
    }));
    assert_eq!(service.clone().oneshot(request("first")).await.expect("infallible").status(), StatusCode::OK);
    let refused = service.clone().oneshot(request("second")).await.expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = refused.headers()["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((1..=1200).contains(&retry_after), "Retry-After: {retry_after} (within two windows)");
    let bytes = refused.into_body().collect().await.expect("body").to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&bytes).expect("problem+json");
    assert_eq!(problem["type"], problem_types::QUOTA_EXCEEDED);
    let replay = service.clone().oneshot(request("first")).await.expect("infallible");
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
