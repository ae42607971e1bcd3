//! The workloads and the request each one sends. Fixtures (completed keys, held leases) are built
//! before a cell is timed, never inside it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idemstore::{Begin, Fingerprint, IdempotencyKey, Outbox, Owner, RunOutcome, Scope, Store, TxFuture};
use redis::Script;
use serde_json::{Value, json};
use sqlx::PgPool;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Every request a fresh key: claim, work, complete.
    New,
    /// Retries of keys that completed earlier.
    Replay,
    /// Duplicates of keys whose owner is still working.
    Inflight,
    /// Keys reused with a different payload.
    Mismatch,
    /// 70% new, 25% replay, 4% in flight, 1% mismatch.
    Mixed,
}

/// What a cell measures: the library in one mode, or one of the floors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Subject {
    TwoTier,
    /// Two-tier on a three-master Redis Cluster instead of one Redis (replay and new keys).
    TwoTierCluster,
    /// Two-tier with every response encrypted (`StoreBuilder::encryption`): its cost (replay and new keys).
    TwoTierEncrypted,
    /// Two-tier under a per-tenant quota that the load never reaches (`Policy::quota`): the cost of
    /// counting new keys and live leases (new keys only; nothing else reaches the quota).
    TwoTierQuota,
    PostgresOnly,
    /// Two-tier with group commit off (`StoreBuilder::group_commit(false)`): each claim and completion
    /// its own statement (new keys only).
    TwoTierAlone,
    /// Postgres-only with group commit off (new keys only).
    PostgresOnlyAlone,
    /// Two-tier with `run_once_in_tx`: claim, work and completion in one commit (new keys only).
    TwoTierInTx,
    /// Postgres-only with `run_once_in_tx`: the transactional path's own baseline (new keys only).
    PostgresOnlyInTx,
    /// As `TwoTierInTx`, the work also writing an outbox row (a receipt to send): the outbox's cost.
    TwoTierInTxOutbox,
    /// A raw EVALSHA of a trivial script: the least a Redis-answered request can cost.
    EvalshaFloor,
    /// A raw `INSERT ... ON CONFLICT` + `UPDATE` pair: the least a durable claim and completion cost.
    SqlFloor,
}

impl Subject {
    pub fn name(self) -> &'static str {
        match self {
            Subject::TwoTier => "two-tier",
            Subject::TwoTierCluster => "two-tier cluster",
            Subject::TwoTierEncrypted => "two-tier encrypted",
            Subject::TwoTierQuota => "two-tier quota",
            Subject::PostgresOnly => "postgres-only",
            Subject::TwoTierAlone => "two-tier, writes alone",
            Subject::PostgresOnlyAlone => "postgres-only, writes alone",
            Subject::TwoTierInTx => "two-tier in-tx",
            Subject::PostgresOnlyInTx => "postgres-only in-tx",
            Subject::TwoTierInTxOutbox => "two-tier in-tx + outbox",
            Subject::EvalshaFloor => "evalsha floor",
            Subject::SqlFloor => "sql floor",
        }
    }
}

/// How a library fixture sends new keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewKeyPath {
    /// `run_once`: the claim, the work and the completion commit one after the other.
    Separate,
    /// `run_once_in_tx`: one commit.
    InTx,
    /// `run_once_in_tx`, the work also enqueueing an outbox row.
    InTxWithOutbox,
}

impl Subject {
    /// The Postgres-only subject a two-tier one is compared with, like for like.
    pub fn postgres_only_baseline(self) -> Option<Subject> {
        match self {
            Subject::TwoTier | Subject::TwoTierCluster | Subject::TwoTierEncrypted | Subject::TwoTierQuota => {
                Some(Subject::PostgresOnly)
            }
            Subject::TwoTierInTx | Subject::TwoTierInTxOutbox => Some(Subject::PostgresOnlyInTx),
            Subject::TwoTierAlone => Some(Subject::PostgresOnlyAlone),
            _ => None,
        }
    }

