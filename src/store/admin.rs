//! [`Admin`], the handle for operators and schedulers: purge expired records, recover stale leases,
//! resolve indeterminate records, look up, inspect and evict keys, and count what the store holds. None
//! of it is on a request's path, and the library runs none of it by itself: schedule the jobs (or run
//! `idemctl`).

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::time::Duration;

use sqlx::Row as _;

use super::redis_tier::RedisView;
use super::{Statement, Store};
use crate::error::{ConfigError, EncryptionError, StoreError};
use crate::key::{IdempotencyKey, Scope};
use crate::policy::{LeaseExpiry, millis};
use crate::record::{Lease, Record, State};
use crate::telemetry;

/// One bounded batch of expired records. Completed ones leave a tombstone (so a late retry is refused,
/// not executed again), released ones go; in-progress and indeterminate records are never purged: a live
/// lease outlives any retention, and an indeterminate record waits for its resolution. `FOR UPDATE SKIP
/// LOCKED` lets several purgers run at once and never waits on a record being claimed; the condition is
/// checked again on the locked row. Records are matched by primary key (ctids repeat across partitions).
/// A tombstone lasts for the horizon its record was claimed under (NULL: forever).
const PURGE_BATCH: Statement = Statement::new(
    "purge",
    "
    WITH doomed AS (
        SELECT digest, tenant FROM idempotency_records
        WHERE expires_at <= now() AND state IN ('c', 'r')
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM idempotency_records r USING doomed d
        WHERE r.digest = d.digest AND r.tenant = d.tenant
          AND r.expires_at <= now() AND r.state IN ('c', 'r')
        RETURNING r.digest, r.state, r.fingerprint, r.fence, r.expires_at, r.tombstone_ms
    ), buried AS (
        INSERT INTO idempotency_tombstones (digest, fingerprint, fence, expires_at)
        SELECT digest, ('x' || encode(substring(fingerprint FROM 1 FOR 8), 'hex'))::bit(64)::bigint,
               fence,
               expires_at + tombstone_ms::float8 * interval '1 millisecond'
        FROM gone WHERE state = 'c'
        ON CONFLICT (digest) DO UPDATE
        SET fingerprint = EXCLUDED.fingerprint, fence = EXCLUDED.fence, expires_at = EXCLUDED.expires_at
    )
    SELECT count(*) FROM gone",
);

/// One bounded batch of quota counters ([`crate::Quota`]) whose windows have both passed.
const PURGE_QUOTA_USAGE: Statement = Statement::new(
    "purge_quota_usage",
    "
    DELETE FROM idempotency_quota_usage u USING (
        SELECT tenant, operation, window_ms, window_index, backend FROM idempotency_quota_usage
        WHERE expires_at <= now()
        LIMIT $1
        FOR UPDATE SKIP LOCKED) AS spent
    WHERE (u.tenant, u.operation, u.window_ms, u.window_index, u.backend)
        = (spent.tenant, spent.operation, spent.window_ms, spent.window_index, spent.backend)",
);

/// One bounded batch of tombstones whose horizon ended: their keys are new again.
const PURGE_TOMBSTONES: Statement = Statement::new(
    "purge_tombstones",
    "
    DELETE FROM idempotency_tombstones
    WHERE digest IN (
        SELECT digest FROM idempotency_tombstones
        WHERE expires_at <= now()
        LIMIT $1
        FOR UPDATE SKIP LOCKED)
      AND expires_at <= now()",
);

const COUNT_EXPIRED: Statement = Statement::new(
    "count_expired",
    "SELECT count(*) FROM idempotency_records WHERE expires_at <= now() AND state IN ('c', 'r')",
);

const STALE: Statement = Statement::new(
    "stale",
    "
    SELECT tenant, operation, idempotency_key, fingerprint, fence, owner, on_lease_expiry
    FROM idempotency_records
    WHERE state = 'p' AND lease_expires_at <= now()
    ORDER BY lease_expires_at
    LIMIT $1",
);

const COUNT_STALE: Statement = Statement::new(
    "count_stale",
    "SELECT count(*) FROM idempotency_records WHERE state = 'p' AND lease_expires_at <= now()",
);

