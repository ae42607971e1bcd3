//! Captured responses: what is stored after the handler ran, and how a replay is rebuilt from it.

use super::boxed::{Boxed, with_trailers};
use bytes::Bytes;
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

/// A stored form as the layer reads it back: the first byte names its layout (5 withheld, 4 a
/// response; 2 and 3 are those without the principal, still read), so that another layout can be added
/// and these stay readable. Read in place: a replay's body and header values are slices of this one
/// buffer, not copies.
pub(crate) struct StoredForm(Bytes);

impl StoredForm {
    pub(crate) fn new(stored: Vec<u8>) -> Self {
        let stored = match stored.first() {
            // Layouts 2 and 3 are 5 and 4 without their last field, the principal: stored unbound.
            Some(&old @ (2 | 3)) => {
                let layout = if old == 2 { 5 } else { 4 };
                [&[layout], &stored[1..], UNBOUND].concat()
            }
            _ => stored,
        };
        Self(Bytes::from(stored))
    }

    /// `None` for bytes that are not the layer's (stored by another writer of the same key).
    pub(crate) fn read(&self) -> Option<Stored<'_>> {
        match self.0.first()? {
            5 => postcard::from_bytes::<Withheld>(&self.0).ok().map(Stored::Withheld),
            4 => postcard::from_bytes::<CapturedIn<'_>>(&self.0)
                .ok()
                .map(|response| Stored::Response(Replayable { buffer: &self.0, response })),
            _ => None,
        }
    }
}

/// What the layer stored for a request whose handler ran.
#[derive(Debug)]
pub(crate) enum Stored<'a> {
    /// The response, replayed to every retry.
    Response(Replayable<'a>),
    /// The handler ran, but its response was not kept (larger than the capture limit): retries are told
    /// so, and never run it again.
    Withheld(Withheld),
}

impl Stored<'_> {
    /// Whether the stored response (or that there was one) may be shown to `asking`.
    pub(crate) fn answers(&self, asking: Principal) -> bool {
        match self {
            Stored::Response(replayable) => replayable.response.principal.answers(asking),
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

    /// The stored form (layout 5).
    pub(crate) fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).unwrap_or_default()
    }
}

/// Header or trailer fields, as stored.
type Fields = Vec<(String, Vec<u8>)>;

/// The stored form of a response (layout 4), as written.
#[derive(Debug, Serialize)]
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

    /// The principal's digits, for a key derived per principal; `None` for an anonymous one.
    pub(crate) fn digits(self) -> Option<String> {
        let Principal::Named(kept) = self else { return None };
        Some(kept.iter().map(|byte| format!("{byte:02x}")).collect())
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

    /// The stored form (layout 4).
    pub(crate) fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).unwrap_or_default()
    }
}

/// [`Captured`] as read back, its fields borrowed from the stored bytes (postcard lays out a byte
/// vector and a byte slice alike).
#[derive(Debug, Deserialize)]
struct CapturedIn<'a> {
    _layout: u8,
    status: u16,
    #[serde(borrow)]
    headers: Vec<(&'a str, &'a [u8])>,
    body: &'a [u8],
    #[serde(borrow)]
    trailers: Vec<(&'a str, &'a [u8])>,
    principal: Principal,
}

/// A stored response, ready to replay from the buffer it was read from.
#[derive(Debug)]
pub(crate) struct Replayable<'a> {
    buffer: &'a Bytes,
    response: CapturedIn<'a>,
}

impl Replayable<'_> {
    /// The replay: the stored status, headers, body and trailers, marked `Idempotent-Replayed: true`;
    /// `status` overrides the stored one (for the 409-with-original mismatch answer). The body and the
    /// header values share the stored buffer (at most the capture limit and its headers): a layer
    /// outside that keeps one of them keeps it all.
    pub(crate) fn replay(self, status: Option<StatusCode>) -> Response<Boxed> {
        let Replayable { buffer, response: CapturedIn { status: stored, headers, body, trailers, .. } } = self;
        let trailers = Some(header_map(buffer, &trailers, 0)).filter(|trailers| !trailers.is_empty());
        let mut response = Response::new(with_trailers(buffer.slice_ref(body), trailers));
        *response.status_mut() = status.or_else(|| StatusCode::from_u16(stored).ok()).unwrap_or(StatusCode::OK);
        let mut map = header_map(buffer, &headers, 1);
        map.insert(REPLAYED, HeaderValue::from_static("true"));
        *response.headers_mut() = map;
        response
    }
}

