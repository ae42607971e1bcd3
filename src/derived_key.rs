//! Keys derived from what a request says, for callers that send none or a new one on every retry (an
//! agent's re-emitted tool call, a webhook sender that changes its event id, an upstream that retries
//! without a key): the request's duplicates are recognized within a window, as a queue deduplicates
//! by content.
//!
//! Opt-in per operation, and wrong where two identical requests are both meant (two equal payments in
//! a minute): the window limits how long two such requests are taken for one, and naming the fields
//! that make a request distinct (an order number, an account and an amount, not free text a model
//! rewords) decides what "identical" means. A key the client sends always wins.

use std::time::Duration;

use crate::error::InputError;
use crate::fingerprint::{Fingerprint, FingerprintOptions, JsonPointer};
use crate::key::IdempotencyKey;
use crate::policy::Policy;

/// How a key-less request's key is derived, and for how long its duplicates are answered.
///
/// ```
/// use std::time::Duration;
/// use idemstore::{DerivedKeys, FingerprintOptions, Policy};
///
/// let derived = DerivedKeys::of_fields(["/order", "/amount"], Duration::from_secs(300))?;
/// let delivery = br#"{"order": "A-17", "amount": 1200, "note": "reworded each retry"}"#;
/// let (key, fingerprint) = derived.derive_json(delivery, &FingerprintOptions::default())?;
/// let retry = br#"{"note": "said another way", "amount": 1200, "order": "A-17"}"#;
/// assert_eq!(derived.derive_json(retry, &FingerprintOptions::default())?, (key, fingerprint));
/// // Claims of these keys run under this policy: the record answers for five minutes, then the key is free.
/// let policy = derived.policy(&Policy::default());
/// assert_eq!(policy.retention(), Some(Duration::from_secs(300)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DerivedKeys {
    /// The fields compared; none: the whole canonical payload.
    fields: Vec<JsonPointer>,
    window: Duration,
}

impl DerivedKeys {
    /// How a derived key begins: no key the store derives for itself starts so, but a client may send
    /// one (it names a record of its own tenant only).
    pub const PREFIX: &'static str = "idem-d-";

    /// Keys derived from the whole canonical payload (a JSON body by its meaning, any other byte for
    /// byte): any difference makes another request.
    pub fn of_payload(window: Duration) -> Self {
        Self { fields: Vec::new(), window }
    }

