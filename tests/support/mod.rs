//! Shared tooling of the integration tests: real servers, a store in the requested mode, an effects
//! table that counts real executions, and a metrics recorder to read counters back.

#![allow(dead_code, unreachable_pub)]

pub mod chaos;
pub mod payments;
mod sealing;

use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idemstore::{IdempotencyKey, LeaseExpiry, Mode, Policy, Scope, Store};
use idemstore_testkit::{PostgresServer, Proxy, RedisServer};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::postgres::{PgPool, PgPoolOptions};

/// Instantiates each `async fn name(mode: Mode)` of the calling file once per mode, as
/// `two_tier::name` and `postgres_only::name`. The tests listed after `two_tier only:` are about Redis
/// itself (a marker, the circuit, the repair task) and are instantiated in two-tier mode alone: a test
/// that returned early in Postgres-only mode would be listed as passing there.
#[allow(unused_macros)]
macro_rules! suite {
    ($($test:ident),* $(,)? $(; two_tier only: $($redis:ident),* $(,)?)?) => {
        mod two_tier {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $test() { super::$test(idemstore::Mode::TwoTier).await })*
            $($(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $redis() { super::$redis().await })*)?
        }
        mod postgres_only {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $test() { super::$test(idemstore::Mode::PostgresOnly).await })*
        }
    };
}

/// Where the servers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Servers {
    /// `IDEMSTORE_TEST_DATABASE_URL` / `IDEMSTORE_TEST_REDIS_URL` when set, else throwaway servers.
    Any,
    /// Throwaway servers this test may kill, pause and restart.
    Owned,
    /// Like `Owned`, with extra `redis-server` arguments (memory limits, eviction policy).
    OwnedRedisWith(&'static [&'static str]),
    /// Like `Owned`, with the store reaching both servers through TCP proxies the test controls.
    Proxied,
}

pub struct Harness {
    pub mode: Mode,
    pub store: Store,
    pub pool: PgPool,
    pub redis: Option<RedisServer>,
    pub postgres: Option<PostgresServer>,
    /// With `Servers::Proxied`: the proxies between the store and Redis, and Postgres.
    pub redis_proxy: Option<Proxy>,
    pub postgres_proxy: Option<Proxy>,
    pub redis_url: Option<String>,
    pub database_url: String,
    /// Where the store connects: `database_url`, or the Postgres proxy's address with `Servers::Proxied`.
    pub store_url: String,
    pub prefix: String,
    pub operation: String,
    /// Set by the tests that store a response in clear on purpose; in the encrypted pass every other
    /// test's responses are checked sealed as its harness is dropped (`sealing.rs`).
    pub clear_allowed: AtomicBool,
}

impl Harness {
    pub async fn start(mode: Mode) -> Self {
        Self::with(mode, Policy::default(), Servers::Any).await
    }

    pub async fn with(mode: Mode, policy: Policy, servers: Servers) -> Self {
        let id = unique_id();
        let env = |name| std::env::var(name).ok().filter(|_| servers == Servers::Any);

        let (postgres, database_url) = match env("IDEMSTORE_TEST_DATABASE_URL") {
            Some(admin_url) => (None, create_database(&admin_url, &id).await),
            None => {
                let server = PostgresServer::start().expect("start a throwaway Postgres");
                let url = server.url();
                (Some(server), url)
            }
        };
        let (redis, redis_url) = match (mode, env("IDEMSTORE_TEST_REDIS_URL")) {
            (Mode::PostgresOnly, _) => (None, None),
            (_, Some(url)) => (None, Some(url)),
            _ => {
                let args = match servers {
                    Servers::OwnedRedisWith(args) => args,
                    _ => &[],
                };
                let server = RedisServer::start_with(args).expect("start a throwaway Redis");
                let url = server.url();
                (Some(server), Some(url))
            }
        };

        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(3))
            .connect(&database_url)
            .await
            .expect("connect to Postgres");
        sqlx::query("CREATE TABLE effects (id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, key TEXT NOT NULL)")
            .execute(&pool)
            .await
            .expect("create the effects table");

