//! Captured responses: what is stored after the handler ran, and how a replay is rebuilt from it.

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde::{Deserialize, Serialize};

use super::IDEMPOTENT_REPLAYED;

/// Headers replayed by default: those that describe the stored body or the created resource. Never
/// `Set-Cookie` (a session is not a result), `Date`, hop-by-hop headers or `Content-Length` (recomputed).
pub(crate) const DEFAULT_REPLAYED_HEADERS: [&str; 8] = [
    "content-type",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
    "link",
    "cache-control",
];

/// The stored form of a response. Versioned so a later layout can still read what an earlier one stored.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Captured {
    version: u8,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Captured {
    pub(crate) fn new(status: StatusCode, headers: &HeaderMap, body: &[u8], replayed: &[HeaderName]) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| replayed.contains(name))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        Self { version: 1, status: status.as_u16(), headers, body: body.to_vec() }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).unwrap_or_default()
    }

    /// `None` for bytes that are not a captured response (stored by another writer of the same key).
    pub(crate) fn decode(stored: &[u8]) -> Option<Self> {
        postcard::from_bytes::<Self>(stored).ok().filter(|c| c.version == 1)
    }

    /// The replay: the stored status, headers and body, marked `Idempotent-Replayed: true`; `status`
    /// overrides the stored one (for the 409-with-original mismatch answer).
    pub(crate) fn replay(self, status: Option<StatusCode>) -> Response<Body> {
        let mut response = Response::new(Body::from(Bytes::from(self.body)));
        *response.status_mut() = status.or_else(|| StatusCode::from_u16(self.status).ok()).unwrap_or(StatusCode::OK);
        let headers = response.headers_mut();
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::from_bytes(&value)) {
                headers.append(name, value);
            }
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_allowed_headers_and_round_trips() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("location", HeaderValue::from_static("/payments/7"));
        headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
        headers.insert("date", HeaderValue::from_static("Mon, 30 Nov 2026 03:00:00 GMT"));
        headers.insert("connection", HeaderValue::from_static("keep-alive"));
        let allowed: Vec<HeaderName> = DEFAULT_REPLAYED_HEADERS.iter().map(|h| HeaderName::from_static(h)).collect();
        let captured = Captured::new(StatusCode::CREATED, &headers, b"{\"id\":7}", &allowed);
        let decoded = Captured::decode(&captured.encode()).expect("round trip");
        assert_eq!(decoded, captured);

        let replay = decoded.replay(None);
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["location"], "/payments/7");
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(replay.headers().get("set-cookie").is_none());
        assert!(replay.headers().get("date").is_none());
        assert!(replay.headers().get("connection").is_none());
        assert!(Captured::decode(b"\"not a capture\"").is_none());
    }
}
