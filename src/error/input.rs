//! What the caller sent and the store refused before reading or writing anything.
//!
//! A module of its own, free of the rest of the crate: CI compiles the fingerprint code with it alone
//! (with `serde_json/arbitrary_precision`; .ci/fingerprint-precision) instead of the whole library.

/// The input was refused before anything was read or written.
///
/// Nothing already stored is touched when one of these is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InputError {
    /// The idempotency key is the empty string.
    #[error("the idempotency key is empty")]
    EmptyKey,
    /// The idempotency key is longer than [`crate::IdempotencyKey::MAX_LEN`] bytes.
    #[error("the idempotency key is {len} bytes long; at most 255 are allowed")]
    KeyTooLong {
        /// Length of the refused key, in bytes.
        len: usize,
    },
    /// The idempotency key holds a byte that is not visible ASCII (0x21..=0x7E).
    #[error("the idempotency key has a byte outside visible ASCII at offset {offset}")]
    KeyInvalidByte {
        /// Byte offset of the first refused byte.
        offset: usize,
    },
    /// The tenant or operation name of a [`crate::Scope`], or an outbox topic, is empty, too long or holds
    /// a control character.
    #[error("the {field} is invalid: {reason}")]
    InvalidScope {
        /// `"tenant"`, `"operation"` or `"topic"`.
        field: &'static str,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The payload is larger than the operation's limit.
    #[error("the payload is {len} bytes; the limit is {limit}")]
    PayloadTooLarge {
        /// Length of the refused payload, in bytes.
        len: usize,
        /// The configured limit, in bytes.
        limit: usize,
    },
    /// The JSON payload nests arrays or objects deeper than the operation's limit.
    #[error("the JSON payload nests deeper than {limit} levels")]
    TooDeep {
        /// The configured depth limit.
        limit: usize,
    },
    /// A JSON object in the payload names the same member twice, which parsers resolve differently.
    #[error("a JSON object in the payload has the member {name:?} twice")]
    DuplicateMember {
        /// The repeated member name.
        name: String,
    },
    /// The payload is not valid JSON.
    #[error("the payload is not valid JSON")]
    InvalidJson(#[source] serde_json::Error),
    /// The payload holds NaN or an infinite number, which JSON cannot represent (`serde_json` would
    /// write it as `null`).
    #[error("the payload holds NaN or an infinite number")]
    NonFiniteNumber,
    /// An inbox with a verifier ([`crate::Inbox::verified_by`]) was given a bare event id, or a delivery
    /// another verifier checked ([`crate::Inbox::receive`]): it takes only what its own verifier
    /// checked ([`crate::Inbox::verify`]).
    #[error("this inbox takes only deliveries its own verifier checked")]
    UnverifiedDelivery,
    /// A batch claim ([`crate::Store::begin_many`]) of more items than one statement takes.
    #[error("the batch has {items} items; at most {max} are claimed at once")]
    BatchTooLarge {
        /// Items in the refused batch.
        items: usize,
        /// The most one batch may hold.
        max: usize,
    },
    /// A key derived from named fields ([`crate::DerivedKeys::of_fields`]) was asked of a payload that
    /// holds none of them, or is not JSON: it would name one key for every such payload.
    #[error("the payload holds none of the fields its idempotency key is derived from; send an Idempotency-Key")]
    KeyFieldsMissing,
    /// An ignored-field entry is not an RFC 6901 JSON pointer to a member or element.
    #[error("{pointer:?} is not a JSON pointer to a field (it must start with '/')")]
    InvalidPointer {
        /// The refused pointer.
        pointer: String,
    },
}
