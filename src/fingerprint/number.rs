//! The canonical spelling of a JSON number, from its text.

use std::fmt::Write as _;

use crate::error::InputError;

/// The exact decimal value, one spelling per value and never through `f64`. The significant
/// digits without leading or trailing zeros, then `e` and the power of ten: `100`, `1e2` and `1.00e2` are
/// all `1e2`, `-0.0` is `0`. At most 21 bytes longer than the number's text (so `1e308` stays short).
///
/// # Errors
/// [`InputError::InvalidJson`] for an exponent beyond 18 digits.
pub(super) fn write_exact(text: &str, out: &mut Vec<u8>) -> Result<(), InputError> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], &unsigned[at + 1..]),
        None => (unsigned, "0"),
    };
    let (integer, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let exponent = exponent.strip_prefix('+').unwrap_or(exponent);
    let (exponent_negative, exponent_digits) = match exponent.strip_prefix('-') {
        Some(rest) => (true, rest.trim_start_matches('0')),
        None => (false, exponent.trim_start_matches('0')),
    };
    if exponent_digits.len() > 18 {
        return Err(InputError::InvalidJson(serde::de::Error::custom(format_args!(
            "the exponent of {}... is out of range",
            &text[..text.len().min(24)]
        ))));
    }
    let magnitude: i64 = if exponent_digits.is_empty() { 0 } else { exponent_digits.parse().unwrap_or(0) };
    let digits = || integer.bytes().chain(fraction.bytes());
    let leading = digits().take_while(|&d| d == b'0').count();
    let significant = integer.len() + fraction.len() - leading;
    if significant == 0 {
        out.push(b'0');
        return Ok(());
    }
    let trailing = digits().rev().take_while(|&d| d == b'0').count();
    // Bodies are bounded, so the digit counts are far below 2^62; the exponent is below 10^18.
    let power = (if exponent_negative { -magnitude } else { magnitude }) - fraction.len() as i64 + trailing as i64;
    if negative {
        out.push(b'-');
    }
    out.extend(digits().skip(leading).take(significant - trailing));
    let _ = write!(Utf8(out), "e{power}");
    Ok(())
}

/// `fmt::Write` into a byte buffer (writing into a `Vec` cannot fail).
struct Utf8<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for Utf8<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(text: &str) -> String {
        let mut out = Vec::new();
        write_exact(text, &mut out).expect("in range");
        String::from_utf8(out).expect("ASCII")
    }

    #[test]
    fn one_exact_spelling_per_value() {
        for (same, form) in [
            (&["1", "1.0", "1e0", "10e-1", "0.1e1", "1.000E+0"][..], "1e0"),
            (&["100", "1e2", "1.00e2", "0100e0"][..], "1e2"),
            (&["0", "-0", "0.0", "-0.0e5", "0e-7"][..], "0"),
            (&["-1.5", "-15e-1", "-0.15E1"][..], "-15e-1"),
            (&["100000000000000000001"][..], "100000000000000000001e0"),
            (&["1e308"][..], "1e308"),
            (&["1e400", "10e399"][..], "1e400"),
            (&["0.30000000000000000000000000001"][..], "30000000000000000000000000001e-29"),
        ] {
            for text in same {
                assert_eq!(exact(text), form, "{text}");
            }
        }
        assert_ne!(exact("100000000000000000001"), exact("100000000000000000000"));
        assert!(write_exact("1e1234567890123456789", &mut Vec::new()).is_err());
        assert_eq!(exact("1e000000000000000000000000000001"), "1e1");
    }
}