        let prefix = format!("t{id}");
        let operation = format!("charge-{id}");
        let (mut redis_proxy, mut postgres_proxy) = (None, None);
        let (mut store_url, mut store_redis_url) = (database_url.clone(), redis_url.clone());
        if servers == Servers::Proxied {
            let loopback = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let pg_port = postgres.as_ref().expect("owned Postgres").port();
            let proxy = Proxy::start(loopback(pg_port)).await.expect("Postgres proxy");
            store_url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());
            postgres_proxy = Some(proxy);
            if let Some(server) = &redis {
                let proxy = Proxy::start(loopback(server.port())).await.expect("Redis proxy");
                store_redis_url = Some(format!("redis://127.0.0.1:{}/", proxy.port()));
                redis_proxy = Some(proxy);
            }
        }
        let store = build_store(&store_url, &prefix, &operation, store_redis_url.as_deref(), policy);
        store.migrate().await.expect("migrate");
        // CI runs the suite a second time on the tenant-partitioned layout.
        if let Some(partitions) = std::env::var("IDEMSTORE_TEST_PARTITIONS").ok().and_then(|n| n.parse().ok()) {
            store.admin().partition_by_tenant(partitions).await.expect("partition the records by tenant");
        }
        recorder();
        Self {
            mode,
            store,
            pool,
            redis,
            postgres,
            redis_proxy,
            postgres_proxy,
            redis_url,
            database_url,
            store_url,
            prefix,
            operation,
            clear_allowed: AtomicBool::new(false),
        }
    }

    /// A two-tier harness whose hot tier is `cluster` (a throwaway Postgres of its own).
    pub async fn on_cluster(cluster: &idemstore_testkit::RedisCluster, policy: Policy) -> Self {
        let mut h = Self::with(Mode::PostgresOnly, policy.clone(), Servers::Owned).await;
        let builder = Store::builder()
            .database_url(&h.store_url)
            .key_prefix(&h.prefix)
            .redis_cluster(cluster.seed_urls())
            // Six nodes, Postgres and the client share two cores here: a budget that a healthy cluster
            // always meets, so that a fallback means a fault.
            .redis_budget(Duration::from_millis(500))
            .redis_cooldown(Duration::from_millis(50))
            .postgres_timeout(Duration::from_secs(2))
            .policy(&h.operation, policy);
        h.store = sealed(builder).build().expect("build the cluster store");
        h.mode = Mode::TwoTier;
        h
    }

    /// Joins servers another process started (for child processes of fault tests): no server is
    /// started, nothing is created, and dropping it stops nothing.
    pub async fn attach(mode: Mode, policy: Policy, database_url: String, redis_url: Option<String>, id: &str) -> Self {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(3))
            .connect(&database_url)
            .await
            .expect("connect to Postgres");
        let (prefix, operation) = (format!("t{id}"), format!("charge-{id}"));
        let store = build_store(&database_url, &prefix, &operation, redis_url.as_deref(), policy);
        recorder();
        Self {
            mode,
            store,
            pool,
            redis: None,
            postgres: None,
            redis_proxy: None,
            postgres_proxy: None,
            redis_url,
            store_url: database_url.clone(),
            database_url,
            prefix,
            operation,
            clear_allowed: AtomicBool::new(false),
        }
    }

    /// The id that names this test's Redis prefix and operation, for child processes to `attach` with.
    pub fn id(&self) -> &str {
        self.prefix.trim_start_matches('t')
    }

    /// Another store on the same servers, as a second process would have.
    pub fn new_store(&self, policy: Policy) -> Store {
        build_store(&self.store_url, &self.prefix, &self.operation, self.redis_url.as_deref(), policy)
    }

    pub fn scope(&self, tenant: &str) -> Scope {
        Scope::new(tenant, self.operation.clone()).expect("valid scope")
    }

    /// The side effect under test: one row per execution, in a table without a unique constraint.
    pub async fn charge(&self, tenant: &str, key: &IdempotencyKey) -> Result<serde_json::Value, sqlx::Error> {
        let id: i64 = sqlx::query_scalar("INSERT INTO effects (tenant, key) VALUES ($1, $2) RETURNING id")
            .bind(tenant)
            .bind(key.as_str())
            .fetch_one(&self.pool)
            .await?;
        Ok(serde_json::json!({ "charge": id, "tenant": tenant }))
    }

    pub async fn effects(&self, tenant: &str, key: &IdempotencyKey) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE tenant = $1 AND key = $2")
            .bind(tenant)
            .bind(key.as_str())
            .fetch_one(&self.pool)
            .await
            .expect("count effects")
    }

    /// A plain Redis connection, for flushing and inspecting.
    pub async fn redis_connection(&self) -> redis::aio::MultiplexedConnection {
        let url = self.redis_url.as_ref().expect("two-tier mode");
        let client = redis::Client::open(url.as_str()).expect("Redis URL");
        client.get_multiplexed_async_connection().await.expect("connect to Redis")
    }

    /// The Redis keys of this test.
    pub async fn redis_keys(&self) -> Vec<String> {
        let mut conn = self.redis_connection().await;
        redis::cmd("KEYS").arg(format!("{}:*", self.prefix)).query_async(&mut conn).await.expect("KEYS")
    }

    /// Time passes for one key without waiting: the owner's lease ran out (server time stays the only
    /// clock; the record's deadline moves instead). Its Redis marker goes with it, as it would.
    pub async fn pass_lease(&self, scope: &Scope, key: &IdempotencyKey) {
        self.move_deadline("idempotency_records", "lease_expires_at", scope, key).await;
        self.expire_redis_copy(scope, key, "p").await;
    }

    /// The record's retention ran out (for an in-progress record: its owner kept extending past it).
    /// A completed record's Redis copy expires with it, as its TTL makes it.
    pub async fn pass_retention(&self, scope: &Scope, key: &IdempotencyKey) {
        self.move_deadline("idempotency_records", "expires_at", scope, key).await;
        self.expire_redis_copy(scope, key, "c").await;
    }

    /// The key's tombstone reached its horizon.
    pub async fn pass_tombstone_horizon(&self, scope: &Scope, key: &IdempotencyKey) {
        let sql = "UPDATE idempotency_tombstones SET expires_at = now() - interval '1 millisecond'
                   WHERE digest = idempotency_key_digest($1, $2, $3)";
        let query = sqlx::query(sql).bind(scope.tenant()).bind(scope.operation()).bind(key.as_str());
        query.execute(&self.pool).await.expect("move the tombstone's horizon");
    }

    async fn move_deadline(&self, table: &str, column: &str, scope: &Scope, key: &IdempotencyKey) {
        let sql = format!(
            "UPDATE {table} SET {column} = now() - interval '1 millisecond'
             WHERE digest = idempotency_key_digest($1, $2, $3) AND tenant = $1 AND {column} IS NOT NULL"
        );
        let query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(scope.tenant()).bind(scope.operation());
        query.bind(key.as_str()).execute(&self.pool).await.expect("move a deadline");
    }

    /// Expires the key's Redis copy if it is in state `state` (`p`, `c` or `i`): a completed record is a
    /// string, a marker a hash.
    async fn expire_redis_copy(&self, scope: &Scope, key: &IdempotencyKey, state: &str) {
        if self.redis_url.is_none() {
            return;
        }
        let mut conn = self.redis_connection().await;
        let record_key = self.redis_key(scope, key);
        let kind: String = redis::cmd("TYPE").arg(&record_key).query_async(&mut conn).await.expect("TYPE");
        let held = match kind.as_str() {
            "string" => Some("c".to_owned()),
            "hash" => redis::cmd("HGET").arg(&record_key).arg("s").query_async(&mut conn).await.expect("HGET"),
            _ => None,
        };
        if held.as_deref() == Some(state) {
            let _: i64 = redis::cmd("DEL").arg(&record_key).query_async(&mut conn).await.expect("DEL");
        }
    }

    /// A record's Redis name: `prefix:{digest}`, the digest 32 hex digits of SHA-256 over the
    /// length-prefixed tenant, operation and key (written out here, so a change of format fails tests).
    pub fn redis_key(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        use sha2::Digest as _;
        let (tenant, operation) = (scope.tenant(), scope.operation());
        let named = format!("{}:{tenant}:{}:{operation}:{key}", tenant.len(), operation.len());
        let digest: String = sha2::Sha256::digest(named).iter().take(16).map(|byte| format!("{byte:02x}")).collect();
        format!("{}:{{{digest}}}", self.prefix)
    }

    /// Waits until a claim has asked to hear of the record's settlement: the digest in the Redis marker, or
    /// the `waited` flag in Postgres (`in_redis` chooses).
    pub async fn wait_until_flagged(&self, scope: &Scope, k: &IdempotencyKey, in_redis: bool) {
        let started = std::time::Instant::now();
        loop {
            let flagged = if in_redis {
                let mut conn = self.redis_connection().await;
                let field: Option<String> = redis::cmd("HGET")
                    .arg(self.redis_key(scope, k))
                    .arg("w")
                    .query_async(&mut conn)
                    .await
                    .expect("HGET");
                field.is_some()
            } else {
                sqlx::query_scalar::<_, bool>(
                    "SELECT waited FROM idempotency_records WHERE digest = idempotency_key_digest($1, $2, $3) AND tenant = $1",
                )
                .bind(scope.tenant())
                .bind(scope.operation())
                .bind(k.as_str())
                .fetch_optional(&self.pool)
                .await
                .expect("read the flag")
                .unwrap_or(false)
            };
            if flagged {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "the waiter never asked to be woken");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A counter of this test's operation (labels other than `operation` must match too).
    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        counter(&self.operation, name, labels)
    }
}

