//! Error types, one enum per layer: what the caller sent ([`InputError`]) and what the store could not
//! do ([`StoreError`]). Outcomes such as "in flight" or "payload mismatch" are not errors: they are
//! answers, returned as [`crate::Begin`] and [`crate::RunOutcome`] variants.

mod input;

pub use input::InputError;

/// A store, policy or policy file was configured wrongly; nothing was built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// [`StoreBuilder::build`](crate::StoreBuilder::build) was given neither a pool nor a URL.
    #[error("a Postgres pool or URL is required")]
    MissingPostgres,
    /// The Postgres URL does not parse.
    #[error("invalid Postgres URL")]
    DatabaseUrl(#[source] sqlx::Error),
    /// The Redis pool could not be created from its URL.
    #[error("invalid Redis configuration")]
    Redis(#[source] deadpool_redis::CreatePoolError),
    /// The Redis Cluster client could not be created from its seed URLs.
    #[error("invalid Redis Cluster configuration")]
    RedisCluster(#[source] redis::RedisError),
    /// Both a single Redis and a Redis Cluster were given.
    #[error("give either a Redis server or a Redis Cluster, not both")]
    RedisTwice,
    /// A Redis Cluster store's key prefix holds `{` or `}`: the cluster would hash every key by the
    /// braces' content and put them all in one slot.
    #[error("the Redis key prefix {prefix:?} must not contain '{{' or '}}'")]
    KeyPrefix {
        /// The refused prefix.
        prefix: String,
    },
    /// A partition count outside 1..=1024.
    #[error("{partitions} partitions: give between 1 and 1024")]
    Partitions {
        /// The refused count.
        partitions: u16,
    },
    /// A webhook verifier was given no secret, an empty one, or a Standard Webhooks secret that is not
    /// `whsec_` and base64.
    #[error("webhook secret: {reason}")]
    WebhookSecret {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An encryption key list is empty, repeats a key, or holds an entry that is not base64 of 32 bytes.
    #[error("encryption key: {reason}")]
    EncryptionKey {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A [`crate::Quota`] with a limit of zero or of 2^31 and more, a window under a millisecond or over
    /// 366 days, or a policy file's `new_keys` that is not a count and a window.
    #[error("quota: {reason}")]
    Quota {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The call needs Redis, and this store is Postgres-only.
    #[error("this store is Postgres-only; the call needs Redis")]
    NoRedis,
    /// A lease, Redis TTL, retention, Postgres timeout or Redis budget shorter than a millisecond.
    #[error("lease, Redis TTL, retention, Postgres timeout and Redis budget must be at least 1 ms")]
    TooShort,
    /// A duration is longer than the store can honour end to end (an expiry Redis or Postgres refuses,
    /// or a deadline past the clock's range).
    #[error("{setting} must be at most {max:?}")]
    TooLong {
        /// The builder setting.
        setting: &'static str,
        /// The longest accepted.
        max: std::time::Duration,
    },
    /// The lease would outlive the Redis copy of its marker.
    #[error("the lease ({lease:?}) must be shorter than the Redis TTL ({redis_ttl:?})")]
    LeaseOutlivesRedisTtl {
        /// The policy's lease.
        lease: std::time::Duration,
        /// The policy's Redis TTL.
        redis_ttl: std::time::Duration,
    },
    /// Redis would keep a result longer than Postgres, and replay it after Postgres forgot it.
    #[error("the Redis TTL ({redis_ttl:?}) must not exceed the Postgres retention ({retention:?})")]
    RedisTtlOutlivesRetention {
        /// The policy's Redis TTL.
        redis_ttl: std::time::Duration,
        /// The policy's Postgres retention.
        retention: std::time::Duration,
    },
    /// Not a duration like `500ms`, `30s`, `15m`, `24h` or `7d` (or too long).
    #[error("{text:?} is not a duration like 30s, 15m or 7d (units ms, s, m, h, d; at most 2^32 of them)")]
    InvalidDuration {
        /// The refused text.
        text: String,
    },
    /// The policy file is not valid TOML of the expected shape (the message says where).
    #[error("policy file: {0}")]
    PolicyFile(toml::de::Error),
    /// A tier of the policy file is invalid.
    #[error("tier {tier:?}: {reason}")]
    Tier {
        /// The tier's name.
        tier: String,
        /// What is wrong with it.
        reason: Box<ConfigError>,
    },
    /// The default or an operation names a tier that does not exist.
    #[error("{used_by} uses the unknown tier {tier:?}")]
    UnknownTier {
        /// `default`, or the operation.
        used_by: String,
        /// The unknown tier.
        tier: String,
    },
}

/// A webhook delivery was refused before anything was read or written: it is unsigned, garbled, signed
/// with no active secret, or signed too long ago (or ahead).
///
/// [`SignatureError::is_unauthorized`] tells a forged or stale delivery (HTTP 401) from a malformed one
/// (400); both must not be acknowledged as handled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// The inbox has no verifier ([`crate::Inbox::verified_by`]).
    #[error("this inbox has no webhook verifier")]
    NoVerifier,
    /// A header the scheme requires is absent (the delivery is unsigned).
    #[error("the delivery has no {name} header")]
    MissingHeader {
        /// The header's name.
        name: &'static str,
    },
    /// A signature header does not parse.
    #[error("the delivery's {name} header is malformed")]
    MalformedHeader {
        /// The header's name.
        name: &'static str,
    },
    /// No signature matches any active secret over this body, timestamp and event id.
    #[error("no signature of the delivery matches an active secret")]
    Mismatch,
    /// The signed timestamp is further from now than the tolerance.
    #[error("the delivery was signed {skew:?} away from now; the tolerance is {tolerance:?}")]
    Stale {
        /// How far the signed timestamp is from now.
        skew: std::time::Duration,
        /// The verifier's tolerance.
        tolerance: std::time::Duration,
    },
    /// The signed body has no top-level string `id` (Stripe's event id).
    #[error("the signed body has no event id")]
    MissingEventId,
}

impl SignatureError {
    /// Whether the delivery is signed wrongly or too long ago (401), as opposed to malformed (400).
    pub fn is_unauthorized(&self) -> bool {
        matches!(self, SignatureError::Mismatch | SignatureError::Stale { .. })
    }
}

/// A stored response could not be opened ([`crate::Encryption`]): it is never replayed then, and the
/// work is not run again (it completed); an operator restores the key or resolves the record.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncryptionError {
    /// The response was sealed with a master key that is no longer configured.
    #[error("the stored response was sealed with key {id:08x}, which is not configured")]
    UnknownKey {
        /// The id of the missing key (as [`crate::Encryption::key_ids`] lists them).
        id: u32,
    },
    /// The sealed bytes were changed, or moved from another record.
    #[error("the stored response does not open: it was changed or belongs to another record")]
    Tampered,
    /// The response is stored in clear, and the store does not accept that
    /// ([`crate::Encryption::accept_unsealed`]).
    #[error("the stored response is not encrypted")]
    Unsealed,
    /// A store without [`crate::Encryption`] was asked to write a response where the stored responses
    /// are sealed: every store with the key would refuse to replay it. Build the store with the
    /// deployment's key (`IDEMSTORE_ENCRYPTION_KEY` for `idemctl`).
    #[error("this store has no encryption key, and the stored responses are encrypted")]
    WouldWriteClear,
}

impl EncryptionError {
    /// The metric label of this refusal.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            EncryptionError::UnknownKey { .. } => "unknown_key",
            EncryptionError::Tampered => "tampered",
            EncryptionError::Unsealed => "unsealed",
            EncryptionError::WouldWriteClear => "would_write_clear",
        }
    }
}

/// The store could not answer.
///
/// A caller that gets one of these must not assume anything ran or did not run, except where a
/// variant says so.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The input was refused; nothing was read or written.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Postgres, the source of truth, could not be reached or failed. The store fails closed.
    ///
    /// From a claim ([`Store::begin`](crate::Store::begin), the start of `run_once`): nothing ran. From
    /// a settlement ([`Owner::complete`](crate::Owner::complete), `run_once` after the work, `step` is
    /// `"complete"`): **the work ran**, and its result could not be stored although the owner retried
    /// while its lease lasted; the record stays in progress until the lease runs out, then the policy's
    /// [`LeaseExpiry`](crate::LeaseExpiry) rule decides (a takeover runs the work again, or the record
    /// goes indeterminate). From a transactional completion (`run_once_in_tx`, the HTTP layer's
    /// transactional path): nothing was committed, or the commit's outcome is unknown; a retry replays
    /// what was committed or runs once.
    #[error("the idempotency store is unavailable: Postgres failed during {step}")]
    StoreUnavailable {
        /// The protocol step that failed (`"claim"`, `"complete"`, ...).
        step: &'static str,
        /// The Postgres error.
        #[source]
        source: sqlx::Error,
    },
    /// The lease was taken over (or the record resolved) since it was acquired: the caller no longer
    /// owns the key, and its completion or release was not applied.
    #[error("the lease on this key was lost to another owner (fence {fence})")]
    LeaseLost {
        /// The fence of the lease that was lost.
        fence: i64,
    },
    /// The embedded migrations could not be applied.
    #[error("applying the idempotency store migrations failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// The store or policy configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// A stored response could not be opened; nothing was replayed or run.
    #[error(transparent)]
    Encryption(#[from] EncryptionError),
    /// Redis failed an operator command that only Redis can answer (such as `evict`). The protocol
    /// itself never returns this: it degrades to Postgres instead.
    #[error("Redis is unavailable")]
    RedisUnavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    /// Whether retrying the same call later may succeed (the store was unavailable), as opposed to an
    /// answer that a retry would repeat (bad input, a lost lease, bad configuration).
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::StoreUnavailable { .. })
    }

    /// Whether the same fenced write may pass when asked again: Postgres could not be reached (the
    /// connection, the pool, a server shutting down or starting, the store's own deadline) or gave up on
    /// it (its statement or lock timeout, a serialization failure, a deadlock), as opposed to a statement
    /// that Postgres ran and refused.
    pub(crate) fn is_retryable(&self) -> bool {
        let StoreError::StoreUnavailable { source, .. } = self else { return false };
        match source {
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Protocol(_) => true,
            sqlx::Error::Database(error) => error.code().is_some_and(|code| {
                // Connection exceptions; admin, crash or immediate shutdown; cannot connect now; query
                // cancelled (statement timeout); lock not available; serialization failure; deadlock.
                code.starts_with("08")
                    || matches!(code.as_ref(), "57P01" | "57P02" | "57P03" | "57014" | "55P03" | "40001" | "40P01")
            }),
            _ => false,
        }
    }

    /// The SQLSTATE of a statement Postgres refused.
    #[cfg(feature = "http")]
    pub(crate) fn sqlstate(&self) -> Option<String> {
        let StoreError::StoreUnavailable { source: sqlx::Error::Database(error), .. } = self else { return None };
        error.code().map(|code| code.into_owned())
    }
}
