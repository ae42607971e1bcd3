//! The canonicalizer on arbitrary bytes: a typed answer, never a panic or a stack overflow, the same
//! fingerprint for the same input (no hidden state, no unordered iteration), and every document
//! `serde_json` accepts is accepted (unless over the limits, repeating a member, or with an exponent
//! beyond 18 digits).
#![no_main]

use idemstore::{Fingerprint, FingerprintOptions, InputError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let options = FingerprintOptions::default().with_max_depth(32).with_max_bytes(64 << 10);
    let first = Fingerprint::of_json(data, &options);
    let second = Fingerprint::of_json(data, &options);
    assert_eq!(first.as_ref().ok(), second.as_ref().ok());
    // Exponents beyond 18 digits are refused on purpose (serde_json reads them as 0 or infinity).
    if serde_json::from_slice::<serde_json::Value>(data).is_ok() && !has_huge_exponent(data) {
        assert!(
            matches!(
                first,
                Ok(_) | Err(InputError::TooDeep { .. } | InputError::DuplicateMember { .. })
            ),
            "{first:?}"
        );
    }
});

/// Whether an `e` or `E` is followed (after an optional sign and leading zeros) by more than 18 digits.
fn has_huge_exponent(data: &[u8]) -> bool {
    data.iter().enumerate().any(|(at, &b)| {
        if b != b'e' && b != b'E' {
            return false;
        }
        let rest = &data[at + 1..];
        let rest = rest.strip_prefix(b"-").or_else(|| rest.strip_prefix(b"+")).unwrap_or(rest);
        let digits = rest.iter().skip_while(|&&d| d == b'0').take_while(|d| d.is_ascii_digit()).count();
        digits > 18
    })
}
