//! The layer as a plain tower middleware (no axum): trailers, a request cancelled while the response body
//! is read, and an inner service that fails. Real Redis and Postgres, both modes.

#[macro_use]
mod support;

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
    inner_errors_follow_the_records_rule,
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

/// A response's trailers (here a checksum) reach the client that ran the handler and every replay
/// (before: only replays had them).
async fn trailers_reach_the_first_caller_and_every_replay(mode: Mode) {
    let h = Harness::start(mode).await;
    let service = layer(&h, Policy::default()).layer(tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("abc"));
        let body = Full::new(Bytes::from_static(b"abc")).with_trailers(async { Some(Ok(trailers)) });
        Ok::<_, Infallible>(Response::new(body))
    }));
    for attempt in ["first", "replay"] {
        let response = service.clone().oneshot(request("with-trailers")).await.expect("infallible");
        let collected = response.into_body().collect().await.expect("body");
        let checksum = collected.trailers().and_then(|t| t.get("x-checksum")).cloned();
        assert_eq!(checksum, Some(HeaderValue::from_static("abc")), "{attempt}");
        assert_eq!(collected.to_bytes().as_ref(), b"abc", "{attempt}");
    }
}

/// A 10-byte body (its length known, so the layer settles it whole before answering) that comes after
/// `delay`.
struct Slow(Pin<Box<tokio::time::Sleep>>, bool);

impl http_body::Body for Slow {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.1 {
            return Poll::Ready(None);
        }
        std::task::ready!(self.0.as_mut().poll(cx));
        self.1 = true;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"0123456789")))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(if self.1 { 0 } else { 10 })
    }
}

use std::future::Future as _;

/// The handler answered, and the request is cancelled while its (known-length) body is still being
/// read: the work ran, so the retry is told the response is not replayable and the handler does not run
/// again (before: the dropped owner released the key and the retry ran it a second time).
async fn request_cancelled_while_the_body_is_read_never_runs_again(mode: Mode) {
    let h = Harness::start(mode).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let service = layer(&h, Policy::default()).layer(tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        async {
            Ok::<_, Infallible>(Response::new(Slow(Box::pin(tokio::time::sleep(Duration::from_millis(500))), false)))
        }
    }));
    let cancelled = tokio::time::timeout(Duration::from_millis(100), service.clone().oneshot(request("cut"))).await;
    assert!(cancelled.is_err(), "the request was cancelled while the body was read");
    let answer = loop {
        let response = service.clone().oneshot(request("cut")).await.expect("infallible");
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