/// The sum of all series of a metric in this process (for metrics without an `operation` label).
pub fn total(name: &str) -> f64 {
    recorder()
        .render()
        .lines()
        .filter(|line| line.starts_with(name) && !line.starts_with('#'))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, value| sum + value)
}

/// The sum of a counter's series for `operation` whose labels include `labels`.
pub fn counter(operation: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut labels = labels.to_vec();
    labels.push(("operation", operation));
    labelled(name, &labels)
}

/// The sum of a metric's series whose labels include `labels`.
pub fn labelled(name: &str, labels: &[(&str, &str)]) -> f64 {
    let wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    recorder()
        .render()
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter(|line| wanted.iter().all(|w| line.contains(w.as_str())))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, value| sum + value)
}

/// A store connecting to `database_url` (directly or through the test's proxy) with pool connections of
/// its own, as an application's store would, carrying the server-side bounds.
pub fn build_store(
    database_url: &str,
    prefix: &str,
    operation: &str,
    redis_url: Option<&str>,
    policy: Policy,
) -> Store {
    let mut builder = Store::builder()
        .database_url(database_url)
        .key_prefix(prefix)
        .redis_cooldown(Duration::from_millis(50))
        .postgres_timeout(Duration::from_secs(2))
        .policy(operation, policy);
    if let Some(url) = redis_url {
        builder = builder.redis_url(url);
    }
    sealed(builder).build().expect("build the store")
}