    /// The subject this one is a variant of, and compared with: plain two-tier (one Redis, responses in
    /// clear, group commit on) or plain Postgres-only.
    pub fn variant_of(self) -> Option<Subject> {
        match self {
            Subject::TwoTierCluster | Subject::TwoTierEncrypted | Subject::TwoTierQuota | Subject::TwoTierAlone => {
                Some(Subject::TwoTier)
            }
            Subject::PostgresOnlyAlone => Some(Subject::PostgresOnly),
            _ => None,
        }
    }

    pub fn new_key_path(self) -> NewKeyPath {
        match self {
            Subject::TwoTierInTx | Subject::PostgresOnlyInTx => NewKeyPath::InTx,
            Subject::TwoTierInTxOutbox => NewKeyPath::InTxWithOutbox,
            _ => NewKeyPath::Separate,
        }
    }
}

/// Completed keys per replay/mismatch fixture, and held keys per in-flight fixture.
const COMPLETED: u64 = 256;
const HELD: u64 = 32;

/// One timed cell's requests.
pub enum Fixture {
    Library {
        store: Store,
        pool: PgPool,
        workload: Workload,
        new_keys: NewKeyPath,
        scope: Scope,
        cell: String,
        next: AtomicU64,
        completed: Vec<IdempotencyKey>,
        held: Vec<(IdempotencyKey, Owner)>,
    },
    Evalsha {
        conn: redis::aio::MultiplexedConnection,
        script: Script,
    },
    Sql {
        pool: PgPool,
        cell: String,
        next: AtomicU64,
    },
}

/// What a request came back with: whether it was the answer its workload expects.
pub type Expected = bool;

fn payload() -> Value {
    json!({"amount": 1200, "currency": "EUR", "customer": "cus_1"})
}

fn other_payload() -> Value {
    json!({"amount": 9900, "currency": "EUR", "customer": "cus_1"})
}

impl Fixture {
    pub async fn library(
        store: Store,
        pool: PgPool,
        workload: Workload,
        new_keys: NewKeyPath,
        cell: String,
    ) -> Arc<Self> {
        let scope = Scope::new(cell.clone(), format!("{workload:?}")).expect("valid scope");
        let mut completed = Vec::new();
        let mut held = Vec::new();
        if matches!(workload, Workload::Replay | Workload::Mismatch | Workload::Mixed) {
            for i in 0..COMPLETED {
                let key = IdempotencyKey::new(format!("{cell}-done-{i}")).expect("key");
                let done = store.run_once(&scope, &key, &payload(), || work(&pool, &cell)).await;
                assert!(matches!(done, Ok(RunOutcome::Executed(_))), "fixture: {done:?}");
                completed.push(key);
            }
        }
        if matches!(workload, Workload::Inflight | Workload::Mixed) {
            let fingerprint = Fingerprint::of_serialize(&payload(), store.policy(scope.operation()).fingerprint())
                .expect("fingerprint");
            for i in 0..HELD {
                let key = IdempotencyKey::new(format!("{cell}-held-{i}")).expect("key");
                let Ok(Begin::Acquired(lease)) = store.begin(&scope, &key, &fingerprint).await else {
                    panic!("fixture: could not hold {key}")
                };
                held.push((key, lease));
            }
        }
        Arc::new(Fixture::Library {
            store,
            pool,
            workload,
            new_keys,
            scope,
            cell,
            next: AtomicU64::new(0),
            completed,
            held,
        })
    }

    /// One multiplexed connection, as the store uses.
    pub async fn evalsha(client: &redis::Client) -> Arc<Self> {
        let conn = client.get_multiplexed_async_connection().await.expect("connect to Redis");
        Arc::new(Fixture::Evalsha { conn, script: Script::new("return 1") })
    }

    pub fn sql(pool: PgPool, cell: String) -> Arc<Self> {
        Arc::new(Fixture::Sql { pool, cell, next: AtomicU64::new(0) })
    }

