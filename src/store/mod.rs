//! The store: configuration and lifecycle here, the claim protocol in [`protocol`](self) submodules.

mod admin;
mod attach;
mod awaiting;
mod background;
mod batch;
mod begin;
mod clear_writes;
mod group_commit;
mod lagging;
mod owner;
mod pool;
mod postgres_tier;
mod protocol;
mod redis_connection;
mod redis_tier;
mod scripts;
mod sealing;
mod statement;
mod wakeup;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPool};

use crate::config::PolicyConfig;
use crate::encryption::Encryption;
use crate::error::{ConfigError, StoreError};
use crate::policy::Policy;
use crate::telemetry;
pub use admin::{Admin, Inspection, Purging, Recovery, Resolution, StatsRow};
pub use attach::Attached;
pub(crate) use background::Background;
pub use batch::{BatchBegin, MAX_BATCH_ITEMS};
pub use begin::Begin;
use group_commit::GroupCommit;
pub use owner::{KeepAlive, Owner};
pub use pool::{pool_options, server_bounded};
use postgres_tier::PostgresTier;
use redis_connection::RedisSource;
use redis_tier::RedisTier;
pub use redis_tier::RedisView;
pub(crate) use statement::{COMMIT, Statement};

/// The migrations in `migrations/`, embedded at build time (by `include_str!`, not sqlx's `migrate!`:
/// a dependent then builds no sqlx proc macro). Their bookkeeping lives in its own table,
/// `_idemstore_migrations`, so they never clash with the application's own sqlx migrations.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut migrator = Migrator::with_migrations(EMBEDDED_MIGRATIONS.iter().map(embedded_migration).collect());
    migrator.dangerous_set_table_name("_idemstore_migrations");
    migrator
});

/// Version, description (the file name's rest, as sqlx reads it) and SQL of each file in `migrations/`
/// (a unit test holds this list to the directory).
const EMBEDDED_MIGRATIONS: [(i64, &str, &str); 1] =
    [(20261205000001, "idempotency store", include_str!("../../migrations/20261205000001_idempotency_store.sql"))];

/// A migration as sqlx's `migrate!` builds it: the same checksum (a database migrated before keeps
/// validating), and outside a transaction when it starts with `-- no-transaction`.
fn embedded_migration(&(version, description, sql): &(i64, &'static str, &'static str)) -> Migration {
    let no_tx = sql.starts_with("-- no-transaction");
    Migration::new(version, description.into(), MigrationType::Simple, sqlx::SqlStr::from_static(sql), no_tx)
}

/// Which tiers a [`Store`] runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Redis answers duplicates in front of Postgres.
    TwoTier,
    /// Postgres alone; the same protocol without Redis calls.
    PostgresOnly,
}

/// The idempotency store. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    postgres: PostgresTier,
    redis: Option<RedisTier>,
    default_policy: Arc<Policy>,
    policies: HashMap<String, Arc<Policy>>,
    /// Operation prefixes (patterns ending in `*`), longest first.
    patterns: Vec<(String, Arc<Policy>)>,
    /// Operations whose metric series are registered at 0.
    registered: telemetry::Registered,
    /// Claims waiting for an in-flight duplicate, and the subscriptions that wake them.
    wakeups: wakeup::Wakeups,
    /// Seals responses before they are stored, and opens them before they are replayed.
    encryption: Option<Encryption>,
    /// Without encryption: whether the deployment seals its responses, as last asked (`None`: never
    /// asked, for a store that seals or that may write in clear).
    sealed_deployment: Option<clear_writes::SealedDeployment>,
    /// The tasks this store spawned: settlements to wait for, followers to stop.
    background: Background,
}

