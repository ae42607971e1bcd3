//! Admission: what the layer reads of a keyed request before it claims anything (key, tenant, scope,
//! body, fingerprint), or the refusal it answers instead. Both paths, plain and transactional, start
//! here.

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::BoxError;

use super::TenantResolver;
use super::answer;
use super::boxed::Boxed;
use super::config::{Config, KeyRequirement};
use super::key_header::read_key;
use super::request_fingerprint::{MAX_PARTS, Unreadable, fingerprint};
use crate::error::InputError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope};

/// What admission made of a request.
pub(crate) enum Admission<B> {
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
pub(crate) async fn admit<T, B>(config: &Config<T>, request: Request<B>) -> Admission<B>
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
