//! The library's fingerprint module and its tests, compiled from the library's own files.
#![allow(dead_code, unreachable_pub)]

#[path = "../../../src/error/input.rs"]
mod input;

mod error {
    pub use super::input::InputError;
}

#[path = "../../../src/fingerprint/mod.rs"]
mod fingerprint;