/// The last handle is gone: the followers stop (a repair of Redis copies would otherwise retry for as
/// long as Redis stays unreachable). Settlements under way go on.
impl Drop for Inner {
    fn drop(&mut self) {
        self.background.stop();
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("mode", &self.mode())
            .field("default_policy", &self.inner.default_policy)
            .field("operations", &self.inner.policies.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Store {
    /// Starts configuring a store.
    pub fn builder() -> StoreBuilder {
        StoreBuilder::default()
    }

    /// Whether Redis fronts this store.
    pub fn mode(&self) -> Mode {
        if self.inner.redis.is_some() { Mode::TwoTier } else { Mode::PostgresOnly }
    }

    /// The policy that applies to `operation`.
    pub fn policy(&self, operation: &str) -> &Policy {
        self.shared_policy_ref(operation)
    }

    /// The policy of `operation`, shared with the leases taken under it.
    pub(crate) fn shared_policy(&self, operation: &str) -> Arc<Policy> {
        Arc::clone(self.shared_policy_ref(operation))
    }

    /// The exact operation's policy, else that of the longest matching `prefix*` pattern, else the default.
    fn shared_policy_ref(&self, operation: &str) -> &Arc<Policy> {
        let inner = &self.inner;
        inner
            .policies
            .get(operation)
            .or_else(|| inner.patterns.iter().find(|(prefix, _)| operation.starts_with(prefix)).map(|(_, p)| p))
            .unwrap_or(&inner.default_policy)
    }

    /// The Postgres pool the store uses (to run the embedded migrations elsewhere, or for your own work).
    /// Built from [`StoreBuilder::database_url`] (unless [`StoreBuilder::server_timeouts`] is off), its
    /// connections carry the store's server-side bounds ([`server_bounded`](crate::server_bounded)): the
    /// server cancels your queries on it after the same `statement_timeout` (4/5 of
    /// [`StoreBuilder::postgres_timeout`]) and their lock waits after `lock_timeout` (1/2 of it); set both
    /// with `SET LOCAL` in a transaction that needs longer, as [`Store::migrate`] does.
    pub fn pg_pool(&self) -> &PgPool {
        self.inner.postgres.pool()
    }

    /// Stops the store's background tasks and waits for the settlements under way; call it when the
    /// process stops taking requests, before it exits.
    ///
    /// A store spawns two kinds of task. Settlements finish what a call started when the call could not
    /// wait: the release of an owner dropped unsettled, the settlement of a response whose client went
    /// away mid-body (drained first when the rest can still be stored), and a claim whose caller was
    /// cancelled while its statement ran, given back once it landed. A process that exits before they
    /// land leaves those keys in progress until their lease runs out, so this waits for them: a body is
    /// drained for at most a lease, a settling write retries within the lease it keeps extending, and a
    /// claim's statements are bounded by [`StoreBuilder::postgres_timeout`] (a claim transaction's `BEGIN`
    /// only by the pool's acquire timeout and its connection: it is never cut short), so the wait is
    /// bounded by about two of the longest lease in use; bound it by the process's grace period if that
    /// is shorter. Requests that keep coming keep it waiting: stop taking them first. Followers run as
    /// long as the store:
    /// the deletion of Redis copies that may lag behind Postgres after Redis failed (they expire with
    /// their lease instead) and the subscriptions that wake claims waiting for an in-flight duplicate
    /// (waiting claims poll instead). This stops them; so does dropping the store's last handle.
    ///
    /// The store still answers afterwards, on every clone, without its followers. Owners still held,
    /// and settlements that start after this returned, are not waited for: settle or drop owners first.
    ///
    /// ```no_run
    /// # async fn serve(store: idemstore::Store) {
    /// // ... the server stopped accepting requests and finished the ones in flight ...
    /// let grace = std::time::Duration::from_secs(25);
    /// if tokio::time::timeout(grace, store.shutdown()).await.is_err() {
    ///     tracing::warn!("settlements still under way: their keys wait for their lease");
    /// }
    /// # }
    /// ```
    pub async fn shutdown(&self) {
        self.inner.background.shutdown().await;
    }

    pub(crate) fn background(&self) -> &Background {
        &self.inner.background
    }

    /// Applies the embedded migrations (idempotent; safe from several processes at once), on a
    /// connection of its own without the store's statement timeouts: a migration may take long.
    ///
    /// # Errors
    /// [`StoreError::Migrate`] if a migration fails or Postgres is unreachable.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.pg_pool().acquire().await.map_err(|e| StoreError::Migrate(e.into()))?.detach();
        sqlx::raw_sql("SET statement_timeout = 0; SET lock_timeout = 0")
            .execute(&mut conn)
            .await
            .map_err(|e| StoreError::Migrate(e.into()))?;
        let migrated = MIGRATOR.run(&mut conn).await.map_err(StoreError::Migrate);
        // The connection leaves the pool's accounting; closing it is a courtesy, its loss harmless.
        let _ = sqlx::Connection::close(conn).await;
        migrated
    }
}

/// The longest [`StoreBuilder::postgres_timeout`]: one hour.
const MAX_POSTGRES_TIMEOUT: Duration = Duration::from_secs(3600);
/// The longest [`StoreBuilder::redis_budget`]: one minute (the budget is per call, on the request path).
const MAX_REDIS_BUDGET: Duration = Duration::from_secs(60);
/// The longest [`StoreBuilder::redis_cooldown`]: one hour.
const MAX_REDIS_COOLDOWN: Duration = Duration::from_secs(3600);

/// Configures a [`Store`]. Postgres is required; Redis is optional (without it, [`Mode::PostgresOnly`]).
#[derive(Default)]
pub struct StoreBuilder {
    pg_pool: Option<PgPool>,
    database_url: Option<String>,
    redis_pool: Option<deadpool_redis::Pool>,
    redis_url: Option<String>,
    #[cfg(feature = "cluster")]
    redis_cluster: Option<Vec<String>>,
    key_prefix: Option<String>,
    redis_budget: Option<Duration>,
    redis_cooldown: Option<Duration>,
    postgres_timeout: Option<Duration>,
    server_timeouts: Option<bool>,
    group_commit: Option<bool>,
    default_policy: Option<Policy>,
    policies: HashMap<String, Policy>,
    encryption: Option<Encryption>,
    clear_responses_allowed: bool,
}

impl fmt::Debug for StoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("redis", &(self.redis_pool.is_some() || self.redis_url.is_some()))
            .field("redis_cluster", &self.has_cluster())
            .field("key_prefix", &self.key_prefix)
            .field("encryption", &self.encryption)
            .finish_non_exhaustive()
    }
}

