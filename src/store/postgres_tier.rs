//! The source of truth: every statement of the protocol, one round trip each, fenced where it writes.

use std::future::Future;
use std::io;
use std::time::Duration;

use sqlx::Row as _;
use sqlx::postgres::{PgConnection, PgPool, PgRow};

use crate::key::{IdempotencyKey, Scope};
use crate::policy::{LeaseExpiry, millis};
use crate::record::{Lease, Record, State, StoredResponse};
use crate::telemetry;

/// The record columns every read returns, with the lease and retention as milliseconds of server time,
/// so that application clocks never take part in a lease decision.
macro_rules! record_columns {
    () => {
        "state, fingerprint, fence, owner, response, tier,
         CASE WHEN lease_expires_at IS NOT NULL
              THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM lease_expires_at - now()) * 1000))::bigint END AS lease_ms,
         CASE WHEN expires_at IS NOT NULL
              THEN CEIL(GREATEST(0, EXTRACT(EPOCH FROM expires_at - now()) * 1000))::bigint END AS expires_ms"
    };
}

/// The claim, in one round trip. Inserts a fresh record, or re-acquires one (fence + 1) that expired,
/// was released, or whose owner's lease ran out under `TakeOver` (`$8`); any other existing record is
/// returned as it is, for the caller to answer from. `prior` is read from the statement's snapshot: it
/// says what was re-acquired (for the takeover metric) and is the answer when nothing was written.
const CLAIM: &str = concat!(
    "WITH prior AS (
        SELECT state, fingerprint, fence, owner, response, tier, lease_expires_at, expires_at
        FROM idempotency_records
        WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3
    ), claimed AS (
        INSERT INTO idempotency_records AS r
            (tenant, operation, idempotency_key, fingerprint, state, fence, owner, lease_expires_at, expires_at,
             tier, on_lease_expiry, retention_ms)
        VALUES ($1, $2, $3, $4, 'in_progress', 1, $5,
                now() + $6::float8 * interval '1 millisecond',
                now() + $7::float8 * interval '1 millisecond', $9,
                CASE WHEN $8 THEN 'take_over' ELSE 'mark_indeterminate' END, $7::float8::bigint)
        ON CONFLICT (tenant, operation, idempotency_key) DO UPDATE
        SET fingerprint = EXCLUDED.fingerprint, state = 'in_progress', fence = r.fence + 1,
            owner = EXCLUDED.owner, lease_expires_at = EXCLUDED.lease_expires_at, response = NULL,
            expires_at = EXCLUDED.expires_at, tier = EXCLUDED.tier,
            on_lease_expiry = EXCLUDED.on_lease_expiry, retention_ms = EXCLUDED.retention_ms, updated_at = now()
        WHERE r.expires_at <= now()
           OR (r.fingerprint = EXCLUDED.fingerprint
               AND (r.state = 'released'
                    OR (r.state = 'in_progress' AND r.lease_expires_at <= now() AND $8)))
        RETURNING state, fingerprint, fence, owner, response, tier, lease_expires_at, expires_at
    )
    SELECT true AS acquired, (SELECT state FROM prior) AS prior_state, ",
    record_columns!(),
    " FROM claimed
    UNION ALL
    SELECT false, NULL, ",
    record_columns!(),
    " FROM prior WHERE NOT EXISTS (SELECT 1 FROM claimed)"
);

const LOOKUP: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_records WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3"
);

const COMPLETE: &str = "
    UPDATE idempotency_records
    SET state = 'completed', response = $5, owner = NULL, lease_expires_at = NULL,
        expires_at = now() + $6::float8 * interval '1 millisecond', updated_at = now()
    WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND fence = $4
      AND state IN ('in_progress', 'indeterminate')";

const RELEASE: &str = "
    UPDATE idempotency_records
    SET state = 'released', owner = NULL, lease_expires_at = NULL, updated_at = now()
    WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND fence = $4
      AND state IN ('in_progress', 'indeterminate')";

const EXTEND: &str = "
    UPDATE idempotency_records
    SET lease_expires_at = now() + $5::float8 * interval '1 millisecond', updated_at = now()
    WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND fence = $4
      AND state = 'in_progress'";

/// Only a lease that really ran out, and whose owner has not moved on since it was read, is marked.
const MARK_INDETERMINATE: &str = "
    UPDATE idempotency_records
    SET state = 'indeterminate', updated_at = now()
    WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND fence = $4
      AND state = 'in_progress' AND lease_expires_at <= now()";

/// What the claim statement found or wrote.
#[derive(Debug)]
pub(crate) struct Claim {
    /// The caller now owns the key.
    pub(crate) acquired: bool,
    /// The record was re-acquired from an owner whose lease ran out.
    pub(crate) took_over: bool,
    pub(crate) owner: Option<String>,
    pub(crate) record: Record,
}

pub(crate) struct PostgresTier {
    pool: PgPool,
    /// Longest wait for one statement: a partitioned or stalled Postgres fails the call (closed)
    /// instead of holding the request forever.
    timeout: Duration,
}

