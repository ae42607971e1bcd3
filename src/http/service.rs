//! [`IdempotencyService`]: admits a request (key, tenant, scope, body, fingerprint), then executes it as
//! the key's owner (the inner service runs once, its response is captured and settled) or answers from
//! what the key holds. The plain path uses only the store's public API, as any user's middleware could;
//! the transactional one ([`super::transaction`]) claims inside a transaction it hands to the handler.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use super::TenantResolver;
use super::answer::{self, Boxed, own};
use super::body::{Settlement, SettlingBody, fits, settle_whole};
use super::config::{Config, KeyRequirement};
use super::key_header::read_key;
use super::request_fingerprint::{MAX_PARTS, Unreadable, fingerprint};
use super::transaction;
use crate::error::InputError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::policy::LeaseExpiry;
use crate::record::Begin;

/// The request body the inner service gets: the caller's as it came (a request the layer passes
/// through), or the bytes the layer read to fingerprint it.
pub type RequestBody<B> = Either<B, Full<Bytes>>;

/// The response body the layer answers with: the inner service's as it came (a request passed through),
/// or the layer's own (a replay, a refusal, or the owner's response settling the record as it streams).
pub type ResponseBody<B> = Either<B, UnsyncBoxBody>;

/// The boxed body of the layer's own answers.
pub type UnsyncBoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// The middleware service made by [`super::IdempotencyLayer`].
pub struct IdempotencyService<S, T> {
    inner: S,
    config: Arc<Config<T>>,
}

impl<S: Clone, T> Clone for IdempotencyService<S, T> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), config: Arc::clone(&self.config) }
    }
}

impl<S: fmt::Debug, T> fmt::Debug for IdempotencyService<S, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, T> IdempotencyService<S, T> {
    pub(crate) fn new(inner: S, config: Arc<Config<T>>) -> Self {
        Self { inner, config }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, T, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyService<S, T>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    T: TenantResolver,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready clone serves this call; a fresh clone stays behind for the next poll_ready.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        let config = Arc::clone(&self.config);
        let span = tracing::debug_span!("idemstore.http", method = %request.method());
        Box::pin(
            async move {
                match admit(&config, request).await {
                    Admission::PassThrough(request) => {
                        inner.oneshot(request.map(Either::Left)).await.map(|response| response.map(Either::Left))
                    }
                    Admission::Refused(response) => Ok(own(response)),
                    Admission::Admitted(admitted) if config.in_claim_transaction => {
                        transaction::execute(inner, &config, admitted).await.map(own)
                    }
                    Admission::Admitted(admitted) => execute(inner, &config, admitted).await.map(own),
                }
            }
            .instrument(span),
        )
    }
}

/// What admission made of a request.
enum Admission<B> {
    /// Not the layer's business (another method, no key where one is optional).
    PassThrough(Request<B>),
    /// Turned away before anything was claimed.
    Refused(Response<Boxed>),
    /// A keyed request, read and fingerprinted.
    Admitted(Admitted),
}

/// A request the layer will claim a key for.
pub(crate) struct Admitted {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
    pub(crate) scope: Scope,
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
}

/// Key, tenant, scope, body and fingerprint, or the refusal; nothing is claimed yet.
async fn admit<T, B>(config: &Config<T>, request: Request<B>) -> Admission<B>
where
    T: TenantResolver,
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if !config.methods.contains(request.method()) {
        return Admission::PassThrough(request);
    }
    let key = match read_key(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.key == KeyRequirement::Optional => return Admission::PassThrough(request),
        Ok(None) => return Admission::Refused(answer::missing_key()),
        Err(detail) => return Admission::Refused(answer::invalid_key(detail)),
    };
    let (parts, body) = request.into_parts();
    let Some(tenant) = config.tenant.tenant(&parts) else { return Admission::Refused(answer::missing_tenant()) };
    let scope = match Scope::new(tenant, operation(config, &parts)) {
        Ok(scope) => scope,
        // The tenant resolver gave a name the store cannot hold: the request has no usable tenant.
        Err(InputError::InvalidScope { field: "tenant", .. }) => return Admission::Refused(answer::missing_tenant()),
        Err(error) => return Admission::Refused(answer::invalid_body(error)),
    };
    let body = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            return Admission::Refused(answer::too_large(config.max_request_body));
        }
        Err(error) => return Admission::Refused(answer::invalid_body(format!("the body could not be read: {error}"))),
    };
    let policy = config.options.policy.as_deref().unwrap_or_else(|| config.store.policy(scope.operation()));
    match fingerprint(&parts, &body, policy.fingerprint(), config.query, config.max_request_body).await {
        Ok(fingerprint) => Admission::Admitted(Admitted { parts, body, scope, key, fingerprint }),
        Err(Unreadable::Input(InputError::PayloadTooLarge { limit, .. })) => {
            Admission::Refused(answer::too_large(limit))
        }
        Err(Unreadable::Input(error)) => Admission::Refused(answer::invalid_body(error)),
        Err(Unreadable::Encoding(detail)) => Admission::Refused(answer::unsupported_encoding(detail)),
        Err(Unreadable::TooManyParts) => Admission::Refused(answer::too_many_parts(MAX_PARTS)),
    }
}

/// Claims the key; as its owner, runs the inner service once and settles the record with its response
/// (as the body streams, for a body that is not known to fit the capture limit); otherwise answers from
/// what the key holds.
async fn execute<S, T, ReqBody, ResBody>(
    inner: S,
    config: &Config<T>,
    admitted: Admitted,
) -> Result<Response<Boxed>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Admitted { parts, body, scope, key, fingerprint } = admitted;
    let store = &config.store;
    let owner = match store.begin_with(&scope, &key, &fingerprint, &config.options).await {
        Ok(Begin::Acquired(owner)) => owner,
        Ok(answer) => return Ok(answer::refusal(answer, config, &parts, &scope, &key).await),
        Err(error) => return Ok(answer::store_failed(&error)),
    };
    // Cancelled or panicking, the handler drops the owner, which gives the key up under its rule.
    let request = Request::from_parts(parts, Either::Right(Full::new(body)));
    let response = match owner.run(inner.oneshot(request)).await {
        Ok(response) => response,
        Err(error) => {
            // No response to store. The service may have acted (a timeout layer inside this one cancels a
            // handler mid-work): what a dropped handler gets, by the record's rule.
            if owner.policy().lease_expiry() == LeaseExpiry::MarkIndeterminate {
                owner.abandon();
            } else if let Err(release) = owner.release().await {
                tracing::warn!(error = %release, "could not release the key after the service failed");
            }
            return Err(error);
        }
    };
    let (head, body) = response.into_parts();
    let capture = (config.max_response_body, config.replayed_headers.as_slice());
    let settlement = Settlement::new(owner, head.status, &head.headers, config.stored, capture);
    if !fits(&body, config.max_response_body) {
        return Ok(Response::from_parts(head, SettlingBody::new(body, settlement).boxed_unsync()));
    }
    Ok(match settle_whole(settlement, body).await {
        Some((bytes, trailers)) => Response::from_parts(head, answer::with_trailers(bytes, trailers)),
        None => answer::response_failed(),
    })
}

/// The configured operation name; else the method and axum's matched route template; else the method
/// and `unmatched`. Never the request path: it is client input, and every distinct path would be a new
/// metric series and a new set of records.
fn operation<T>(config: &Config<T>, parts: &Parts) -> String {
    if let Some(operation) = &config.operation {
        return operation.clone();
    }
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return format!("{} {}", parts.method, matched.as_str());
    }
    format!("{} unmatched", parts.method)
}
