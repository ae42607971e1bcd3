//! When a retry over HTTP is the same request: query parameters in another order, a multipart body
//! rebuilt with another boundary, a body sent compressed. Through the layer, real Redis and Postgres, both
//! modes.

#[macro_use]
mod support;

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
