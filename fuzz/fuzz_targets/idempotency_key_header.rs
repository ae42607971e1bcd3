//! The `Idempotency-Key` header parser on arbitrary bytes: a key or a refusal, never a panic; every key
//! it accepts is a valid key, and the bare form of an accepted key parses to the same key.
#![no_main]

use idemstore::IdempotencyKey;
use idemstore::http::fuzz_read_key;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(key) = fuzz_read_key(data) {
        assert!(IdempotencyKey::new(key.as_str()).is_ok(), "{key:?}");
        if !(key.starts_with('"') && key.ends_with('"')) {
            assert_eq!(fuzz_read_key(key.as_bytes()).as_deref(), Some(key.as_str()));
        }
    }
});