/// `builder` with the test run's encryption key, when there is one: CI runs the suite a second time with
/// every response encrypted, and a store a test builds itself must seal (and open) as the harness's do.
pub fn sealed(builder: idemstore::StoreBuilder) -> idemstore::StoreBuilder {
    match std::env::var("IDEMSTORE_TEST_ENCRYPTION_KEY") {
        Ok(keys) => {
            builder.encryption(idemstore::Encryption::from_base64(&keys).expect("IDEMSTORE_TEST_ENCRYPTION_KEY"))
        }
        Err(_) => builder,
    }
}

/// The `idemctl` binary of the workspace's `idemstore-cli` package, beside this test binary (cargo and
/// nextest build it with the workspace's tests: that package has an integration test of its own), or
/// `IDEMCTL` (taken as it is). Refused when a source it was built from (its dep-info file lists them,
/// the library's included) is newer than it: a run of this package's tests alone (`-p idemstore`) does
/// not rebuild it.
pub fn idemctl() -> std::path::PathBuf {
    if let Some(binary) = std::env::var_os("IDEMCTL") {
        return binary.into();
    }
    let this = std::env::current_exe().expect("the test binary's path");
    // <target>/<profile>/deps/integration-<hash> -> <target>/<profile>/idemctl
    let profile = this.parent().and_then(std::path::Path::parent).expect("a target directory");
    let binary = profile.join(format!("idemctl{}", std::env::consts::EXE_SUFFIX));
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} is missing: build it with `cargo build -p idemstore-cli`", binary.display()));
    // "<binary>: <source> <source> ...", paths with spaces escaped (none here).
    let sources = std::fs::read_to_string(profile.join("idemctl.d")).unwrap_or_default();
    let stale = sources
        .split_once(": ")
        .map_or("", |(_, sources)| sources)
        .split_whitespace()
        .find(|source| std::fs::metadata(source).and_then(|m| m.modified()).is_ok_and(|changed| changed > built));
    if let Some(source) = stale {
        panic!("{} is older than {source}: rebuild it with `cargo build -p idemstore-cli`", binary.display());
    }
    binary
}

pub fn key(name: &str) -> IdempotencyKey {
    IdempotencyKey::new(name).expect("valid key")
}

fn unique_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

