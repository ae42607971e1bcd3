//! Who is asking and for what: the validated [`IdempotencyKey`] and the [`Scope`] (tenant + operation)
//! that together name one record.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::error::InputError;

/// A client-supplied idempotency key: 1 to 255 bytes of visible ASCII (0x21..=0x7E).
///
/// The bounds keep keys safe to log, to put in an HTTP header and to embed in a Redis key, and match what
/// the IETF Idempotency-Key draft and the major payment APIs accept.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The longest key accepted, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Validates `key`.
    ///
    /// # Errors
    /// [`InputError::EmptyKey`], [`InputError::KeyTooLong`] or [`InputError::KeyInvalidByte`].
    pub fn new(key: impl Into<String>) -> Result<Self, InputError> {
        let key = key.into();
        if key.is_empty() {
            return Err(InputError::EmptyKey);
        }
        if key.len() > Self::MAX_LEN {
            return Err(InputError::KeyTooLong { len: key.len() });
        }
        if let Some(offset) = key.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(InputError::KeyInvalidByte { offset });
        }
        Ok(Self(key))
    }

    /// The key as sent by the client.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A child key for one downstream call of this request (`"stripe.charge"`, `"email.receipt"`):
    /// the same on every retry and after every takeover, different per label, per key and per scope (so two
    /// tenants reusing a key never collide at a shared downstream account), and itself a valid
    /// Idempotency-Key. Pass it to every downstream API that accepts one.
    pub fn derive(&self, scope: &Scope, label: &str) -> IdempotencyKey {
        digest_key(b"idemstore-derive\0", "idem-", [scope.tenant(), scope.operation(), self.as_str(), label])
    }

    /// The key as the store keeps it for a request to `target` (a concrete path, such as
    /// `/accounts/A/transfers`), so that one key sent to two targets of one operation names two records:
    /// `<target>#<key>`, or `idem-t-` and a digest of both when that would be longer than 255 bytes or
    /// the target is not visible ASCII. The target is read in its one spelling first, as a router decodes
    /// it (an escape of a character that means the same encoded or not is decoded, `%2F` stays an
    /// escape, a character beyond ASCII is encoded), so that `/accounts/%41` and `/accounts/A`, one
    /// resource, are one key space. The HTTP layer keeps the keys of routes with path parameters this way
    /// ([`KeySpace::Target`](crate::http::KeySpace::Target)): look their records up in this form (in
    /// code, or with `idemctl inspect --target`).
    pub fn for_target(&self, target: &str) -> IdempotencyKey {
        let target = crate::target::path(target);
        let target = target.as_ref();
        let readable = target.len() + 1 + self.0.len() <= Self::MAX_LEN && target.bytes().all(|b| b.is_ascii_graphic());
        if readable {
            // A request target never holds '#' (it starts a fragment, which is never sent), so the
            // first '#' ends the target: no two (target, key) pairs give one form.
            return IdempotencyKey(format!("{target}#{}", self.0));
        }
        digest_key(b"idemstore-target\0", TARGET_DIGEST_PREFIX, [target, self.as_str()])
    }

    /// The key of an agent's tool call: the same for one run (or conversation), tool and arguments,
    /// whatever call id the model gave the call this turn, so that a call the agent emits again (after
    /// a timeout, a restart, a model that retries) is answered from the first one's record instead of
    /// acting twice. The arguments are JSON, compared by meaning under `options` (name the fields that
    /// decide with [`FingerprintOptions::compare_only`](crate::FingerprintOptions::compare_only) when the
    /// model rewords free text between calls); the key is `idem-tool-` and 64 hex digits.
    ///
    /// # Errors
    /// As [`Fingerprint::of_json`](crate::Fingerprint::of_json) for the arguments.
    pub fn for_tool_call(
        run: &str,
        tool: &str,
        arguments: &[u8],
        options: &crate::FingerprintOptions,
    ) -> Result<IdempotencyKey, InputError> {
        let arguments = crate::Fingerprint::of_json(arguments, options)?.to_hex();
        Ok(digest_key(b"idemstore-tool-call\0", "idem-tool-", [run, tool, &arguments]))
    }

    /// An outbox row's key: `outbox-<id>-<nonce>` (the nonce in hex), valid by construction.
    pub(crate) fn outbox(id: i64, nonce: i64) -> Self {
        IdempotencyKey(format!("outbox-{id}-{nonce:x}"))
    }
}

/// How a key qualified by a target begins when it is a digest ([`IdempotencyKey::for_target`]).
pub(crate) const TARGET_DIGEST_PREFIX: &str = "idem-t-";

/// The SHA-256 of `parts` under `domain`, each part length-prefixed, so that no two different inputs
/// hash the same bytes.
pub(crate) fn digest_of<const N: usize>(domain: &[u8], parts: [&str; N]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(domain);
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.finalize().into()
}

