//! The payload [`Fingerprint`]: SHA-256 over a canonical form of the request, so that a retry of the same
//! request matches and a different request under a reused key is caught.
//!
//! JSON is canonicalized before hashing: object members sorted, insignificant whitespace dropped, numbers
//! written in one form per value (`1`, `1.0` and `1e0` are the same number), and the fields named in
//! [`FingerprintOptions::ignore_field`] removed (client timestamps, trace ids). Parsing is bounded in size
//! and depth, so hostile input gets an [`InputError`], never a stack overflow, and objects that repeat a
//! member are refused because two parsers may disagree about which copy counts.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};

use crate::error::InputError;

/// SHA-256 of a canonical request, as 64 lowercase hex digits (the form stored in both tiers).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Fingerprint(String);

impl Fingerprint {
    /// Fingerprints a JSON body in its canonical form.
    ///
    /// # Errors
    /// [`InputError::PayloadTooLarge`], [`InputError::TooDeep`], [`InputError::DuplicateMember`] or
    /// [`InputError::InvalidJson`].
    pub fn of_json(body: &[u8], options: &FingerprintOptions) -> Result<Self, InputError> {
        options.check_size(body.len())?;
        let mut canon = parse(body, options.max_depth)?;
        for pointer in &options.ignored {
            pointer.blank(&mut canon);
        }
        let mut out = Vec::with_capacity(body.len() + 8);
        out.extend_from_slice(b"json\0");
        canon.write(&mut out);
        Ok(Self::digest(&out))
    }

    /// Fingerprints any serializable value through its JSON form, with the same canonical rules.
    ///
    /// # Errors
    /// As [`Fingerprint::of_json`]; [`InputError::InvalidJson`] if `value` cannot be serialized.
    pub fn of_serialize<T: serde::Serialize + ?Sized>(
        value: &T,
        options: &FingerprintOptions,
    ) -> Result<Self, InputError> {
        let body = serde_json::to_vec(value).map_err(InputError::InvalidJson)?;
        Self::of_json(&body, options)
    }

    /// Fingerprints an opaque body byte for byte (for content that is not JSON).
    ///
    /// # Errors
    /// [`InputError::PayloadTooLarge`].
    pub fn of_bytes(body: &[u8], options: &FingerprintOptions) -> Result<Self, InputError> {
        options.check_size(body.len())?;
        let mut hasher = Sha256::new();
        hasher.update(b"raw\0");
        hasher.update(body);
        Ok(Self(format!("{:x}", hasher.finalize())))
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
        hasher.update(self.0.as_bytes());
        Self(format!("{:x}", hasher.finalize()))
    }

    /// A fingerprint read back from storage.
    pub(crate) fn from_hex(hex: String) -> Self {
        Self(hex)
    }

    /// The fingerprint as 64 lowercase hex digits.
    pub fn as_hex(&self) -> &str {
        &self.0
    }

    fn digest(canonical: &[u8]) -> Self {
        Self(format!("{:x}", Sha256::digest(canonical)))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.0[..12])
    }
}

/// Limits and ignored fields for fingerprinting one operation's payloads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintOptions {
    max_bytes: usize,
    max_depth: usize,
    ignored: Vec<JsonPointer>,
}

impl Default for FingerprintOptions {
    fn default() -> Self {
        Self { max_bytes: 1 << 20, max_depth: 64, ignored: Vec::new() }
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

    fn check_size(&self, len: usize) -> Result<(), InputError> {
        if len > self.max_bytes {
            return Err(InputError::PayloadTooLarge { len, limit: self.max_bytes });
        }
        Ok(())
    }
}

/// A parsed JSON value, borrowing its strings from the body where no escape forced a copy. Objects keep
/// their members sorted by name (byte order) once parsed.
#[derive(Debug, PartialEq)]
enum Canon<'a> {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    String(Cow<'a, str>),
    Array(Vec<Canon<'a>>),
    Object(Vec<(Cow<'a, str>, Canon<'a>)>),
}

impl Canon<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Canon::Null => out.extend_from_slice(b"null"),
            Canon::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Canon::Int(n) => write_display(n, out),
            Canon::UInt(n) => write_display(n, out),
            Canon::Float(v) => write_float(*v, out),
            Canon::String(s) => write_string(s, out),
            Canon::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write(out);
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
                    value.write(out);
                }
                out.push(b'}');
            }
        }
    }
}

fn write_display(value: &impl fmt::Display, out: &mut Vec<u8>) {
    use std::io::Write as _;
    // Writing into a Vec cannot fail.
    let _ = write!(out, "{value}");
}

