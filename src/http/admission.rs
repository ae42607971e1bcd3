//! Admission: what the layer reads of a keyed request before it claims anything (key, tenant, scope,
//! body, fingerprint), or the refusal it answers instead. Both paths, plain and transactional, start
//! here.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, Uri, request::Parts};
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use tower::BoxError;

use super::TenantResolver;
use super::answer;
use super::boxed::Boxed;
use super::capture::Principal;
use super::config::{Config, KeyRequirement, KeySpace};
use super::key_header::read_key;
use super::request_fingerprint::{MAX_PARTS, Unreadable, fingerprint};
use crate::derived_key::DerivedKeys;
use crate::error::InputError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope, TARGET_DIGEST_PREFIX};
use crate::options::RunOptions;
use crate::policy::Policy;

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
    /// Who made the request (the default without a principal binding).
    pub(crate) principal: Principal,
    /// The key the layer derived, when the request sent none.
    pub(crate) derived: Option<Derived>,
}

/// A key the layer derived ([`DerivedKeys`]) and the policy it is claimed under.
pub(crate) struct Derived {
    /// As derived, before the key space qualified it: what the answer's header shows.
    key: IdempotencyKey,
    pub(crate) policy: Arc<Policy>,
}

impl Admitted {
    /// The options the key is claimed under ([`Config::options_for`]).
    pub(crate) fn options<'c, T>(&self, config: &'c Config<T>) -> Cow<'c, RunOptions> {
        config.options_for(&self.parts.headers, self.derived.as_ref().map(|derived| &derived.policy))
    }

    /// The answer's header naming a derived key ([`super::IDEMPOTENCY_KEY_DERIVED`]), if the key was.
    pub(crate) fn derived_header(&self) -> Option<HeaderValue> {
        let derived = self.derived.as_ref()?;
        HeaderValue::try_from(format!("\"{}\"", derived.key)).ok()
    }
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
    let sent = match read_key(request.headers()) {
        Ok(Some(key)) => Some(key),
        Ok(None) if config.derived_keys.is_some() => None,
        Ok(None) if config.key == KeyRequirement::Optional => return Admission::PassThrough(request),
        Ok(None) => return Admission::Refused(answer::missing_key()),
        Err(detail) => return Admission::Refused(answer::invalid_key(detail)),
    };
    // The layer's own keys: one sent by a client would be compared and kept under the wrong rules.
    if config.derived_keys.is_some() && sent.as_ref().is_some_and(|key| key.as_str().starts_with(DerivedKeys::PREFIX)) {
        let detail =
            format!("keys beginning {:?} are derived by the server; send a key of your own", DerivedKeys::PREFIX);
        return Admission::Refused(answer::invalid_key(detail));
    }
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
    let target = request_target(&parts);
    // A request without a key, on a layer that derives one: compared by the fields its key is made of.
    let deriving = config.derived_keys.as_ref().filter(|_| sent.is_none());
    let options = deriving
        .map_or(Cow::Borrowed(policy.fingerprint()), |keys| Cow::Owned(keys.fingerprint_options(policy.fingerprint())));
    match fingerprint(&parts, target, &body, &options, config.query, config.max_request_body).await {
        Ok(fingerprint) => {
            let principal =
                config.principal.as_ref().map_or_else(Principal::default, |of| Principal::of(of(&parts).as_deref()));
            let (key, derived) = match deriving {
                None => (sent.unwrap_or_else(|| DerivedKeys::key(&fingerprint)), None),
                Some(keys) => {
                    crate::telemetry::derived_key(scope.operation());
                    // Under a principal binding each principal's requests are its own: two users of one
                    // tenant sending one payload are two requests.
                    let key = match principal.digits() {
                        Some(digits) => DerivedKeys::key(&fingerprint.within(&["principal", &digits])),
                        None => DerivedKeys::key(&fingerprint),
                    };
                    (key.clone(), Some(Derived { key, policy: Arc::new(keys.policy(policy)) }))
                }
            };
            let key = key_in_space(config.key_space, key, &parts);
            Admission::Admitted(Admitted { parts, body, scope, key, fingerprint, principal, derived })
        }
        Err(Unreadable::Input(InputError::PayloadTooLarge { limit, .. })) => {
            Admission::Refused(answer::too_large(limit))
        }
        Err(Unreadable::Input(error)) => Admission::Refused(answer::invalid_body(error)),
        Err(Unreadable::Encoding(detail)) => Admission::Refused(answer::unsupported_encoding(detail)),
        Err(Unreadable::TooManyParts) => Admission::Refused(answer::too_many_parts(MAX_PARTS)),
    }
}

/// The scope and the key a keyed request is stored under, in its extensions for the handler: derive the
/// keys of downstream calls from these ([`IdempotencyContext::derive_key`]), not from the header, which
/// names another record on every path of a route with path parameters.
#[derive(Clone, Debug)]
pub struct IdempotencyContext {
    scope: Scope,
    key: IdempotencyKey,
}

impl IdempotencyContext {
    /// The tenant and operation.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The key as the store keeps it ([`KeySpace`]).
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// A downstream call's key ([`IdempotencyKey::derive`]): the same on every retry of this request,
    /// different per label, per request target and per tenant.
    pub fn derive_key(&self, label: &str) -> IdempotencyKey {
        self.key.derive(&self.scope, label)
    }
}

impl Admitted {
    /// The request the handler gets, once its key is acquired: the body read, and the scope and stored
    /// key in its extensions ([`IdempotencyContext`]).
    pub(crate) fn into_request<B>(self) -> Request<super::RequestBody<B>> {
        let Admitted { mut parts, body, scope, key, .. } = self;
        parts.extensions.insert(IdempotencyContext { scope, key });
        Request::from_parts(parts, Either::Right(Full::new(body)))
    }
}

/// The key as the store keeps it. Under [`KeySpace::Target`], on a route with path parameters, every key
/// is qualified by the request path; on any route, so is a key that looks like a qualified one (it
/// starts with `/` or `idem-t-`), so that no bare key can name another target's record (a path that
/// spells the template literally, a static route sharing a named operation). Without axum's matched
/// route the operation is the key space.
fn key_in_space(space: KeySpace, key: IdempotencyKey, parts: &Parts) -> IdempotencyKey {
    let Some(template) = matched_route(parts).filter(|_| space == KeySpace::Target) else { return key };
    let lookalike = key.as_str().starts_with('/') || key.as_str().starts_with(TARGET_DIGEST_PREFIX);
    if template.contains('{') || lookalike { key.for_target(request_target(parts).path()) } else { key }
}

/// The target the client sent: a nested router sees its own part of it, and the template is whole. The
/// key space and the fingerprint both read this one (before, the fingerprint read the nested part, so
/// one router mounted under `/v1` and `/v2` answered a `/v2` request with `/v1`'s response).
fn request_target(parts: &Parts) -> &Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    &parts.uri
}

/// The configured operation name; else the method and axum's matched route template; else the method
/// and `unmatched`. Never the request path: it is client input, and every distinct path would be a new
/// metric series and a new set of records.
fn operation<T>(config: &Config<T>, parts: &Parts) -> String {
    if let Some(operation) = &config.operation {
        return operation.clone();
    }
    match matched_route(parts) {
        Some(template) => format!("{} {template}", parts.method),
        None => format!("{} unmatched", parts.method),
    }
}

/// axum's route template, when the layer runs inside a route (`route_layer`).
fn matched_route(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    return parts.extensions.get::<axum::extract::MatchedPath>().map(axum::extract::MatchedPath::as_str);
    #[cfg(not(feature = "axum"))]
    {
        let _ = parts;
        None
    }
}
