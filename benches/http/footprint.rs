//! Bytes per completed record in each tier, beyond the stored response itself: what sizing needs.

use redis::AsyncCommands;
use sqlx::PgPool;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Footprint {
    postgres_rows: i64,
    /// Heap, TOAST and indexes of `idempotency_records` over its rows, as the run left them.
    postgres_bytes_per_row: f64,
    /// The same after `VACUUM FULL` (no dead tuples, indexes rebuilt): the steady-state floor.
    postgres_compact_bytes_per_row: f64,
    postgres_heap_compact_bytes_per_row: f64,
    postgres_response_bytes: f64,
    redis_keys: usize,
    /// `MEMORY USAGE` of completed records.
    redis_bytes_per_key: f64,
    redis_response_bytes: f64,
}

impl Footprint {
    pub fn markdown(&self) -> String {
        format!(
            "\nBytes per completed record (responses stored as {:.0} B in Postgres, {:.0} B in Redis):\n\n\
             | tier | bytes per record | beyond the response |\n|---|---|---|\n\
             | Postgres, as written ({} rows, heap + indexes) | {:.0} | {:.0} |\n\
             | Postgres, compacted (VACUUM FULL) | {:.0} | {:.0} |\n\
             | Postgres, compacted heap only | {:.0} | {:.0} |\n\
             | Redis (MEMORY USAGE, {} keys) | {:.0} | {:.0} |\n",
            self.postgres_response_bytes,
            self.redis_response_bytes,
            self.postgres_rows,
            self.postgres_bytes_per_row,
            self.postgres_bytes_per_row - self.postgres_response_bytes,
            self.postgres_compact_bytes_per_row,
            self.postgres_compact_bytes_per_row - self.postgres_response_bytes,
            self.postgres_heap_compact_bytes_per_row,
            self.postgres_heap_compact_bytes_per_row - self.postgres_response_bytes,
            self.redis_keys,
            self.redis_bytes_per_key,
            self.redis_bytes_per_key - self.redis_response_bytes,
        )
    }
}

const SIZES: &str = "SELECT count(*)::bigint,
    pg_total_relation_size('idempotency_records')::float8 / greatest(count(*), 1),
    pg_relation_size('idempotency_records')::float8 / greatest(count(*), 1),
    COALESCE(avg(octet_length(response)) FILTER (WHERE response IS NOT NULL), 0)::float8
    FROM idempotency_records";

/// Measures both tiers' records with the key prefix `prefix` in Redis; compacts Postgres's table.
pub async fn measure(pg: &PgPool, redis_url: &str, prefix: &str) -> Result<Footprint, Box<dyn std::error::Error>> {
    let (postgres_rows, postgres_bytes_per_row, _, postgres_response_bytes): (i64, f64, f64, f64) =
        sqlx::query_as(SIZES).fetch_one(pg).await?;
    sqlx::raw_sql("VACUUM FULL idempotency_records").execute(pg).await?;
    let (_, postgres_compact_bytes_per_row, postgres_heap_compact_bytes_per_row, _): (i64, f64, f64, f64) =
        sqlx::query_as(SIZES).fetch_one(pg).await?;

    let mut redis = redis::Client::open(redis_url)?.get_multiplexed_async_connection().await?;
    let keys: Vec<String> = {
        let mut iter = redis.scan_match::<_, String>(format!("{prefix}:*")).await?;
        let mut keys = Vec::new();
        while let Some(key) = futures::StreamExt::next(&mut iter).await {
            keys.push(key?);
            if keys.len() == 2000 {
                break;
            }
        }
        keys
    };
    // A completed record is one string: its 32-byte fingerprint, then the response.
    let (mut used, mut response, mut completed) = (0u64, 0u64, 0usize);
    for key in &keys {
        let kind: String = redis::cmd("TYPE").arg(key).query_async(&mut redis).await?;
        if kind != "string" {
            continue;
        }
        let usage: u64 =
            redis::cmd("MEMORY").arg("USAGE").arg(key).arg("SAMPLES").arg(0).query_async(&mut redis).await?;
        let length: u64 = redis.strlen(key).await?;
        (used, response, completed) = (used + usage, response + length.saturating_sub(32), completed + 1);
    }
    let per = |total: u64| if completed == 0 { 0.0 } else { total as f64 / completed as f64 };
    Ok(Footprint {
        postgres_rows,
        postgres_bytes_per_row,
        postgres_compact_bytes_per_row,
        postgres_heap_compact_bytes_per_row,
        postgres_response_bytes,
        redis_keys: completed,
        redis_bytes_per_key: per(used),
        redis_response_bytes: per(response),
    })
}
