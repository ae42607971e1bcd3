//! The same contract for gRPC: a tower layer for tonic channels that adds the `idempotency-key` metadata
//! and retries by what the server answered, with the rules, policy, budget and journal of
//! [`IdempotencyMiddleware`].

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::BodyExt as _;
use tonic::Code;
use tonic::body::Body;
use tonic_types::StatusExt as _;
use tower::{BoxError, Layer, Service, ServiceExt as _};

use crate::attempts::{Attempts, Wait};
use crate::error::{Problem, Retryable};
use crate::journal::{KeyJournal, MemoryJournal};
use crate::middleware::{IDEMPOTENCY_KEY, IdempotencyMiddleware, Operation};
use crate::policy::{Judgment, judge_head, judge_with_body, replayed};

/// A tower layer for a tonic `Channel` (or any client service of `http::Request<tonic::body::Body>`):
/// every call to one of its methods carries an `idempotency-key` (the one the request already has, the
/// journal's for an [`Operation`] in the request's extensions, else a UUIDv7), the same key and the same
/// message on every attempt, and retries by the answer:
///
/// - **Retried**: no answer (the channel's error, a body cut short); `UNAVAILABLE`;
///   `RESOURCE_EXHAUSTED` that carries a `RetryInfo` (waited out in full); `ABORTED` (a conflict, or a
///   request in flight on a server that answers it so: a failure like the others, its `RetryInfo`
///   waited out if it has one); and the HTTP answers of an idempotency layer in front of the service, as
///   [`IdempotencyMiddleware`] reads them (409 `in-flight` polled; 408, 425, 429 and a 5xx that is not
///   final retried, `Retry-After` honoured).
/// - **Handed back as they are**: every other status, `OK` included, and an answer the server replayed
///   from its record (`idempotent-replayed: true`): tonic turns them into the call's `Status` as
///   without the layer.
/// - **When the retries stop** (attempts, deadline, budget), the call gets the last attempt's answer or
///   error, as without the layer; [`telemetry::GAVE_UP`](crate::telemetry::GAVE_UP) counts why. The
///   deadline is the policy's, or the call's own timeout (`grpc-timeout`, as `Request::set_timeout`
///   sets it) if sooner; each attempt is sent with the time left, and a deadline that passes while an
///   attempt is unanswered is `DEADLINE_EXCEEDED`.
/// - **The retry budget** is the layer's (the requests a tonic client sends carry no host): give each
///   channel a layer of its own.
/// - **`Endpoint::timeout`** bounds each attempt, not the call (it sends no `grpc-timeout`): an attempt
///   it cuts off is retried as no answer, within the policy's deadline. Bound the call with
///   `Request::set_timeout`.
///
/// Only the methods named here get a key and retries; every other call passes untouched. A method's
/// message is read whole before its first attempt, so that every attempt can send it: name unary
/// methods, never a streaming one.
///
/// ```no_run
/// use idemstore_client::{IdempotencyGrpcLayer, IdempotencyMiddleware, RetryPolicy};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:50051").connect().await?;
/// let rules = IdempotencyMiddleware::new().policy(RetryPolicy::default());
/// let layer = IdempotencyGrpcLayer::new(rules, ["/charges.Charges/Create"]);
/// let channel = tower::ServiceBuilder::new().layer(layer).service(channel);
/// let client = tonic::client::Grpc::new(channel);
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct IdempotencyGrpcLayer<J = MemoryJournal> {
    client: Arc<IdempotencyMiddleware<J>>,
    methods: Arc<[String]>,
}

impl<J> Clone for IdempotencyGrpcLayer<J> {
    fn clone(&self) -> Self {
        Self { client: Arc::clone(&self.client), methods: Arc::clone(&self.methods) }
    }
}

impl<J> IdempotencyGrpcLayer<J> {
    /// The middleware's policy, budget and journal, for calls to `methods` (`/package.Service/Method`,
    /// unary ones).
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(rules: IdempotencyMiddleware<J>, methods: I) -> Self {
        Self { client: Arc::new(rules), methods: methods.into_iter().map(Into::into).collect() }
    }
}

