//! Captured responses: what is stored after the handler ran, and how a replay is rebuilt from it.

use super::boxed::{Boxed, with_trailers};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use serde::{Deserialize, Serialize};

use super::IDEMPOTENT_REPLAYED;

/// Header (and trailer) fields replayed by default: those that describe the stored body or the created
/// resource, and a gRPC call's status and message encoding (in the trailers, or the headers of a
/// trailers-only answer). Never `Set-Cookie` (a session is not a result), `Date`, hop-by-hop headers or
/// `Content-Length` (recomputed).
pub(crate) const DEFAULT_REPLAYED_HEADERS: [&str; 14] = [
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
    "grpc-status",
    "grpc-message",
    "grpc-status-details-bin",
    "grpc-encoding",
];

/// What the layer stores for a request whose handler ran. The first byte of the stored form names its
/// layout (5 withheld, 4 a response; 2 and 3 are those without the principal, still read), so that
/// another layout can be added and these stay readable.
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
            5 => postcard::from_bytes::<Withheld>(stored).ok().map(Stored::Withheld),
            4 => postcard::from_bytes::<Captured>(stored).ok().map(Stored::Response),
            // Layouts 2 and 3 are 5 and 4 without their last field, the principal: stored unbound.
            2 | 3 => {
                let layout = if stored[0] == 2 { 5 } else { 4 };
                Self::decode(&[&[layout], &stored[1..], UNBOUND].concat())
            }
            _ => None,
        }
    }

    /// Whether the stored response (or that there was one) may be shown to `asking`.
    pub(crate) fn answers(&self, asking: Principal) -> bool {
        match self {
            Stored::Response(captured) => captured.principal.answers(asking),
            Stored::Withheld(withheld) => withheld.principal.answers(asking),
        }
    }
}

/// A response that was sent but not stored (layout 5).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Withheld {
    version: u8,
    /// The status the handler answered.
    pub(crate) status: u16,
    /// How many body bytes it had sent when it was settled: past the capture limit, or fewer when the body
    /// was cut short or streamed past the layer's bound.
    pub(crate) bytes: u64,
    /// Who the response answered.
    principal: Principal,
}

impl Withheld {
    pub(crate) fn new(status: StatusCode, bytes: u64, principal: Principal) -> Self {
        Self { version: 5, status: status.as_u16(), bytes, principal }
    }
}

/// Header or trailer fields, as stored.
type Fields = Vec<(String, Vec<u8>)>;

/// The stored form of a response (layout 4).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Captured {
    version: u8,
    status: u16,
    headers: Fields,
    body: Vec<u8>,
    /// The response's trailers that are replayed (the same allow-list as headers): they carry the
    /// outcome of a gRPC call (`grpc-status`).
    trailers: Fields,
    /// Who the response answered, with a principal binding
    /// ([`IdempotencyLayer::with_principal`](super::IdempotencyLayer::with_principal)).
    principal: Principal,
}

/// Who made a request, as the layer stores it beside a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Principal {
    /// No principal binding: a response stored so (before the binding was turned on, or by an
    /// operator's resolve) answers every principal, and a request without the binding sees every
    /// response.
    #[default]
    Unbound,
    /// The resolver found no principal.
    Anonymous,
    /// A 128-bit digest of what the resolver answered (an unkeyed digest: not a secret for a guessable
    /// name).
    Named([u8; 16]),
}

/// [`Principal::Unbound`], encoded.
const UNBOUND: &[u8] = &[0];

impl Principal {
    /// The principal `name` (a user id, an API key's id); `None` is anonymous.
    pub(crate) fn of(name: Option<&str>) -> Self {
        use sha2::{Digest, Sha256};
        let Some(name) = name else { return Principal::Anonymous };
        let digest = Sha256::new().chain_update(b"idemstore-principal\0").chain_update(name).finalize();
        let mut kept = [0; 16];
        kept.copy_from_slice(&digest[..16]);
        Principal::Named(kept)
    }

    /// Whether a response stored for this principal may be shown to `asking`.
    fn answers(self, asking: Principal) -> bool {
        self == Principal::Unbound || asking == Principal::Unbound || self == asking
    }
}

impl Captured {
    /// `headers` and `trailers` are the response's, already filtered to those replayed; `principal` is
    /// who the response answers.
    pub(crate) fn new(
        status: StatusCode,
        headers: &HeaderMap,
        body: Vec<u8>,
        trailers: Option<&HeaderMap>,
        principal: Principal,
    ) -> Self {
        let fields = |map: &HeaderMap| -> Fields {
            map.iter().map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec())).collect()
        };
        let trailers = trailers.map(fields).unwrap_or_default();
        Self { version: 4, status: status.as_u16(), headers: fields(headers), body, trailers, principal }
    }

    /// The replay: the stored status, headers, body and trailers, marked `Idempotent-Replayed: true`;
    /// `status` overrides the stored one (for the 409-with-original mismatch answer).
    pub(crate) fn replay(self, status: Option<StatusCode>) -> Response<Boxed> {
        let trailers = Some(header_map(self.trailers)).filter(|trailers| !trailers.is_empty());
        let mut response = Response::new(with_trailers(self.body.into(), trailers));
        *response.status_mut() = status.or_else(|| StatusCode::from_u16(self.status).ok()).unwrap_or(StatusCode::OK);
        let headers = response.headers_mut();
        headers.extend(header_map(self.headers));
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

/// Stored fields as a header map; a field that is no longer valid is skipped.
fn header_map(fields: Fields) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in fields {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::from_bytes(&value)) {
            map.append(name, value);
        }
    }
    map
}

