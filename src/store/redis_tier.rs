//! The Redis hot path: script calls under a latency budget, with a circuit breaker so that a Redis
//! outage costs one budget per cool-down instead of one per request.

use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::Value;

use super::Background;
use super::lagging::LaggingKeys;
use super::redis_connection::{RedisConnection, RedisSource};
use super::scripts::{self, LuaScript, RedisBegin};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Scope, key_digest};
use crate::record::State;
use crate::telemetry;

/// What a script call is for, which decides whether an open circuit skips it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// Answering a request (claim, heartbeat): skipped while the circuit is open, so an outage costs one
    /// budget per cool-down, not one per request.
    Answer,
    /// Writing what Postgres just settled (a completion, a release): always tried, within the budget. A
    /// skipped write would leave another process reading a stale copy until this one catches up;
    /// during an outage it costs the settling request up to one budget (a refused connection fails fast).
    Settle,
}

/// What taking a marker back means (release.lua): whether the caller owned the key, and so whether
/// claims waiting for it hear of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Takeback {
    /// Postgres released the record under the caller's fence: an indeterminate copy goes too.
    Released,
    /// The caller's claim was rolled back with its transaction.
    RolledBack,
    /// The caller's marker answered for a key it never got: Postgres holds another owner, or failed.
    Unclaimed,
}

/// Why a Redis call was not answered; every one degrades the call to the Postgres path.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RedisUnavailable {
    #[error("the Redis circuit is open after a recent failure")]
    CircuitOpen,
    #[error("Redis did not answer within the budget")]
    Timeout,
    /// A cluster still answered MOVED, ASK, TRYAGAIN or CLUSTERDOWN once its retries within the budget
    /// were spent: a failover or a slot migration under way.
    #[error("the Redis Cluster is reconfiguring")]
    Cluster(#[source] redis::RedisError),
    #[error("Redis failed")]
    Failed(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<redis::RedisError> for RedisUnavailable {
    fn from(error: redis::RedisError) -> Self {
        if error.is_cluster_error() {
            Self::Cluster(error)
        } else if error.is_timeout() {
            // A cluster client's own response timeout, held within the budget.
            Self::Timeout
        } else {
            Self::Failed(Box::new(error))
        }
    }
}

impl RedisUnavailable {
    /// The `reason` label of the fallback metric.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            RedisUnavailable::CircuitOpen => "circuit_open",
            RedisUnavailable::Timeout => "timeout",
            RedisUnavailable::Cluster(_) => "cluster",
            RedisUnavailable::Failed(_) => "error",
        }
    }
}

/// A record's Redis copy, for operators ([`crate::admin::Admin::inspect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisView {
    /// The state the copy answers with; `None` for a tag this version does not know (a malformed copy,
    /// which the protocol treats as a miss).
    pub state: Option<State>,
    /// The fingerprint the copy holds (32 bytes).
    pub fingerprint: Vec<u8>,
    /// The owner token of an in-progress marker.
    pub owner: Option<String>,
    /// Bytes of the stored response, if completed.
    pub response_bytes: usize,
    /// Time left before Redis drops the copy.
    pub ttl: Option<Duration>,
}

/// The `s` field of a Redis marker: the state's code, for the states Redis holds (released and expired
/// records have no copy).
fn tag_of(state: State) -> Option<u8> {
    match state {
        State::InProgress | State::Completed | State::Indeterminate => Some(state.code()),
        State::Released | State::Expired => None,
    }
}

pub(crate) struct RedisTier {
    source: RedisSource,
    /// One connection, shared by every call: it pipelines concurrent requests on one socket (per node,
    /// on a cluster). Taking a connection from the pool per call would cost a recycling PING each time,
    /// doubling the round trips; the source is only asked again after a failure.
    shared: RwLock<Option<RedisConnection>>,
    /// Held while a new shared connection is built.
    connecting: tokio::sync::Mutex<()>,
    prefix: String,
    /// Where settlements of waited-for records are published (`<prefix>:settled`).
    channel: String,
    budget: Duration,
    cooldown: Duration,
    /// Keys whose copy may lag behind Postgres, deleted before Redis answers again.
    lagging: LaggingKeys,
    /// Milliseconds since `epoch` until which Redis is skipped; 0 when closed.
    open_until: AtomicU64,
    epoch: Instant,
}

