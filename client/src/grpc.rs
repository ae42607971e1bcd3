//! The same contract for gRPC: a tower layer for tonic channels that adds the `idempotency-key` metadata
//! and retries by what the server answered, with the rules, policy, budget and journal of
//! [`IdempotencyMiddleware`].

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
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
/// every call through it carries an `idempotency-key` (the one the request already has, the journal's
/// for an [`Operation`] in the request's extensions, else a UUIDv7), the same key and the same message on
/// every attempt, and retries by the answer:
///
/// - **Retried**: no answer (the channel's error, a body cut short); `UNAVAILABLE`;
///   `RESOURCE_EXHAUSTED` that carries a `RetryInfo` (waited out in full); `ABORTED`, which a server
///   answers for a request in flight (polled, bounded by its `RetryInfo`); and the HTTP answers of an
///   idempotency layer in front of the service, as [`IdempotencyMiddleware`] reads them (409
///   `in-flight`, 429 and 503 with `Retry-After`, other 5xx unless final).
/// - **Handed back as they are**: every other status, `OK` included, and an `UNAVAILABLE` the server
///   replayed from its record (`idempotent-replayed: true`): tonic turns them into the call's
///   `Status` as without the layer.
/// - **When the retries stop** (attempts, deadline, budget), the call gets the last attempt's answer or
///   error, as without the layer; [`telemetry::GAVE_UP`](crate::telemetry::GAVE_UP) counts why. A
///   deadline that passes while an attempt is unanswered is `DEADLINE_EXCEEDED`.
///
/// Each call's message is read whole before the first attempt, so that every attempt can send it: use
/// it for unary calls (streaming calls pass untouched when [`IdempotencyGrpcLayer::only`] leaves them
/// out).
///
/// ```no_run
/// use idemstore_client::{IdempotencyGrpcLayer, IdempotencyMiddleware, RetryPolicy};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:50051").connect().await?;
/// let layer = IdempotencyGrpcLayer::from(IdempotencyMiddleware::new().policy(RetryPolicy::default()))
///     .only(["/charges.Charges/Create"]);
/// let channel = tower::ServiceBuilder::new().layer(layer).service(channel);
/// let client = tonic::client::Grpc::new(channel);
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct IdempotencyGrpcLayer<J = MemoryJournal> {
    client: Arc<IdempotencyMiddleware<J>>,
    only: Option<Arc<[String]>>,
}

impl<J> Clone for IdempotencyGrpcLayer<J> {
    fn clone(&self) -> Self {
        Self { client: Arc::clone(&self.client), only: self.only.clone() }
    }
}

impl Default for IdempotencyGrpcLayer<MemoryJournal> {
    fn default() -> Self {
        Self::from(IdempotencyMiddleware::new())
    }
}

impl<J> From<IdempotencyMiddleware<J>> for IdempotencyGrpcLayer<J> {
    /// The middleware's policy, budgets and journal, for gRPC calls.
    fn from(client: IdempotencyMiddleware<J>) -> Self {
        Self { client: Arc::new(client), only: None }
    }
}

impl<J> IdempotencyGrpcLayer<J> {
    /// Only these methods (`/package.Service/Method`) get a key and retries; every other call passes
    /// untouched. By default every call through the layer does.
    pub fn only<I: IntoIterator<Item = S>, S: Into<String>>(mut self, methods: I) -> Self {
        self.only = Some(methods.into_iter().map(Into::into).collect());
        self
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
        let covered = self.layer.only.as_ref().is_none_or(|only| only.iter().any(|m| m == request.uri().path()));
        if !covered {
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
    let (mut head, body) = request.into_parts();
    if !head.headers.contains_key(IDEMPOTENCY_KEY) {
        let key = client.key(head.extensions.get::<Operation>().cloned()).await?;
        head.headers.insert(IDEMPOTENCY_KEY, key);
    }
    let message = body.collect().await?.to_bytes();
    let host = head.uri.authority().map(ToString::to_string).unwrap_or_default();
    let mut attempts = Attempts::start(&client.policy, &client.budget, host);
    loop {
        let left = attempts.send();
        let attempt = async {
            // Ready already for the first attempt (the caller polled it); after a wait, again.
            let service = inner.ready().await.map_err(Into::into)?;
            read(service.call(copy(&head, &message)).await.map_err(Into::into)?).await
        };
        let Ok(answered) = tokio::time::timeout(left, attempt).await else {
            let deadline = attempts.timed_out();
            return Err(tonic::Status::deadline_exceeded(deadline.to_string()).into());
        };
        let (last, wait, failed) = match answered {
            Ok(read) => match judge(&read) {
                Judgment::Answer | Judgment::Refused => {
                    attempts.answered(replayed(&read.head.headers));
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

/// One attempt's request: the call's head and message, again.
fn copy(head: &http::request::Parts, message: &Bytes) -> Request<Body> {
    let mut request = Request::new(Body::new(http_body_util::Full::new(message.clone())));
    *request.method_mut() = head.method.clone();
    *request.uri_mut() = head.uri.clone();
    *request.version_mut() = head.version;
    *request.headers_mut() = head.headers.clone();
    *request.extensions_mut() = head.extensions.clone();
    request
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
        (Code::Unavailable, None) if fresh => Judgment::Retry(last, Wait::Backoff),
        (Code::Unavailable | Code::ResourceExhausted, Some(asked)) if fresh => {
            Judgment::Retry(last, Wait::Asked(asked))
        }
        (Code::Aborted, _) if fresh => Judgment::Retry(last, Wait::Poll(asked)),
        _ => Judgment::Answer,
    }
}
