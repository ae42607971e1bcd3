//! The Lua scripts of `lua/`, loaded once, and the one place their replies are decoded.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value};

pub(crate) static BEGIN: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../../lua/begin.lua")));
pub(crate) static PUT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../../lua/put.lua")));
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../../lua/release.lua")));
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../../lua/extend.lua")));

/// The answer of `begin.lua`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RedisBegin {
    Claimed,
    /// Redis cannot tell (an unconfirmed marker of another payload): Postgres decides, no marker written.
    Unconfirmed,
    Mismatch,
    InFlight {
        retry_after: Duration,
    },
    Completed(Vec<u8>),
    Indeterminate,
}

/// A reply that does not follow a script's contract (a different script under the same SHA, a proxy
/// in the way): treated like any other Redis failure, so the request takes the Postgres path.
#[derive(Debug, thiserror::Error)]
#[error("unexpected reply from begin.lua: {0:?}")]
pub(crate) struct UnexpectedReply(Value);

impl RedisBegin {
    pub(crate) fn decode(reply: Value) -> Result<Self, UnexpectedReply> {
        let Value::Array(items) = &reply else { return Err(UnexpectedReply(reply)) };
        let answer = match items.as_slice() {
            [Value::BulkString(tag)] => match tag.as_slice() {
                b"claimed" => Some(RedisBegin::Claimed),
                b"unconfirmed" => Some(RedisBegin::Unconfirmed),
                b"mismatch" => Some(RedisBegin::Mismatch),
                b"indeterminate" => Some(RedisBegin::Indeterminate),
                _ => None,
            },
            [Value::BulkString(tag), Value::Int(pttl)] if tag == b"in_flight" => {
                // PTTL is -1/-2 for a key without expiry or already gone: retry at once.
                let millis = u64::try_from(*pttl).unwrap_or(0);
                Some(RedisBegin::InFlight { retry_after: Duration::from_millis(millis) })
            }
            [Value::BulkString(tag), Value::BulkString(response)] if tag == b"completed" => {
                Some(RedisBegin::Completed(response.clone()))
            }
            _ => None,
        };
        answer.ok_or(UnexpectedReply(reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    #[test]
    fn decodes_every_answer_of_the_contract() {
        let cases = [
            (vec![bulk(b"claimed")], RedisBegin::Claimed),
            (vec![bulk(b"mismatch")], RedisBegin::Mismatch),
            (vec![bulk(b"unconfirmed")], RedisBegin::Unconfirmed),
            (vec![bulk(b"indeterminate")], RedisBegin::Indeterminate),
            (
                vec![bulk(b"in_flight"), Value::Int(1500)],
                RedisBegin::InFlight { retry_after: Duration::from_millis(1500) },
            ),
            (vec![bulk(b"in_flight"), Value::Int(-2)], RedisBegin::InFlight { retry_after: Duration::ZERO }),
            (vec![bulk(b"completed"), bulk(b"\0{\"id\":1}")], RedisBegin::Completed(b"\0{\"id\":1}".to_vec())),
            (vec![bulk(b"completed"), bulk(b"")], RedisBegin::Completed(Vec::new())),
        ];
        for (reply, expected) in cases {
            assert_eq!(RedisBegin::decode(Value::Array(reply)).expect("valid reply"), expected);
        }
    }

    #[test]
    fn refuses_replies_outside_the_contract() {
        for reply in [
            Value::Nil,
            Value::Okay,
            Value::Array(vec![]),
            Value::Array(vec![bulk(b"executed")]),
            Value::Array(vec![bulk(b"completed")]),
            Value::Array(vec![bulk(b"in_flight"), bulk(b"soon")]),
        ] {
            assert!(RedisBegin::decode(reply).is_err());
        }
    }
}