/// [`IDEMPOTENT_REPLAYED`] as a header name, made once (from a `&str`, a custom name is copied into the
/// map on every insert).
const REPLAYED: HeaderName = HeaderName::from_static(IDEMPOTENT_REPLAYED);

/// Stored fields (read from `buffer`) as a header map with room for `more`; a field that is no longer
/// valid is skipped. Room is made up front only for as many fields as a map can index: many values of
/// one name (thousands of `Link`s) need no more, and the map grows as they are added.
fn header_map(buffer: &Bytes, fields: &[(&str, &[u8])], more: usize) -> HeaderMap {
    let mut map = HeaderMap::try_with_capacity(fields.len() + more).unwrap_or_default();
    for &(name, value) in fields {
        let value = HeaderValue::from_maybe_shared(buffer.slice_ref(value));
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), value) {
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
    Captured::new(status, &headers, body, None, Principal::default()).encode()
}

/// The replayed headers of a response.
pub(crate) fn replayed(headers: &HeaderMap, names: &[HeaderName]) -> HeaderMap {
    let kept = headers.iter().filter(|(name, _)| names.contains(name));
    kept.map(|(name, value)| (name.clone(), value.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn read(stored: Vec<u8>) -> StoredForm {
        StoredForm::new(stored)
    }

    #[tokio::test]
    async fn keeps_allowed_headers_and_round_trips() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("location", HeaderValue::from_static("/payments/7"));
        headers.insert("x-request-cost", HeaderValue::from_static("3"));
        headers.insert("set-cookie", HeaderValue::from_static("session=secret"));
        headers.insert("date", HeaderValue::from_static("Mon, 30 Nov 2026 03:00:00 GMT"));
        headers.insert("connection", HeaderValue::from_static("keep-alive"));
        let mut allowed: Vec<HeaderName> =
            DEFAULT_REPLAYED_HEADERS.iter().map(|h| HeaderName::from_static(h)).collect();
        allowed.push(HeaderName::from_static("x-request-cost"));
        let headers = replayed(&headers, &allowed);
        let captured =
            Captured::new(StatusCode::CREATED, &headers, b"{\"id\":7}".to_vec(), None, Principal::of(Some("user-1")));
        assert_eq!(captured.encode()[0], 4);
        let stored = read(captured.encode());
        let Some(Stored::Response(decoded)) = stored.read() else { panic!("a response") };

        let replay = decoded.replay(None);
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["content-type"], "application/json");
        assert_eq!(replay.headers()["location"], "/payments/7");
        assert_eq!(replay.headers()["x-request-cost"], "3");
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(replay.headers().len(), 4, "{:?}", replay.headers());
        assert!(replay.headers().get("set-cookie").is_none());
        assert!(replay.headers().get("date").is_none());
        assert!(replay.headers().get("connection").is_none());
        let body = replay.into_body().collect().await.expect("replayed body");
        assert_eq!(body.to_bytes().as_ref(), b"{\"id\":7}");
        assert!(read(b"\"not a capture\"".to_vec()).read().is_none());
    }

    /// The layout as stored since version 4 was written: a response stored before the decoder read it
    /// in place still replays byte for byte.
    #[tokio::test]
    async fn reads_the_stored_layout() {
        // Layout 4, status 201, one header (content-type: a/b), body "ok", no trailers, unbound.
        let stored = [4, 0xc9, 0x01, 1, 12, b'c', b'o', b'n', b't', b'e', b'n', b't', b'-', b't', b'y', b'p', b'e', 3];
        let stored = [&stored[..], b"a/b", &[2], b"ok", &[0, 0]].concat();
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("a/b"));
        assert_eq!(
            Captured::new(StatusCode::CREATED, &headers, b"ok".to_vec(), None, Principal::Unbound).encode(),
            stored
        );
        let stored = read(stored);
        let Some(Stored::Response(decoded)) = stored.read() else { panic!("a response") };
        let replay = decoded.replay(Some(StatusCode::CONFLICT));
        assert_eq!(replay.status(), StatusCode::CONFLICT);
        assert_eq!(replay.headers()["content-type"], "a/b");
        assert_eq!(replay.into_body().collect().await.expect("body").to_bytes().as_ref(), b"ok");
    }

    /// Trailers (a gRPC call's `grpc-status`) are stored and replayed after the body.
    #[tokio::test]
    async fn trailers_round_trip() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let captured =
            Captured::new(StatusCode::OK, &HeaderMap::new(), b"msg".to_vec(), Some(&trailers), Principal::default());
        let stored = read(captured.encode());
        let Some(Stored::Response(decoded)) = stored.read() else { panic!("a response") };
        let collected = decoded.replay(None).into_body().collect().await.expect("replayed body");
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes().as_ref(), b"msg");
    }

    /// A stored response answers its own principal, and any request without a binding; one stored
    /// without a binding (layouts 2 and 3 among them) answers every principal.
    #[test]
    fn responses_answer_their_principal() {
        let (alice, bob, anonymous) = (Principal::of(Some("alice")), Principal::of(Some("bob")), Principal::of(None));
        let bound = Captured::new(StatusCode::OK, &HeaderMap::new(), b"a".to_vec(), None, alice).encode();
        let answers = |stored: &[u8], asking: Principal| read(stored.to_vec()).read().expect("read").answers(asking);
        assert!(answers(&bound, alice) && answers(&bound, Principal::Unbound));
        assert!(!answers(&bound, bob) && !answers(&bound, anonymous));
        let withheld = Withheld::new(StatusCode::OK, 9, alice).encode();
        assert!(answers(&withheld, alice) && !answers(&withheld, bob));
        let unbound =
            Captured::new(StatusCode::OK, &HeaderMap::new(), b"a".to_vec(), None, Principal::Unbound).encode();
        assert!(answers(&unbound, alice) && answers(&unbound, anonymous));
        // The layouts before the principal: the same fields, no principal.
        let layout3 = [&[3u8][..], &bound[1..bound.len() - 17]].concat();
        let stored = read(layout3.clone());
        let Some(Stored::Response(replayable)) = stored.read() else { panic!("layout 3 is read") };
        assert_eq!(replayable.replay(None).status(), StatusCode::OK);
        assert!(answers(&layout3, bob));
        let layout2 = [&[2u8][..], &withheld[1..withheld.len() - 17]].concat();
        assert!(matches!(read(layout2).read(), Some(Stored::Withheld(w)) if w.status == 200 && w.bytes == 9));
    }

    /// An operator's response keeps its headers but not those that frame a message: a replay with a
    /// stale `Content-Length` would be malformed.
    #[test]
    fn stored_responses_drop_framing_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from_static("999"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        let stored = read(stored_response(StatusCode::CREATED, &headers, b"{}".to_vec()));
        let Some(Stored::Response(captured)) = stored.read() else { panic!("a response") };
        let replay = captured.replay(None);
        assert_eq!(replay.headers()["content-type"], "application/json");
        assert!(
            replay.headers().get("content-length").is_none() && replay.headers().get("transfer-encoding").is_none()
        );
    }

    /// A response with more values of one header than a header map can index up front (as many `Link`s
    /// as a handler may send) replays all of them: the map grows as they come.
    #[test]
    fn many_values_of_one_header_replay() {
        let mut headers = HeaderMap::new();
        for n in 0..30_000 {
            headers.append("link", HeaderValue::from_str(&format!("</p/{n}>; rel=item")).expect("valid"));
        }
        let stored = read(Captured::new(StatusCode::OK, &headers, Vec::new(), None, Principal::Unbound).encode());
        let Some(Stored::Response(replayable)) = stored.read() else { panic!("a response") };
        let replay = replayable.replay(None);
        assert_eq!(replay.headers().get_all("link").iter().count(), 30_000);
        assert_eq!(replay.headers().get_all("link").iter().next_back().expect("the last"), "</p/29999>; rel=item");
    }

    #[test]
    fn withheld_responses_round_trip() {
        let withheld = Withheld::new(StatusCode::CREATED, 5 << 20, Principal::of(Some("alice")));
        assert!(matches!(read(withheld.encode()).read(), Some(Stored::Withheld(read)) if read == withheld));
    }
}
