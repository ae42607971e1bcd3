//! When two HTTP requests are the same request: the method, the path, the query and the body, each
//! compared by what it means rather than how it was spelled on the wire. Query parameters in another
//! order, a multipart body rebuilt with another boundary, and a body sent compressed are the same
//! request; a retry from a client that does any of these is not refused as a different payload.

use std::borrow::Cow;
use std::future::Future;
use std::io::Read;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Method, Uri, header};

use crate::error::InputError;
use crate::fingerprint::{Fingerprint, FingerprintOptions};

/// How the query string takes part in a request's fingerprint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueryComparison {
    /// Parameters compared by name in any order (`?a=1&b=2` is `?b=2&a=1`), each as a form decodes it
    /// (`?ref=%41` is `?ref=A`, `+` is `%20`, `%2B` is not `+`); the values of one name keep their order
    /// (`?a=1&a=2` is not `?a=2&a=1`, which many servers read as another list). The default.
    #[default]
    Unordered,
    /// The query string byte for byte (the path still in its one spelling, as the key space reads it).
    Exact,
}

/// How many `Content-Encoding`s (other than `identity`) the layer undoes. Clients send one; each one
/// may inflate up to the body limit, so a stack of them multiplies the work one request can ask for. A
/// request that lists more is refused (415) before anything is decoded, so the decoded bytes of one
/// request never exceed this many times the body limit.
pub(crate) const MAX_ENCODINGS: usize = 2;

/// How many multipart parts the layer compares (413 past it): every part costs a parse, a sort of its
/// headers and a copy, so a body of many tiny parts is far more work than its size suggests.
pub(crate) const MAX_PARTS: usize = 1_000;

/// Bodies from this size on, and every compressed body, are decoded and hashed on a blocking thread:
/// inflating and hashing megabytes on an async worker would stall every other request it serves
/// (health checks included) for as long as it takes.
const BLOCKING_FROM: usize = 64 * 1024;

/// Why a request's body could not be fingerprinted.
#[derive(Debug)]
pub(crate) enum Unreadable {
    /// Malformed or over a limit (as for any payload).
    Input(InputError),
    /// A `Content-Encoding` the layer cannot decode, or too many of them (415).
    Encoding(String),
    /// A multipart body of more than [`MAX_PARTS`] parts (413).
    TooManyParts,
}

impl From<InputError> for Unreadable {
    fn from(error: InputError) -> Self {
        Unreadable::Input(error)
    }
}

/// The request's fingerprint: the method, the target and the body, each by what it means. `target` is
/// the request's whole target, as the client sent it (a nested router's request names only its part of
/// the path), the one the key space reads too.
///
/// A large or compressed body is fingerprinted on a blocking thread (see [`BLOCKING_FROM`]).
pub(crate) async fn fingerprint(
    parts: &Parts,
    target: &Uri,
    body: &Bytes,
    options: &FingerprintOptions,
    query: QueryComparison,
    max_body: usize,
) -> Result<Fingerprint, Unreadable> {
    if body.len() < BLOCKING_FROM && !parts.headers.contains_key(header::CONTENT_ENCODING) {
        return of_request((&parts.method, target, &parts.headers), body, options, query, max_body).await;
    }
    // As many at once as there are cores: more would only queue on the blocking pool (which other work,
    // such as a reconnect's DNS lookup, needs too) while each holds its decoded bytes.
    let Ok(_permit) = blocking_decodes().acquire().await else {
        return Err(Unreadable::Encoding("the body could not be decoded".into()));
    };
    // What of the request's head the fingerprint reads, owned to move to the blocking thread.
    let (method, uri, headers) = (parts.method.clone(), target.clone(), parts.headers.clone());
    let (body, options) = (body.clone(), options.clone());
    let blocking = tokio::task::spawn_blocking(move || {
        // Nothing in it waits for I/O (multer reads a body already in memory): it runs to its end here.
        let runtime = tokio::runtime::Handle::current();
        runtime.block_on(of_request((&method, &uri, &headers), &body, &options, query, max_body))
    });
    blocking.await.unwrap_or_else(|_| Err(Unreadable::Encoding("the body could not be decoded".into())))
}

fn blocking_decodes() -> &'static tokio::sync::Semaphore {
    static DECODES: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    DECODES.get_or_init(|| {
        tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get))
    })
}