impl StoreBuilder {
    fn has_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        return self.redis_cluster.is_some();
        #[cfg(not(feature = "cluster"))]
        false
    }

    /// Uses an existing Postgres pool, as it is. The server-side bounds of
    /// [`StoreBuilder::postgres_timeout`] are then yours to set on its connections (build it with
    /// [`server_bounded`](crate::server_bounded)), or the store's timeout stays client-side only. Keep its
    /// acquire timeout short: a caller waits that long before getting [`StoreError::StoreUnavailable`].
    pub fn postgres(mut self, pool: PgPool) -> Self {
        self.pg_pool = Some(pool);
        self
    }

    /// Connects lazily to Postgres at `url` with a pool of [`pool_options`](crate::pool_options) (16
    /// connections, a 5 s acquire timeout, no ping for a connection in use a moment ago) and the
    /// server-side bounds of [`StoreBuilder::postgres_timeout`].
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = Some(url.into());
        self
    }

    /// Uses an existing Redis pool. A pool does not tell its URL, so claims that wait for an in-flight
    /// duplicate ([`RunOptions::wait_in_flight`](crate::RunOptions::wait_in_flight)) are then woken
    /// through Postgres (a flag on the record, `LISTEN`/`NOTIFY`) rather than Redis pub/sub; with
    /// [`StoreBuilder::redis_url`] they follow Redis.
    pub fn redis(mut self, pool: deadpool_redis::Pool) -> Self {
        self.redis_pool = Some(pool);
        self
    }

    /// Connects lazily to Redis at `url` (and, once a claim first waits for an in-flight duplicate, a
    /// second connection subscribes to settlements).
    pub fn redis_url(mut self, url: impl Into<String>) -> Self {
        self.redis_url = Some(url.into());
        self
    }

    /// Uses a Redis Cluster as the hot tier (feature `cluster`), found through any of `seed_urls`
    /// (`redis://host:port`; a few masters is enough, the client learns the rest).
    ///
    /// Every record lives in the slot of its key's digest, and each script touches that one key, so
    /// redirects (MOVED, ASK) during a resharding or failover are followed by the client; its retries
    /// and timeouts are held within [`StoreBuilder::redis_budget`], past which the call degrades to
    /// Postgres (`reason="cluster"`). Replicas are never read. A node that lost its scripts is answered
    /// with `EVAL` on that node. Claims that wait for an in-flight duplicate are woken through Postgres.
    #[cfg(feature = "cluster")]
    pub fn redis_cluster<S: Into<String>>(mut self, seed_urls: impl IntoIterator<Item = S>) -> Self {
        self.redis_cluster = Some(seed_urls.into_iter().map(Into::into).collect());
        self
    }

    /// Prefix of every Redis key (default `idem`), to share one Redis between applications. On a Redis
    /// Cluster it must not contain `{` or `}` (it would become every key's hash tag).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = Some(prefix.into());
        self
    }

    /// How long one Redis call may take before the request degrades to Postgres (default 100 ms; at most
    /// a minute, else [`build`](Self::build) refuses it).
    pub fn redis_budget(mut self, budget: Duration) -> Self {
        self.redis_budget = Some(budget);
        self
    }

    /// How long Redis is skipped after it failed, before it is tried again (default 1 s; at most an hour).
    pub fn redis_cooldown(mut self, cooldown: Duration) -> Self {
        self.redis_cooldown = Some(cooldown);
        self
    }

    /// Longest wait for one Postgres statement before the call fails closed with
    /// [`StoreError::StoreUnavailable`] (default 5 s; at most an hour, else [`build`](Self::build) refuses
    /// it). Guards against a partitioned or stalled server.
    ///
    /// The server enforces it too, with room to spare, on the connections the store opens from
    /// [`StoreBuilder::database_url`] (see [`server_bounded`](crate::server_bounded)): a statement the store
    /// gave up on has been cancelled by the server by then, so a claim answered "unavailable" is not
    /// left claimed (one that a shared statement of [`group_commit`](Self::group_commit) wrote after
    /// its caller gave up is given back at once), and no abandoned statement holds a connection past
    /// the timeout. This includes the statements of [`Store::run_once_in_tx`]'s work, which runs on the
    /// store's connection (`SET LOCAL statement_timeout` there to give it longer).
    pub fn postgres_timeout(mut self, timeout: Duration) -> Self {
        self.postgres_timeout = Some(timeout);
        self
    }

    /// Whether the connections opened from [`StoreBuilder::database_url`] carry the server-side bounds
    /// (default `true`). Turn it off behind a pooler that refuses startup parameters (PgBouncer unless
    /// `ignore_startup_parameters` lists `options`), and set `statement_timeout` and `lock_timeout` there.
    pub fn server_timeouts(mut self, enabled: bool) -> Self {
        self.server_timeouts = Some(enabled);
        self
    }

    /// Whether concurrent calls share their Postgres writes (default `true`): the claims of keys that are
    /// most likely new, and the completions, of calls under way at the same time go to Postgres as one
    /// statement each, which commits before any of them is answered. Under load this is several times
    /// fewer statements for the server; while the pool has a connection to spare (idle, or not opened
    /// yet), or fewer than two shared statements are under way, a call writes at once, alone, on its own
    /// task, as without group commit (on a pool shared with the application, those writes take its
    /// connections as the application's own queries do). Claims and
    /// completions inside the caller's transaction never share. A key whose row another transaction
    /// holds holds up a shared claim for at most 50 ms; then each of its calls claims alone. The store
    /// has a task for the shared statements, on the runtime of its first call (and of the next one if
    /// that runtime ends); a store shared between runtimes depends on that one. Turn it off to measure
    /// what it buys, or where calls run on many runtimes.
    pub fn group_commit(mut self, enabled: bool) -> Self {
        self.group_commit = Some(enabled);
        self
    }

    /// The policy of operations without one of their own (default [`Policy::default`]).
    pub fn default_policy(mut self, policy: Policy) -> Self {
        self.default_policy = Some(policy);
        self
    }

    /// The policies of a [`PolicyConfig`] (a TOML file of tiers and operations): its default and every
    /// operation it lists.
    pub fn policies(mut self, config: PolicyConfig) -> Self {
        self.default_policy = Some(config.default);
        self.policies.extend(config.operations);
        self
    }

    /// The policy of one operation; an operation ending in `*` is a prefix pattern
    /// (`"POST /webhooks/*"`), used when no exact operation matches.
    pub fn policy(mut self, operation: impl Into<String>, policy: Policy) -> Self {
        self.policies.insert(operation.into(), policy);
        self
    }

    /// Seals every stored response before either tier sees it (see [`Encryption`]): Redis and Postgres
    /// then hold ciphertext only, and a response whose key is no longer configured, or whose bytes were
    /// changed, is refused as [`StoreError::Encryption`](crate::StoreError::Encryption), never replayed.
    pub fn encryption(mut self, encryption: Encryption) -> Self {
        self.encryption = Some(encryption);
        self
    }

    /// Lets a store without [`encryption`](StoreBuilder::encryption) write responses in clear where the
    /// deployment's are sealed. Without it, such a store asks Postgres once (a sample of 16 stored
    /// responses, any tenant and operation) and, if one is sealed, refuses every claim and resolve with
    /// [`EncryptionError::WouldWriteClear`](crate::EncryptionError::WouldWriteClear) before anything
    /// runs: a process started without the key would otherwise store responses that no store with the
    /// key replays. For a deployment that turned encryption off for good (its sealed responses stay
    /// unreadable).
    pub fn clear_responses_allowed(mut self) -> Self {
        self.clear_responses_allowed = true;
        self
    }

    /// Builds the store. No connection is made here; call [`Store::migrate`] to check Postgres.
    ///
    /// # Errors
    /// [`ConfigError`] when no Postgres is given, a URL does not parse, the Redis pool or cluster client
    /// cannot be created, or a cluster store's key prefix holds a brace.
    pub fn build(self) -> Result<Store, ConfigError> {
        let prefix = self.key_prefix.unwrap_or_else(|| "idem".into());
        #[cfg(feature = "cluster")]
        if self.redis_cluster.is_some() && prefix.contains(['{', '}']) {
            return Err(ConfigError::KeyPrefix { prefix });
        }
        let timeout = self.postgres_timeout.unwrap_or(Duration::from_secs(5));
        let budget = self.redis_budget.unwrap_or(Duration::from_millis(100));
        let cooldown = self.redis_cooldown.unwrap_or(Duration::from_secs(1));
        // Each bounds calls and timers: past these, deadlines overflow the clock (a panic on a request, or
        // a background task that dies), and nothing useful waits that long anyway.
        for (setting, value, max) in [
            ("postgres_timeout", timeout, MAX_POSTGRES_TIMEOUT),
            ("redis_budget", budget, MAX_REDIS_BUDGET),
            ("redis_cooldown", cooldown, MAX_REDIS_COOLDOWN),
        ] {
            if value > max {
                return Err(ConfigError::TooLong { setting, max });
            }
        }
        // A zero bound fails every call: a store that can never answer.
        if timeout < Duration::from_millis(1) || budget < Duration::from_millis(1) {
            return Err(ConfigError::TooShort);
        }
        let pg_pool = match (self.pg_pool, self.database_url) {
            (Some(pool), _) => pool,
            (None, Some(url)) => {
                let connect: PgConnectOptions = url.parse().map_err(ConfigError::DatabaseUrl)?;
                let connect =
                    if self.server_timeouts.unwrap_or(true) { server_bounded(connect, timeout) } else { connect };
                pool_options().connect_lazy_with(connect)
            }
            (None, None) => return Err(ConfigError::MissingPostgres),
        };
        // A client of its own for the subscription that wakes waiting claims: a pool given ready-made
        // does not tell its URL, and its waiters follow Postgres instead.
        let (source, subscriber) = match (self.redis_pool, self.redis_url) {
            #[cfg(feature = "cluster")]
            (pool, url) if let Some(seeds) = self.redis_cluster => {
                if pool.is_some() || url.is_some() {
                    return Err(ConfigError::RedisTwice);
                }
                (Some(RedisSource::cluster(&seeds, budget).map_err(ConfigError::RedisCluster)?), None)
            }
            (Some(pool), _) => (Some(RedisSource::Single(pool)), None),
            (None, Some(url)) => {
                let config = deadpool_redis::Config::from_url(url.as_str());
                let pool = config.create_pool(Some(deadpool_redis::Runtime::Tokio1)).map_err(ConfigError::Redis)?;
                (Some(RedisSource::Single(pool)), redis::Client::open(url).ok())
            }
            (None, None) => (None, None),
        };
        let background = Background::default();
        let redis = source.map(|source| RedisTier::new(source, prefix, budget, cooldown, background.clone()));
        let (mut patterns, policies): (Vec<_>, Vec<_>) =
            self.policies.into_iter().map(|(op, p)| (op, Arc::new(p))).partition(|(op, _)| op.ends_with('*'));
        let policies: HashMap<_, _> = policies.into_iter().collect();
        for (pattern, _) in &mut patterns {
            pattern.pop();
        }
        patterns.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        // Series are registered when an operation is first seen, not here: a recorder installed after the
        // store was built would miss them.
        let registered = telemetry::Registered::default();
        let subscriber = subscriber.zip(redis.as_ref().map(|redis| redis.channel().to_owned()));
        let wakeups = wakeup::Wakeups::new(subscriber, pg_pool.clone(), background.clone());
        let group = self.group_commit.unwrap_or(true).then(|| GroupCommit::new(&pg_pool, timeout, &background));
        Ok(Store {
            inner: Arc::new(Inner {
                postgres: PostgresTier::new(pg_pool, timeout, group, background.clone()),
                redis,
                default_policy: Arc::new(self.default_policy.unwrap_or_default()),
                patterns,
                policies,
                registered,
                wakeups,
                sealed_deployment: (self.encryption.is_none() && !self.clear_responses_allowed)
                    .then(clear_writes::SealedDeployment::default),
                encryption: self.encryption,
                background,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::RunOptions;

    /// Every file in `migrations/` is embedded, under the version and description sqlx reads from its
    /// name: a file added without its line would never run.
    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files: Vec<(i64, String, String)> = std::fs::read_dir(dir)
            .expect("migrations/")
            .map(|entry| {
                let path = entry.expect("entry").path();
                let name = path.file_stem().expect("name").to_string_lossy().into_owned();
                let (version, rest) = name.split_once('_').expect("<version>_<description>.sql");
                let sql = std::fs::read_to_string(&path).expect("read");
                (version.parse().expect("version"), rest.replace('_', " "), sql)
            })
            .collect();
        files.sort();
        let embedded: Vec<(i64, String, String)> =
            EMBEDDED_MIGRATIONS.iter().map(|&(v, d, sql)| (v, d.to_owned(), sql.to_owned())).collect();
        assert_eq!(embedded, files);
    }

    /// Extreme durations are refused by `build` with a typed error, never a panic (before:
    /// `postgres_timeout(Duration::MAX)` overflowed in `server_bounded`; a huge budget killed the
    /// repair task later, a huge TTL opened the Redis circuit on every completion).
    #[tokio::test]
    async fn extreme_durations_are_refused_or_hold_end_to_end() {
        let url = "postgres://postgres@127.0.0.1:1/none";
        for extreme in [Duration::ZERO, Duration::from_nanos(1), Duration::from_secs(u64::MAX), Duration::MAX] {
            let built = Store::builder().database_url(url).postgres_timeout(extreme).build();
            let valid = |max| (Duration::from_millis(1)..=max).contains(&extreme);
            assert!(built.is_ok() == valid(MAX_POSTGRES_TIMEOUT), "postgres_timeout({extreme:?})");
            let built =
                Store::builder().database_url(url).redis_url("redis://127.0.0.1:1/").redis_budget(extreme).build();
            assert!(built.is_ok() == valid(MAX_REDIS_BUDGET), "redis_budget({extreme:?})");
            let built = Store::builder().database_url(url).redis_cooldown(extreme).build();
            assert!(built.is_ok() == (extreme <= MAX_REDIS_COOLDOWN), "redis_cooldown({extreme:?})");
            let _ = server_bounded(PgConnectOptions::new(), extreme);
            let ttl = Policy::builder().redis_ttl(extreme).retention(None).build();
            assert!(ttl.is_err() || extreme <= crate::policy::MAX_POLICY_DURATION, "redis_ttl({extreme:?})");
            let options = RunOptions::default().wait_in_flight(extreme);
            let _deadline = tokio::time::Instant::now() + options.wait.unwrap_or_default();
        }
    }
}