/// Copies runs of bytes that need no escape at once; escapes `"`, `\` and control characters.
fn write_string(s: &str, out: &mut Vec<u8>) {
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

/// One spelling per numeric value: integers (and floats holding an integer below 2^53) as plain
/// integers, other floats in Rust's shortest round-trip form. Integers beyond 64 bits are compared as
/// IEEE-754 doubles, as RFC 8785 does.
fn write_float(v: f64, out: &mut Vec<u8>) {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if v.fract() == 0.0 && v.abs() < EXACT { write_display(&(v as i64), out) } else { write_display(&v, out) }
}

fn parse(body: &[u8], max_depth: usize) -> Result<Canon<'_>, InputError> {
    let refusal = Cell::new(None);
    let seed = CanonSeed { depth: 0, max_depth, refusal: &refusal };
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = seed.deserialize(&mut de).and_then(|canon| de.end().map(|()| canon));
    parsed.map_err(|err| refusal.take().unwrap_or(InputError::InvalidJson(err)))
}

/// Builds a [`Canon`] while parsing, enforcing the depth limit and refusing repeated members. A refusal
/// is kept in `refusal` so that it reaches the caller typed, not as serde's message.
struct CanonSeed<'r> {
    depth: usize,
    max_depth: usize,
    refusal: &'r Cell<Option<InputError>>,
}

impl CanonSeed<'_> {
    fn nested<E: de::Error>(&self) -> Result<Self, E> {
        if self.depth >= self.max_depth {
            return Err(self.refuse(InputError::TooDeep { limit: self.max_depth }));
        }
        Ok(CanonSeed { depth: self.depth + 1, max_depth: self.max_depth, refusal: self.refusal })
    }

    fn nested_copy(&self) -> Self {
        CanonSeed { depth: self.depth, max_depth: self.max_depth, refusal: self.refusal }
    }

    fn refuse<E: de::Error>(&self, error: InputError) -> E {
        self.refusal.set(Some(error));
        E::custom("payload refused")
    }
}

