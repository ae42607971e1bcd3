//! The `Idempotency-Key` header, read in the draft's structured-field string form (`"abc"`) or bare
//! (`abc`); a repeated or malformed header is refused, never guessed at.

use http::HeaderMap;

use crate::error::InputError;
use crate::key::IdempotencyKey;

/// Reads `Idempotency-Key` in the draft's structured-field string form (`"abc"`) or bare (`abc`).
pub(crate) fn read_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, String> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err("the Idempotency-Key header is repeated".into());
    }
    let raw = value.as_bytes();
    let key = match raw {
        [b'"', quoted @ .., b'"'] => unquote(quoted)?,
        bare => bare.to_vec(),
    };
    let key = String::from_utf8(key).map_err(|_| InputError::KeyInvalidByte { offset: 0 }.to_string())?;
    IdempotencyKey::new(key).map(Some).map_err(|e| e.to_string())
}

/// Fuzzing entry (`cargo fuzz` builds with `--cfg fuzzing`): one `Idempotency-Key` value, parsed.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn fuzz_read_key(value: &[u8]) -> Option<String> {
    let value = http::HeaderValue::from_bytes(value).ok()?;
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", value);
    read_key(&headers).ok().flatten().map(|key| key.as_str().to_owned())
}

/// Undoes sf-string escaping (RFC 8941 §3.3.3): `\"` and `\\` only.
fn unquote(quoted: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(quoted.len());
    let mut bytes = quoted.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err("the quoted Idempotency-Key has an invalid escape".into()),
            },
            b'"' => return Err("the quoted Idempotency-Key has an unescaped quote".into()),
            b => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("idempotency-key", http::HeaderValue::from_bytes(value).expect("header value"));
        }
        headers
    }

    proptest! {
        /// The quoted (structured-field string) and bare forms of any valid key name the same key.
        #[test]
        fn quoted_and_bare_forms_agree(key in "[!-~]{1,255}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            let bare = read_key(&headers(&[key.as_bytes()]));
            let from_quoted = read_key(&headers(&[quoted.as_bytes()]));
            if key.starts_with('"') && key.ends_with('"') && key.len() >= 2 {
                // A bare value wrapped in quotes is read as the quoted form; that is what the draft says.
                prop_assert!(from_quoted.is_ok());
            } else {
                prop_assert_eq!(bare.clone().ok().flatten(), from_quoted.clone().ok().flatten());
                prop_assert_eq!(bare.ok().flatten().map(|k| k.as_str().to_owned()), Some(key));
            }
        }

        /// Arbitrary header bytes give a key or an error, never a panic.
        #[test]
        fn never_panics(value in prop::collection::vec(32u8..=255, 0..300)) {
            if let Ok(value) = http::HeaderValue::from_bytes(&value) {
                let _ = read_key(&headers(&[value.as_bytes()]));
            }
        }
    }

    #[test]
    fn repeated_and_malformed_headers_are_refused() {
        assert!(read_key(&headers(&[b"a", b"b"])).is_err());
        assert!(read_key(&headers(&[b"\"a\\qb\""])).is_err());
        assert!(read_key(&headers(&[b"\"a\"b\""])).is_err());
        assert!(read_key(&headers(&[b"\"\""])).is_err());
        assert!(read_key(&headers(&[b""])).is_err());
        assert_eq!(read_key(&headers(&[])).ok(), Some(None));
        let escaped = read_key(&headers(&[b"\"a\\\"b\""])).expect("valid escape").expect("a key");
        assert_eq!(escaped.as_str(), "a\"b");
    }
}
