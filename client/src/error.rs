//! What the middleware answers instead of a response: the server refused for good, or the retries ran out.
//! Both travel inside `reqwest_middleware::Error::Middleware`; [`ClientError::of`] finds them there.

use std::time::Duration;

use http::StatusCode;

/// A request the middleware stopped retrying. Returned as `reqwest_middleware::Error::Middleware`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server answered for good, and not with success: a 4xx other than the ones that ask for a retry
    /// (`409 in-flight`, 408, 425, 429), e.g. 400 (bad key), 410 (expired), 422 (key reused with another
    /// body), or `409 indeterminate` (an operator must resolve the key); or a 5xx that is final: replayed
    /// from the server's record (`Idempotent-Replayed: true`) or a stored response the server cannot
    /// read (`unreadable-response`). Sending again cannot help.
    #[error("the server refused the request with {status}{}", problem_title(.problem))]
    Refused {
        /// The status the server answered.
        status: StatusCode,
        /// Its body as a problem document (RFC 9457), when it is one.
        problem: Option<Problem>,
        /// Its body, as sent (a card decline's details, or the original response some servers send
        /// with a 409).
        body: Vec<u8>,
    },
    /// Every attempt the policy allows failed with an answer worth retrying (a connection error, a
    /// timeout, 5xx, 429, `409 in-flight`): the operation may or may not have run. Send it again later
    /// with the same key (the journal keeps it) and the server answers what happened.
    #[error("gave up after {attempts} attempts: {last}")]
    GaveUp {
        /// How many times the request was sent.
        attempts: u32,
        /// Why the last attempt failed.
        last: Retryable,
        /// Why no further attempt was made.
        because: Stop,
    },
    /// The key journal could not record the operation's key, so nothing was sent: a key that is not
    /// durable would be lost by a crash, and the retry after it would be charged again.
    #[error("the key journal failed")]
    Journal(#[source] std::io::Error),
}

impl ClientError {
    /// The [`ClientError`] inside a middleware error, if the middleware returned one.
    pub fn of(error: &reqwest_middleware::Error) -> Option<&ClientError> {
        match error {
            reqwest_middleware::Error::Middleware(inner) => inner.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}

/// Why an attempt is worth repeating.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retryable {
    /// No answer: the connection failed or the request timed out. The server may have run it.
    Transport(String),
    /// A status that asks for a retry: 5xx, 408, 425, 429, or 409 with problem type `in-flight`.
    Status(StatusCode),
    /// A gRPC status that asks for a retry: `UNAVAILABLE`, `ABORTED`, or `RESOURCE_EXHAUSTED` with a
    /// `RetryInfo`.
    #[cfg(feature = "tonic")]
    Grpc(tonic::Code),
}

impl std::fmt::Display for Retryable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Transport(error) => write!(f, "no answer ({error})"),
            Self::Status(status) => write!(f, "{status}"),
            #[cfg(feature = "tonic")]
            Self::Grpc(code) => write!(f, "gRPC {code:?}"),
        }
    }
}

/// Why the middleware stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stop {
    /// [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts) sends failed.
    Attempts,
    /// The next attempt would start after [`RetryPolicy::deadline`](crate::RetryPolicy::deadline) (the
    /// server may have asked to wait longer than the time left).
    Deadline,
    /// The host's retry budget is spent: most recent requests to it failed, and retrying them all would
    /// only add load to a server that is down.
    Budget,
    /// The request's body is a stream that cannot be sent twice.
    BodyNotReplayable,
}

/// An RFC 9457 problem document, as the server sent it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[non_exhaustive]
pub struct Problem {
    /// The problem type, e.g. `urn:idemstore:problem:key-reused`.
    #[serde(rename = "type")]
    pub kind: String,
    /// A short summary.
    #[serde(default)]
    pub title: Option<String>,
    /// What happened to this request.
    #[serde(default)]
    pub detail: Option<String>,
}

impl Problem {
    /// Parses a problem document; `None` when the body is not one (not JSON, or no `type`).
    pub fn parse(body: &[u8]) -> Option<Self> {
        serde_json::from_slice(body).ok()
    }

    /// Whether the problem type ends with `kind` (`in-flight` matches `urn:idemstore:problem:in-flight`).
    pub fn is(&self, kind: &str) -> bool {
        self.kind.rsplit([':', '/']).next() == Some(kind)
    }
}

fn problem_title(problem: &Option<Problem>) -> String {
    match problem.as_ref().and_then(|p| p.title.as_deref()) {
        Some(title) => format!(" ({title})"),
        None => String::new(),
    }
}

/// The longest `Retry-After` taken as it is: a day. Longer (or absurd) values are read as a day, which
/// no deadline allows, so the retries end at once.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// How long `Retry-After` asks to wait: delay-seconds or an HTTP-date (RFC 9110 §10.2.3). `None` when
/// absent or unreadable; a date in the past is no wait.
pub(crate) fn retry_after(headers: &http::HeaderMap, now: std::time::SystemTime) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    let asked = match value.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => httpdate::parse_http_date(value).ok()?.duration_since(now).unwrap_or(Duration::ZERO),
    };
    Some(asked.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn headers(value: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::RETRY_AFTER, value.parse().expect("a header value"));
        headers
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        assert_eq!(retry_after(&headers("7"), now), Some(Duration::from_secs(7)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(retry_after(&headers(&later), now), Some(Duration::from_secs(90)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(retry_after(&headers(&earlier), now), Some(Duration::ZERO));
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&headers("-3"), now), None);
        assert_eq!(retry_after(&headers("18446744073709551615"), now), Some(MAX_RETRY_AFTER));
        assert_eq!(retry_after(&http::HeaderMap::new(), now), None);
    }

    #[test]
    fn problem_types_match_by_their_last_segment() {
        let problem = Problem::parse(br#"{"type":"urn:idemstore:problem:in-flight","title":"Request in flight"}"#)
            .expect("a problem");
        assert!(problem.is("in-flight"));
        assert!(!problem.is("flight"));
        assert_eq!(Problem::parse(b"<html>"), None);
        assert_eq!(Problem::parse(br#"{"decline_code":"insufficient_funds"}"#), None, "no type, no problem");
    }
}
