//! Stored formats across versions: fingerprints that tell exact amounts apart (version 2), and records an
//! earlier release stored (version 1) that still answer their retries. Real Redis and Postgres, both modes.

#[macro_use]
mod support;

use idemstore::{Mode, RunOutcome};
use serde_json::json;
use sha2::{Digest, Sha256};
use support::{Harness, key};

suite!(
    amounts_beyond_64_bits_are_different_requests,
    a_record_stored_by_version_1_still_replays,
    non_finite_numbers_are_refused,
);

/// Two amounts that differ only in the 21st digit, under one key: the second is refused as a different
/// payload (before: both had one fingerprint, and the second request got the first one's response).
async fn amounts_beyond_64_bits_are_different_requests(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("wei"));
    #[derive(serde::Serialize)]
    struct Transfer {
        amount_wei: u128,
    }
    let first = Transfer { amount_wei: 100_000_000_000_000_000_001 };
    let second = Transfer { amount_wei: 100_000_000_000_000_000_000 };
    let ran = h.store.run_once(&scope, &k, &first, || h.charge("acme", &k)).await.expect("first");
    assert!(matches!(ran, RunOutcome::Executed(_)), "{ran:?}");
    let again = h.store.run_once(&scope, &k, &second, || h.charge("acme", &k)).await;
    assert!(matches!(again, Ok(RunOutcome::Mismatch)), "{again:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// A completed record as an earlier release stored it (its fingerprint in version 1) answers a retry
/// with its response, from Postgres and then from the repaired Redis copy; another payload is still a
/// mismatch.
async fn a_record_stored_by_version_1_still_replays(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("stored-by-v1"));
    // Version 1: SHA-256 of "json\0" and the canonical JSON, numbers as f64 read them.
    let version_1 = format!("{:x}", Sha256::digest(b"json\0{\"amount\":1200,\"currency\":\"EUR\"}"));
    sqlx::query(
        "INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, state, fence, response)
         VALUES ($1, $2, $3, $4, 'completed', nextval('idempotency_fences'), $5)",
    )
    .bind(scope.tenant())
    .bind(scope.operation())
    .bind(k.as_str())
    .bind(&version_1)
    .bind(br#"{"charge":"ch_1"}"#.as_slice())
    .execute(&h.pool)
    .await
    .expect("a record as version 1 stored it");
    // The same request in another layout and number spelling.
    let payload = json!({"currency": "EUR", "amount": 1.2e3});
    for attempt in ["from Postgres", "from the repaired Redis copy"] {
        let answer = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await.expect(attempt);
        assert_eq!(answer, RunOutcome::Replayed(json!({"charge": "ch_1"})), "{attempt}");
    }
    if mode == Mode::TwoTier {
        assert!(h.counter("idemstore_redis_lookups_total", &[("result", "hit")]) >= 1.0, "Redis answered the retry");
    }
    let other =
        h.store.run_once(&scope, &k, &json!({"amount": 1201, "currency": "EUR"}), || h.charge("acme", &k)).await;
    assert!(matches!(other, Ok(RunOutcome::Mismatch)), "{other:?}");
    assert_eq!(h.effects("acme", &k).await, 0);
}

/// NaN and infinities are refused with a typed error before anything runs (before: serde_json wrote them
/// as `null`, so `{"amount": NaN}` was the request `{"amount": null}`); the outbox refuses them too.
async fn non_finite_numbers_are_refused(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("nan"));
    for amount in [f64::NAN, f64::INFINITY] {
        let payload = std::collections::BTreeMap::from([("amount", amount)]);
        let refused = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await;
        assert!(
            matches!(
                refused,
                Err(idemstore::RunError::Store(idemstore::StoreError::Input(idemstore::InputError::NonFiniteNumber)))
            ),
            "{refused:?}"
        );
    }
    assert_eq!(h.effects("acme", &k).await, 0);
    let mut tx = h.pool.begin().await.expect("begin");
    let enqueued = h.store.outbox().enqueue(&mut tx, "mail", &[f64::NAN]).await;
    assert!(
        matches!(enqueued, Err(idemstore::StoreError::Input(idemstore::InputError::NonFiniteNumber))),
        "{enqueued:?}"
    );
}