impl RedisTier {
    pub(crate) fn new(
        source: RedisSource,
        prefix: String,
        budget: Duration,
        cooldown: Duration,
        background: Background,
    ) -> Self {
        Self {
            source,
            shared: RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
            lagging: LaggingKeys::new(background),
            channel: format!("{prefix}:settled"),
            prefix,
            budget,
            cooldown,
            open_until: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    pub(crate) fn budget(&self) -> Duration {
        self.budget
    }

    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// `prefix:{digest}`: the key's digest (32 hex digits over its length-prefixed tenant, operation and
    /// key, as Postgres's `idempotency_key_digest`) names it in a fixed length however long the key,
    /// and no tenant can forge another tenant's name. The braces are the Redis Cluster hash tag.
    pub(crate) fn record_key(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        format!("{}:{{{}}}", self.prefix, key_digest(scope, key).as_str())
    }

    pub(crate) async fn begin(
        &self,
        record_key: &str,
        fingerprint: &Fingerprint,
        owner: &str,
        lease_ms: i64,
        waiter: Option<&str>,
    ) -> Result<RedisBegin, RedisUnavailable> {
        let mut lease = itoa::Buffer::new();
        let lease = lease.format(lease_ms);
        let args = [&fingerprint.as_bytes()[..], owner.as_bytes(), lease.as_bytes(), waiter.unwrap_or("").as_bytes()];
        let reply =
            self.invoke("begin", &scripts::BEGIN, record_key, &args, Call::Answer).await.inspect_err(|error| {
                // A call that timed out may still have written its marker.
                if !matches!(error, RedisUnavailable::CircuitOpen) {
                    self.left_behind(record_key);
                }
            })?;
        // A reply outside the contract says nothing about the key, but nothing about Redis either: the
        // request asks Postgres, and the circuit stays closed for everyone else.
        Ok(RedisBegin::decode(reply).unwrap_or_else(|error| {
            tracing::warn!(%error, "unexpected begin reply; asking Postgres");
            self.left_behind(record_key);
            RedisBegin::Unconfirmed
        }))
    }

    /// Mirrors a Postgres state into Redis. `owner` matters for in-progress markers, `response` for
    /// completed records.
    pub(crate) async fn put(
        &self,
        record_key: &str,
        state: State,
        fingerprint: &[u8],
        owner: &str,
        response: &[u8],
        ttl_ms: i64,
    ) -> Result<(), RedisUnavailable> {
        // A released record needs no marker: the next request claims it in Postgres; an expired one is
        // answered by Postgres's tombstone.
        let Some(tag) = tag_of(state) else { return Ok(()) };
        let mut ttl = itoa::Buffer::new();
        let ttl = ttl.format(ttl_ms.max(1));
        let args = [&[tag][..], fingerprint, owner.as_bytes(), response, ttl.as_bytes(), self.channel.as_bytes()];
        let put = self.invoke("put", &scripts::PUT, record_key, &args, Call::Settle).await;
        put.map(drop).inspect_err(|_| self.left_behind(record_key))
    }

    /// Deletes the caller's own marker (and, once Postgres released the record, an indeterminate copy).
    pub(crate) async fn release(
        &self,
        record_key: &str,
        owner: &str,
        takeback: Takeback,
    ) -> Result<(), RedisUnavailable> {
        let mode: &[u8] = match takeback {
            Takeback::Released => b"released",
            Takeback::RolledBack => b"rolled_back",
            Takeback::Unclaimed => b"",
        };
        let args = [owner.as_bytes(), mode, self.channel.as_bytes()];
        let released = self.invoke("release", &scripts::RELEASE, record_key, &args, Call::Settle).await;
        released.map(drop).inspect_err(|_| self.left_behind(record_key))
    }

    pub(crate) async fn extend(&self, record_key: &str, owner: &str, lease_ms: i64) -> Result<(), RedisUnavailable> {
        let mut lease = itoa::Buffer::new();
        let lease = lease.format(lease_ms);
        let args = [owner.as_bytes(), lease.as_bytes()];
        self.invoke("extend", &scripts::EXTEND, record_key, &args, Call::Answer).await.map(drop)
    }

    /// Reads a record's copy (not budgeted: an operator command): a completed record's string
    /// (fingerprint, then response), or a marker's hash.
    pub(crate) async fn view(&self, record_key: &str) -> Result<Option<RedisView>, RedisUnavailable> {
        let failed = RedisUnavailable::from;
        let mut conn = self.connection().await?;
        let (kind, pttl): (String, i64) =
            redis::pipe().cmd("TYPE").arg(record_key).pttl(record_key).query_async(&mut conn).await.map_err(failed)?;
        let ttl = u64::try_from(pttl).ok().map(Duration::from_millis);
        if kind == "string" {
            let packed: Vec<u8> = redis::cmd("GET").arg(record_key).query_async(&mut conn).await.map_err(failed)?;
            let (fingerprint, response) = packed.split_at(packed.len().min(32));
            let state = (fingerprint.len() == 32).then_some(State::Completed);
            let (fingerprint, response_bytes) = (fingerprint.to_vec(), response.len());
            return Ok(Some(RedisView { state, fingerprint, owner: None, response_bytes, ttl }));
        }
        if kind != "hash" {
            return Ok(None);
        }
        let fields: std::collections::HashMap<String, Vec<u8>> =
            redis::cmd("HGETALL").arg(record_key).query_async(&mut conn).await.map_err(failed)?;
        let text = |name: &str| fields.get(name).map(|v| String::from_utf8_lossy(v).into_owned());
        Ok(fields.get("s").map(|tag| RedisView {
            // A completed record is a string: a hash that says so is malformed.
            state: match tag.as_slice() {
                [code] => {
                    State::from_code(*code).filter(|state| matches!(state, State::InProgress | State::Indeterminate))
                }
                _ => None,
            },
            fingerprint: fields.get("h").cloned().unwrap_or_default(),
            owner: text("t"),
            response_bytes: 0,
            ttl,
        }))
    }

    /// Deletes a record's copy; returns whether there was one. A copy that could not be deleted is left
    /// to the lagging keys' repair (the caller settled the record in Postgres, or asked for it gone).
    pub(crate) async fn evict(&self, record_key: &str) -> Result<bool, RedisUnavailable> {
        let evict = |mut conn: RedisConnection| async move {
            let deleted: i64 = redis::cmd("DEL").arg(record_key).query_async(&mut conn).await?;
            Ok(deleted == 1)
        };
        self.on_live_connection(evict).await.inspect_err(|_| self.left_behind(record_key))
    }

    /// Remembers a key whose Redis copy may now lag behind Postgres ([`LaggingKeys`]).
    fn left_behind(&self, record_key: &str) {
        self.lagging.push(record_key, &self.source, self.cooldown, self.budget);
    }

    /// Runs one script ([`LuaScript::invoke`]), bounded by the budget, after deleting the key's copy if
    /// it may lag behind Postgres; a failure opens the circuit for the cool-down. An open circuit skips
    /// answers, not settlements (see [`Call`]).
    async fn invoke(
        &self,
        name: &'static str,
        script: &LuaScript,
        record_key: &str,
        args: &[&[u8]],
        call: Call,
    ) -> Result<Value, RedisUnavailable> {
        if call == Call::Answer && self.now_ms() < self.open_until.load(Ordering::Relaxed) {
            return Err(RedisUnavailable::CircuitOpen);
        }
        telemetry::redis_call(name);
        let attempt = |mut conn: RedisConnection| async move {
            // Boxed: rare, and it keeps every request's future shallow.
            if let Some(seen) = self.lagging.lagging(record_key) {
                Box::pin(self.lagging.delete(&conn, record_key, seen)).await?;
            }
            script.invoke(&mut conn, record_key, args).await
        };
        let call = async {
            match call {
                // A settlement is worth a second connection: every process reads what it leaves.
                Call::Settle => Box::pin(self.on_live_connection(attempt)).await,
                Call::Answer => Ok(attempt(self.connection().await?).await?),
            }
        };
        match tokio::time::timeout(self.budget, call).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(self.trip(e)),
            Err(_) => Err(self.trip(RedisUnavailable::Timeout)),
        }
    }

    /// Runs `call` on the shared connection, and once more on a new one if that connection itself
    /// failed (gone stale, as after a Redis restart: the first command on it fails), not when Redis
    /// answered an error. Only for calls that are safe to run twice (all of them are: see the scripts).
    async fn on_live_connection<T, Fut>(&self, call: impl Fn(RedisConnection) -> Fut) -> Result<T, RedisUnavailable>
    where
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        match call(self.connection().await?).await {
            Err(error) if error.is_io_error() || error.is_connection_dropped() => {
                tracing::debug!(%error, "the shared Redis connection failed; trying a new one");
                if let Ok(mut shared) = self.shared.write() {
                    *shared = None;
                }
                Ok(call(self.connection().await?).await?)
            }
            answered => Ok(answered?),
        }
    }

