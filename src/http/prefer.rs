//! A client's `Prefer: wait=N` (RFC 7240, section 4.3): how many seconds it is willing to wait for a
//! request still running under its key. The route's bound
//! ([`with_wait_in_flight`](super::IdempotencyLayer::with_wait_in_flight)) caps it: a client can shorten
//! the wait (down to none, `wait=0`), never lengthen it or turn it on where the route has none.

use std::time::Duration;

use http::HeaderMap;
use http::header::HeaderName;

static PREFER: HeaderName = HeaderName::from_static("prefer");

/// The `wait` preference among the request's `Prefer` fields: the first one that parses, in seconds.
/// Preferences are comma-separated, each `token [ "=" value ] *( ";" parameter )`, the token
/// case-insensitive, the value optionally quoted. A value that is no number of seconds is ignored, as the
/// RFC asks of preferences a server does not understand.
pub(crate) fn preferred_wait(headers: &HeaderMap) -> Option<Duration> {
    headers.get_all(&PREFER).iter().filter_map(|field| field.to_str().ok()).flat_map(|field| field.split(',')).find_map(
        |preference| {
            let preference = preference.split(';').next()?;
            let (token, value) = preference.split_once('=')?;
            if !token.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            let value = value.trim().trim_matches('"');
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            // A number past u64 is "a very long time": the route's bound caps it anyway.
            Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_of(fields: &[&str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for field in fields {
            headers.append(&PREFER, field.parse().expect("field"));
        }
        preferred_wait(&headers)
    }

    /// The forms RFC 7240 allows, among other preferences, and what is not a wait.
    #[test]
    fn reads_the_wait_preference() {
        assert_eq!(wait_of(&["wait=10"]), Some(Duration::from_secs(10)));
        assert_eq!(wait_of(&["respond-async, WAIT = \"5\"; x=1"]), Some(Duration::from_secs(5)));
        assert_eq!(wait_of(&["return=minimal", "wait=0"]), Some(Duration::ZERO));
        assert_eq!(wait_of(&["wait=99999999999999999999999"]), Some(Duration::from_secs(u64::MAX)));
        assert_eq!(wait_of(&["wait=-1", "wait=1.5", "wait=", "waiting=3", "return=wait"]), None);
        assert_eq!(wait_of(&[]), None);
    }
}