impl<'de> DeserializeSeed<'de> for CanonSeed<'_> {
    type Value = Canon<'de>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Canon<'de>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CanonSeed<'_> {
    type Value = Canon<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Canon<'de>, E> {
        Ok(Canon::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Canon<'de>, E> {
        Ok(Canon::Bool(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Canon<'de>, E> {
        Ok(Canon::UInt(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Canon<'de>, E> {
        Ok(Canon::Int(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Canon<'de>, E> {
        Ok(Canon::Float(v))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Canon<'de>, E> {
        Ok(Canon::String(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Canon<'de>, E> {
        Ok(Canon::String(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Canon<'de>, E> {
        Ok(Canon::String(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Canon<'de>, A::Error> {
        let inner = self.nested()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(inner.nested_copy())? {
            items.push(item);
        }
        Ok(Canon::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Canon<'de>, A::Error> {
        let inner = self.nested()?;
        let mut members = Vec::new();
        while let Some(name) = map.next_key_seed(MemberName)? {
            members.push((name, map.next_value_seed(inner.nested_copy())?));
        }
        // Byte order, as `str` compares; a repeated name ends up next to itself.
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        if let Some(pair) = members.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(self.refuse(InputError::DuplicateMember { name: pair[0].0.clone().into_owned() }));
        }
        Ok(Canon::Object(members))
    }
}

/// An object member's name, borrowed from the body unless it holds an escape.
struct MemberName;

impl<'de> DeserializeSeed<'de> for MemberName {
    type Value = Cow<'de, str>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Cow<'de, str>, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MemberName {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v))
    }
}

/// An RFC 6901 pointer, split into unescaped reference tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
struct JsonPointer(Vec<String>);

impl JsonPointer {
    fn parse(pointer: &str) -> Result<Self, InputError> {
        let Some(rest) = pointer.strip_prefix('/') else {
            return Err(InputError::InvalidPointer { pointer: pointer.to_owned() });
        };
        let tokens = rest.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect();
        Ok(Self(tokens))
    }

    /// Removes the member (or blanks the array element, to keep later indices stable) that the
    /// pointer names; a pointer to nothing changes nothing.
    fn blank(&self, root: &mut Canon) {
        let Some((last, parents)) = self.0.split_last() else { return };
        let mut node = root;
        for token in parents {
            let next = match node {
                Canon::Object(members) => member(members, token).map(|i| &mut members[i].1),
                Canon::Array(items) => token.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
                _ => None,
            };
            match next {
                Some(child) => node = child,
                None => return,
            }
        }
        match node {
            Canon::Object(members) => {
                if let Some(i) = member(members, last) {
                    members.remove(i);
                }
            }
            Canon::Array(items) => {
                if let Some(item) = last.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                    *item = Canon::Null;
                }
            }
            _ => {}
        }
    }
}

/// The index of the member `name` in a sorted object.
fn member(members: &[(Cow<'_, str>, Canon<'_>)], name: &str) -> Option<usize> {
    members.binary_search_by(|(candidate, _)| candidate.as_ref().cmp(name)).ok()
}

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

    /// Found by `fuzz/`: without correctly rounded float parsing, an integer beyond 64 bits and its
    /// shortest float spelling could parse to neighbouring doubles and fingerprint differently.
    #[test]
    fn big_integers_and_their_float_spelling_agree() {
        let big = "1111111111555555555555555";
        let respelled = serde_json::to_string(&serde_json::from_str::<serde_json::Value>(big).expect("valid"));
        assert_eq!(fp(big), fp(&respelled.expect("serializable")));
    }

    /// Fingerprints are stored in both tiers: the canonical form must never change across versions, or
    /// retries that span an upgrade would be refused as mismatches.
    #[test]
    fn fingerprints_are_a_stored_format() {
        let golden = [
            (
                r#"{"amount":1200,"currency":"EUR","customer":{"id":"cus_1"},"items":[1,2.5,-3,true,null,[],{}]}"#,
                "de6d95321feefe4df4205416bf9b2f37944d1144bf01eafabc9eb2499639abe5",
            ),
            (
                r#"{"b":"quote \" backslash \\ tab \t nul \u0000 bell \u0007","a":"é ü 日本 🎉 \ud83c\udf89"}"#,
                "d14938111673ff62920231ab3915827e670590c485794efffb8a73c9cfcffe2f",
            ),
            (
                r#"[0,-0,-0.0,1e0,1.5e3,1e-7,1e21,1e300,18446744073709551615,-9223372036854775808,123456789012345678901234567890]"#,
                "0fa092f3c0e405784b52288d4f43252c294c860ecf6ee8daa49c62829b0a76e7",
            ),
            (
                r#"{"z":1,"é":2,"Z":3,"a b":4,"a\nb":5,"":6,"aa":7,"a":8}"#,
                "5e983d579120fd406aff1d7ad87d928a08193d35bf5b0ee00ed0c1b8db301ae9",
            ),
            (r#""just a string""#, "9bcf318e16d168781747d788c05ae170d43178940982410bfd90246ff4be00ec"),
            (
                r#"[[[[{"deep":[{"x":{"y":[]}}]}]]]]"#,
                "ac9427bd1b6b0a355ab3c1ed12aec471d71145f8ddb4b9ddbac066ed488d1091",
            ),
        ];
        for (body, hex) in golden {
            assert_eq!(fp(body).as_hex(), hex, "{body}");
        }
        let options = FingerprintOptions::default().ignore_field("/meta/ts").and_then(|o| o.ignore_field("/items/1"));
        let ignored = Fingerprint::of_json(br#"{"meta":{"ts":5,"id":1},"items":[1,2,3]}"#, &options.expect("pointers"));
        assert_eq!(
            ignored.expect("valid").as_hex(),
            "93cb7b9205ef87799a3f3b30cc6b728ff8dc6b1645e661a0c1ed33dd757d4a8e"
        );
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
        assert!(matches!(Fingerprint::of_json(b"1e400", &options), Err(InputError::InvalidJson(_))));
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
            parse(&compact, 64).expect("valid").write(&mut canonical);
            let reparsed: serde_json::Value = serde_json::from_slice(&canonical).expect("canonical form is JSON");
            let mut again = Vec::new();
            parse(&serde_json::to_vec(&reparsed).expect("ser"), 64).expect("valid").write(&mut again);
            prop_assert_eq!(canonical, again);
        }

        /// Two payloads share a fingerprint exactly when their canonical values are equal.
        #[test]
        fn different_values_differ(a in json_value(), b in json_value()) {
            let (a, b) = (serde_json::to_vec(&a).expect("ser"), serde_json::to_vec(&b).expect("ser"));
            let options = FingerprintOptions::default();
            let same_value = parse(&a, 64).ok() == parse(&b, 64).ok();
            let same_fingerprint = Fingerprint::of_json(&a, &options).ok() == Fingerprint::of_json(&b, &options).ok();
            prop_assert_eq!(same_fingerprint, same_value);
        }
    }
}
