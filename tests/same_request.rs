//! When a retry over HTTP is the same request: query parameters in another order, a multipart body
//! rebuilt with another boundary, a body sent compressed. Through the layer, real Redis and Postgres, both
//! modes.

use crate::support;

use std::convert::Infallible;
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idemstore::Mode;
use idemstore::http::{IdempotencyLayer, QueryComparison, RequestBody, problem_types};
use support::Harness;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};

suite!(
    query_parameters_in_another_order_are_the_same_request,
    a_multipart_body_with_another_boundary_is_the_same_request,
    a_compressed_body_is_compared_decoded,
    stacked_encodings_are_refused_before_any_is_decoded,
    a_compressed_body_never_aliases_the_same_bytes_sent_plain,
    a_multipart_body_of_too_many_parts_is_refused,
);

type Handler = BoxCloneService<Request<Full<Bytes>>, Response<idemstore::http::ResponseBody<Full<Bytes>>>, Infallible>;

/// The layer in front of a handler that counts its runs and answers 201.
fn charges(h: &Harness, query: QueryComparison) -> (Handler, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let mut response = Response::new(Full::new(Bytes::from_static(b"charged")));
        *response.status_mut() = StatusCode::CREATED;
        std::future::ready(Ok::<_, Infallible>(response))
    });
    let tenant = |_: &http::request::Parts| Some("acme".to_owned());
    let layer =
        IdempotencyLayer::new(h.store.clone(), tenant).with_operation(h.operation.clone()).with_query_comparison(query);
    (BoxCloneService::new(layer.layer(handler)), runs)
}

fn post(uri: &str, key: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Request<Full<Bytes>> {
    let mut request = Request::post(uri).header("idempotency-key", key);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Full::new(Bytes::from(body))).expect("request")
}

/// Status and problem type (or body) of an answer.
async fn answer(service: &Handler, request: Request<Full<Bytes>>) -> (StatusCode, String) {
    let response = service.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body").to_bytes();
    let text = String::from_utf8_lossy(&body).into_owned();
    let kind =
        serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| v["type"].as_str().map(str::to_owned));
    (status, kind.unwrap_or(text))
}

/// `?currency=EUR&amount=5` then `?amount=5&currency=EUR`: a replay (before: 422, key reused). With
/// `QueryComparison::Exact` the order counts.
async fn query_parameters_in_another_order_are_the_same_request(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, runs) = charges(&h, QueryComparison::default());
    let first = answer(&service, post("/charges?currency=EUR&amount=5", "q-1", &[], vec![])).await;
    let retry = answer(&service, post("/charges?amount=5&currency=EUR", "q-1", &[], vec![])).await;
    assert_eq!((first.0, retry.0), (StatusCode::CREATED, StatusCode::CREATED), "{retry:?}");
    let other = answer(&service, post("/charges?amount=6&currency=EUR", "q-1", &[], vec![])).await;
    assert_eq!(other, (StatusCode::UNPROCESSABLE_ENTITY, problem_types::KEY_REUSED.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let (exact, _) = charges(&h, QueryComparison::Exact);
    answer(&exact, post("/charges?currency=EUR&amount=5", "q-2", &[], vec![])).await;
    let reordered = answer(&exact, post("/charges?amount=5&currency=EUR", "q-2", &[], vec![])).await;
    assert_eq!(reordered.0, StatusCode::UNPROCESSABLE_ENTITY);
}

fn form(boundary: &str, amount: &str) -> (String, Vec<u8>) {
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n{amount}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"receipt\"; filename=\"r.txt\"\r\n\
         Content-Type: text/plain\r\n\r\nhello\r\n--{boundary}--\r\n"
    );
    (format!("multipart/form-data; boundary={boundary}"), body.into_bytes())
}

/// The same form rebuilt by a client with a new boundary: a replay (before: another request, 422); a
/// changed field is still another request.
async fn a_multipart_body_with_another_boundary_is_the_same_request(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, runs) = charges(&h, QueryComparison::default());
    let (first_type, first_body) = form("XyZ1", "5");
    let (retry_type, retry_body) = form("----other-boundary-77", "5");
    let first = answer(&service, post("/charges", "m-1", &[("content-type", &first_type)], first_body)).await;
    let retry = answer(&service, post("/charges", "m-1", &[("content-type", &retry_type)], retry_body)).await;
    assert_eq!((first.0, retry.0), (StatusCode::CREATED, StatusCode::CREATED), "{retry:?}");
    let (changed_type, changed_body) = form("XyZ1", "6");
    let changed = answer(&service, post("/charges", "m-1", &[("content-type", &changed_type)], changed_body)).await;
    assert_eq!(changed.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("compress");
    encoder.finish().expect("compress")
}

