//! The Lua scripts of `lua/`, called by their SHA, and the one place their replies are decoded.

use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{ErrorKind, RedisResult, ServerErrorKind, Value};

pub(crate) static BEGIN: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(include_str!("../../lua/begin.lua")));
pub(crate) static PUT: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(include_str!("../../lua/put.lua")));
pub(crate) static RELEASE: LazyLock<LuaScript> =
    LazyLock::new(|| LuaScript::new(include_str!("../../lua/release.lua")));
pub(crate) static EXTEND: LazyLock<LuaScript> = LazyLock::new(|| LuaScript::new(include_str!("../../lua/extend.lua")));

/// A script of one key, sent as `EVALSHA`, and as `EVAL` of its source where the server answers
/// NOSCRIPT (a restarted or flushed server, a cluster node that never saw it). `EVAL` goes to the key's
/// node and caches the script there; `redis::Script` would instead answer NOSCRIPT with `SCRIPT LOAD`,
/// which a cluster sends to every node and which fails while any node is down.
pub(crate) struct LuaScript {
    source: &'static str,
    sha: String,
}

impl LuaScript {
    fn new(source: &'static str) -> Self {
        Self { source, sha: redis::Script::new(source).get_hash().to_owned() }
    }

    pub(crate) async fn invoke(&self, conn: &mut impl ConnectionLike, key: &str, args: &[&[u8]]) -> RedisResult<Value> {
        let call = |command: &str, script: &str| {
            // Sized up front: one allocation each for the arguments and their bytes, none on the way.
            let bytes = command.len() + script.len() + 1 + key.len() + args.iter().map(|arg| arg.len()).sum::<usize>();
            let mut cmd = redis::Cmd::with_capacity(4 + args.len(), bytes);
            cmd.arg(command).arg(script).arg(1).arg(key);
            for arg in args {
                cmd.arg(*arg);
            }
            cmd
        };
        match call("EVALSHA", &self.sha).query_async(conn).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                call("EVAL", self.source).query_async(conn).await
            }
            answered => answered,
        }
    }
}

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
#[error("unexpected reply from begin.lua: {}", shape(.0))]
pub(crate) struct UnexpectedReply(Value);

/// A reply's shape for the log: its kinds and sizes, never its bytes (they may be a stored response).
fn shape(reply: &Value) -> String {
    match reply {
        Value::Array(items) => format!("[{}]", items.iter().map(shape).collect::<Vec<_>>().join(", ")),
        Value::BulkString(bytes) => format!("{} bytes", bytes.len()),
        Value::Int(_) => "an integer".into(),
        Value::Nil => "nil".into(),
        other => format!(
            "a {}",
            match other {
                Value::SimpleString(_) => "simple string",
                Value::Okay => "OK",
                Value::ServerError(_) => "server error",
                _ => "value of another type",
            }
        ),
    }
}

impl RedisBegin {
    /// Moves the stored response out of the reply (a replay's bytes are not copied).
    pub(crate) fn decode(reply: Value) -> Result<Self, UnexpectedReply> {
        let Value::Array(mut items) = reply else { return Err(UnexpectedReply(reply)) };
        let answer = match items.as_mut_slice() {
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
                Some(RedisBegin::Completed(std::mem::take(response)))
            }
            _ => None,
        };
        answer.ok_or(UnexpectedReply(Value::Array(items)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reply() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Nil),
            Just(Value::Okay),
            any::<i64>().prop_map(Value::Int),
            prop::collection::vec(any::<u8>(), 0..16).prop_map(Value::BulkString),
            prop::sample::select(vec!["claimed", "completed", "in_flight", "mismatch", "unconfirmed", "x"])
                .prop_map(|tag| Value::BulkString(tag.as_bytes().to_vec())),
            "[a-z_]{0,12}".prop_map(Value::SimpleString),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| prop::collection::vec(inner, 0..4).prop_map(Value::Array))
    }

    proptest! {
        /// Any reply, however malformed, decodes to an answer or a typed error; never a panic.
        #[test]
        fn never_panics_on_any_reply(value in reply()) {
            let _ = RedisBegin::decode(value);
        }

        /// A completed reply carries its stored bytes through unchanged.
        #[test]
        fn completed_responses_round_trip(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let reply = Value::Array(vec![bulk(b"completed"), Value::BulkString(bytes.clone())]);
            prop_assert_eq!(RedisBegin::decode(reply).ok(), Some(RedisBegin::Completed(bytes)));
        }
    }

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