    /// Sends one request.
    pub async fn request(&self) -> Expected {
        match self {
            Fixture::Library { store, pool, workload, new_keys, scope, cell, next, completed, held } => {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let kind = match workload {
                    Workload::Mixed => match n % 100 {
                        0..70 => Workload::New,
                        70..95 => Workload::Replay,
                        95..99 => Workload::Inflight,
                        _ => Workload::Mismatch,
                    },
                    other => *other,
                };
                let pick = |keys: &[IdempotencyKey]| keys[(n % keys.len() as u64) as usize].clone();
                let (key, body) = match kind {
                    Workload::New => (IdempotencyKey::new(format!("{cell}-new-{n}")).expect("key"), payload()),
                    Workload::Replay => (pick(completed), payload()),
                    Workload::Mismatch => (pick(completed), other_payload()),
                    _ => (held[(n % HELD) as usize].0.clone(), payload()),
                };
                let outcome = if kind == Workload::New && *new_keys != NewKeyPath::Separate {
                    let (tenant, outbox) =
                        (cell.clone(), (*new_keys == NewKeyPath::InTxWithOutbox).then(|| store.outbox()));
                    store.run_once_in_tx(scope, &key, &body, move |tx| work_in_tx(tx, tenant, outbox)).await
                } else {
                    store.run_once(scope, &key, &body, || work(pool, cell)).await
                };
                matches!(
                    (kind, outcome),
                    (Workload::New, Ok(RunOutcome::Executed(_)))
                        | (Workload::Replay, Ok(RunOutcome::Replayed(_)))
                        | (Workload::Inflight, Ok(RunOutcome::InFlight { .. }))
                        | (Workload::Mismatch, Ok(RunOutcome::Mismatch))
                )
            }
            Fixture::Evalsha { conn, script } => {
                script.invoke_async::<_, i64>(&mut conn.clone()).await.is_ok_and(|one| one == 1)
            }
            Fixture::Sql { pool, cell, next } => {
                let key = format!("{cell}-{}", next.fetch_add(1, Ordering::Relaxed));
                let claimed =
                    sqlx::query("INSERT INTO floor_claims (k, state) VALUES ($1, 'p') ON CONFLICT (k) DO NOTHING")
                        .bind(&key)
                        .execute(pool)
                        .await;
                let completed =
                    sqlx::query("UPDATE floor_claims SET state = 'c' WHERE k = $1").bind(&key).execute(pool).await;
                claimed.is_ok() && completed.is_ok()
            }
        }
    }

    /// Statements the work itself sent, beyond the store's.
    pub fn floor_costs(&self) -> Option<(f64, f64)> {
        match self {
            Fixture::Evalsha { .. } => Some((0.0, 1.0)),
            Fixture::Sql { .. } => Some((2.0, 0.0)),
            Fixture::Library { .. } => None,
        }
    }
}

/// The side effect, the same in both modes: one small durable insert.
async fn work(pool: &PgPool, tenant: &str) -> Result<Value, WorkError> {
    let id: i64 = sqlx::query_scalar(CHARGE).bind(tenant).fetch_one(pool).await?;
    Ok(json!({ "charge": id }))
}

/// The same insert, inside the claim's transaction; with an outbox, its receipt too.
fn work_in_tx(tx: &mut sqlx::PgConnection, tenant: String, outbox: Option<Outbox>) -> TxFuture<'_, Value, WorkError> {
    Box::pin(async move {
        let id: i64 = sqlx::query_scalar(CHARGE).bind(tenant).fetch_one(&mut *tx).await?;
        if let Some(outbox) = outbox {
            outbox.enqueue(tx, RECEIPTS, &json!({ "charge": id })).await?;
        }
        Ok(json!({ "charge": id }))
    })
}

type WorkError = Box<dyn std::error::Error + Send + Sync>;

const CHARGE: &str = "INSERT INTO bench_charges (tenant, amount) VALUES ($1, 1200) RETURNING id";

/// The outbox topic of the receipts that `TwoTierInTxOutbox` writes.
pub const RECEIPTS: &str = "receipts";

pub const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS bench_charges (id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL);
    CREATE TABLE IF NOT EXISTS floor_claims (k TEXT PRIMARY KEY, state TEXT NOT NULL);";