/// Fenced like every write: an owner that extended its lease or finished since it was read is untouched.
const RELEASE_STALE: Statement = Statement::new(
    "release_stale",
    "
    UPDATE idempotency_records
    SET state = 'r', owner = NULL, lease_expires_at = NULL, updated_at = now()
    WHERE digest = $1::uuid AND tenant = $2 AND fence = $3
      AND state = 'p' AND lease_expires_at <= now()",
);

/// Kept for the retention the record was claimed under (NULL: forever). Also replaces the response of a
/// completed record whose bytes were changed (`$5`, as read; its retention unchanged); the fingerprint
/// (`$4`), which the sealed response is bound to, and the fence (`$6`) read must still be the record's.
const RESOLVE_COMPLETED: Statement = Statement::new(
    "resolve",
    "
    UPDATE idempotency_records
    SET response = $3, owner = NULL, lease_expires_at = NULL,
        expires_at = CASE WHEN state = 'c' THEN expires_at
                          ELSE now() + retention_ms::float8 * interval '1 millisecond' END,
        state = 'c', updated_at = now()
    WHERE digest = $1::uuid AND tenant = $2 AND fingerprint = $4 AND fence = $6
      AND (state = 'i' OR (state = 'c' AND response = $5))",
);

const RESOLVE_RELEASED: Statement = Statement::new(
    "resolve",
    "
    UPDATE idempotency_records
    SET state = 'r', owner = NULL, lease_expires_at = NULL, updated_at = now()
    WHERE digest = $1::uuid AND tenant = $2 AND state = 'i'",
);

const COUNTS: Statement = Statement::new(
    "stats",
    "
    SELECT operation, state, tier, count(*) AS records,
           count(*) FILTER (WHERE expires_at <= now() + $1::float8 * interval '1 millisecond') AS expiring
    FROM idempotency_records GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
);

const INDETERMINATE: Statement =
    Statement::new("count_indeterminate", "SELECT count(*) FROM idempotency_records WHERE state = 'i'");

/// The purge statements, each run in batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purge {
    /// Expired records (completed ones leave a tombstone).
    Records,
    /// Tombstones past their horizon.
    Tombstones,
    /// Quota counters of windows that no longer take part in any estimate.
    QuotaUsage,
}

impl Purge {
    /// Whether what it deletes counts as purged (returned, and in `idemstore_purged_records_total`):
    /// records and tombstones, not quota counters.
    fn counted(self) -> bool {
        self != Purge::QuotaUsage
    }
}

/// What [`Admin::recover_stale`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Recovery {
    /// Stale records found.
    pub found: u64,
    /// Released so the next request executes (operations under `LeaseExpiry::TakeOver`).
    pub released: u64,
    /// Marked indeterminate (operations under `LeaseExpiry::MarkIndeterminate`).
    pub marked_indeterminate: u64,
    /// Left as they are because they cannot be read as records (a tenant, operation or key written
    /// around the store that it would refuse, a fingerprint that is not 32 bytes): each is logged with
    /// its tenant and operation, for an operator to repair or delete. The others are recovered.
    pub unreadable: u64,
}

/// How an operator settles an indeterminate record.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// The work did happen: store this response for replay.
    Completed(Vec<u8>),
    /// The work did not happen: the next request executes it.
    Released,
}

/// Records by operation, state and tier ([`Admin::stats`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StatsRow {
    /// The operation.
    pub operation: String,
    /// The state.
    pub state: State,
    /// The tier the records were stored under.
    pub tier: String,
    /// How many records.
    pub records: u64,
    /// How many of them expire within the window asked for.
    pub expiring: u64,
}

/// A key as both tiers hold it ([`Admin::inspect`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The Redis key of the record.
    pub redis_key: Option<String>,
    /// What Postgres holds, the source of truth, its response opened ([`crate::Encryption`]).
    pub postgres: Option<Record>,
    /// Why the stored response did not open (it is left out of `postgres` then).
    pub unreadable: Option<EncryptionError>,
    /// What Redis holds, if it is configured and reachable.
    pub redis: Option<RedisView>,
}

