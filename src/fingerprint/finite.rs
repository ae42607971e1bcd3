//! Finds the floats JSON cannot hold (NaN, ±infinity) in a value before it is serialized: `serde_json`
//! writes them as `null`, so `{"x": NaN}` would fingerprint as `{"x": null}`, the fingerprint of another
//! request.

use std::fmt;

use serde::ser::{self, Serialize};

/// Whether `value` holds no NaN or infinite float. Other serialization errors are left to `serde_json`.
pub(crate) fn is_finite<T: Serialize + ?Sized>(value: &T) -> bool {
    !matches!(value.serialize(Check), Err(Checked::NonFinite))
}

/// What a check ended with (an error type of its own, so that `serde`'s other errors stay apart).
#[derive(Debug)]
enum Checked {
    NonFinite,
    Other,
}

impl fmt::Display for Checked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl std::error::Error for Checked {}

impl ser::Error for Checked {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Checked::Other
    }
}

/// A serializer that writes nothing and only looks at floats.
struct Check;

fn float(value: f64) -> Result<(), Checked> {
    if value.is_finite() { Ok(()) } else { Err(Checked::NonFinite) }
}

macro_rules! accept {
    ($($method:ident($($arg:ty),*)),* $(,)?) => {
        $(fn $method(self, $(_: $arg),*) -> Result<(), Checked> { Ok(()) })*
    };
}

impl ser::Serializer for Check {
    type Ok = ();
    type Error = Checked;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = Self;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    accept!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_none(),
        serialize_unit(),
        serialize_unit_struct(&'static str),
        serialize_unit_variant(&'static str, u32, &'static str),
    );

    fn serialize_f32(self, value: f32) -> Result<(), Checked> {
        float(f64::from(value))
    }

    fn serialize_f64(self, value: f64) -> Result<(), Checked> {
        float(value)
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Checked> {
        value.serialize(Check)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result<(), Checked> {
        value.serialize(Check)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Result<(), Checked> {
        value.serialize(Check)
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Self, Checked> {
        Ok(self)
    }

    fn serialize_tuple(self, _: usize) -> Result<Self, Checked> {
        Ok(self)
    }

    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Self, Checked> {
        Ok(self)
    }

    fn serialize_tuple_variant(self, _: &'static str, _: u32, _: &'static str, _: usize) -> Result<Self, Checked> {
        Ok(self)
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Self, Checked> {
        Ok(self)
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self, Checked> {
        Ok(self)
    }

    fn serialize_struct_variant(self, _: &'static str, _: u32, _: &'static str, _: usize) -> Result<Self, Checked> {
        Ok(self)
    }
}

/// Every compound checks its elements, keys and values alike.
macro_rules! compound {
    ($($trait:ident :: $method:ident $(($key:ty))?),* $(,)?) => {
        $(impl ser::$trait for Check {
            type Ok = ();
            type Error = Checked;

            fn $method<T: Serialize + ?Sized>(&mut self, $(_: $key,)? value: &T) -> Result<(), Checked> {
                value.serialize(Check)
            }

            fn end(self) -> Result<(), Checked> {
                Ok(())
            }
        })*
    };
}

compound!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
    SerializeStruct::serialize_field(&'static str),
    SerializeStructVariant::serialize_field(&'static str),
);

impl ser::SerializeMap for Check {
    type Ok = ();
    type Error = Checked;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Checked> {
        key.serialize(Check)
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Checked> {
        value.serialize(Check)
    }

    fn end(self) -> Result<(), Checked> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_floats_are_found_anywhere() {
        #[derive(serde::Serialize)]
        struct Charge {
            amount: f64,
            parts: Vec<Option<f32>>,
        }
        assert!(is_finite(&Charge { amount: 1.5, parts: vec![Some(2.0), None] }));
        assert!(!is_finite(&Charge { amount: f64::NAN, parts: vec![] }));
        assert!(!is_finite(&Charge { amount: 1.0, parts: vec![None, Some(f32::INFINITY)] }));
        assert!(!is_finite(&std::collections::BTreeMap::from([("x", f64::NEG_INFINITY)])));
        assert!(is_finite(&serde_json::json!({"x": [1, 2.5, null]})));
    }
}
