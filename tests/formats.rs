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
    let version_1 = Sha256::digest(b"json\0{\"amount\":1200,\"currency\":\"EUR\"}").to_vec();
    sqlx::query(
        "INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, state, fence, response)
         VALUES ($1, $2, $3, $4, 'c', nextval('idempotency_fences'), $5)",
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
    // With encryption (CI's second pass), a Redis copy in clear is never replayed: Postgres answers.
    if mode == Mode::TwoTier && std::env::var_os("IDEMSTORE_TEST_ENCRYPTION_KEY").is_none() {
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

/// The compact-records migration converts rows as the previous schema held them (hex fingerprints, states
/// and lease rules as words): a completed record still replays and refuses another payload, an in-progress
/// one keeps its rule, a released one is claimed again. It refuses to run while a lease of the earlier
/// release is live (that owner's completion would match no row of the new format).
#[tokio::test]
async fn records_of_the_previous_schema_are_converted() {
    const COMPACT: &str = "20261203000001";
    let server = idemstore::testkit::PostgresServer::start().expect("start a throwaway Postgres");
    let pool = sqlx::PgPool::connect(&server.url()).await.expect("connect");
    // The schema as the release before the compact records left it.
    let earlier = tempfile::tempdir().expect("a directory");
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations")).expect("migrations") {
        let path = entry.expect("entry").path();
        if path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.as_bytes() < COMPACT.as_bytes()) {
            std::fs::copy(&path, earlier.path().join(path.file_name().expect("a name"))).expect("copy");
        }
    }
    let mut migrator = sqlx::migrate::Migrator::new(earlier.path()).await.expect("earlier migrations");
    migrator.dangerous_set_table_name("_idemstore_migrations"); // the store's own history table
    migrator.run(&pool).await.expect("run the earlier migrations");

    let store = idemstore::Store::builder().postgres(pool.clone()).build().expect("store");
    let scope = idemstore::Scope::new("acme", "charge").expect("scope");
    let payload = json!({"amount": 1200});
    let fingerprint = idemstore::Fingerprint::of_serialize(&payload, &Default::default()).expect("fingerprint");
    for (name, state, rule, response, lease) in [
        ("done", "completed", "take_over", Some(&b"\"ch_1\""[..]), None),
        ("running", "in_progress", "mark_indeterminate", None, Some(60)),
        ("unsure", "indeterminate", "mark_indeterminate", None, None),
        ("failed", "released", "take_over", None, None),
    ] {
        sqlx::query(
            "INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, state, fence,
                 owner, lease_expires_at, response, tier, on_lease_expiry, retention_ms)
             VALUES ('acme', 'charge', $1, $2, $3, nextval('idempotency_fences'), 'owner-1',
                     now() + $4 * interval '1 second', $5, 'standard', $6, 86400000)",
        )
        .bind(name)
        .bind(fingerprint.to_hex())
        .bind(state)
        .bind(lease.map(f64::from))
        .bind(response)
        .bind(rule)
        .execute(&pool)
        .await
        .expect("a record as the previous schema held it");
    }
    let refused = store.migrate().await;
    assert!(format!("{refused:?}").contains("live leases of an earlier idemstore release"), "{refused:?}");
    sqlx::query(
        "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second' WHERE state = 'in_progress'",
    )
    .execute(&pool)
    .await
    .expect("the earlier release's lease ends");
    store.migrate().await.expect("the compact-records migration");

    let done = store.lookup(&scope, &key("done")).await.expect("lookup").expect("a record");
    assert_eq!((done.state, done.fingerprint.as_slice()), (idemstore::State::Completed, &fingerprint.as_bytes()[..]));
    let replay = store.run_once(&scope, &key("done"), &payload, || async { Ok::<_, String>(json!("ran")) }).await;
    assert!(matches!(&replay, Ok(RunOutcome::Replayed(stored)) if *stored == json!("ch_1")), "{replay:?}");
    let other = json!({"amount": 1});
    let other = store.run_once(&scope, &key("done"), &other, || async { Ok::<_, String>(json!(1)) }).await;
    assert!(matches!(other, Ok(RunOutcome::Mismatch)), "{other:?}");

    let running = store.lookup(&scope, &key("running")).await.expect("lookup").expect("a record");
    assert_eq!(running.state, idemstore::State::InProgress);
    assert_eq!(running.lease_expiry, Some(idemstore::LeaseExpiry::MarkIndeterminate));
    let unsure = store.lookup(&scope, &key("unsure")).await.expect("lookup").expect("a record");
    assert_eq!(unsure.state, idemstore::State::Indeterminate);
    // The expired lease under "mark indeterminate": the retry is told so, and nothing runs.
    let after = store.run_once(&scope, &key("running"), &payload, || async { Ok::<_, String>(json!("ran")) }).await;
    assert!(matches!(after, Ok(RunOutcome::Indeterminate)), "{after:?}");

    let retried = store.run_once(&scope, &key("failed"), &payload, || async { Ok::<_, String>(json!("ran")) }).await;
    assert!(matches!(retried, Ok(RunOutcome::Executed(_))), "{retried:?}");
}
