//! [`IdempotencyService`]: reads the key, claims it, runs the inner service once, stores and replays.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::MatchedPath;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, request::Parts};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::{BoxError, Service, ServiceExt};

use super::TenantResolver;
use super::body::{Settlement, SettlingBody, fits, settle_whole};
use super::capture::Stored;
use super::layer::Config;
use super::problem::{Problem, problem_types as types};
use crate::error::InputError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};
use crate::record::Begin;

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
    S: Service<Request<Body>, Response = Response<ResBody>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
    T: TenantResolver,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready clone serves this call; a fresh clone stays behind for the next poll_ready.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        let config = Arc::clone(&self.config);
        Box::pin(async move { Ok(handle(inner, &config, request).await) })
    }
}

async fn handle<S, T, ReqBody, ResBody>(inner: S, config: &Config<T>, request: Request<ReqBody>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<ResBody>, Error = Infallible> + Send,
    S::Future: Send,
    T: TenantResolver,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !config.methods.contains(request.method()) {
        return pass_through(inner, request.map(Body::new)).await;
    }
    let key = match read_key(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if config.key == super::KeyRequirement::Optional => {
            return pass_through(inner, request.map(Body::new)).await;
        }
        Ok(None) => {
            let detail = "this route requires an Idempotency-Key header";
            return Problem::new(StatusCode::BAD_REQUEST, types::MISSING_KEY, "Idempotency-Key missing", detail)
                .into_response();
        }
        Err(detail) => {
            return Problem::new(StatusCode::BAD_REQUEST, types::INVALID_KEY, "Invalid Idempotency-Key", detail)
                .into_response();
        }
    };
    let (parts, body) = request.into_parts();
    let Some(tenant) = config.tenant.tenant(&parts) else {
        let detail = "the request has no tenant; authenticate first";
        return Problem::new(StatusCode::UNAUTHORIZED, types::MISSING_TENANT, "Tenant unknown", detail).into_response();
    };
    let operation = config.operation.clone().unwrap_or_else(|| {
        let path = parts.extensions.get::<MatchedPath>().map_or(parts.uri.path(), MatchedPath::as_str);
        format!("{} {path}", parts.method)
    });
    let scope = match Scope::new(tenant, operation) {
        Ok(scope) => scope,
        Err(error) => return invalid_body(error),
    };
    let policy = config.options.policy.as_deref().unwrap_or_else(|| config.store.policy(scope.operation()));

    let body = match Limited::new(Body::new(body), config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            return too_large(config.max_request_body);
        }
        Err(error) => return invalid_body(format!("the request body could not be read: {error}")),
    };
    let fingerprint = match fingerprint(&parts, &body, policy.fingerprint()) {
        Ok(fingerprint) => fingerprint,
        Err(InputError::PayloadTooLarge { limit, .. }) => return too_large(limit),
        Err(error) => return invalid_body(error),
    };

    let store = &config.store;
    let owner = match store.begin_with(&scope, &key, &fingerprint, &config.options).await {
        Ok(Begin::Acquired(owner)) => owner,
        Ok(Begin::Completed(stored)) => return replay(&stored, None),
        Ok(Begin::InFlight { retry_after }) => {
            let detail = "a request with this Idempotency-Key is being processed; retry later";
            return Problem::new(StatusCode::CONFLICT, types::IN_FLIGHT, "Request in flight", detail)
                .retry_after(retry_after)
                .into_response();
        }
        Ok(Begin::Mismatch) => return mismatch(config, &scope, &key).await,
        Ok(Begin::Indeterminate) => {
            let detail = "an earlier attempt with this key ended without an answer; it must be resolved first";
            return Problem::new(StatusCode::CONFLICT, types::INDETERMINATE, "Outcome unknown", detail).into_response();
        }
        Ok(Begin::Expired) => {
            let detail =
                "a request with this key completed, and its response is no longer kept; it is not executed again";
            return Problem::new(StatusCode::GONE, types::EXPIRED, "Response expired", detail).into_response();
        }
        Err(_) => return unavailable(),
    };

    // Cancelled or panicking, the handler drops the owner, which gives the key up under its rule.
    let request = Request::from_parts(parts, Body::from(body));
    let Ok(response) = owner.run(inner.oneshot(request)).await;
    let (head, body) = response.into_parts();
    let stored = config.stored.stores(head.status);
    let capture = (config.max_response_body, config.replayed_headers.as_slice());
    let settlement = Settlement::new(owner, head.status, &head.headers, stored, capture);
    let body = Body::new(body);
    if !fits(&body, config.max_response_body) {
        return Response::from_parts(head, Body::new(SettlingBody::new(body, settlement)));
    }
    match settle_whole(settlement, body).await {
        Some(bytes) => Response::from_parts(head, Body::from(bytes)),
        None => {
            Problem::new(StatusCode::INTERNAL_SERVER_ERROR, types::UNAVAILABLE, "Response failed", "").into_response()
        }
    }
}

async fn pass_through<S, ResBody>(inner: S, request: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<ResBody>, Error = Infallible>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Ok(response) = inner.oneshot(request).await;
    response.map(Body::new)
}

/// Reads `Idempotency-Key` in the draft's structured-field string form (`"abc"`) or bare (`abc`).
fn read_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, String> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err("the Idempotency-Key header is repeated".into());
    }
    let raw = value.as_bytes();
    let key = match raw {
        [b'"', quoted @ .., b'"'] => unquote(quoted)?,
        bare => bare.to_vec(),
    };
    let key = String::from_utf8(key).map_err(|_| InputError::KeyInvalidByte { offset: 0 }.to_string())?;
    IdempotencyKey::new(key).map(Some).map_err(|e| e.to_string())
}