/// A gzip-encoded JSON body, then the same JSON sent plain (members in another order): a replay (before:
/// the compressed bytes were parsed as JSON, and the first request got 400). An encoding the layer cannot
/// decode gets 415; a decoded body over the limit gets 413.
async fn a_compressed_body_is_compared_decoded(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, runs) = charges(&h, QueryComparison::default());
    let json = [("content-type", "application/json")];
    let gzipped = [("content-type", "application/json"), ("content-encoding", "gzip")];
    let first = answer(&service, post("/charges", "z-1", &gzipped, gzip(br#"{"amount":5,"currency":"EUR"}"#))).await;
    let retry = answer(&service, post("/charges", "z-1", &json, br#"{"currency":"EUR","amount":5}"#.to_vec())).await;
    assert_eq!((first.0, retry.0), (StatusCode::CREATED, StatusCode::CREATED), "{first:?} {retry:?}");
    let other = answer(&service, post("/charges", "z-1", &gzipped, gzip(br#"{"amount":6,"currency":"EUR"}"#))).await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let zstd = [("content-type", "application/json"), ("content-encoding", "zstd")];
    let refused = answer(&service, post("/charges", "z-2", &zstd, b"\x28\xb5\x2f\xfd".to_vec())).await;
    assert_eq!(refused, (StatusCode::UNSUPPORTED_MEDIA_TYPE, problem_types::UNSUPPORTED_ENCODING.to_owned()));
    let bomb = gzip(&vec![b' '; 4 << 20]);
    let too_large = answer(&service, post("/charges", "z-3", &gzipped, bomb)).await;
    assert_eq!(too_large, (StatusCode::PAYLOAD_TOO_LARGE, problem_types::BODY_TOO_LARGE.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Request A sends gzip bytes G as a plain body; request B reuses A's key with the same bytes G and
/// `Content-Encoding: gzip` (its payload is the decompressed text, another payload): 422, never A's 201
/// replayed (before: B got A's stored 201, since the raw body's form was accepted against any record).
async fn a_compressed_body_never_aliases_the_same_bytes_sent_plain(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, runs) = charges(&h, QueryComparison::default());
    let compressed = gzip(b"amount=5");
    let plain = answer(&service, post("/charges", "alias-1", &[], compressed.clone())).await;
    assert_eq!(plain.0, StatusCode::CREATED);
    let encoded = answer(&service, post("/charges", "alias-1", &[("content-encoding", "gzip")], compressed)).await;
    assert_eq!(encoded, (StatusCode::UNPROCESSABLE_ENTITY, problem_types::KEY_REUSED.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A body gzipped 40 times over, each layer listed in `Content-Encoding` (the shape of a nested bomb:
/// each layer may inflate to the body limit): 415 before anything is decoded or run (before: every layer
/// was undone on the async worker, and the request ran). Two encodings are still undone.
async fn stacked_encodings_are_refused_before_any_is_decoded(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, runs) = charges(&h, QueryComparison::default());
    let json = br#"{"amount":5,"currency":"EUR"}"#.to_vec();
    let stacked = (0..40).fold(json.clone(), |body, _| gzip(&body));
    let encodings = vec!["gzip"; 40].join(", ");
    let headers = [("content-type", "application/json"), ("content-encoding", encodings.as_str())];
    let refused = answer(&service, post("/charges", "s-1", &headers, stacked)).await;
    assert_eq!(refused, (StatusCode::UNSUPPORTED_MEDIA_TYPE, problem_types::UNSUPPORTED_ENCODING.to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let twice = [("content-type", "application/json"), ("content-encoding", "gzip, gzip")];
    let decoded = answer(&service, post("/charges", "s-2", &twice, gzip(&gzip(&json)))).await;
    assert_eq!(decoded, (StatusCode::CREATED, "charged".to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A multipart body of 5,000 empty parts (each a parse, a sort and a copy): 413 before anything runs
/// (before: every part was compared, and the request ran).
async fn a_multipart_body_of_too_many_parts_is_refused(mode: Mode) {
    let h = Harness::start(mode).await;
    let (service, runs) = charges(&h, QueryComparison::default());
    let part = "--b\r\nContent-Disposition: form-data; name=\"p\"\r\n\r\n\r\n";
    let body = format!("{}--b--\r\n", part.repeat(5_000)).into_bytes();
    let headers = [("content-type", "multipart/form-data; boundary=b")];
    let refused = answer(&service, post("/charges", "p-1", &headers, body)).await;
    assert_eq!(refused.0, StatusCode::PAYLOAD_TOO_LARGE, "{refused:?}");
    assert_eq!(refused.1, problem_types::BODY_TOO_LARGE);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A large compressed body is decoded off the async worker: on a runtime of one worker, a request to
/// another route is answered while the layer is still inflating a 4 MiB body (before: the worker was
/// busy inflating it, and the large request was answered before anything else ran).
#[tokio::test(flavor = "current_thread")]
async fn a_large_body_is_decoded_off_the_async_worker() {
    let h = Harness::start(Mode::PostgresOnly).await;
    let limit = 4 << 20;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = tower::service_fn(move |_: Request<RequestBody<BoxedBody>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok")))))
    });
    let tenant = |_: &http::request::Parts| Some("acme".to_owned());
    let layer =
        IdempotencyLayer::new(h.store.clone(), tenant).with_operation(h.operation.clone()).with_max_request_body(limit);
    let service = layer.layer(handler);

    // The large body tells the test when the layer has read it: from then on, the layer fingerprints it.
    let (read, was_read) = tokio::sync::oneshot::channel();
    let bomb = Bytes::from(gzip(&vec![b' '; limit + 1]));
    let frame = futures::stream::once(async move {
        let _ = read.send(());
        Ok::<_, Infallible>(http_body::Frame::data(bomb))
    });
    let body = http_body_util::StreamBody::new(frame).boxed_unsync();
    let large = Request::post("/charges").header("idempotency-key", "big-1").header("content-encoding", "gzip");
    let large = tokio::spawn(service.clone().oneshot(large.body(body).expect("request")));
    was_read.await.expect("the layer reads the body");

    // One worker: this runs only once the large request has given the worker back.
    let health = Request::get("/healthz").body(Full::new(Bytes::new()).map_err(|never| match never {}).boxed_unsync());
    let health = service.clone().oneshot(health.expect("request")).await.expect("infallible");
    assert_eq!(health.status(), StatusCode::OK);
    assert!(!large.is_finished(), "the large body was decoded on the worker, before the health check");

    let large = large.await.expect("no panic").expect("infallible");
    assert_eq!(large.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the health check ran");
}

type BoxedBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;
