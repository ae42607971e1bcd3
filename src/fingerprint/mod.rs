//! The payload [`Fingerprint`]: SHA-256 over a canonical form of the request, so that a retry of the same
//! request matches and a different request under a reused key is caught.
//!
//! JSON is canonicalized before hashing: object members sorted, insignificant whitespace dropped, numbers
//! written in one form per value (`1`, `1.0` and `1e0` are the same number), and the fields named in
//! [`FingerprintOptions::ignore_field`] removed (client timestamps, trace ids). Parsing is bounded in size
//! and depth, so hostile input gets an [`InputError`], never a stack overflow, and objects that repeat a
//! member are refused because two parsers may disagree about which copy counts.
//!
//! # Versions
//! Fingerprints are stored with every record, for as long as the record (forever in a ledger tier), so
//! their form is versioned: each form is hashed under a prefix that names it (`json-v2`, `raw`, ...), and
//! a form added later can never equal one a record holds. The JSON form reads every number from its
//! decimal text, never through `f64`: any integer and any decimal exactly (through `f64`, integers beyond
//! 2^64 and decimals beyond 17 significant digits would share a fingerprint with a neighbour), in an
//! output at most a few bytes longer than its input per number.

mod finite;
mod json;
mod number;
mod pointer;

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::InputError;
pub(crate) use finite::is_finite;
use json::Canon;
pub(crate) use pointer::JsonPointer;

/// SHA-256 of a canonical request (32 bytes, the form stored in both tiers).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    digest: [u8; 32],
}

impl Fingerprint {
    /// Fingerprints a JSON body in its canonical form.
    ///
    /// # Errors
    /// [`InputError::PayloadTooLarge`], [`InputError::TooDeep`], [`InputError::DuplicateMember`] or
    /// [`InputError::InvalidJson`].
    pub fn of_json(body: &[u8], options: &FingerprintOptions) -> Result<Self, InputError> {
        options.check_size(body.len())?;
        let mut canon = json::parse(body, options.max_depth)?;
        for pointer in &options.ignored {
            pointer.blank(&mut canon);
        }
        let mut out = Vec::with_capacity(body.len() + 16);
        if !options.compared.is_empty() {
            // The named fields only, each as its pointer's tokens and its value, or `!` where missing
            // (not JSON, so no value spells it). A form of its own, under its own prefix.
            out.extend_from_slice(b"json-v2-fields\0");
            let mut found = 0;
            for pointer in &options.compared {
                pointer.write_tokens(&mut out);
                match pointer.find(&canon) {
                    Some(value) => {
                        found += 1;
                        value.write_exact(&mut out)?;
                    }
                    None => out.push(b'!'),
                }
            }
            if found == 0 && options.key_from_fields {
                return Err(InputError::KeyFieldsMissing);
            }
            return Ok(Self { digest: Sha256::digest(&out).into() });
        }
        out.extend_from_slice(b"json-v2\0");
        canon.write_exact(&mut out)?;
        Ok(Self { digest: Sha256::digest(&out).into() })
    }

    /// Fingerprints any serializable value through its JSON form, with the same canonical rules.
    ///
    /// # Errors
    /// As [`Fingerprint::of_json`]; [`InputError::InvalidJson`] if `value` cannot be serialized;
    /// [`InputError::NonFiniteNumber`] if it holds NaN or an infinity (which JSON writes as `null`, the
    /// fingerprint of another request).
    pub fn of_serialize<T: serde::Serialize + ?Sized>(
        value: &T,
        options: &FingerprintOptions,
    ) -> Result<Self, InputError> {
        if !is_finite(value) {
            return Err(InputError::NonFiniteNumber);
        }
        let body = serde_json::to_vec(value).map_err(InputError::InvalidJson)?;
        Self::of_json(&body, options)
    }

    /// Fingerprints an opaque body byte for byte (for content that is not JSON).
    ///
    /// # Errors
    /// [`InputError::PayloadTooLarge`]; [`InputError::KeyFieldsMissing`] under options that derive a
    /// key from JSON fields ([`crate::DerivedKeys::of_fields`]).
    pub fn of_bytes(body: &[u8], options: &FingerprintOptions) -> Result<Self, InputError> {
        options.check_size(body.len())?;
        if options.key_from_fields {
            return Err(InputError::KeyFieldsMissing);
        }
        let mut hasher = Sha256::new();
        hasher.update(b"raw\0");
        hasher.update(body);
        Ok(Self { digest: hasher.finalize().into() })
    }