/// The operator's and the scheduler's handle on a store ([`Store::admin`]): purging, recovery, resolution,
/// lookup, inspection, eviction and counts. Cheap to make and to clone (it holds the store).
#[derive(Clone, Debug)]
pub struct Admin {
    store: Store,
}

impl Store {
    /// The jobs and operator tools of this store, apart from the request path.
    pub fn admin(&self) -> Admin {
        Admin { store: self.clone() }
    }

    pub(crate) async fn evict_redis(&self, scope: &Scope, key: &IdempotencyKey) {
        if let Some(redis) = &self.inner.redis
            && let Err(error) = redis.evict(&redis.record_key(scope, key)).await
        {
            telemetry::redis_fallback(scope.operation(), error.reason());
        }
    }
}

/// A purge under way ([`Admin::purge_expired`]): records first, then tombstones past their horizon, then
/// spent quota counters, a batch at a time.
#[must_use = "a purge does nothing until it is awaited or asked for its batches"]
#[derive(Debug)]
pub struct Purging {
    admin: Admin,
    batch: u32,
    /// The statements still to run, the current one last.
    left: Vec<Purge>,
}

impl Purging {
    /// Purges the next batch; returns how many records and tombstones it purged (a batch of quota
    /// counters counts 0), or `None` once nothing expired is left.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed (batches already purged stay purged; asking
    /// again goes on).
    pub async fn next_batch(&mut self) -> Result<Option<u64>, StoreError> {
        let Some(&statement) = self.left.last() else { return Ok(None) };
        let deleted = self.admin.purge(statement, self.batch).await?;
        if deleted < u64::from(self.batch) {
            self.left.pop();
        }
        Ok(Some(if statement.counted() { deleted } else { 0 }))
    }
}

impl IntoFuture for Purging {
    type Output = Result<u64, StoreError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    /// Purges every batch; returns how many records and tombstones went.
    fn into_future(mut self) -> Self::IntoFuture {
        Box::pin(async move {
            let mut purged = 0;
            while let Some(deleted) = self.next_batch().await? {
                purged += deleted;
            }
            Ok(purged)
        })
    }
}

