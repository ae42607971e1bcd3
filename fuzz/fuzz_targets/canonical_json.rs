//! The canonicalizer on arbitrary bytes: a typed answer, never a panic or a stack overflow, and the
//! same fingerprint for the same input (no hidden state, no unordered iteration).
#![no_main]

use idemstore::{Fingerprint, FingerprintOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let options = FingerprintOptions::default().with_max_depth(32).with_max_bytes(64 << 10);
    let first = Fingerprint::of_json(data, &options);
    let second = Fingerprint::of_json(data, &options);
    assert_eq!(first.as_ref().ok(), second.as_ref().ok());
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data)
        && let Ok(fingerprint) = first
    {
        // Re-serializing the value changes the layout, never the fingerprint.
        let relaid = serde_json::to_vec_pretty(&value).expect("a parsed value serializes");
        assert_eq!(Fingerprint::of_json(&relaid, &options).ok(), Some(fingerprint));
    }
});
