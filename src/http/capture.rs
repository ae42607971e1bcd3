//! Captured responses: what is stored after the handler ran, and how a replay is rebuilt from it.

use super::answer::{Boxed, full};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde::{Deserialize, Serialize};

use super::IDEMPOTENT_REPLAYED;

/// Headers replayed by default: those that describe the stored body or the created resource. Never
/// `Set-Cookie` (a session is not a result), `Date`, hop-by-hop headers or `Content-Length` (recomputed).
pub(crate) const DEFAULT_REPLAYED_HEADERS: [&str; 10] = [
    "content-type",
    "content-encoding",
    "vary",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
    "link",
    "cache-control",
];

/// What the layer stores for a request whose handler ran. The first byte of the stored form is its
/// version, so each layout stays readable after another is added.
#[derive(Debug, PartialEq)]
pub(crate) enum Stored {
    /// The response, replayed to every retry.
    Response(Captured),
    /// The handler ran, but its response was not kept (larger than the capture limit): retries are told
    /// so, and never run it again.
    Withheld(Withheld),
}

impl Stored {
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Stored::Response(captured) => postcard::to_stdvec(captured),
            Stored::Withheld(withheld) => postcard::to_stdvec(withheld),
        }
        .unwrap_or_default()
    }

    /// `None` for bytes that are not the layer's (stored by another writer of the same key).
    pub(crate) fn decode(stored: &[u8]) -> Option<Self> {
        match stored.first()? {
            1 => postcard::from_bytes::<Captured>(stored).ok().map(Stored::Response),
            2 => postcard::from_bytes::<Withheld>(stored).ok().map(Stored::Withheld),
            _ => None,
        }
    }
}

/// A response that was sent but not stored.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Withheld {
    version: u8,
    /// The status the handler answered.
    pub(crate) status: u16,
    /// How many body bytes it sent (at least the capture limit).
    pub(crate) bytes: u64,
}

impl Withheld {
    pub(crate) fn new(status: StatusCode, bytes: u64) -> Self {
        Self { version: 2, status: status.as_u16(), bytes }
    }
}

/// The stored form of a response (version 1).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Captured {
    version: u8,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Captured {
    pub(crate) fn new(status: StatusCode, headers: &HeaderMap, body: Vec<u8>, replayed: &[HeaderName]) -> Self {
        let headers = headers
            .iter()
            .filter(|(name, _)| replayed.contains(name))
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        Self { version: 1, status: status.as_u16(), headers, body }
    }

    /// The replay: the stored status, headers and body, marked `Idempotent-Replayed: true`; `status`
    /// overrides the stored one (for the 409-with-original mismatch answer).
    pub(crate) fn replay(self, status: Option<StatusCode>) -> Response<Boxed> {
        let mut response = Response::new(full(self.body));
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
        let captured = Stored::Response(Captured::new(StatusCode::CREATED, &headers, b"{\"id\":7}".to_vec(), &allowed));
        let decoded = Stored::decode(&captured.encode()).expect("round trip");
        assert_eq!(decoded, captured);
        let Stored::Response(decoded) = decoded else { panic!("a response") };

        let replay = decoded.replay(None);
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["location"], "/payments/7");
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(replay.headers().get("set-cookie").is_none());
        assert!(replay.headers().get("date").is_none());
        assert!(replay.headers().get("connection").is_none());
        assert!(Stored::decode(b"\"not a capture\"").is_none());
    }

    #[test]
    fn withheld_responses_round_trip() {
        let withheld = Stored::Withheld(Withheld::new(StatusCode::CREATED, 5 << 20));
        assert_eq!(Stored::decode(&withheld.encode()), Some(withheld));
    }
}