    /// This fingerprint bound to a context (such as the HTTP method and target), so that the same body
    /// sent to two different targets gives two different fingerprints.
    pub fn within(&self, context: &[&str]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"ctx\0");
        for part in context {
            // Length-prefixed, so no two different contexts hash the same bytes.
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        // The hex digits, not the bytes: the bound form is stored, so it stays as it was first defined.
        hasher.update(hex(&self.digest));
        Self { digest: hasher.finalize().into() }
    }

    /// A fingerprint read back from storage; `None` unless it is 32 bytes.
    pub(crate) fn from_stored(stored: &[u8]) -> Option<Self> {
        Some(Self { digest: stored.try_into().ok()? })
    }

    /// The 32 bytes (what records store).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.digest
    }

    /// The 64 lowercase hex digits (how logs and `idemctl` show it).
    pub fn to_hex(&self) -> String {
        String::from_utf8(hex(&self.digest).to_vec()).expect("hex digits are ASCII")
    }

    /// Whether a stored fingerprint is this request's.
    pub(crate) fn is(&self, stored: &[u8]) -> bool {
        self.digest == stored
    }

    /// Whether a stored prefix (a tombstone keeps 8 bytes) is this request's.
    pub(crate) fn starts_with(&self, prefix: &[u8]) -> bool {
        self.digest.starts_with(prefix)
    }
}

/// 64 lowercase hex digits.
fn hex(digest: &[u8; 32]) -> [u8; 64] {
    let mut out = [0; 64];
    write_hex(digest, &mut out);
    out
}

/// `bytes` as lowercase hex digits into `out` (twice as long), without the formatting machinery: the
/// request path names every key this way.
pub(crate) fn write_hex(bytes: &[u8], out: &mut [u8]) {
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = HEX[usize::from(byte >> 4)];
        pair[1] = HEX[usize::from(byte & 0xf)];
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..12])
    }
}

/// Limits and ignored (or only compared) fields for fingerprinting one operation's payloads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintOptions {
    max_bytes: usize,
    max_depth: usize,
    ignored: Vec<JsonPointer>,
    compared: Vec<JsonPointer>,
    /// The compared fields name a derived key ([`crate::DerivedKeys`]): a payload holding none of them
    /// (or no JSON) names nothing, and is refused.
    key_from_fields: bool,
}

impl Default for FingerprintOptions {
    fn default() -> Self {
        Self { max_bytes: 1 << 20, max_depth: 64, ignored: Vec::new(), compared: Vec::new(), key_from_fields: false }
    }
}

impl FingerprintOptions {
    /// The deepest nesting any JSON payload may ask for; `serde_json` itself stops at 128.
    pub const DEPTH_CEILING: usize = 120;

    /// Largest payload accepted, in bytes (default 1 MiB).
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Deepest nesting of JSON arrays and objects accepted (default 64, at most
    /// [`Self::DEPTH_CEILING`], larger values are clamped).
    pub fn with_max_depth(mut self, max_depth: usize) -> Self {
        self.max_depth = max_depth.min(Self::DEPTH_CEILING);
        self
    }

    /// Leaves the field at `pointer` (RFC 6901, e.g. `/client_ts` or `/items/0/sent_at`) out of the
    /// fingerprint, so retries that differ only there still match.
    ///
    /// # Errors
    /// [`InputError::InvalidPointer`] if `pointer` does not start with `/`.
    pub fn ignore_field(mut self, pointer: &str) -> Result<Self, InputError> {
        self.ignored.push(JsonPointer::parse(pointer)?);
        Ok(self)
    }

    /// Compares only the field at `pointer` (and the others named so): two payloads match when each of
    /// these fields holds the same value in both (or is missing from both), whatever else differs.
    /// For deliveries whose bodies carry bookkeeping a sender changes between attempts, such as a
    /// webhook's retry counters. Applied after [`FingerprintOptions::ignore_field`].
    ///
    /// # Errors
    /// [`InputError::InvalidPointer`] if `pointer` does not start with `/`.
    pub fn compare_only(mut self, pointer: &str) -> Result<Self, InputError> {
        self.compared.push(JsonPointer::parse(pointer)?);
        Ok(self)
    }

    /// These options with `fields` the only ones compared, as a derived key reads them: a payload
    /// with none of them is refused ([`InputError::KeyFieldsMissing`]).
    pub(crate) fn deriving_keys_from(&self, fields: &[JsonPointer]) -> Self {
        Self { compared: fields.to_vec(), key_from_fields: true, ..self.clone() }
    }

    fn check_size(&self, len: usize) -> Result<(), InputError> {
        if len > self.max_bytes {
            return Err(InputError::PayloadTooLarge { len, limit: self.max_bytes });
        }
        Ok(())
    }
}

impl Canon<'_> {
    /// Writes the canonical form, every number exact (see `number::write_exact`).
    pub(super) fn write_exact(&self, out: &mut Vec<u8>) -> Result<(), InputError> {
        match self {
            Canon::Null => out.extend_from_slice(b"null"),
            Canon::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Canon::Number(text) => number::write_exact(text, out)?,
            Canon::String(s) => write_string(s, out),
            Canon::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write_exact(out)?;
                }
                out.push(b']');
            }
            Canon::Object(members) => {
                out.push(b'{');
                for (i, (name, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(name, out);
                    out.push(b':');
                    value.write_exact(out)?;
                }
                out.push(b'}');
            }
        }
        Ok(())
    }
}