/// Fuzzing entry (`cargo fuzz` builds with `--cfg fuzzing`): one `Idempotency-Key` value, parsed.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn fuzz_read_key(value: &[u8]) -> Option<String> {
    let value = http::HeaderValue::from_bytes(value).ok()?;
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", value);
    read_key(&headers).ok().flatten().map(|key| key.as_str().to_owned())
}

/// Undoes sf-string escaping (RFC 8941 §3.3.3): `\"` and `\\` only.
fn unquote(quoted: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(quoted.len());
    let mut bytes = quoted.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err("the quoted Idempotency-Key has an invalid escape".into()),
            },
            b'"' => return Err("the quoted Idempotency-Key has an unescaped quote".into()),
            b => out.push(b),
        }
    }
    Ok(out)
}

/// Method + path and query + the body's canonical fingerprint: the same body sent to another resource is
/// another request.
fn fingerprint(parts: &Parts, body: &[u8], options: &crate::FingerprintOptions) -> Result<Fingerprint, InputError> {
    let is_json = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| {
            let mime = mime.trim();
            mime.eq_ignore_ascii_case("application/json") || mime.to_ascii_lowercase().ends_with("+json")
        });
    let body = if is_json && !body.is_empty() {
        Fingerprint::of_json(body, options)?
    } else {
        Fingerprint::of_bytes(body, options)?
    };
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    Ok(body.within(&[parts.method.as_str(), target]))
}

fn replay(stored: &crate::StoredResponse, status: Option<StatusCode>) -> Response<Body> {
    match Stored::decode(stored.as_bytes()) {
        Some(Stored::Response(captured)) => captured.replay(status),
        Some(Stored::Withheld(withheld)) => not_replayable(format!(
            "a request with this key completed with status {}, but its {}-byte response was not stored for \
             replay (larger than the capture limit, or cut short); it is not executed again",
            withheld.status, withheld.bytes
        )),
        // Completed by another writer of the key (an operator's raw bytes): done, but not replayable here.
        None => not_replayable(
            "a request with this key completed; its stored result is not an HTTP response this \
             layer can replay; it is not executed again"
                .into(),
        ),
    }
}

/// The answer to a retry of a request that ran but whose response cannot be replayed: it runs no more.
fn not_replayable(detail: String) -> Response<Body> {
    Problem::new(StatusCode::CONFLICT, types::NOT_REPLAYABLE, "Response not replayable", detail).into_response()
}

async fn mismatch<T>(config: &Config<T>, scope: &Scope, key: &IdempotencyKey) -> Response<Body> {
    let status = config.mismatch.status();
    if config.mismatch == super::MismatchStatus::ConflictWithOriginal
        && let Ok(Some(record)) = config.store.lookup(scope, key).await
        && let Some(Stored::Response(original)) = record.response.and_then(|r| Stored::decode(r.as_bytes()))
    {
        return original.replay(Some(status));
    }
    let detail = "this Idempotency-Key was used with a different request payload";
    Problem::new(status, types::KEY_REUSED, "Idempotency-Key reused", detail).into_response()
}

fn too_large(limit: usize) -> Response<Body> {
    let detail = format!("the request body is larger than {limit} bytes");
    Problem::new(StatusCode::PAYLOAD_TOO_LARGE, types::BODY_TOO_LARGE, "Request body too large", detail).into_response()
}

fn invalid_body(detail: impl fmt::Display) -> Response<Body> {
    Problem::new(StatusCode::BAD_REQUEST, types::INVALID_BODY, "Invalid request", detail.to_string()).into_response()
}

fn unavailable() -> Response<Body> {
    let detail = "the idempotency store is unavailable; nothing was executed";
    Problem::new(StatusCode::SERVICE_UNAVAILABLE, types::UNAVAILABLE, "Store unavailable", detail)
        .retry_after(Duration::from_secs(1))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("idempotency-key", http::HeaderValue::from_bytes(value).expect("header value"));
        }
        headers
    }

    proptest! {
        /// The quoted (structured-field string) and bare forms of any valid key name the same key.
        #[test]
        fn quoted_and_bare_forms_agree(key in "[!-~]{1,255}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            let bare = read_key(&headers(&[key.as_bytes()]));
            let from_quoted = read_key(&headers(&[quoted.as_bytes()]));
            if key.starts_with('"') && key.ends_with('"') && key.len() >= 2 {
                // A bare value wrapped in quotes is read as the quoted form; that is what the draft says.
                prop_assert!(from_quoted.is_ok());
            } else {
                prop_assert_eq!(bare.clone().ok().flatten(), from_quoted.clone().ok().flatten());
                prop_assert_eq!(bare.ok().flatten().map(|k| k.as_str().to_owned()), Some(key));
            }
        }

        /// Arbitrary header bytes give a key or an error, never a panic.
        #[test]
        fn never_panics(value in prop::collection::vec(32u8..=255, 0..300)) {
            if let Ok(value) = http::HeaderValue::from_bytes(&value) {
                let _ = read_key(&headers(&[value.as_bytes()]));
            }
        }
    }

    #[test]
    fn repeated_and_malformed_headers_are_refused() {
        assert!(read_key(&headers(&[b"a", b"b"])).is_err());
        assert!(read_key(&headers(&[b"\"a\\qb\""])).is_err());
        assert!(read_key(&headers(&[b"\"a\"b\""])).is_err());
        assert!(read_key(&headers(&[b"\"\""])).is_err());
        assert!(read_key(&headers(&[b""])).is_err());
        assert_eq!(read_key(&headers(&[])).ok(), Some(None));
        let escaped = read_key(&headers(&[b"\"a\\\"b\""])).expect("valid escape").expect("a key");
        assert_eq!(escaped.as_str(), "a\"b");
    }
}