impl PostgresTier {
    pub(crate) fn new(pool: PgPool, timeout: Duration) -> Self {
        Self { pool, timeout }
    }

    /// `call`, failing with a timeout error once the statement timeout has passed.
    pub(crate) async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, sqlx::Error> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(sqlx::Error::Io(io::Error::new(io::ErrorKind::TimedOut, "Postgres did not answer in time"))),
        }
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The claim on a pooled connection, or on `conn` (inside the caller's transaction) when given.
    pub(crate) async fn claim(&self, lease: &Lease, conn: Option<&mut PgConnection>) -> Result<Claim, sqlx::Error> {
        let mut pooled;
        let conn = match conn {
            Some(conn) => conn,
            None => {
                pooled = self.bounded(self.pool.acquire()).await?;
                &mut *pooled
            }
        };
        let policy = &lease.policy;
        // A concurrent claim that committed after this statement's snapshot conflicts with the insert
        // but is invisible to `prior`, so the statement returns no row; the next attempt sees it.
        loop {
            telemetry::postgres_statement("claim");
            let claim = sqlx::query(CLAIM)
                .bind(lease.scope.tenant())
                .bind(lease.scope.operation())
                .bind(lease.key.as_str())
                .bind(lease.fingerprint.as_hex())
                .bind(&lease.owner)
                .bind(millis(policy.lease) as f64)
                .bind(policy.retention.map(|r| millis(r) as f64))
                .bind(policy.lease_expiry == LeaseExpiry::TakeOver)
                .bind(policy.name())
                .fetch_optional(&mut *conn);
            let row = self.bounded(claim).await?;
            if let Some(row) = row {
                let acquired: bool = row.try_get("acquired")?;
                let prior: Option<String> = row.try_get("prior_state")?;
                return Ok(Claim {
                    acquired,
                    took_over: acquired && prior.as_deref() == Some(State::InProgress.as_str()),
                    owner: row.try_get("owner")?,
                    record: decode_record(&row)?,
                });
            }
        }
    }

    pub(crate) async fn lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, sqlx::Error> {
        telemetry::postgres_statement("lookup");
        let lookup = sqlx::query(LOOKUP)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str())
            .fetch_optional(&self.pool);
        let row = self.bounded(lookup).await?;
        row.as_ref().map(decode_record).transpose()
    }

    /// Returns whether the fenced completion matched (false: the lease was lost). On `conn` (inside the
    /// caller's transaction, the one that claimed) when given.
    pub(crate) async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        conn: Option<&mut PgConnection>,
    ) -> Result<bool, sqlx::Error> {
        let retention = lease.policy.retention.map(|r| millis(r) as f64);
        let query = self.fenced("complete", COMPLETE, lease).bind(response).bind(retention);
        let done = match conn {
            Some(conn) => self.bounded(query.execute(conn)).await,
            None => self.bounded(query.execute(&self.pool)).await,
        };
        done.map(matched)
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<bool, sqlx::Error> {
        self.bounded(self.fenced("release", RELEASE, lease).execute(&self.pool)).await.map(matched)
    }

    pub(crate) async fn extend(&self, lease: &Lease) -> Result<bool, sqlx::Error> {
        let lease_ms = millis(lease.policy.lease) as f64;
        self.bounded(self.fenced("extend", EXTEND, lease).bind(lease_ms).execute(&self.pool)).await.map(matched)
    }

    /// Marks the record of `stale` (the lease that ran out, as read) indeterminate.
    pub(crate) async fn mark_indeterminate(&self, stale: &Lease) -> Result<bool, sqlx::Error> {
        self.bounded(self.fenced("mark_indeterminate", MARK_INDETERMINATE, stale).execute(&self.pool))
            .await
            .map(matched)
    }

    /// A write keyed by the lease's record and fence (`$1`..`$4`), counted as `statement`.
    fn fenced<'q>(
        &self,
        statement: &'static str,
        sql: &'static str,
        lease: &'q Lease,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        telemetry::postgres_statement(statement);
        sqlx::query(sql)
            .bind(lease.scope.tenant())
            .bind(lease.scope.operation())
            .bind(lease.key.as_str())
            .bind(lease.fence)
    }
}

fn matched(result: sqlx::postgres::PgQueryResult) -> bool {
    result.rows_affected() == 1
}

fn decode_record(row: &PgRow) -> Result<Record, sqlx::Error> {
    let state: String = row.try_get("state")?;
    let state = State::parse(&state)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown idempotency record state {state:?}").into()))?;
    let ms = |column: &str| -> Result<Option<Duration>, sqlx::Error> {
        let value: Option<i64> = row.try_get(column)?;
        Ok(value.map(|v| Duration::from_millis(u64::try_from(v).unwrap_or(0))))
    };
    Ok(Record {
        state,
        fence: row.try_get("fence")?,
        fingerprint: row.try_get("fingerprint")?,
        lease_remaining: if state == State::InProgress { ms("lease_ms")? } else { None },
        expires_in: ms("expires_ms")?,
        response: row.try_get::<Option<Vec<u8>>, _>("response")?.map(StoredResponse::new),
        tier: row.try_get("tier")?,
    })
}