/// The stored form of an HTTP response, as the layer writes it: for an operator who settles an
/// indeterminate record of the layer by hand ([`crate::admin::Admin::resolve`], `idemctl resolve --status`), so
/// that retries get this response replayed. `headers` are stored as given (choose those to replay),
/// except those that frame a message rather than describe the response (`Content-Length`,
/// `Transfer-Encoding`, `Connection` and the other hop-by-hop headers), which a replay computes anew.
pub fn stored_response(status: StatusCode, headers: &HeaderMap, body: Vec<u8>) -> Vec<u8> {
    const FRAMING: [&str; 8] = [
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ];
    let mut headers = headers.clone();
    for name in FRAMING {
        headers.remove(name);
    }
    Stored::Response(Captured::new(status, &headers, body, None, Principal::default())).encode()
}

/// The replayed headers of a response.
pub(crate) fn replayed(headers: &HeaderMap, names: &[HeaderName]) -> HeaderMap {
    let kept = headers.iter().filter(|(name, _)| names.contains(name));
    kept.map(|(name, value)| (name.clone(), value.clone())).collect()
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
        let headers = replayed(&headers, &allowed);
        let captured = Stored::Response(Captured::new(
            StatusCode::CREATED,
            &headers,
            b"{\"id\":7}".to_vec(),
            None,
            Principal::of(Some("user-1")),
        ));
        assert_eq!(captured.encode()[0], 4);
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

    /// Trailers (a gRPC call's `grpc-status`) are stored and replayed after the body.
    #[tokio::test]
    async fn trailers_round_trip() {
        use http_body_util::BodyExt;
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let captured = Stored::Response(Captured::new(
            StatusCode::OK,
            &HeaderMap::new(),
            b"msg".to_vec(),
            Some(&trailers),
            Principal::default(),
        ));
        assert_eq!(captured.encode()[0], 4);
        let Some(Stored::Response(decoded)) = Stored::decode(&captured.encode()) else { panic!("a response") };
        let collected = decoded.replay(None).into_body().collect().await.expect("replayed body");
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes().as_ref(), b"msg");
    }

    /// A stored response answers its own principal, and any request without a binding; one stored
    /// without a binding (layouts 2 and 3 among them) answers every principal.
    #[test]
    fn responses_answer_their_principal() {
        let (alice, bob, anonymous) = (Principal::of(Some("alice")), Principal::of(Some("bob")), Principal::of(None));
        let bound = Stored::Response(Captured::new(StatusCode::OK, &HeaderMap::new(), b"a".to_vec(), None, alice));
        assert!(bound.answers(alice) && bound.answers(Principal::Unbound));
        assert!(!bound.answers(bob) && !bound.answers(anonymous));
        let withheld = Stored::Withheld(Withheld::new(StatusCode::OK, 9, alice));
        assert!(withheld.answers(alice) && !withheld.answers(bob));
        let unbound =
            Stored::Response(Captured::new(StatusCode::OK, &HeaderMap::new(), b"a".to_vec(), None, Principal::Unbound));
        assert!(unbound.answers(alice) && unbound.answers(anonymous));
        // The layouts before the principal: the same fields, no principal.
        let layout3 = [&[3u8][..], &bound.encode()[1..bound.encode().len() - 17]].concat();
        let Some(Stored::Response(read)) = Stored::decode(&layout3) else { panic!("layout 3 is read") };
        assert_eq!(read.replay(None).status(), StatusCode::OK);
        assert!(Stored::decode(&layout3).expect("read").answers(bob));
        let layout2 = [&[2u8][..], &withheld.encode()[1..withheld.encode().len() - 17]].concat();
        assert!(matches!(Stored::decode(&layout2), Some(Stored::Withheld(w)) if w.status == 200 && w.bytes == 9));
    }

    /// An operator's response keeps its headers but not those that frame a message: a replay with a
    /// stale `Content-Length` would be malformed.
    #[test]
    fn stored_responses_drop_framing_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("999"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        let stored = stored_response(StatusCode::CREATED, &headers, b"{}".to_vec());
        let Some(Stored::Response(captured)) = Stored::decode(&stored) else { panic!("a response") };
        let replay = captured.replay(None);
        assert_eq!(replay.headers()["content-type"], "application/json");
        assert!(
            replay.headers().get("content-length").is_none() && replay.headers().get("transfer-encoding").is_none()
        );
    }

    #[test]
    fn withheld_responses_round_trip() {
        let withheld = Stored::Withheld(Withheld::new(StatusCode::CREATED, 5 << 20, Principal::of(Some("alice"))));
        assert_eq!(Stored::decode(&withheld.encode()), Some(withheld));
    }
}
