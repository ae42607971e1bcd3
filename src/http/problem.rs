//! `application/problem+json` (RFC 9457) answers, one stable `type` per case.

use std::time::Duration;

use super::boxed::{Boxed, full};
use http::{HeaderValue, Response, StatusCode, header};

/// The `type` URIs of the problems the middleware answers with. They never change meaning.
pub mod problem_types {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    pub const MISSING_KEY: &str = "urn:idemstore:problem:missing-key";
    /// 400: the key is empty, too long, not visible ASCII, or the header is repeated.
    pub const INVALID_KEY: &str = "urn:idemstore:problem:invalid-key";
    /// 401: no tenant could be determined for the request.
    pub const MISSING_TENANT: &str = "urn:idemstore:problem:missing-tenant";
    /// 400: the body could not be read or fingerprinted (malformed or too deeply nested JSON).
    pub const INVALID_BODY: &str = "urn:idemstore:problem:invalid-body";
    /// 415: the request body has a `Content-Encoding` the layer cannot decode to compare it (gzip,
    /// deflate and br are decoded).
    pub const UNSUPPORTED_ENCODING: &str = "urn:idemstore:problem:unsupported-encoding";
    /// 413: the request body is larger than the route's limit.
    pub const BODY_TOO_LARGE: &str = "urn:idemstore:problem:body-too-large";
    /// 409: a request with this key is being processed.
    pub const IN_FLIGHT: &str = "urn:idemstore:problem:in-flight";
    /// 422 (or 400/409 as configured): the key was used with a different payload.
    pub const KEY_REUSED: &str = "urn:idemstore:problem:key-reused";
    /// 409: an earlier attempt ended without an answer; an operator must resolve the key.
    pub const INDETERMINATE: &str = "urn:idemstore:problem:indeterminate";
    /// 409: the request completed, but its response was not stored (larger than the capture limit); it
    /// is not executed again.
    pub const NOT_REPLAYABLE: &str = "urn:idemstore:problem:not-replayable";
    /// 410: the request completed, but its stored response was purged after the retention; it is not
    /// executed again.
    pub const EXPIRED: &str = "urn:idemstore:problem:expired";
    /// 403: the application's replay check refused to show this request the stored response of its key
    /// (see `IdempotencyLayer::with_replay_check`); nothing was executed or revealed.
    pub const REPLAY_REFUSED: &str = "urn:idemstore:problem:replay-refused";
    /// 500: the request completed, but its stored response does not open (`StoreBuilder::encryption`: its
    /// key is no longer configured, or the bytes were changed); it is not executed again.
    pub const UNREADABLE: &str = "urn:idemstore:problem:unreadable-response";
    /// 429 with Retry-After: the request's tenant reached a limit of its policy's quota (`Quota`);
    /// nothing was executed or recorded.
    pub const QUOTA_EXCEEDED: &str = "urn:idemstore:problem:quota-exceeded";
    /// 503: the idempotency store is unavailable; nothing was executed.
    pub const UNAVAILABLE: &str = "urn:idemstore:problem:store-unavailable";
    /// 500: the handler ran, and its response body failed before it could be sent; the record says the
    /// response cannot be replayed, so a retry gets 409 `not-replayable`.
    pub const RESPONSE_FAILED: &str = "urn:idemstore:problem:response-failed";
}

pub(crate) struct Problem {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: String,
    retry_after: Option<Duration>,
}

impl Problem {
    pub(crate) fn new(status: StatusCode, kind: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Self { status, kind, title, detail: detail.into(), retry_after: None }
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn into_response(self) -> Response<Boxed> {
        let body = serde_json::json!({
            "type": self.kind,
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = Response::new(full(body.to_string()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up, at least one: a client told "0" would retry in a tight loop.
            let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        }
        response
    }
}
