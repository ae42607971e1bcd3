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
use http::{Request, Response};
use http_body_util::{BodyExt, Either, Full};
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use super::TenantResolver;
use super::admission::{Admission, Admitted, admit};
use super::answer;
use super::body::{Settlement, SettlingBody, Whole, fits, settle_whole};
use super::boxed::{Boxed, own, with_trailers};
use super::config::Config;
use super::transaction;
use crate::policy::LeaseExpiry;
use crate::store::Begin;

/// The request body the inner service gets: the caller's as it came (a request the layer passes
/// through), or the bytes the layer read to fingerprint it.
pub type RequestBody<B> = Either<B, Full<Bytes>>;

/// The response body the layer answers with: the inner service's as it came (a request passed through),
/// or the layer's own (a replay, a refusal, or the owner's response settling the record as it streams).
pub type ResponseBody<B> = Either<B, UnsyncBoxBody>;

pub use super::boxed::UnsyncBoxBody;

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
                    Admission::Admitted(admitted) => {
                        let derived = admitted.derived_header();
                        let answered = match config.in_claim_transaction {
                            true => transaction::execute(inner, &config, admitted).await,
                            false => execute(inner, &config, admitted).await,
                        };
                        answered.map(|mut response| {
                            if let Some(derived) = derived {
                                response.headers_mut().insert(super::IDEMPOTENCY_KEY_DERIVED, derived);
                            }
                            own(response)
                        })
                    }
                }
            }
            .instrument(span),
        )
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
    let Admitted { parts, scope, key, fingerprint, principal, .. } = &admitted;
    let store = &config.store;
    // The client may shorten the route's wait (`Prefer: wait`), never lengthen it.
    let options = admitted.options(config);
    let owner = match store.begin_with(scope, key, fingerprint, &options).await {
        Ok(Begin::Acquired(owner)) => owner,
        Ok(answer) => return Ok(answer::refusal(answer, config, parts, (scope, key, *principal)).await),
        Err(error) => return Ok(answer::store_failed(&error)),
    };
    let principal = *principal;
    // Cancelled or panicking, the handler drops the owner, which gives the key up under its rule.
    let request = admitted.into_request();
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
    let settlement = Settlement::new(owner, head.status, &head.headers, config.stored, capture, principal);
    if !fits(&body, config.max_response_body) {
        return Ok(Response::from_parts(
            head,
            SettlingBody::new(body, settlement, config.max_streaming).boxed_unsync(),
        ));
    }
    Ok(match settle_whole(settlement, body, config.max_streaming).await {
        Whole::Settled(Some((bytes, trailers))) => Response::from_parts(head, with_trailers(bytes, trailers)),
        Whole::Settled(None) => answer::response_failed(),
        Whole::Stalled(body) => Response::from_parts(head, body),
    })
}