impl<S, J> Layer<S> for IdempotencyGrpcLayer<J> {
    type Service = IdempotencyGrpc<S, J>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyGrpc { inner, layer: self.clone() }
    }
}

/// The service [`IdempotencyGrpcLayer`] wraps around a channel.
#[derive(Debug)]
pub struct IdempotencyGrpc<S, J = MemoryJournal> {
    inner: S,
    layer: IdempotencyGrpcLayer<J>,
}

impl<S: Clone, J> Clone for IdempotencyGrpc<S, J> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), layer: self.layer.clone() }
    }
}

type BoxFuture<T> = std::pin::Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, J> Service<Request<Body>> for IdempotencyGrpc<S, J>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    J: KeyJournal,
{
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Response<Body>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The service that was made ready takes this call's first attempt; a clone takes the rest.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        if !self.layer.methods.iter().any(|method| method == request.uri().path()) {
            let mut inner = inner;
            return Box::pin(async move { inner.call(request).await.map_err(Into::into) });
        }
        Box::pin(send(inner, Arc::clone(&self.layer.client), request))
    }
}

/// A call's attempts: its key, its message read once, and the answers judged.
async fn send<S, J>(
    mut inner: S,
    client: Arc<IdempotencyMiddleware<J>>,
    request: Request<Body>,
) -> Result<Response<Body>, BoxError>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Error: Into<BoxError>,
    J: KeyJournal,
{
    let started = Instant::now();
    let (mut head, body) = request.into_parts();
    // No host to budget by: the budget is the layer's (see its docs).
    let host = head.uri.authority().map(ToString::to_string).unwrap_or_default();
    let caller = head.headers.get(GRPC_TIMEOUT).and_then(parse_timeout);
    let mut attempts = Attempts::start(&client.policy, &client.budget, host, started, caller);
    if !head.headers.contains_key(IDEMPOTENCY_KEY) {
        let key = client.key(head.extensions.get::<Operation>().cloned()).await?;
        head.headers.insert(IDEMPOTENCY_KEY, key);
    }
    let Ok(message) = tokio::time::timeout(attempts.left(), body.collect()).await else {
        return Err(tonic::Status::deadline_exceeded("the call's message was not read before the deadline").into());
    };
    let message = message?.to_bytes();
    loop {
        let left = attempts.send();
        let attempt = async {
            // Ready already for the first attempt (the caller polled it); after a wait, again.
            let service = inner.ready().await.map_err(Into::into)?;
            // The time left once the channel is ready: the server's deadline is never past the call's.
            let request = copy(&head, &message, caller.map(|_| attempts.left()));
            read(service.call(request).await.map_err(Into::into)?).await
        };
        let Ok(answered) = tokio::time::timeout(left, attempt).await else {
            let deadline = attempts.timed_out();
            return Err(tonic::Status::deadline_exceeded(deadline.to_string()).into());
        };
        let (last, wait, failed) = match answered {
            Ok(read) => match judge(&read) {
                Judgment::Answer => {
                    attempts.answered(replayed(&read.head.headers));
                    return Ok(read.into_response());
                }
                Judgment::Refused => {
                    attempts.answered(false);
                    return Ok(read.into_response());
                }
                Judgment::Retry(last, wait) => (last, wait, Ok(read)),
            },
            Err(error) => (Retryable::Transport(error.to_string()), Wait::Backoff, Err(error)),
        };
        // When the retries stop, the caller gets what it would have got without the layer.
        let Ok(wait) = attempts.retry(last, wait, true) else {
            return failed.map(Read::into_response);
        };
        tokio::time::sleep(wait).await;
    }
}

/// One attempt's request: the call's head and message, again, with the time left as its `grpc-timeout`
/// when the call has one.
fn copy(head: &http::request::Parts, message: &Bytes, left: Option<Duration>) -> Request<Body> {
    let mut request = Request::new(Body::new(http_body_util::Full::new(message.clone())));
    *request.method_mut() = head.method.clone();
    *request.uri_mut() = head.uri.clone();
    *request.version_mut() = head.version;
    *request.headers_mut() = head.headers.clone();
    *request.extensions_mut() = head.extensions.clone();
    if let Some(left) = left {
        request.headers_mut().insert(GRPC_TIMEOUT, format_timeout(left));
    }
    request
}