async fn create_database(admin_url: &str, id: &str) -> String {
    let name = format!("idemstore_test_{id}");
    let admin = PgPool::connect(admin_url).await.expect("connect to IDEMSTORE_TEST_DATABASE_URL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .expect("create a test database");
    let (base, _) = admin_url.rsplit_once('/').expect("URL with a database name");
    format!("{base}/{name}")
}

/// One recorder per test process, shared by all tests in it; tests read only their own operation.
pub fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new().set_buckets(idemstore::telemetry::CLAIM_DURATION_BUCKETS);
        let handle = builder.and_then(PrometheusBuilder::install_recorder).expect("install the metrics recorder");
        idemstore::telemetry::describe();
        handle
    })
}

/// Short leases, so that markers orphaned by a fault expire within the test.
pub fn short_lease(expiry: LeaseExpiry) -> Policy {
    Policy::builder()
        .lease(Duration::from_secs(2))
        .redis_ttl(Duration::from_secs(600))
        .lease_expiry(expiry)
        .build()
        .expect("policy")
}

/// Under `cargo test` every test shares one process, so one metrics recorder: a test that reads absolute
/// counters runs itself again in a process of its own (nextest gives each test one already). `module` is
/// the caller's `module_path!()`. Returns `true` when this call only supervised that child, which passed;
/// the caller then returns.
pub fn rerun_alone(mode: Mode, module: &str, test: &str) -> bool {
    let own_process = std::env::var("NEXTEST_EXECUTION_MODE").is_ok_and(|m| m == "process-per-test");
    if own_process || std::env::var_os("IDEMSTORE_ALONE").is_some() {
        return false;
    }
    let suite = if mode == Mode::TwoTier { "two_tier" } else { "postgres_only" };
    let name = test_name(module, &format!("{suite}::{test}"));
    let status = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", &name, "--nocapture"])
        .env("IDEMSTORE_ALONE", "1")
        .status()
        .expect("run the test in a process of its own");
    assert!(status.success(), "{name} failed in its own process");
    true
}

/// The name libtest knows a test of `module` (a `module_path!()`) by: its path below the crate root.
fn test_name(module: &str, test: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{test}"),
        None => test.to_owned(),
    }
}

/// This test binary, run again as a child process that joins this test's servers: `entry` is an ignored
/// test of `module` (the caller's `module_path!()`).
pub fn child(h: &Harness, module: &str, entry: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args(["--exact", &test_name(module, entry), "--ignored", "--nocapture"])
        .env("IDEMSTORE_CHILD_DATABASE_URL", &h.database_url)
        .env("IDEMSTORE_CHILD_ID", h.id())
        .env("IDEMSTORE_CHILD_MODE", format!("{:?}", h.mode));
    if let Some(url) = &h.redis_url {
        command.env("IDEMSTORE_CHILD_REDIS_URL", url);
    }
    command
}

/// Runs the child `entry`, waits until it prints a line containing `cue`, then SIGKILLs and reaps it:
/// a process dying at an exact point of its work.
pub fn kill_child_at(h: &Harness, module: &str, entry: &str, cue: &str) {
    use std::io::BufRead as _;
    let mut process = child(h, module, entry).stdout(std::process::Stdio::piped()).spawn().expect("spawn the child");
    let lines = std::io::BufReader::new(process.stdout.take().expect("stdout")).lines();
    let mut cued = false;
    for line in lines {
        if line.expect("child stdout").contains(cue) {
            cued = true;
            break;
        }
    }
    // A child that ended without its cue never reached the window the test kills it in.
    assert!(cued, "the child never printed {cue:?}");
    process.kill().expect("SIGKILL the child");
    process.wait().expect("reap the child");
}

/// In a child process: the harness of the parent test, or `None` when run on its own.
pub async fn attach_to_parent() -> Option<Harness> {
    let database_url = std::env::var("IDEMSTORE_CHILD_DATABASE_URL").ok()?;
    let id = std::env::var("IDEMSTORE_CHILD_ID").ok()?;
    let mode =
        if std::env::var("IDEMSTORE_CHILD_MODE").ok()? == "TwoTier" { Mode::TwoTier } else { Mode::PostgresOnly };
    let redis_url = std::env::var("IDEMSTORE_CHILD_REDIS_URL").ok();
    Some(Harness::attach(mode, short_lease(LeaseExpiry::TakeOver), database_url, redis_url, &id).await)
}