    /// Keys derived from the named fields of a JSON payload (RFC 6901 pointers, such as `/order` or
    /// `/items/0/sku`), in this order; the rest of the payload is not compared, so a retry that rewords
    /// a note is the same request. A missing field takes part as missing (not as `null`): two payloads
    /// that both lack it, and agree on the others, are one request. A payload with none of them, or one
    /// that is not JSON, is refused ([`InputError::KeyFieldsMissing`]).
    ///
    /// # Errors
    /// [`InputError::InvalidPointer`] for a pointer that does not start with `/`.
    pub fn of_fields<'p>(fields: impl IntoIterator<Item = &'p str>, window: Duration) -> Result<Self, InputError> {
        let fields = fields.into_iter().map(JsonPointer::parse).collect::<Result<Vec<_>, _>>()?;
        Ok(Self { fields, window })
    }

    /// How long a request's duplicates are answered, counted from its completion; the record's
    /// retention, when shorter, bounds it.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Whether the key is derived from named fields rather than the whole payload.
    pub fn compares_fields(&self) -> bool {
        !self.fields.is_empty()
    }

    /// The fingerprint options a request's fingerprint is taken under: `base` (its limits and ignored
    /// fields), comparing only the named fields when there are any.
    pub fn fingerprint_options(&self, base: &FingerprintOptions) -> FingerprintOptions {
        match self.fields.is_empty() {
            true => base.clone(),
            false => base.deriving_keys_from(&self.fields),
        }
    }

    /// The key a request with this fingerprint (taken under [`DerivedKeys::fingerprint_options`]) is
    /// stored under: [`DerivedKeys::PREFIX`] and the fingerprint's digits.
    pub fn key(fingerprint: &Fingerprint) -> IdempotencyKey {
        IdempotencyKey::new(format!("{}{}", Self::PREFIX, fingerprint.to_hex())).expect("hex digits make a valid key")
    }

    /// The key and fingerprint of a JSON payload (a message, a webhook delivery).
    ///
    /// # Errors
    /// As [`Fingerprint::of_json`]; [`InputError::KeyFieldsMissing`] when the payload holds none of
    /// the named fields.
    pub fn derive_json(
        &self,
        payload: &[u8],
        options: &FingerprintOptions,
    ) -> Result<(IdempotencyKey, Fingerprint), InputError> {
        let fingerprint = Fingerprint::of_json(payload, &self.fingerprint_options(options))?;
        Ok((Self::key(&fingerprint), fingerprint))
    }

    /// The policy derived keys are claimed under: `base`, its retention and Redis TTL cut to the
    /// window, and no tombstone, so that a key is free again once the window has passed
    /// ([`Policy::tombstone`]). A window no longer than the lease is taken as just past it: a
    /// duplicate is answered while its first request runs, however short the window.
    pub fn policy(&self, base: &Policy) -> Policy {
        let window = self.window.clamp(base.lease + Duration::from_millis(1), crate::policy::MAX_POLICY_DURATION);
        let retention = base.retention.map_or(window, |retention| retention.min(window));
        Policy {
            redis_ttl: base.redis_ttl.min(retention),
            retention: Some(retention),
            tombstone: Some(Duration::ZERO),
            ..base.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyBuilder;

    fn options() -> FingerprintOptions {
        FingerprintOptions::default()
    }

    #[test]
    fn fields_alone_name_the_key_and_missing_ones_take_part() {
        let derived = DerivedKeys::of_fields(["/to", "/amount"], Duration::from_secs(60)).expect("pointers");
        let key = |body: &[u8]| derived.derive_json(body, &options()).map(|(key, _)| key);
        let first = key(br#"{"to":"ana","amount":5,"memo":"hi"}"#).expect("derived");
        assert_eq!(key(br#"{"amount":5.0,"to":"ana","memo":"hello"}"#).expect("derived"), first);
        assert_ne!(key(br#"{"to":"ana","amount":6}"#).expect("derived"), first);
        assert_ne!(key(br#"{"to":"ana"}"#).expect("derived"), key(br#"{"to":"ana","amount":null}"#).expect("derived"));
        assert!(first.as_str().starts_with(DerivedKeys::PREFIX));
        assert!(matches!(key(br#"{"memo":"hi"}"#), Err(InputError::KeyFieldsMissing)));
        assert!(matches!(key(b"not json"), Err(InputError::InvalidJson(_))));
        let bytes = Fingerprint::of_bytes(b"x", &derived.fingerprint_options(&options()));
        assert!(matches!(bytes, Err(InputError::KeyFieldsMissing)), "a key from fields needs JSON");
    }

    #[test]
    fn the_whole_payload_names_the_key_without_fields() {
        let derived = DerivedKeys::of_payload(Duration::from_secs(60));
        let key = |body: &[u8]| derived.derive_json(body, &options()).map(|(key, _)| key).expect("derived");
        assert_eq!(key(br#"{"a":1,"b":2}"#), key(br#"{"b":2,"a":1}"#));
        assert_ne!(key(br#"{"a":1,"b":2}"#), key(br#"{"a":1,"b":3}"#));
    }

    #[test]
    fn the_policy_keeps_records_for_the_window_and_no_tombstone() {
        let minute = Duration::from_secs(60);
        let policy = DerivedKeys::of_payload(minute).policy(&Policy::default());
        assert_eq!(
            (policy.retention(), policy.redis_ttl(), policy.tombstone()),
            (Some(minute), minute, Some(Duration::ZERO))
        );
        let short = Policy::builder().lease(Duration::from_secs(1)).redis_ttl(Duration::from_secs(5)).build();
        let policy = DerivedKeys::of_payload(minute).policy(&short.expect("valid"));
        assert_eq!(policy.redis_ttl(), Duration::from_secs(5), "a shorter Redis TTL stays");
        let within_lease = DerivedKeys::of_payload(Duration::from_secs(10)).policy(&Policy::default());
        let past_lease = Duration::from_millis(30_001);
        assert_eq!((within_lease.retention(), within_lease.redis_ttl()), (Some(past_lease), past_lease));
        assert!(PolicyBuilder::from(within_lease).build().is_ok(), "a valid policy");
    }
}