/// What of a request's head its fingerprint reads.
type Head<'a> = (&'a Method, &'a Uri, &'a HeaderMap);

async fn of_request(
    (method, uri, headers): Head<'_>,
    body: &[u8],
    options: &FingerprintOptions,
    query: QueryComparison,
    max_body: usize,
) -> Result<Fingerprint, Unreadable> {
    let decoded = decode(headers, body, max_body)?;
    let payload = if media_type(headers).is_some_and(is_json) && !decoded.is_empty() {
        Fingerprint::of_json(&decoded, options)?
    } else if let Some(parts_of) = multipart_boundary(headers) {
        // Boxed as a trait object: multer's future types would otherwise nest into every layer's future,
        // past the compiler's default query depth in the crates that use the layer.
        let parsed: std::pin::Pin<Box<dyn Future<Output = _> + Send + '_>> =
            Box::pin(multipart(&decoded, parts_of, options));
        match parsed.await {
            Some(parsed) => parsed?,
            // Not a multipart body after all: compared byte for byte.
            None => Fingerprint::of_bytes(&decoded, options)?,
        }
    } else {
        Fingerprint::of_bytes(&decoded, options)?
    };
    // The path in its one spelling whatever the comparison (the key space reads it so).
    let path = crate::target::path(uri.path());
    let target = match (query, uri.query()) {
        (QueryComparison::Exact, Some(query)) if !query.is_empty() => Cow::Owned(format!("{path}?{query}")),
        (QueryComparison::Exact, _) => path,
        (QueryComparison::Unordered, query) => unordered(&path, query),
    };
    Ok(payload.within(&[method.as_str(), &target]))
}

/// The media type, as sent (media types compare without regard to case).
fn media_type(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    Some(value.split(';').next()?.trim())
}

fn is_json(media: &str) -> bool {
    const SUFFIX: &str = "+json";
    let suffix = media.len().checked_sub(SUFFIX.len()).and_then(|at| media.get(at..));
    media.eq_ignore_ascii_case("application/json") || suffix.is_some_and(|suffix| suffix.eq_ignore_ascii_case(SUFFIX))
}

fn multipart_boundary(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    value.to_ascii_lowercase().starts_with("multipart/").then(|| multer::parse_boundary(value).ok()).flatten()
}

/// The path (in its one spelling) with its query parameters, in theirs, sorted by name (stable: one
/// name's values keep their order).
fn unordered<'a>(path: &Cow<'a, str>, query: Option<&str>) -> Cow<'a, str> {
    let mut pairs = query.map(crate::target::query).unwrap_or_default();
    if pairs.is_empty() {
        // `/p?` and `/p&&` name no parameter, as `/p` does.
        return path.clone();
    }
    pairs.sort_by(|a, b| a.split('=').next().cmp(&b.split('=').next()));
    Cow::Owned(format!("{path}?{}", pairs.join("&")))
}

/// The body with its `Content-Encoding`s undone (`gzip`, `x-gzip`, `deflate`, `br`; `identity`), at
/// most `max_body` bytes once decoded. More than [`MAX_ENCODINGS`] of them are refused before any is
/// decoded.
fn decode<'b>(headers: &HeaderMap, body: &'b [u8], max_body: usize) -> Result<Cow<'b, [u8]>, Unreadable> {
    let mut encodings: Vec<String> = Vec::new();
    for value in headers.get_all(header::CONTENT_ENCODING) {
        let value = value.to_str().map_err(|_| Unreadable::Encoding("a Content-Encoding that is not text".into()))?;
        for encoding in value.split(',').map(str::trim).filter(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity"))
        {
            if encodings.len() == MAX_ENCODINGS {
                let detail =
                    format!("the body lists more than {MAX_ENCODINGS} Content-Encodings; send it encoded once");
                return Err(Unreadable::Encoding(detail));
            }
            encodings.push(encoding.to_ascii_lowercase());
        }
    }
    let mut decoded = Cow::Borrowed(body);
    // Applied in the order listed: undone last first.
    for encoding in encodings.iter().rev() {
        let reader: Box<dyn Read + '_> = match encoding.as_str() {
            "gzip" | "x-gzip" => Box::new(flate2::read::MultiGzDecoder::new(&decoded[..])),
            "deflate" => Box::new(flate2::read::ZlibDecoder::new(&decoded[..])),
            "br" => Box::new(brotli_decompressor::Decompressor::new(&decoded[..], 4096)),
            other => return Err(Unreadable::Encoding(format!("the Content-Encoding {other:?} is not supported"))),
        };
        let mut out = Vec::new();
        let limit = u64::try_from(max_body).unwrap_or(u64::MAX).saturating_add(1);
        reader
            .take(limit)
            .read_to_end(&mut out)
            .map_err(|e| Unreadable::Encoding(format!("the body is not valid {encoding}: {e}")))?;
        if out.len() > max_body {
            return Err(InputError::PayloadTooLarge { len: out.len(), limit: max_body }.into());
        }
        decoded = Cow::Owned(out);
    }
    Ok(decoded)
}

