//! The canonicalizer on arbitrary bytes: a typed answer, never a panic or a stack overflow, the same
//! fingerprint for the same input (no hidden state, no unordered iteration), and every document
//! `serde_json` accepts is accepted (unless over the limits, or repeating a member).
#![no_main]

use idemstore::{Fingerprint, FingerprintOptions, InputError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let options = FingerprintOptions::default().with_max_depth(32).with_max_bytes(64 << 10);
    let first = Fingerprint::of_json(data, &options);
    let second = Fingerprint::of_json(data, &options);
    assert_eq!(first.as_ref().ok(), second.as_ref().ok());
    if serde_json::from_slice::<serde_json::Value>(data).is_ok() {
        assert!(
            matches!(
                first,
                Ok(_) | Err(InputError::TooDeep { .. } | InputError::DuplicateMember { .. })
            ),
            "{first:?}"
        );
    }
});
