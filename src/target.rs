//! A request target in one spelling: the path and the query as a router reads them, so that one request
//! retried through a proxy, an SDK or a client that encodes differently (`/accounts/%41` or
//! `/accounts/A`, `?ref=%41` or `?ref=A`, `a%2Bb` or `a+b` in a path) names one record and has one
//! fingerprint. The key space ([`IdempotencyKey::for_target`](crate::IdempotencyKey::for_target)) and
//! the HTTP layer's request fingerprint both read a target through this module, and nothing else does.
//!
//! Every escape that a router decodes to the same value as the character itself is decoded; what would
//! change the target's structure if decoded (a `/` in a path segment, a `&` in a query parameter or an
//! `=` in its name, `?`, `#`, `%`) stays an escape, its hex digits upper-cased; a byte that is not visible ASCII is
//! encoded, whether it came raw or encoded. A `%` that starts no escape is the percent sign itself
//! (routers decode it so), and is encoded.

use std::borrow::Cow;

/// The path in its one spelling. As axum's `Path` decodes a parameter: `%2B` and `+` are one path (in a
/// path `+` is a plus sign), `%2F` is not `/` (it does not end a segment).
pub(crate) fn path(path: &str) -> Cow<'_, str> {
    respell(path, b"/?#%", None)
}

// Only the HTTP layer's fingerprint reads a query.
#[cfg(feature = "http")]
/// The query in its one spelling, as HTML forms (and axum's `Query`) decode it: each parameter as
/// `name=value`, `+` and `%20` both a space (written `+`), `%2B` a plus sign, an `&` still encoded and an
/// `=` too in a name (in a value, after the first `=`, it is the character, encoded or not); an empty
/// parameter (`a=1&&b=2`) is none.
pub(crate) fn query(query: &str) -> Vec<String> {
    let mut parameters = Vec::new();
    for parameter in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = parameter.split_once('=').unwrap_or((parameter, ""));
        // Only the first `=` splits: one inside the value is the character, encoded or not.
        let name = respell(name, b"&=+#%", Some(b'+'));
        let value = respell(value, b"&+#%", Some(b'+'));
        parameters.push(format!("{name}={value}"));
    }
    parameters
}

/// `text` respelled: escapes of visible ASCII other than `kept` decoded, every other byte that is not
/// visible ASCII encoded, hex digits upper-cased; a space written as `space` where one is given (and a
/// raw `space` read as a space). Borrowed when nothing changes.
fn respell<'a>(text: &'a str, kept: &[u8], space: Option<u8>) -> Cow<'a, str> {
    let bytes = text.as_bytes();
    let plain = |b: u8| b.is_ascii_graphic() && b != b'%' && Some(b) != space;
    if bytes.iter().all(|&b| plain(b)) {
        return Cow::Borrowed(text);
    }
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut respelled = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let escape = (bytes[i] == b'%').then(|| Some((hex(*bytes.get(i + 1)?)?, hex(*bytes.get(i + 2)?)?))).flatten();
        match (escape, bytes[i]) {
            (Some((high, low)), _) => {
                put(&mut respelled, high << 4 | low, kept, space);
                i += 3;
                continue;
            }
            (None, b) if Some(b) == space => put(&mut respelled, b' ', kept, space),
            // A character that is part of the target's syntax (a `/`, an `=` in a value), as sent.
            (None, b) if b.is_ascii_graphic() && b != b'%' => respelled.push(char::from(b)),
            (None, b) => put(&mut respelled, b, kept, space),
        }
        i += 1;
    }
    Cow::Owned(respelled)
}

/// Writes a byte read from an escape (or one that must be written as one): the character itself where it
/// means the same, else its escape.
fn put(respelled: &mut String, byte: u8, kept: &[u8], space: Option<u8>) {
    match space {
        Some(space) if byte == b' ' => respelled.push(char::from(space)),
        _ if byte.is_ascii_graphic() && !kept.contains(&byte) => respelled.push(char::from(byte)),
        _ => respelled.push_str(&format!("%{byte:02X}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path spelled with and without percent-encoding is one path: an unreserved or sub-delimiter
    /// character encoded is the character (`%2B` is `+`, as a router decodes both), a reserved one that
    /// would change the path's structure stays encoded, and a stray `%` is the percent sign.
    #[test]
    fn paths_compare_as_a_router_decodes_them() {
        let same = [
            ("/accounts/%41/transfers", "/accounts/A/transfers"),
            ("/a/%7e%2d%5F%2E", "/a/~-_."),
            ("/a/b%2Bc", "/a/b+c"),
            ("/a/%3b%3D%40", "/a/;=@"),
            ("/a/%c3%a9", "/a/%C3%A9"),
            ("/ä/%41", "/%c3%a4/A"),
            ("/a/%zz%", "/a/%25zz%25"),
        ];
        for (encoded, plain) in same {
            assert_eq!(path(encoded), path(plain), "{encoded}");
        }
        assert_eq!(path("/a/%2f"), "/a/%2F");
        assert_ne!(path("/a/B%2FC"), path("/a/B/C"));
        assert_eq!(path("/a/%4é"), "/a/%254%C3%A9");
        assert_eq!(path("/a/%20"), "/a/%20");
        assert!(matches!(path("/accounts/A/transfers"), Cow::Borrowed(_)), "nothing to respell");
    }

    /// Query parameters as forms decode them: `+` is a space and `%2B` a plus sign; an `&` or `=` inside
    /// a value stays encoded; a parameter without `=` has an empty value.
    #[cfg(feature = "http")]
    #[test]
    fn queries_compare_as_forms_decode_them() {
        assert_eq!(query("ref=%41&b=1"), query("ref=A&b=1"));
        assert_eq!(query("q=a+b"), query("q=a%20b"));
        assert_eq!(query("q=a+b"), ["q=a+b"]);
        assert_ne!(query("q=a%2Bb"), query("q=a+b"));
        assert_eq!(query("q=a%2bb"), ["q=a%2Bb"]);
        assert_eq!(query("q=a%26b%3dc"), ["q=a%26b=c"]);
        assert_eq!(query("q=a=b"), query("q=a%3Db"));
        assert_eq!(query("a%3Db=c"), ["a%3Db=c"]);
        assert_ne!(query("q=a%26b"), query("q=a&b"));
        assert_eq!(query("a&&b=%7E"), ["a=", "b=~"]);
        assert_eq!(query(""), Vec::<String>::new());
    }
}