/// A key named by a digest of `parts` under `domain` ([`digest_of`]): `prefix` and 64 hex digits, a
/// valid key.
fn digest_key<const N: usize>(domain: &[u8], prefix: &str, parts: [&str; N]) -> IdempotencyKey {
    let mut digits = [0; 64];
    crate::fingerprint::write_hex(&digest_of(domain, parts), &mut digits);
    IdempotencyKey(format!("{prefix}{}", std::str::from_utf8(&digits).expect("hex digits are ASCII")))
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The namespace of a key: the tenant (the authenticated caller, supplied by the application and never
/// taken from the request) and the operation (a route or handler name).
///
/// Records are identified by (tenant, operation, key): two tenants that pick the same key never see
/// each other's records, and one key reused on two operations names two records.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: String,
    operation: String,
}

impl Scope {
    /// The longest tenant or operation name accepted, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Validates both names: 1 to 255 bytes of UTF-8 without control characters.
    ///
    /// # Errors
    /// [`InputError::InvalidScope`], naming the field that was refused.
    pub fn new(tenant: impl Into<String>, operation: impl Into<String>) -> Result<Self, InputError> {
        let tenant = tenant.into();
        let operation = operation.into();
        validate_name("tenant", &tenant)?;
        validate_name("operation", &operation)?;
        Ok(Self { tenant, operation })
    }

    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The operation.
    pub fn operation(&self) -> &str {
        &self.operation
    }
}

/// A name of 1 to 255 bytes of UTF-8 without control characters (tenants, operations, outbox topics).
pub(crate) fn validate_name(field: &'static str, name: &str) -> Result<(), InputError> {
    let reason = if name.is_empty() {
        "it is empty"
    } else if name.len() > Scope::MAX_LEN {
        "it is longer than 255 bytes"
    } else if name.chars().any(char::is_control) {
        "it contains a control character"
    } else {
        return Ok(());
    };
    Err(InputError::InvalidScope { field, reason })
}

/// Names a key in Redis (its record's name), its tombstone in Postgres and notifications: 32 hex digits
/// (128 bits) of SHA-256 over its length-prefixed tenant, operation and key, as `idempotency_key_digest`
/// in Postgres (whose length prefixes count UTF-8 bytes, as `str::len` does). No tenant can
/// name another tenant's key: that takes a second preimage (2^128 work), and even an accidental collision
/// replays only to a request with the same payload fingerprint.
pub(crate) fn key_digest(scope: &Scope, key: &IdempotencyKey) -> KeyDigest {
    let (tenant, operation) = (scope.tenant(), scope.operation());
    let mut hasher = Sha256::new();
    for (name, separator) in [(tenant, ":"), (operation, ":")] {
        hasher.update(decimal(name.len(), &mut [0; 20]));
        hasher.update(b":");
        hasher.update(name);
        hasher.update(separator);
    }
    hasher.update(key.as_str());
    let mut digits = [0; 32];
    crate::fingerprint::write_hex(&hasher.finalize()[..16], &mut digits);
    KeyDigest(digits)
}

/// A key's digest ([`key_digest`]), on the stack: the hot path formats it into a Redis name or binds it
/// as it is, without an allocation of its own.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyDigest([u8; 32]);

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyDigest({})", self.as_str())
    }
}

impl KeyDigest {
    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("hex digits are ASCII")
    }
}