impl Admin {
    /// Reads a record from Postgres, the source of truth, its response opened. A completed record whose
    /// retention has passed (not purged yet) reads as [`State::Expired`], without its response: what a
    /// retry is answered, and nothing of the response is shown past its retention.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed; [`StoreError::Encryption`] if the stored
    /// response cannot be opened.
    pub async fn lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.store.lookup(scope, key).await
    }

    /// Turns the records table into `partitions` hash partitions by tenant (`PARTITION BY HASH
    /// (tenant)`), after [`Store::migrate`](crate::Store::migrate): the layout a tenant-distributed deployment starts from
    /// (docs/scale-out.md). Run it with the application stopped, like a migration that rewrites a table:
    /// existing records are copied under a table lock, in one transaction, keeping their fences, and a
    /// claim or completion that waits on that lock past its own lock timeout fails. The table keeps its
    /// schema, owner, grants, index and constraint names; one with triggers, row security, column
    /// privileges, rules or publications of its own is refused. Running it again with the same number
    /// does nothing and takes no lock.
    ///
    /// # Errors
    /// [`ConfigError::Partitions`] for 0 or more than 1024 partitions; [`StoreError::Migrate`] when the
    /// table is already partitioned into another number, has what it refuses above, its lock is not
    /// granted within 5 s, or Postgres fails.
    pub async fn partition_by_tenant(&self, partitions: u16) -> Result<(), StoreError> {
        if !(1..=1024).contains(&partitions) {
            return Err(ConfigError::Partitions { partitions }.into());
        }
        let failed = |e: sqlx::Error| StoreError::Migrate(sqlx::migrate::MigrateError::Execute(e));
        let mut tx = self.store.pg_pool().begin().await.map_err(failed)?;
        sqlx::raw_sql("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::query("SELECT set_config('idemstore.partitions', $1, true)")
            .bind(partitions.to_string())
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
        sqlx::raw_sql(include_str!("partition_by_tenant.sql")).execute(&mut *tx).await.map_err(failed)?;
        tx.commit().await.map_err(failed)
    }

    /// Purges expired records, `batch` at a time: await it to purge until none is left (it returns how
    /// many records and tombstones went; spent quota counters go too, uncounted), or take one batch at a
    /// time with [`Purging::next_batch`] (to show progress, or to pause between batches). A completed
    /// record leaves a tombstone until its horizon ([`Policy::tombstone`](crate::Policy::tombstone)) ends;
    /// in-progress and indeterminate records are never purged. Safe to run from several processes at
    /// once; each batch is one short statement.
    ///
    /// ```no_run
    /// # async fn purge(store: idemstore::Store) -> Result<(), idemstore::StoreError> {
    /// let purged = store.admin().purge_expired(1000).await?;
    /// # Ok(()) }
    /// ```
    pub fn purge_expired(&self, batch: u32) -> Purging {
        Purging {
            admin: self.clone(),
            batch: batch.max(1),
            left: vec![Purge::QuotaUsage, Purge::Tombstones, Purge::Records],
        }
    }

    async fn purge(&self, statement: Purge, batch: u32) -> Result<u64, StoreError> {
        let limit = i64::from(batch);
        let purged = match statement {
            Purge::Records => {
                let query = sqlx::query_scalar::<_, i64>(PURGE_BATCH.sql).bind(limit);
                u64::try_from(self.store.bounded(&PURGE_BATCH, query.fetch_one(self.store.pg_pool())).await?)
                    .unwrap_or(0)
            }
            Purge::Tombstones => {
                let query = sqlx::query(PURGE_TOMBSTONES.sql).bind(limit).execute(self.store.pg_pool());
                self.store.bounded(&PURGE_TOMBSTONES, query).await?.rows_affected()
            }
            Purge::QuotaUsage => {
                let query = sqlx::query(PURGE_QUOTA_USAGE.sql).bind(limit).execute(self.store.pg_pool());
                self.store.bounded(&PURGE_QUOTA_USAGE, query).await?.rows_affected()
            }
        };
        if statement.counted() {
            telemetry::purged(purged);
        }
        Ok(purged)
    }

    /// How many records have expired and await purging.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn count_expired(&self) -> Result<u64, StoreError> {
        count(&self.store, &COUNT_EXPIRED).await
    }

    /// How many in-progress records have a lease that ran out: what [`Admin::recover_stale`] would find.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn count_stale(&self) -> Result<u64, StoreError> {
        count(&self.store, &COUNT_STALE).await
    }

    /// Applies the [`LeaseExpiry`] each record was claimed under to in-progress records whose lease ran
    /// out (at most `batch` of them): released for a retry, or marked indeterminate. Fenced, so a live
    /// owner that extended its lease meanwhile is never disturbed.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn recover_stale(&self, batch: u32) -> Result<Recovery, StoreError> {
        let rows = sqlx::query(STALE.sql).bind(i64::from(batch.max(1))).fetch_all(self.store.pg_pool());
        let rows = self.store.bounded(&STALE, rows).await?;
        let mut recovery = Recovery { found: rows.len() as u64, ..Recovery::default() };
        for row in rows {
            let Ok((stale, rule)) = self.stale_lease(&row) else {
                let (tenant, operation) = (row.try_get::<String, _>(0), row.try_get::<String, _>(1));
                tracing::warn!(?tenant, ?operation, "a stale record that cannot be read is left for an operator");
                recovery.unreadable += 1;
                continue;
            };
            let (recovered, action) = match rule {
                LeaseExpiry::TakeOver => {
                    let released = sqlx::query(RELEASE_STALE.sql)
                        .bind(stale.digest().as_str().to_owned())
                        .bind(stale.scope.tenant())
                        .bind(stale.fence)
                        .execute(self.store.pg_pool());
                    (self.store.bounded(&RELEASE_STALE, released).await?.rows_affected() == 1, "released")
                }
                LeaseExpiry::MarkIndeterminate => {
                    (self.store.inner.postgres.mark_indeterminate(&stale, None).await?, "marked_indeterminate")
                }
            };
            if recovered {
                telemetry::recovered(action);
                match action {
                    "released" => recovery.released += 1,
                    _ => recovery.marked_indeterminate += 1,
                }
                self.store.evict_redis(&stale.scope, &stale.key).await;
            }
        }
        self.indeterminate_gauge().await?;
        Ok(recovery)
    }

    /// A stale row as the lease its owner held, and the rule it was claimed under (a code this version
    /// does not know: the safe one).
    fn stale_lease(&self, row: &sqlx::postgres::PgRow) -> Result<(Lease, LeaseExpiry), StoreError> {
        let decode = |e| STALE.failed(e);
        let scope =
            Scope::new(row.try_get::<String, _>(0).map_err(decode)?, row.try_get::<String, _>(1).map_err(decode)?)?;
        let key = IdempotencyKey::new(row.try_get::<String, _>(2).map_err(decode)?)?;
        let stale = Lease {
            fingerprint: crate::Fingerprint::from_stored(&row.try_get::<Vec<u8>, _>(3).map_err(decode)?)
                .ok_or_else(|| decode(sqlx::Error::Decode("a fingerprint is 32 bytes".into())))?,
            fence: row.try_get(4).map_err(decode)?,
            owner: row.try_get::<Option<String>, _>(5).map_err(decode)?.unwrap_or_default(),
            policy: self.store.shared_policy(scope.operation()),
            scope,
            key,
        };
        let code: i8 = row.try_get(6).map_err(decode)?;
        Ok((stale, LeaseExpiry::from_code(code as u8).unwrap_or(LeaseExpiry::MarkIndeterminate)))
    }

    /// Settles an indeterminate record. Returns `false` if the record is not indeterminate (absent,
    /// or settled meanwhile); nothing is changed then.
    ///
    /// With [`Encryption`](crate::Encryption), [`Resolution::Completed`] also replaces the response of a
    /// completed record whose stored bytes were changed ([`EncryptionError::Tampered`]: nothing can read
    /// them again) or were written in clear ([`EncryptionError::Unsealed`]: by a store or an operator
    /// without the key), so that retries are answered again. A response sealed with a key this store
    /// lacks is left alone: configure that key again instead.
    ///
    /// Without encryption, [`Resolution::Completed`] is refused in a deployment whose stored responses
    /// are sealed (see [`StoreBuilder::clear_responses_allowed`](crate::StoreBuilder::clear_responses_allowed)):
    /// an operator who forgot the key would otherwise store a response that no store of the deployment
    /// replays.
    ///
    /// # Errors
    /// [`EncryptionError::WouldWriteClear`] as above; [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        resolution: Resolution,
    ) -> Result<bool, StoreError> {
        let digest = crate::key::key_digest(scope, key);
        let (statement, query) = match &resolution {
            Resolution::Completed(response) => {
                self.store.refuse_clear_writes().await?;
                // The sealed response is bound to the fingerprint the record holds.
                let Some(record) = self.store.lookup_stored(scope, key).await? else { return Ok(false) };
                let tampered = match (&record.response, record.state) {
                    (Some(stored), State::Completed) => {
                        let opened = self.store.opened(scope, key, &record.fingerprint, stored.clone(), true);
                        // Bytes this store cannot open but may replace: tampered ciphertext, or a response
                        // written in clear into an encrypted deployment (an operator without the key).
                        let replaceable = matches!(opened, Err(EncryptionError::Tampered | EncryptionError::Unsealed));
                        replaceable.then(|| stored.as_bytes().to_vec())
                    }
                    _ => None,
                };
                let sealed = self.store.sealed_for(scope, key, &record.fingerprint, response).into_owned();
                let query = sqlx::query(RESOLVE_COMPLETED.sql)
                    .bind(digest.as_str().to_owned())
                    .bind(scope.tenant())
                    .bind(sealed)
                    .bind(record.fingerprint)
                    .bind(tampered)
                    .bind(record.fence);
                (&RESOLVE_COMPLETED, query)
            }
            Resolution::Released => {
                let query = sqlx::query(RESOLVE_RELEASED.sql).bind(digest.as_str().to_owned()).bind(scope.tenant());
                (&RESOLVE_RELEASED, query)
            }
        };
        let resolved = self.store.bounded(statement, query.execute(self.store.pg_pool())).await?.rows_affected() == 1;
        if resolved {
            // Redis may still answer "indeterminate": drop its copy so the next request reads Postgres.
            self.store.evict_redis(scope, key).await;
            self.indeterminate_gauge().await?;
        }
        Ok(resolved)
    }

    /// Sets the gauges from what Postgres holds now: records awaiting an operator
    /// (`idemstore_indeterminate_records`, on a partial index) and the outbox backlog (pending rows, the
    /// oldest one's age and enqueue time). Schedule it (every 15 to 60 s) in each process that exports
    /// metrics: jobs run elsewhere (`idemctl`, another service) move the database, not this process's
    /// gauges. Two short statements.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn refresh_gauges(&self) -> Result<(), StoreError> {
        self.indeterminate_gauge().await?;
        self.store.outbox().refresh_gauges().await
    }

    /// Records by operation, state and tier, with how many expire within `window`.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn stats(&self, window: Duration) -> Result<Vec<StatsRow>, StoreError> {
        let rows = sqlx::query(COUNTS.sql).bind(millis(window) as f64).fetch_all(self.store.pg_pool());
        let rows = self.store.bounded(&COUNTS, rows).await?;
        let decode = |e| COUNTS.failed(e);
        rows.iter()
            .map(|row| {
                let state: i8 = row.try_get("state").map_err(decode)?;
                Ok(StatsRow {
                    operation: row.try_get("operation").map_err(decode)?,
                    state: State::from_code(state as u8).unwrap_or(State::Indeterminate),
                    tier: row.try_get("tier").map_err(decode)?,
                    records: u64::try_from(row.try_get::<i64, _>("records").map_err(decode)?).unwrap_or(0),
                    expiring: u64::try_from(row.try_get::<i64, _>("expiring").map_err(decode)?).unwrap_or(0),
                })
            })
            .collect()
    }

    /// A key as Postgres and Redis hold it, side by side.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn inspect(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Inspection, StoreError> {
        let (postgres, unreadable) = match self.store.lookup_stored(scope, key).await? {
            Some(record) => match self.store.opened_record(scope, key, record.clone()) {
                Ok(opened) => (Some(opened), None),
                Err(error) => (Some(Record { response: None, ..record }), Some(error)),
            },
            None => (None, None),
        };
        let (redis_key, redis) = match &self.store.inner.redis {
            Some(redis) => {
                let record_key = redis.record_key(scope, key);
                let view = redis.view(&record_key).await.ok().flatten();
                (Some(record_key), view)
            }
            None => (None, None),
        };
        Ok(Inspection { redis_key, postgres, unreadable, redis })
    }

    /// Deletes a key's Redis copy (Postgres keeps the record); the next request reads Postgres and
    /// repairs Redis. Returns whether Redis held it.
    ///
    /// # Errors
    /// [`ConfigError::NoRedis`] in Postgres-only mode; [`StoreError::RedisUnavailable`] if Redis failed.
    pub async fn evict(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let Some(redis) = &self.store.inner.redis else {
            return Err(ConfigError::NoRedis.into());
        };
        redis.evict(&redis.record_key(scope, key)).await.map_err(|e| StoreError::RedisUnavailable(Box::new(e)))
    }

    async fn indeterminate_gauge(&self) -> Result<(), StoreError> {
        let indeterminate = count(&self.store, &INDETERMINATE).await?;
        telemetry::indeterminate(indeterminate);
        Ok(())
    }
}

async fn count(store: &Store, statement: &Statement) -> Result<u64, StoreError> {
    let count: i64 = store.bounded(statement, sqlx::query_scalar(statement.sql).fetch_one(store.pg_pool())).await?;
    Ok(u64::try_from(count).unwrap_or(0))
}