/// The call's timeout, as gRPC sends it: at most 8 digits and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
const GRPC_TIMEOUT: &str = "grpc-timeout";

fn parse_timeout(value: &HeaderValue) -> Option<Duration> {
    let value = value.to_str().ok()?;
    let (digits, unit) = value.split_at_checked(value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let count: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(count * 3600),
        "M" => Duration::from_secs(count * 60),
        "S" => Duration::from_secs(count),
        "m" => Duration::from_millis(count),
        "u" => Duration::from_micros(count),
        "n" => Duration::from_nanos(count),
        _ => return None,
    })
}

/// `left` as a `grpc-timeout`: milliseconds, rounded up (no attempt is sent with nothing left while time
/// remains), or seconds when that is too many digits.
fn format_timeout(left: Duration) -> HeaderValue {
    let millis = left.as_nanos().div_ceil(1_000_000);
    let value =
        if millis < 100_000_000 { format!("{millis}m") } else { format!("{}S", left.as_secs().min(99_999_999)) };
    HeaderValue::from_str(&value).expect("digits and a unit")
}

/// An answer read whole: a unary call's answer is one message and its trailers, which hold its status.
struct Read {
    head: http::response::Parts,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

async fn read(response: Response<Body>) -> Result<Read, BoxError> {
    let (head, body) = response.into_parts();
    let collected = body.collect().await?;
    let trailers = collected.trailers().cloned();
    Ok(Read { head, body: collected.to_bytes(), trailers })
}

impl Read {
    fn into_response(self) -> Response<Body> {
        let body = http_body_util::Full::new(self.body);
        let body = match self.trailers {
            Some(trailers) => Body::new(body.with_trailers(async move { Some(Ok(trailers)) })),
            None => Body::new(body),
        };
        Response::from_parts(self.head, body)
    }
}

/// What an answer means: an HTTP refusal of an idempotency layer (a status other than 200), or the
/// call's gRPC status (in the headers of a trailers-only answer, else in the trailers).
fn judge(read: &Read) -> Judgment {
    let (status, headers) = (read.head.status, &read.head.headers);
    if status != http::StatusCode::OK {
        return judge_head(status, headers)
            .unwrap_or_else(|| judge_with_body(status, headers, Problem::parse(&read.body).as_ref()));
    }
    let grpc = tonic::Status::from_header_map(headers)
        .or_else(|| read.trailers.as_ref().and_then(tonic::Status::from_header_map));
    let Some(grpc) = grpc else { return Judgment::Answer };
    // The server's `RetryInfo`: when to come back, or (in flight) when the first attempt's lease ends.
    let asked = grpc.get_details_retry_info().and_then(|info| info.retry_delay);
    let (last, fresh) = (Retryable::Grpc(grpc.code()), !replayed(headers));
    match (grpc.code(), asked) {
        (Code::Unavailable | Code::Aborted, None) if fresh => Judgment::Retry(last, Wait::Backoff),
        (Code::Unavailable | Code::Aborted | Code::ResourceExhausted, Some(asked)) if fresh => {
            Judgment::Retry(last, Wait::Asked(asked))
        }
        _ => Judgment::Answer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_read_and_write_as_grpc_sends_them() {
        let parse = |value: &str| parse_timeout(&HeaderValue::from_str(value).expect("a header value"));
        assert_eq!(parse("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(parse("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("250u"), Some(Duration::from_micros(250)));
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(format_timeout(Duration::from_micros(1_500_100)), "1501m");
        assert_eq!(format_timeout(Duration::from_secs(200_000)), "200000S");
        let again = format_timeout(Duration::from_millis(42));
        assert_eq!(parse(again.to_str().expect("ascii")), Some(Duration::from_millis(42)));
    }
}