impl std::fmt::Display for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `n` in decimal digits, written at the end of `buffer`.
fn decimal(mut n: usize, buffer: &mut [u8; 20]) -> &[u8] {
    let mut start = buffer.len();
    loop {
        start -= 1;
        buffer[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buffer[start..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The digest hashes the same bytes as the length-prefixed name written out (which Postgres's
        /// `idempotency_key_digest` hashes).
        #[test]
        fn digests_the_length_prefixed_name(tenant in "\\PC{1,40}", operation in "\\PC{1,40}") {
            let scope = Scope::new(tenant.clone(), operation.clone()).expect("scope");
            let key = IdempotencyKey::new("key-1").expect("key");
            let prefixed = format!("{}:{tenant}:{}:{operation}:key-1", tenant.len(), operation.len());
            let mut digits = [0; 32];
            crate::fingerprint::write_hex(&Sha256::digest(prefixed)[..16], &mut digits);
            let digest = key_digest(&scope, &key);
            prop_assert_eq!(digest.as_str(), std::str::from_utf8(&digits).expect("hex"));
        }

        /// A key is accepted exactly when it is 1 to 255 bytes of visible ASCII.
        #[test]
        fn accepts_exactly_visible_ascii_up_to_255_bytes(key in "(\\PC|[ \t\x00-\x1f\x7f]){0,300}") {
            let valid = (1..=255).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic());
            prop_assert_eq!(IdempotencyKey::new(key.clone()).is_ok(), valid, "{:?}", key);
        }
    }

    #[test]
    fn keys_are_visible_ascii_of_bounded_length() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new("x".repeat(255)).is_ok());
        assert!(IdempotencyKey::new("8e2c-4b1f_~!{}").is_ok());
        assert!(matches!(IdempotencyKey::new(""), Err(InputError::EmptyKey)));
        assert!(matches!(IdempotencyKey::new("x".repeat(256)), Err(InputError::KeyTooLong { len: 256 })));
        for bad in ["a b", "a\tb", "aä", "a\u{7f}", "a\0"] {
            assert!(matches!(IdempotencyKey::new(bad), Err(InputError::KeyInvalidByte { offset: 1 })), "{bad:?}");
        }
    }

    #[test]
    fn tool_call_keys_follow_run_tool_and_arguments_not_their_spelling() {
        let options = crate::FingerprintOptions::default();
        let key =
            |run, tool, args: &str| IdempotencyKey::for_tool_call(run, tool, args.as_bytes(), &options).expect("JSON");
        let first = key("run-1", "transfer", r#"{"to":"ana","amount":5}"#);
        assert_eq!(first, key("run-1", "transfer", r#"{ "amount": 5.0, "to": "ana" }"#));
        assert_ne!(first, key("run-2", "transfer", r#"{"to":"ana","amount":5}"#));
        assert_ne!(first, key("run-1", "refund", r#"{"to":"ana","amount":5}"#));
        assert_ne!(first, key("run-1", "transfer", r#"{"to":"ana","amount":6}"#));
        assert!(first.as_str().starts_with("idem-tool-") && IdempotencyKey::new(first.as_str()).is_ok());
        assert!(IdempotencyKey::for_tool_call("run", "tool", b"not json", &options).is_err());
    }

    #[test]
    fn derived_keys_are_stable_distinct_and_valid() {
        let (acme, other) =
            (Scope::new("acme", "charge").expect("scope"), Scope::new("other", "charge").expect("scope"));
        let key = IdempotencyKey::new("order-1").expect("key");
        let child = key.derive(&acme, "stripe.charge");
        assert_eq!(child, key.derive(&acme, "stripe.charge"), "stable across retries");
        assert!(IdempotencyKey::new(child.as_str()).is_ok(), "a valid key itself");
        let others = [
            key.derive(&acme, "email.receipt"),
            key.derive(&other, "stripe.charge"),
            IdempotencyKey::new("order-2").expect("key").derive(&acme, "stripe.charge"),
            child.derive(&acme, "stripe.charge"),
        ];
        assert!(others.iter().all(|o| *o != child), "{others:?}");
    }

    #[test]
    fn keys_for_targets_are_readable_valid_and_distinct() {
        let key = IdempotencyKey::new("t1").expect("key");
        assert_eq!(key.for_target("/accounts/A/transfers").as_str(), "/accounts/A/transfers#t1");
        let long = IdempotencyKey::new("k".repeat(255)).expect("key");
        let forms = [
            key.for_target("/accounts/B/transfers"),
            long.for_target("/accounts/A/transfers"),
            key.for_target(&format!("/{}", "a".repeat(300))),
            key.for_target("/accounts/ä/transfers"),
            IdempotencyKey::new("t2").expect("key").for_target("/accounts/A/transfers"),
        ];
        for form in &forms {
            assert!(IdempotencyKey::new(form.as_str()).is_ok(), "a valid key: {form:?}");
        }
        assert!(forms[1].as_str().starts_with("idem-t-"));
        assert_eq!(forms[3].as_str(), "/accounts/%C3%A4/transfers#t1");
        let mut all = forms.to_vec();
        all.push(key.for_target("/accounts/A/transfers"));
        all.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        all.dedup();
        assert_eq!(all.len(), forms.len() + 1, "one form per (target, key)");
    }

    /// One resource spelled with and without percent-encoding is one key space (before: `%41` and `A`
    /// named two records, so a retry through a proxy that normalizes the path ran the work again); a
    /// reserved character encoded stays distinct from the character itself (`crate::target` has the
    /// rules).
    #[test]
    fn a_target_is_compared_in_its_one_spelling() {
        let key = IdempotencyKey::new("t1").expect("key");
        assert_eq!(key.for_target("/accounts/%41/transfers"), key.for_target("/accounts/A/transfers"));
        assert_eq!(key.for_target("/a/b%2Bc"), key.for_target("/a/b+c"));
        assert_eq!(key.for_target("/a/%2f").as_str(), "/a/%2F#t1");
        assert_ne!(key.for_target("/a/B%2FC"), key.for_target("/a/B/C"));
        assert_eq!(key.for_target("/a/%zz").as_str(), "/a/%25zz#t1");
    }

    #[test]
    fn scope_names_are_bounded_and_free_of_control_characters() {
        assert!(Scope::new("acme", "POST /payments").is_ok());
        assert!(Scope::new("tenant-é", "op").is_ok());
        for (tenant, operation, field) in [
            ("", "op", "tenant"),
            ("t", "", "operation"),
            ("t\n", "op", "tenant"),
            ("t", &*"o".repeat(256), "operation"),
        ] {
            match Scope::new(tenant, operation) {
                Err(InputError::InvalidScope { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{tenant:?}/{operation:?}: {other:?}"),
            }
        }
    }
}
