//! The encrypted pass's proof that sealing happened: the harness's stores refuse to open a response
//! stored in clear, but a test whose responses were all written in clear and never read back would pass
//! without it. So each harness, as it is dropped in that pass, reads both tiers of its test.

use std::sync::atomic::Ordering;

use super::Harness;

/// How a sealed response starts (src/encryption.rs): the format's two bytes, then a key id, a nonce,
/// the ciphertext and its tag.
const SEALED: [u8; 2] = [0xE5, 0x1D];
const OVERHEAD: usize = 46;
/// A completed record in Redis is one string: the payload's fingerprint (32 bytes), then the response.
const REDIS_FINGERPRINT: usize = 32;
/// A server a test left paused would hang the scan: it fails instead.
const SCAN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

impl Drop for Harness {
    fn drop(&mut self) {
        let encrypted = std::env::var_os("IDEMSTORE_TEST_ENCRYPTION_KEY").is_some();
        if !encrypted || self.clear_allowed.load(Ordering::Relaxed) || std::thread::panicking() {
            return;
        }
        let (database_url, redis_url, prefix) =
            (self.database_url.clone(), self.redis_url.clone(), self.prefix.clone());
        // Drop is not async, and may run on a runtime's worker: the scan gets a thread of its own.
        let clear = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            let scan = clear_responses(&database_url, redis_url.as_deref(), &prefix);
            runtime.block_on(async { tokio::time::timeout(SCAN_TIMEOUT, scan).await }).expect("the scan timed out")
        });
        let clear = clear.join().expect("the scan of both tiers");
        assert!(clear.is_empty(), "responses stored in clear in the encrypted pass: {clear:?}");
    }
}

fn is_sealed(response: &[u8]) -> bool {
    response.starts_with(&SEALED) && response.len() >= OVERHEAD
}

/// The responses this test left in clear, named by tier and key. A server the test stopped for good
/// cannot be read, and holds nothing anyone is answered from.
async fn clear_responses(database_url: &str, redis_url: Option<&str>, prefix: &str) -> Vec<String> {
    let mut clear = Vec::new();
    if let Ok(mut conn) = <sqlx::PgConnection as sqlx::Connection>::connect(database_url).await {
        let rows: Vec<(String, String, Vec<u8>)> = sqlx::query_as(
            "SELECT tenant, idempotency_key, response FROM idempotency_records WHERE response IS NOT NULL",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap_or_default();
        let unsealed = rows.into_iter().filter(|(.., response)| !is_sealed(response));
        clear.extend(unsealed.map(|(tenant, key, _)| format!("postgres {tenant}/{key}")));
    }
    let Some(url) = redis_url else { return clear };
    let Ok(mut conn) = redis::Client::open(url).expect("Redis URL").get_multiplexed_async_connection().await else {
        return clear;
    };
    let names: Vec<String> =
        redis::cmd("KEYS").arg(format!("{prefix}:{{*}}")).query_async(&mut conn).await.unwrap_or_default();
    for name in names {
        let value: redis::RedisResult<Vec<u8>> = redis::cmd("GET").arg(&name).query_async(&mut conn).await;
        // Markers are hashes (GET fails on them): only completed records hold a response.
        if let Ok(value) = value
            && value.len() > REDIS_FINGERPRINT
            && !is_sealed(&value[REDIS_FINGERPRINT..])
        {
            clear.push(format!("redis {name}"));
        }
    }
    clear
}