/// A multipart body by its parts (headers and content, in order), whatever its boundary; `None` if it
/// does not parse as multipart.
async fn multipart(
    body: &[u8],
    boundary: String,
    options: &FingerprintOptions,
) -> Option<Result<Fingerprint, Unreadable>> {
    let stream = futures_util::stream::once(std::future::ready(Ok::<_, std::convert::Infallible>(
        bytes::Bytes::copy_from_slice(body),
    )));
    let mut fields = multer::Multipart::new(stream, boundary);
    let mut canonical = Vec::with_capacity(body.len());
    let mut put = |bytes: &[u8]| {
        canonical.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        canonical.extend_from_slice(bytes);
    };
    let mut count = 0;
    while let Some(field) = fields.next_field().await.ok()? {
        count += 1;
        if count > MAX_PARTS {
            return Some(Err(Unreadable::TooManyParts));
        }
        let mut headers: Vec<(String, Vec<u8>)> =
            field.headers().iter().map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec())).collect();
        headers.sort();
        put(&(headers.len() as u64).to_le_bytes());
        for (name, value) in &headers {
            put(name.as_bytes());
            put(value);
        }
        put(&field.bytes().await.ok()?);
    }
    Some(
        Fingerprint::of_bytes(&canonical, options)
            .map(|fingerprint| fingerprint.within(&["multipart"]))
            .map_err(Into::into),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compressed body is its decoded bytes, and nothing else: the fingerprint of the same bytes sent
    /// plain (another payload) is not accepted for it (before: the raw form was, so a record of the
    /// plain body answered the compressed one).
    #[tokio::test]
    async fn a_compressed_body_is_only_its_decoded_form() {
        use std::io::Write as _;
        let options = FingerprintOptions::default();
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gzip.write_all(b"decoded").expect("compress");
        let body = Bytes::from(gzip.finish().expect("compress"));
        let request =
            http::Request::post("/charges").header(header::CONTENT_ENCODING, "gzip").body(()).expect("request");
        let (parts, ()) = request.into_parts();
        let target = parts.uri.clone();
        let fingerprint = fingerprint(&parts, &target, &body, &options, QueryComparison::Unordered, 1 << 20).await;
        let fingerprint = fingerprint.expect("fingerprinted");
        let plain = Fingerprint::of_bytes(&body, &options).expect("raw").within(&["POST", "/charges"]);
        assert!(!fingerprint.is(plain.as_bytes()), "the raw bytes are another payload");
        let decoded = Fingerprint::of_bytes(b"decoded", &options).expect("raw").within(&["POST", "/charges"]);
        assert!(fingerprint.is(decoded.as_bytes()));
    }

    #[test]
    fn query_parameters_compare_by_name_in_any_order() {
        let path = Cow::Borrowed("/p");
        assert_eq!(unordered(&path, Some("b=2&a=1")), unordered(&path, Some("a=1&b=2")));
        assert_ne!(unordered(&path, Some("a=2&a=1")), unordered(&path, Some("a=1&a=2")));
        assert_eq!(unordered(&path, Some("a=1&b=2")), "/p?a=1&b=2", "a sorted query is as sent");
        assert_eq!(unordered(&path, Some("b=%41&a=1")), unordered(&path, Some("a=1&b=A")), "in one spelling");
        assert_eq!(unordered(&path, None), "/p");
        assert_eq!(unordered(&path, Some("")), "/p");
    }

    #[test]
    fn json_media_types_compare_without_case() {
        for json in ["application/json", "Application/JSON", "application/problem+json", "application/vnd.x+JSON"] {
            assert!(is_json(json), "{json}");
        }
        for other in ["text/plain", "json", "+jso", "application/jsonp", ""] {
            assert!(!is_json(other), "{other}");
        }
    }
}