/// Copies runs of bytes that need no escape at once; escapes `"`, `\` and control characters.
pub(super) fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0..0x20 => &[b'\\', b'u', b'0', b'0', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]],
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        out.extend_from_slice(escaped);
        run = i + 1;
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

const HEX: &[u8; 16] = b"0123456789abcdef";

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of_json(body.as_bytes(), &FingerprintOptions::default()).expect("valid JSON")
    }

    #[test]
    fn member_order_whitespace_and_number_spelling_do_not_matter() {
        let a = fp(r#"{"amount":100,"currency":"EUR","meta":{"x":1.5,"y":[1,2]}}"#);
        let b = fp("{ \"meta\" : {\"y\":[1.0, 2e0], \"x\":15e-1},\n \"currency\":\"EUR\", \"amount\":1E2 }");
        assert_eq!(a, b);
        assert_ne!(a, fp(r#"{"amount":101,"currency":"EUR","meta":{"x":1.5,"y":[1,2]}}"#));
        assert_ne!(fp(r#"[1,2]"#), fp(r#"[2,1]"#));
        assert_ne!(fp(r#""1""#), fp("1"));
    }

    /// Two amounts that differ in the 21st digit are two requests (read as `f64`, they would share one
    /// fingerprint, and the second request would be answered with the first one's response).
    #[test]
    fn amounts_beyond_64_bits_differ() {
        let a = fp(r#"{"amount_wei":100000000000000000001}"#);
        let b = fp(r#"{"amount_wei":100000000000000000000}"#);
        assert_ne!(a.to_hex(), b.to_hex());
        assert!(!a.is(b.as_bytes()));
        let c = fp(r#"{"price":0.30000000000000000000000000001}"#);
        assert_ne!(c.to_hex(), fp(r#"{"price":0.3}"#).to_hex());
    }

    /// A body of large exponents: `1e308` is written in 5 bytes, not as its 309 digits (which would
    /// build a ~54 MB canonical buffer for a 1 MiB body).
    #[test]
    fn canonical_form_stays_near_the_input_size() {
        let body = format!("[{}1e308]", "1e308,".repeat(100_000));
        let canon = json::parse(body.as_bytes(), 64).expect("valid");
        let mut exact = Vec::new();
        canon.write_exact(&mut exact).expect("in range");
        assert!(exact.len() <= body.len() + 16, "{} canonical bytes for {} input bytes", exact.len(), body.len());
    }

    /// Fingerprints are stored in both tiers: the canonical form must never change, or retries that span
    /// an upgrade would be refused as mismatches. It is frozen here.
    #[test]
    fn fingerprints_are_a_stored_format() {
        let golden = [
            (
                r#"{"amount":1200,"currency":"EUR","customer":{"id":"cus_1"},"items":[1,2.5,-3,true,null,[],{}]}"#,
                "b7e6823004ef9976262c1a7cd61189291cdc31d79a7f64cc07c6b6a8fddd263e",
            ),
            (
                r#"{"b":"quote \" backslash \\ tab \t nul \u0000 bell \u0007","a":"é ü 日本 🎉 \ud83c\udf89"}"#,
                "6e2f6cdaf15f3f97454dd93f1ab294960de325854055965c57b2284ad85b7fe3",
            ),
            (
                r#"[0,-0,-0.0,1e0,1.5e3,1e-7,1e21,1e300,18446744073709551615,-9223372036854775808,123456789012345678901234567890]"#,
                "e1eafd753c71a57cbfd8cd4bf06a5b2306977f22c72acf9b6f0cb05c64e7e686",
            ),
            (
                r#"{"z":1,"é":2,"Z":3,"a b":4,"a\nb":5,"":6,"aa":7,"a":8}"#,
                "d8c4fee85ba52405d5d3dd88cb79d02402073ca2ff7db95e936c5535ecc01016",
            ),
            (r#""just a string""#, "f761a302d0eb203a2494ec16ff99aa51d638c02417d5dcfdae5bda0ce1d24e4c"),
            (
                r#"[[[[{"deep":[{"x":{"y":[]}}]}]]]]"#,
                "4ca8f986c07b6157f6dd2e0fe0603a3cef2d29560432f65718977d6c3a5eea93",
            ),
        ];
        for (body, expected) in golden {
            assert_eq!(fp(body).to_hex(), expected, "{body}");
        }
        let options = FingerprintOptions::default().ignore_field("/meta/ts").and_then(|o| o.ignore_field("/items/1"));
        let ignored = Fingerprint::of_json(br#"{"meta":{"ts":5,"id":1},"items":[1,2,3]}"#, &options.expect("pointers"));
        let ignored = ignored.expect("valid");
        assert_eq!(ignored.to_hex(), "0c57f7720b661deea92f1645144ec5a8f83a4ec6800bda07e39ee0f23b080e9b");
    }

    /// Only the named fields count: a Stripe-style re-delivery that changed its bookkeeping matches, a
    /// changed amount does not, and a missing field is not a null one.
    #[test]
    fn compared_fields_alone_decide() {
        let options = FingerprintOptions::default().compare_only("/type").and_then(|o| o.compare_only("/data/amount"));
        let options = options.expect("pointers");
        let of = |body: &str| Fingerprint::of_json(body.as_bytes(), &options).expect("valid");
        let first = of(r#"{"type":"charge","data":{"amount":100},"pending_webhooks":2}"#);
        assert_eq!(first, of(r#"{"pending_webhooks":1,"type":"charge","data":{"amount":1e2}}"#));
        assert_ne!(first, of(r#"{"type":"charge","data":{"amount":101},"pending_webhooks":2}"#));
        assert_ne!(of(r#"{"type":null}"#), of(r#"{}"#));
        assert_ne!(of(r#"{}"#), fp("{}"), "a form of its own");
    }

    #[test]
    fn json_and_raw_bytes_never_collide() {
        let raw = Fingerprint::of_bytes(b"{}", &FingerprintOptions::default()).expect("small");
        assert_ne!(raw, fp("{}"));
    }

    #[test]
    fn ignored_fields_are_left_out() {
        let options = FingerprintOptions::default()
            .ignore_field("/client_ts")
            .and_then(|o| o.ignore_field("/items/0/sent~1at"))
            .expect("pointers");
        let a = Fingerprint::of_json(br#"{"a":1,"client_ts":5,"items":[{"sent/at":1,"v":2}]}"#, &options);
        let b = Fingerprint::of_json(br#"{"a":1,"client_ts":9,"items":[{"sent/at":7,"v":2}]}"#, &options);
        let c = Fingerprint::of_json(br#"{"a":2,"client_ts":9,"items":[{"sent/at":7,"v":2}]}"#, &options);
        assert_eq!(a.as_ref().ok(), b.as_ref().ok());
        assert_ne!(a.ok(), c.ok());
        assert!(matches!(
            FingerprintOptions::default().ignore_field("client_ts"),
            Err(InputError::InvalidPointer { .. })
        ));
    }

    #[test]
    fn hostile_payloads_get_typed_errors() {
        let options = FingerprintOptions::default().with_max_depth(8).with_max_bytes(64);
        let deep = format!("{}{}", "[".repeat(9), "]".repeat(9));
        assert!(matches!(Fingerprint::of_json(deep.as_bytes(), &options), Err(InputError::TooDeep { limit: 8 })));
        let ok = format!("{}{}", "[".repeat(8), "]".repeat(8));
        assert!(Fingerprint::of_json(ok.as_bytes(), &options).is_ok());
        let huge = "[".repeat(100_000);
        assert!(matches!(
            Fingerprint::of_json(huge.as_bytes(), &FingerprintOptions::default().with_max_bytes(1 << 20)),
            Err(InputError::TooDeep { limit: 64 })
        ));
        assert!(matches!(
            Fingerprint::of_json(br#"{"a":1,"a":2}"#, &options),
            Err(InputError::DuplicateMember { name }) if name == "a"
        ));
        assert!(matches!(Fingerprint::of_json(b"{\"a\":", &options), Err(InputError::InvalidJson(_))));
        assert!(matches!(Fingerprint::of_json(b"{} {}", &options), Err(InputError::InvalidJson(_))));
        assert!(matches!(
            Fingerprint::of_json(&[b' '; 65], &options),
            Err(InputError::PayloadTooLarge { len: 65, limit: 64 })
        ));
    }

    #[test]
    fn pathological_payloads_get_typed_errors() {
        let options = FingerprintOptions::default();
        let deep = format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(matches!(Fingerprint::of_json(deep.as_bytes(), &options), Err(InputError::TooDeep { limit: 64 })));
        let deep_objects = "{\"a\":".repeat(10_000);
        assert!(matches!(Fingerprint::of_json(deep_objects.as_bytes(), &options), Err(InputError::TooDeep { .. })));
        let huge = vec![b' '; 100 << 20];
        assert!(matches!(Fingerprint::of_json(&huge, &options), Err(InputError::PayloadTooLarge { .. })));
        assert!(matches!(Fingerprint::of_bytes(&huge, &options), Err(InputError::PayloadTooLarge { .. })));
        // Beyond f64, and kept exactly.
        assert!(Fingerprint::of_json(b"1e400", &options).is_ok());
        let exponent = b"1e1234567890123456789";
        assert!(matches!(Fingerprint::of_json(exponent, &options), Err(InputError::InvalidJson(_))));
        for invalid in [&b"01"[..], b"1.", b".5", b"-", b"+1", b"1e", b"tru", b"[1,]", b"{\"a\"}", b"\"\\ud800\""] {
            assert!(matches!(Fingerprint::of_json(invalid, &options), Err(InputError::InvalidJson(_))), "{invalid:?}");
        }
        assert!(matches!(Fingerprint::of_json(b"\"\xff\xfe\"", &options), Err(InputError::InvalidJson(_))));
        assert!(matches!(
            Fingerprint::of_json(b"{\"a\":1,\"b\":{\"c\":1,\"c\":2}}", &options),
            Err(InputError::DuplicateMember { .. })
        ));
        assert!(matches!(Fingerprint::of_json(b"", &options), Err(InputError::InvalidJson(_))));
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            (-1e6f64..1e6).prop_map(serde_json::Value::from),
            "[a-z\\\\\"\u{0}-\u{1f}é]{0,6}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                prop::collection::btree_map("[a-z]{0,4}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Structural equality with numbers compared by exact value.
    fn same_value(a: &serde_json::Value, b: &serde_json::Value) -> bool {
        use serde_json::Value;
        let exact = |n: &serde_json::Number| {
            let mut out = Vec::new();
            number::write_exact(&n.to_string(), &mut out).expect("in range");
            out
        };
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => exact(x) == exact(y),
            (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y)),
            (Value::Object(x), Value::Object(y)) => {
                x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
            }
            _ => a == b,
        }
    }

    proptest! {
        /// Layout never changes the fingerprint, and the canonical form itself parses back to the same value.
        #[test]
        fn layout_is_irrelevant(value in json_value()) {
            let compact = serde_json::to_vec(&value).expect("serializable");
            let pretty = serde_json::to_vec_pretty(&value).expect("serializable");
            let options = FingerprintOptions::default();
            prop_assert_eq!(
                Fingerprint::of_json(&compact, &options).ok(),
                Fingerprint::of_json(&pretty, &options).ok()
            );
            let mut canonical = Vec::new();
            json::parse(&compact, 64).expect("valid").write_exact(&mut canonical).expect("in range");
            let mut again = Vec::new();
            json::parse(&canonical, 64).expect("canonical form is JSON").write_exact(&mut again).expect("in range");
            prop_assert_eq!(canonical, again);
        }

        /// Two payloads share a fingerprint exactly when their canonical values are equal.
        #[test]
        fn different_values_differ(a in json_value(), b in json_value()) {
            let (a, b) = (serde_json::to_vec(&a).expect("ser"), serde_json::to_vec(&b).expect("ser"));
            let options = FingerprintOptions::default();
            let same_value = same_value(&serde_json::from_slice(&a).expect("de"), &serde_json::from_slice(&b).expect("de"));
            let (a, b) = (Fingerprint::of_json(&a, &options).expect("valid"), Fingerprint::of_json(&b, &options).expect("valid"));
            let same_fingerprint = a.to_hex() == b.to_hex();
            prop_assert_eq!(same_fingerprint, same_value);
        }
    }
}