    async fn connection(&self) -> Result<RedisConnection, RedisUnavailable> {
        let shared = || self.shared.read().ok().and_then(|shared| shared.clone());
        if let Some(conn) = shared() {
            return Ok(conn);
        }
        // One connection is built at a time; the callers that waited for it share it. (A cluster
        // connection opens one socket per master: a storm of them would hit a cluster while it recovers.)
        let _building = self.connecting.lock().await;
        if let Some(conn) = shared() {
            return Ok(conn);
        }
        // Boxed: only after a failure, and it keeps every request's future shallow.
        let conn = Box::pin(self.source.connect(self.budget)).await.map_err(|error| {
            if error.is::<tokio::time::error::Elapsed>() {
                RedisUnavailable::Timeout
            } else {
                RedisUnavailable::Failed(error)
            }
        })?;
        if let Ok(mut shared) = self.shared.write() {
            *shared = Some(conn.clone());
        }
        Ok(conn)
    }

    /// Opens the circuit for the cool-down, and drops the shared connection, which may be the broken
    /// part (a cluster connection that lost a master, or that keeps hearing CLUSTERDOWN from one on the
    /// wrong side of a partition, stays stuck on it; a new one maps the slots afresh). A cluster
    /// answering MOVED or ASK keeps its connection: it follows redirects and refreshes its map itself.
    fn trip(&self, error: RedisUnavailable) -> RedisUnavailable {
        let redirected = matches!(&error, RedisUnavailable::Cluster(e) if e.redirect_node().is_some());
        if !redirected && let Ok(mut shared) = self.shared.write() {
            *shared = None;
        }
        let until = self.now_ms() + u64::try_from(self.cooldown.as_millis()).unwrap_or(u64::MAX / 2);
        self.open_until.store(until, Ordering::Relaxed);
        tracing::warn!(error = ?error, cooldown = ?self.cooldown, "Redis unavailable; using the Postgres path");
        error
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX / 2)
    }
}
