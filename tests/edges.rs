//! "Once" at its edges: retention against live leases, fences across purges, the rule stored with each
//! record, tombstones after the retention, and a transaction that never waits on its own lock. Each test
//! reproduces a defect found by reading the protocol (and then by the model checker); time moves in the
//! servers' data, never by sleeping. Real servers, both modes.

use crate::support;

use std::time::Duration;

use idemstore::{
    Begin, Fingerprint, FingerprintOptions, IdempotencyKey, LeaseExpiry, Mode, Policy, RunOptions, RunOutcome, Scope,
    State, StoreError,
};
use idemstore_testkit::ProxyMode;
use serde_json::{Value, json};
use support::{Harness, Servers, key};

suite!(
    a_live_lease_outlives_the_retention,
    fences_never_repeat_across_a_purge,
    the_records_rule_wins_over_the_callers,
    a_completed_key_expires_into_a_tombstone,
    a_transaction_marks_indeterminate_without_waiting_on_itself,
    a_tombstone_takes_at_most_120_bytes,
    a_claim_that_timed_out_never_commits_later,
    redis_never_answers_in_flight_after_postgres_settled,
    a_claim_that_lost_a_race_asks_again,
    releasing_an_indeterminate_record_clears_its_redis_copy,
    a_superseded_owners_release_through_a_blip_is_refused,
    retention_counts_from_a_completion_in_the_claims_transaction,
    a_transactional_retry_that_meets_the_keys_lock_answers_from_the_record;
    two_tier only:
    a_dropped_store_stops_repairing_redis,
    a_malformed_redis_record_is_a_miss,
    another_process_stops_reading_a_stale_marker_once_redis_is_back,
    a_settlement_reaches_redis_while_the_circuit_is_open,
);

fn fingerprint(payload: &str) -> Fingerprint {
    Fingerprint::of_json(payload.as_bytes(), &FingerprintOptions::default()).expect("fingerprint")
}

fn policy(expiry: LeaseExpiry) -> Policy {
    Policy::builder().lease_expiry(expiry).build().expect("policy")
}

async fn acquire(h: &Harness, scope: &Scope, k: &IdempotencyKey, payload: &str) -> idemstore::Owner {
    match h.store.begin(scope, k, &fingerprint(payload)).await.expect("begin") {
        Begin::Acquired(lease) => lease,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

/// An owner that keeps extending its lease past the record's retention keeps its key: another payload is
/// refused (before: `Acquired` under a new fence while the owner still worked), nothing is purged, and
/// the owner completes.
async fn a_live_lease_outlives_the_retention(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("long-job"));
    let owner = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
    h.pass_retention(&scope, &k).await;
    owner.extend().await.expect("the owner extends");
    let other = h.store.begin(&scope, &k, &fingerprint(r#"{"b":2}"#)).await.expect("begin");
    assert!(matches!(other, Begin::InFlight { .. } | Begin::Mismatch), "{other:?}");
    let same = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    assert!(matches!(same, Begin::InFlight { .. }), "{same:?}");
    assert_eq!(h.store.admin().purge_expired(100).await.expect("purge"), 0, "a live lease is never purged");
    owner.complete(b"\"done\"").await.expect("the owner completes");
    let replay = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    assert!(matches!(replay, Begin::Replayed(ref r) if r.as_bytes() == b"\"done\""), "{replay:?}");
}

/// A record released and purged is claimed again under a fence higher than every earlier one, so the
/// old owner's late completion matches nothing (before: the fence restarted at 1 and the old owner's
/// completion landed on the new record, under another payload).
async fn fences_never_repeat_across_a_purge(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("reused"));
    let old = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
    h.pass_lease(&scope, &k).await;
    let recovered = h.store.admin().recover_stale(10).await.expect("recover");
    assert_eq!(recovered.released, 1);
    h.pass_retention(&scope, &k).await;
    assert_eq!(h.store.admin().purge_expired(100).await.expect("purge"), 1, "the released record went");
    let new = acquire(&h, &scope, &k, r#"{"b":2}"#).await;
    assert!(new.fence() > old.fence(), "fences {} then {}", old.fence(), new.fence());
    assert!(matches!(old.complete(b"\"old\"").await, Err(StoreError::LeaseLost { .. })));
    new.complete(b"\"new\"").await.expect("the new owner completes");
    let replay = h.store.begin(&scope, &k, &fingerprint(r#"{"b":2}"#)).await.expect("begin");
    assert!(matches!(replay, Begin::Replayed(ref r) if r.as_bytes() == b"\"new\""), "{replay:?}");
}

/// A record claimed under MarkIndeterminate whose lease ran out is marked indeterminate even when the
/// next caller holds a TakeOver policy (before: taken over, so a payout could run twice); and a caller
/// under MarkIndeterminate never marks a TakeOver record.
async fn the_records_rule_wins_over_the_callers(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, payout) = (h.scope("acme"), key("payout"));
    let fp = fingerprint(r#"{"amount":100}"#);
    let strict = policy(LeaseExpiry::MarkIndeterminate);
    let Begin::Acquired(first) =
        h.store.begin_with(&scope, &payout, &fp, &RunOptions::default().policy(strict.clone())).await.expect("begin")
    else {
        panic!("first claim")
    };
    assert_eq!(first.policy().lease_expiry(), LeaseExpiry::MarkIndeterminate);
    h.pass_lease(&scope, &payout).await;
    let next = h.store.begin(&scope, &payout, &fp).await.expect("begin under TakeOver");
    assert!(matches!(next, Begin::Indeterminate), "the record's rule wins: {next:?}");
    assert_eq!(
        h.store.admin().lookup(&scope, &payout).await.expect("lookup").expect("record").state,
        State::Indeterminate
    );

    let retried = key("retried");
    let Begin::Acquired(first) = h.store.begin(&scope, &retried, &fp).await.expect("begin") else { panic!() };
    h.pass_lease(&scope, &retried).await;
    let Begin::Acquired(second) =
        h.store.begin_with(&scope, &retried, &fp, &RunOptions::default().policy(strict.clone())).await.expect("begin")
    else {
        panic!("a TakeOver record is taken over, whatever the caller's rule")
    };
    assert!(second.fence() > first.fence());
    assert_eq!(second.policy().lease_expiry(), LeaseExpiry::TakeOver, "the lease carries the record's rule");
}

/// After its retention a completed key answers `Expired` to its own payload and `Mismatch` to another,
/// before and after the purge (which leaves a tombstone); once the tombstone's horizon ends, the key is
/// new again, under a higher fence.
async fn a_completed_key_expires_into_a_tombstone(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("old-order"));
    let (mine, other) = (r#"{"a":1}"#, r#"{"a":2}"#);
    let owner = acquire(&h, &scope, &k, mine).await;
    let first_fence = owner.fence();
    owner.complete(b"\"done\"").await.expect("complete");
    h.pass_retention(&scope, &k).await;
    for purge in [false, true] {
        if purge {
            assert_eq!(h.store.admin().purge_expired(100).await.expect("purge"), 1);
            let tombstone = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("tombstone");
            assert_eq!((tombstone.state, tombstone.fence), (State::Expired, first_fence));
        }
        let again = h.store.begin(&scope, &k, &fingerprint(mine)).await.expect("begin");
        assert!(matches!(again, Begin::Expired), "purged: {purge}: {again:?}");
        let changed = h.store.begin(&scope, &k, &fingerprint(other)).await.expect("begin");
        assert!(matches!(changed, Begin::Mismatch), "purged: {purge}: {changed:?}");
    }
    let work = || async { Ok::<_, sqlx::Error>(json!("again")) };
    let run = h.store.run_once(&scope, &k, &json!({"a": 1}), work).await;
    assert!(matches!(run, Ok(RunOutcome::<Value>::Expired)), "{run:?}");
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "expired")]), 3.0);

    h.pass_tombstone_horizon(&scope, &k).await;
    let reborn = acquire(&h, &scope, &k, other).await;
    assert!(reborn.fence() > first_fence);
    assert_eq!(h.store.admin().purge_expired(100).await.expect("purge"), 1, "the tombstone went");
}

/// `run_once_in_tx` on a MarkIndeterminate key whose owner's lease ran out answers `Indeterminate` at
/// once: the mark is written on the transaction's own connection (before: from a second pooled
/// connection, which could wait on the transaction's row lock until the store timeout, then 503).
async fn a_transaction_marks_indeterminate_without_waiting_on_itself(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::MarkIndeterminate), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("tx-payout"));
    let _dead = acquire(&h, &scope, &k, r#"{"amount":5}"#).await;
    h.pass_lease(&scope, &k).await;
    let started = std::time::Instant::now();
    let run = h.store.run_once_in_tx(&scope, &k, &json!({"amount": 5}), ran).await;
    assert!(matches!(run, Ok(RunOutcome::Indeterminate)), "{run:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "answered without waiting for a timeout");
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("record");
    assert_eq!(record.state, State::Indeterminate, "the mark was committed with the answer");
}

fn ran(_tx: &mut sqlx::PgConnection) -> idemstore::TxFuture<'_, Value, sqlx::Error> {
    Box::pin(async { Ok(json!("ran")) })
}

/// Bytes per tombstone in Postgres (heap and both indexes), for 20,000 purged records with UUID keys.
async fn a_tombstone_takes_at_most_120_bytes(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let rows = 20_000;
    let seed = "INSERT INTO idempotency_records
                    (digest, tenant, operation, idempotency_key, fingerprint, state, fence, response, expires_at,
                     tier, on_lease_expiry, retention_ms, tombstone_ms)
                SELECT idempotency_key_digest('acme', $1, k), 'acme', $1, k, sha256(i::text::bytea), 'c',
                       nextval('idempotency_fences'), '\\x00', now() - interval '1 second', 'standard', 't',
                       1000, 86400000
                FROM (SELECT i, gen_random_uuid()::text AS k FROM generate_series(1, $2) AS i) AS keys";
    sqlx::query(seed).bind(&h.operation).bind(rows).execute(&h.pool).await.expect("seed records");
    assert_eq!(h.store.admin().purge_expired(5_000).await.expect("purge"), rows as u64);
    sqlx::query("VACUUM ANALYZE idempotency_tombstones").execute(&h.pool).await.expect("vacuum");
    let bytes: i64 = sqlx::query_scalar("SELECT pg_total_relation_size('idempotency_tombstones')")
        .fetch_one(&h.pool)
        .await
        .expect("size");
    let per_tombstone = bytes as f64 / f64::from(rows);
    println!("{per_tombstone:.1} bytes per tombstone ({bytes} bytes for {rows})");
    assert!(per_tombstone <= 120.0, "{per_tombstone:.1} bytes per tombstone");
}

/// A claim blocked past the store's timeout (here by a table lock) is cancelled by the server, not just
/// abandoned by the client: once the lock goes, no "ghost" claim commits (before: the abandoned statement
/// committed later, so retries were told "in flight" for work that never ran).
async fn a_claim_that_timed_out_never_commits_later(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("ghost"));
    let mut locker = h.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE idempotency_records IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .expect("lock the table");
    let answer = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await;
    assert!(
        matches!(answer, Ok(Begin::InFlight { .. }) | Err(StoreError::StoreUnavailable { .. })),
        "nothing executes while the claim cannot be written: {answer:?}"
    );
    locker.commit().await.expect("unlock");
    // Lock requests queue in order: once this one is granted, a claim still waiting before it has ended.
    let mut after = h.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE").execute(&mut *after).await.expect("lock");
    after.commit().await.expect("unlock");
    let ghost: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records WHERE idempotency_key = $1")
        .bind(k.as_str())
        .fetch_one(&h.pool)
        .await
        .expect("count");
    assert_eq!(ghost, 0, "the abandoned claim was cancelled by the server");
    let Begin::Acquired(_) = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin") else {
        panic!("the key is free for a retry")
    };
}

/// A store whose last handle is dropped while Redis is unreachable stops repairing the copy it left
/// behind (it expires with its lease), where a store still held repairs its own: seen on the real
/// Redis once it is reachable again. Before, the repair task outlived every handle, and retried for as
/// long as Redis stayed down.
async fn a_dropped_store_stops_repairing_redis() {
    let h = Harness::with(Mode::TwoTier, policy(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let proxy = h.redis_proxy.as_ref().expect("a proxy in front of Redis");
    let proxied = format!("redis://127.0.0.1:{}/", proxy.port());
    let through_proxy =
        || support::build_store(&h.store_url, &h.prefix, &h.operation, Some(&proxied), policy(LeaseExpiry::TakeOver));
    let (dropped, held) = (through_proxy(), through_proxy());
    let scope = h.scope("acme");
    let (gone, kept) = (key("left-behind"), key("repaired"));
    let mut owners = Vec::new();
    for (store, k) in [(&dropped, &gone), (&held, &kept)] {
        let Begin::Acquired(owner) = store.begin(&scope, k, &fingerprint(r#"{"a":1}"#)).await.expect("begin") else {
            panic!("a fresh key is acquired")
        };
        owners.push(owner);
    }
    proxy.set(ProxyMode::Blackhole);
    for owner in owners {
        owner.complete(b"\"done\"").await.expect("Postgres completes");
    }
    drop(dropped);
    proxy.cut();
    proxy.set(ProxyMode::Pass);
    let mut conn = h.redis_connection().await;
    let exists = |k: &IdempotencyKey| redis::cmd("EXISTS").arg(h.redis_key(&scope, k)).to_owned();
    // The held store's repair deletes its stale marker once Redis answers again.
    let started = std::time::Instant::now();
    while exists(&kept).query_async::<bool>(&mut conn).await.expect("EXISTS") {
        assert!(started.elapsed() < Duration::from_secs(10), "the held store repaired its copy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // By then (and a few more cool-downs), a repair of the dropped store's would have run too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left: bool = exists(&gone).query_async(&mut conn).await.expect("EXISTS");
    assert!(left, "no task of the dropped store deleted its stale marker");
    drop(held);
}

/// The owner completes while Redis cannot be reached (its marker stays behind in Redis); once Redis is
/// back, the first request is answered from Postgres, not "in flight" from the stale marker (before: for
/// up to a lease after Postgres had settled the key).
async fn redis_never_answers_in_flight_after_postgres_settled(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let (scope, k) = (h.scope("acme"), key("settled"));
    let owner = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
    if let Some(proxy) = &h.redis_proxy {
        proxy.set(ProxyMode::Blackhole);
    }
    owner.complete(b"\"done\"").await.expect("Postgres completes");
    if let Some(proxy) = &h.redis_proxy {
        assert_stale_marker(&h, &scope, &k).await;
        proxy.cut();
        proxy.set(ProxyMode::Pass);
    }
    let mut answer = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    // While the circuit is still open the answer comes from Postgres anyway; poll past the cool-down.
    for _ in 0..50 {
        if h.counter("idemstore_redis_lookups_total", &[("result", "miss")]) > 1.0 || mode == Mode::PostgresOnly {
            break;
        }
        assert!(matches!(answer, Begin::Replayed(_)), "{answer:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        answer = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    }
    assert!(matches!(answer, Begin::Replayed(ref r) if r.as_bytes() == b"\"done\""), "{answer:?}");
    if mode == Mode::TwoTier {
        let misses = h.counter("idemstore_redis_lookups_total", &[("result", "miss")]);
        assert!(misses > 1.0, "Redis answered again (a miss: the stale marker was gone): {misses}");
    }
    let again = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    assert!(matches!(again, Begin::Replayed(_)), "Redis was repaired: {again:?}");
}

/// The window the stale-marker tests are about: Redis (read directly, not through the store's proxy)
/// still holds the owner's in-progress marker for a key that Postgres holds completed.
async fn assert_stale_marker(h: &Harness, scope: &Scope, k: &IdempotencyKey) {
    let mut direct = h.redis_connection().await;
    let state: Option<String> =
        redis::cmd("HGET").arg(h.redis_key(scope, k)).arg("s").query_async(&mut direct).await.expect("HGET");
    assert_eq!(state.as_deref(), Some("p"), "the completion left its in-progress marker behind");
    let completed =
        h.store.admin().lookup(scope, k).await.expect("lookup").is_some_and(|r| r.state == State::Completed);
    assert!(completed, "Postgres holds the key completed");
}

/// A Redis marker that lost fields (or a hash written by something else) is a miss that Postgres answers
/// and repairs (before: a marker without its fingerprint answered "mismatch" to every payload).
async fn a_malformed_redis_record_is_a_miss() {
    let h = Harness::with(Mode::TwoTier, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let scope = h.scope("acme");
    let mut conn = h.redis_connection().await;
    for (name, fields) in
        [("no-fingerprint", &[("s", "i")][..]), ("no-state", &[("h", ""), ("t", "another-owner")][..])]
    {
        let k = key(name);
        let owner = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
        owner.complete(b"\"done\"").await.expect("complete");
        let record_key = h.redis_key(&scope, &k);
        let fp = fingerprint(r#"{"a":1}"#);
        let mut hash = redis::cmd("HSET");
        hash.arg(&record_key);
        for (field, value) in fields {
            hash.arg(field).arg(if *field == "h" { &fp.as_bytes()[..] } else { value.as_bytes() });
        }
        let _: () = redis::pipe()
            .del(&record_key)
            .ignore()
            .add_command(hash)
            .ignore()
            .query_async(&mut conn)
            .await
            .expect("corrupt");
        let answer = h.store.begin(&scope, &k, &fp).await.expect("begin");
        assert!(matches!(answer, Begin::Replayed(ref r) if r.as_bytes() == b"\"done\""), "{name}: {answer:?}");
    }
    // A completed record's string too short to hold its fingerprint, and a key of another type.
    for (name, command, value) in [("truncated", "SET", "short"), ("a-list", "RPUSH", "x")] {
        let k = key(name);
        let owner = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
        owner.complete(b"\"done\"").await.expect("complete");
        let record_key = h.redis_key(&scope, &k);
        let _: () = redis::pipe()
            .del(&record_key)
            .ignore()
            .cmd(command)
            .arg(&record_key)
            .arg(value)
            .ignore()
            .query_async(&mut conn)
            .await
            .expect("corrupt");
        let answer = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
        assert!(matches!(answer, Begin::Replayed(ref r) if r.as_bytes() == b"\"done\""), "{name}: {answer:?}");
        let kind: String = redis::cmd("TYPE").arg(&record_key).query_async(&mut conn).await.expect("TYPE");
        assert_eq!(kind, "string", "{name}: repaired from Postgres");
    }
    assert_eq!(h.counter("idemstore_redis_fallbacks_total", &[]), 0.0, "the circuit never opened");
}

/// Found by the model checker (two clients begin together on a released key): a claim whose snapshot
/// still shows the released record, but which waited for a concurrent winner's row lock, asks again and
/// answers what the winner holds (before: "in flight" from the stale snapshot, for a key that another
/// payload now owns). The winner's claim is held open in a transaction so the loser surely waits on it.
async fn a_claim_that_lost_a_race_asks_again(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("raced"));
    let first = acquire(&h, &scope, &k, r#"{"b":2}"#).await;
    first.release().await.expect("release");
    let mut winner = h.pool.begin().await.expect("begin");
    let take = "UPDATE idempotency_records
                SET state = 'p', fingerprint = $4, fence = nextval('idempotency_fences'),
                    lease_expires_at = now() + interval '30 seconds'
                WHERE digest = idempotency_key_digest($1, $2, $3) AND tenant = $1";
    let other = fingerprint(r#"{"a":1}"#);
    let query =
        sqlx::query(take).bind(scope.tenant()).bind(scope.operation()).bind(k.as_str()).bind(&other.as_bytes()[..]);
    query.execute(&mut *winner).await.expect("the winner's claim, not yet committed");
    let loser = {
        let (store, scope, k) = (h.store.clone(), scope.clone(), k.clone());
        tokio::spawn(async move { store.begin(&scope, &k, &fingerprint(r#"{"b":2}"#)).await })
    };
    let waiting = "SELECT count(*) FROM pg_stat_activity
                   WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'WITH key_lock AS%prior AS%'";
    let mut blocked: i64 = 0;
    // Well within the loser's lock timeout (half the harness's 2 s Postgres timeout).
    for _ in 0..100 {
        blocked = sqlx::query_scalar(waiting).fetch_one(&h.pool).await.expect("pg_stat_activity");
        if blocked >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(blocked >= 1, "the loser's claim waits on the winner's row lock");
    winner.commit().await.expect("the winner commits");
    let answer = loser.await.expect("join").expect("begin");
    assert!(matches!(answer, Begin::Mismatch), "the key now belongs to another payload: {answer:?}");
}

/// Found by the model checker: an owner under MarkIndeterminate releases its record after a duplicate
/// saw it indeterminate (and Redis cached that); the next request executes (before: Redis kept answering
/// "indeterminate" for a record Postgres had released).
async fn releasing_an_indeterminate_record_clears_its_redis_copy(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::MarkIndeterminate), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("late-release"));
    let owner = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
    h.pass_lease(&scope, &k).await;
    let seen = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    assert!(matches!(seen, Begin::Indeterminate), "{seen:?}");
    owner.release().await.expect("the owner still releases under its fence");
    let next = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    assert!(matches!(next, Begin::Acquired(_)), "the released key executes: {next:?}");
}

/// A store behind the harness's Redis proxy, with a cool-down of 10 s: its circuit, once open, stays open
/// for the whole test.
fn proxied_store(h: &Harness, policy: Policy) -> idemstore::Store {
    let proxy = h.redis_proxy.as_ref().expect("a Redis proxy");
    let builder = idemstore::Store::builder()
        .database_url(&h.store_url)
        .redis_url(format!("redis://127.0.0.1:{}/", proxy.port()))
        .key_prefix(&h.prefix)
        .redis_cooldown(Duration::from_secs(10))
        .policy(&h.operation, policy);
    support::sealed(builder).build().expect("store")
}

/// Found by a 3,000-case model campaign: a store completed while Redis was unreachable to it (its marker
/// stayed behind), and another process on the same Redis read that marker as "in flight" once Redis was
/// back, for up to a lease, because only the first store's next call would delete it. Now a background
/// task deletes it as soon as Redis answers: the other process replays within a bound.
async fn another_process_stops_reading_a_stale_marker_once_redis_is_back() {
    let h = Harness::with(Mode::TwoTier, policy(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let (scope, k, payload) = (h.scope("acme"), key("partitioned"), r#"{"a":1}"#);
    let (proxied, other) =
        (proxied_store(&h, policy(LeaseExpiry::TakeOver)), h.new_store(policy(LeaseExpiry::TakeOver)));
    let Begin::Acquired(owner) = proxied.begin(&scope, &k, &fingerprint(payload)).await.expect("begin") else {
        panic!("acquire")
    };
    let proxy = h.redis_proxy.as_ref().expect("proxy");
    proxy.set(ProxyMode::Blackhole);
    owner.complete(b"\"done\"").await.expect("Postgres completes while Redis is unreachable");
    assert_stale_marker(&h, &scope, &k).await;
    proxy.cut();
    proxy.set(ProxyMode::Pass);
    let started = std::time::Instant::now();
    let answer = loop {
        match other.begin(&scope, &k, &fingerprint(payload)).await.expect("begin") {
            Begin::InFlight { .. } if started.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            answer => break answer,
        }
    };
    assert!(matches!(answer, Begin::Replayed(_)), "{answer:?}");
    // The background task tries every cool-down (10 s here); the lease is 30 s.
    assert!(started.elapsed() < Duration::from_secs(15), "stale for {:?}", started.elapsed());
}

/// Found by the model campaign: an owner released its indeterminate record while its store's circuit
/// was open (Redis reachable again, the cool-down not over); the release's Redis write was skipped, and
/// another process kept reading "indeterminate" for a key Postgres had released. Settling writes are
/// now tried whatever the circuit says.
async fn a_settlement_reaches_redis_while_the_circuit_is_open() {
    let strict = policy(LeaseExpiry::MarkIndeterminate);
    let h = Harness::with(Mode::TwoTier, strict.clone(), Servers::Proxied).await;
    let (scope, k, payload) = (h.scope("acme"), key("released-late"), r#"{"a":1}"#);
    let (proxied, other) = (proxied_store(&h, strict.clone()), h.new_store(strict));
    let Begin::Acquired(owner) = proxied.begin(&scope, &k, &fingerprint(payload)).await.expect("begin") else {
        panic!("acquire")
    };
    h.pass_lease(&scope, &k).await;
    let seen = other.begin(&scope, &k, &fingerprint(payload)).await.expect("begin");
    assert!(matches!(seen, Begin::Indeterminate), "{seen:?}");
    // Open the owner's circuit: one call that misses its budget, then Redis is reachable again.
    let proxy = h.redis_proxy.as_ref().expect("proxy");
    let fallbacks = h.counter("idemstore_redis_fallbacks_total", &[]);
    proxy.set(ProxyMode::Blackhole);
    let opened = proxied.begin(&scope, &key("elsewhere"), &fingerprint(payload)).await;
    assert!(matches!(opened, Ok(Begin::Acquired(_))), "Postgres answered alone: {opened:?}");
    assert!(h.counter("idemstore_redis_fallbacks_total", &[]) > fallbacks, "the call fell back: the circuit is open");
    proxy.cut();
    proxy.set(ProxyMode::Pass);
    owner.release().await.expect("the owner releases under its fence");
    // Under load the release's Redis write can outlast its budget and land a moment later; skipped, it
    // would wait for the background repair's cool-down (10 s), so a few seconds still tell them apart.
    let started = std::time::Instant::now();
    let next = loop {
        match other.begin(&scope, &k, &fingerprint(payload)).await.expect("begin") {
            Begin::Indeterminate if started.elapsed() < Duration::from_secs(3) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            answer => break answer,
        }
    };
    assert!(matches!(next, Begin::Acquired(_)), "the released key executes: {next:?}");
}

/// Found by the model checker (seed 20261203, Postgres-only, case 278, shrunk to five steps): an owner
/// whose lease ran out and was taken over released through a blip of Postgres. The first attempt failed,
/// the retry matched no record, and the retry read the new owner's higher fence as "my release landed
/// and another claim followed it": `Ok` for a release that never happened, by an owner that had lost its
/// lease. A retry now takes only its own fence, released, as its landed write.
async fn a_superseded_owners_release_through_a_blip_is_refused(mode: Mode) {
    let h = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let (scope, k, payload) = (h.scope("acme"), key("superseded"), r#"{"a":1}"#);
    // Through the Postgres proxy, with a timeout the stall outlasts.
    let mut builder = idemstore::Store::builder()
        .database_url(&h.store_url)
        .key_prefix(&h.prefix)
        .postgres_timeout(Duration::from_millis(300))
        .policy(&h.operation, policy(LeaseExpiry::TakeOver));
    if let Some(url) = &h.redis_url {
        builder = builder.redis_url(url);
    }
    let stale_store = support::sealed(builder).build().expect("store");
    let Begin::Acquired(stale) = stale_store.begin(&scope, &k, &fingerprint(payload)).await.expect("begin") else {
        panic!("acquire")
    };
    h.pass_lease(&scope, &k).await;
    let successor = acquire(&h, &scope, &k, payload).await;
    assert!(successor.fence() > stale.fence(), "taken over");
    let retries = h.counter("idemstore_settle_retries_total", &[]);
    let proxy = h.postgres_proxy.as_ref().expect("proxied");
    proxy.set(ProxyMode::Blackhole);
    let heal = async {
        // The blip lasts until the first attempt failed and the release is being asked again.
        let started = std::time::Instant::now();
        while h.counter("idemstore_settle_retries_total", &[]) <= retries {
            assert!(started.elapsed() < Duration::from_secs(20), "the release was never asked again");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        proxy.set(ProxyMode::Pass);
    };
    let (released, ()) = tokio::join!(stale.release(), heal);
    assert!(matches!(released, Err(StoreError::LeaseLost { .. })), "{released:?}");
    successor.complete(b"\"done\"").await.expect("the successor completes");
}

/// A completed record is one compact Redis string (fingerprint, then response): 200 bytes or less beyond
/// a 160-byte response, whatever the key's length (before: a hash whose response field passed 64 bytes,
/// stored in Redis's hashtable encoding, about 410 bytes beyond the response, and a name that grew with
/// the key).
#[tokio::test]
async fn a_completed_record_costs_redis_at_most_200_bytes_beyond_its_response() {
    let h = Harness::start(Mode::TwoTier).await;
    let scope = h.scope("acme");
    let k = IdempotencyKey::new("k".repeat(200)).expect("a long key");
    let owner = acquire(&h, &scope, &k, r#"{"a":1}"#).await;
    owner.complete(&[b'x'; 160]).await.expect("complete");
    let mut conn = h.redis_connection().await;
    let record_key = h.redis_key(&scope, &k);
    let kind: String = redis::cmd("TYPE").arg(&record_key).query_async(&mut conn).await.expect("TYPE");
    let usage: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&record_key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(&mut conn)
        .await
        .expect("MEMORY");
    assert_eq!(kind, "string");
    assert!(usage <= 360, "{usage} bytes for a 160-byte response");
    let replay = h.store.begin(&scope, &k, &fingerprint(r#"{"a":1}"#)).await.expect("begin");
    assert!(matches!(&replay, Begin::Replayed(stored) if stored.as_bytes() == [b'x'; 160]), "{replay:?}");
}

/// begin.lua sent twice by the same caller (a Redis Cluster client re-sends a call whose connection
/// dropped after sending; the first run may have written the marker) answers "claimed" both times (the
/// answer that sends the caller on to claim in Postgres) instead of telling it its own key is in
/// flight; another caller still hears "in flight". The script's replies are checked directly. (Before:
/// the second run answered in flight for a whole lease.)
#[tokio::test]
async fn begin_resent_by_its_own_caller_is_still_claimed() {
    let h = Harness::start(Mode::TwoTier).await;
    let record_key = h.redis_key(&h.scope("acme"), &key("resent"));
    let mut conn = h.redis_connection().await;
    let script = redis::Script::new(include_str!("../lua/begin.lua"));
    let fingerprint = [7u8; 32];
    let begin = |owner: &'static str| {
        let mut invocation = script.key(&record_key);
        invocation.arg(&fingerprint[..]).arg(owner).arg(60_000).arg("").arg("");
        invocation
    };
    let first: Vec<redis::Value> = begin("owner-a").invoke_async(&mut conn).await.expect("first run");
    let resent: Vec<redis::Value> = begin("owner-a").invoke_async(&mut conn).await.expect("resent");
    let other: Vec<redis::Value> = begin("owner-b").invoke_async(&mut conn).await.expect("another caller");
    let claimed = vec![redis::Value::BulkString(b"claimed".to_vec())];
    assert_eq!(first, claimed);
    assert_eq!(resent, claimed);
    assert!(matches!(other.first(), Some(redis::Value::BulkString(tag)) if tag == b"in_flight"), "{other:?}");
}

/// Found by the model checker (MODEL_SEED=14070766192722663491, case 87; it fails at 215872d too): an
/// operator's store whose Redis connection went stale in a Redis restart resolved an indeterminate key
/// as released in Postgres, but its eviction of the "indeterminate" copy failed on that connection, so
/// every process went on answering "indeterminate" for a key the next request should execute. A write
/// that settles a key now tries once more on a new connection when the shared one fails.
#[tokio::test]
async fn a_resolution_clears_the_redis_copy_after_a_redis_restart() {
    let policy = policy(LeaseExpiry::MarkIndeterminate);
    let h = Harness::with(Mode::TwoTier, policy.clone(), Servers::Owned).await;
    let (scope, k, payload) = (h.scope("acme"), key("resolved-after-restart"), r#"{"a":1}"#);
    // The operator's store holds a connection from before the restart.
    let operator = h.new_store(policy.clone());
    let warm = operator.begin(&scope, &key("warm-up"), &fingerprint(payload)).await.expect("warm up");
    assert!(matches!(warm, Begin::Acquired(_)), "{warm:?}");
    h.redis.as_ref().expect("an owned Redis").restart().expect("restart Redis");
    // A store connected after the restart leaves an "indeterminate" copy in Redis.
    let app = h.new_store(policy);
    let Begin::Acquired(_owner) = app.begin(&scope, &k, &fingerprint(payload)).await.expect("claim") else {
        panic!("the key is new")
    };
    h.pass_lease(&scope, &k).await;
    let seen = app.begin(&scope, &k, &fingerprint(payload)).await.expect("begin");
    assert!(matches!(seen, Begin::Indeterminate), "{seen:?}");
    let copy: Option<String> = redis::cmd("HGET")
        .arg(h.redis_key(&scope, &k))
        .arg("s")
        .query_async(&mut h.redis_connection().await)
        .await
        .expect("HGET");
    assert_eq!(copy.as_deref(), Some("i"), "Redis holds the indeterminate copy");

    assert!(operator.admin().resolve(&scope, &k, idemstore::admin::Resolution::Released).await.expect("resolve"));
    let next = app.begin(&scope, &k, &fingerprint(payload)).await.expect("begin");
    assert!(matches!(next, Begin::Acquired(_)), "the released key executes: {next:?}");
}

/// Retention counts from the completion, also one that commits in the claim's transaction after work
/// that took a while (1.2 s here), and Redis's copy ends no later than the record (within the moment
/// between the completion and the copy's write). Before the fix the expiry was counted from the
/// transaction's start (`now()`): the record kept 58.8 s of its 60, and Redis's copy, whose TTL the
/// completion returned counted the same way, outlived it by the 1.2 s the work took.
async fn retention_counts_from_a_completion_in_the_claims_transaction(mode: Mode) {
    let retention = Duration::from_secs(60);
    let policy = Policy::builder().retention(Some(retention)).redis_ttl(retention);
    let h = Harness::with(mode, policy.build().expect("policy"), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("late-completion"));
    let payload = json!({});
    let outcome = h.store.run_once_in_tx(&scope, &k, &payload, |tx| {
        Box::pin(async move {
            // The work: a call elsewhere that takes a while, then its write.
            tokio::time::sleep(Duration::from_millis(1200)).await;
            sqlx::query("SELECT 1").execute(&mut *tx).await?;
            Ok::<_, sqlx::Error>(json!("done"))
        })
    });
    assert_eq!(outcome.await.expect("answer"), RunOutcome::Executed(json!("done")));
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("the record");
    let kept = record.expires_in.expect("kept for its retention");
    let from_completion = retention - Duration::from_millis(500);
    assert!(kept > from_completion, "retention counted from the completion: {kept:?} left");
    if mode == Mode::TwoTier {
        let mut conn = h.redis_connection().await;
        let copy: i64 = redis::cmd("PTTL").arg(h.redis_key(&scope, &k)).query_async(&mut conn).await.expect("PTTL");
        let copy = Duration::from_millis(u64::try_from(copy).expect("the copy has a TTL"));
        assert!(
            copy <= kept + Duration::from_millis(250),
            "Redis keeps its copy {copy:?}, Postgres the record {kept:?}"
        );
    }
}

/// The advisory lock a claim inside a transaction takes on its key: 63 bits of the key's digest (the
/// digest of `Harness::redis_key`), negative (written out here, so a change of form fails tests).
fn key_lock(h: &Harness, scope: &Scope, k: &IdempotencyKey) -> i64 {
    let name = h.redis_key(scope, k);
    let digest = name.split('{').nth(1).expect("a digest in braces");
    (u64::from_str_radix(&digest[..16], 16).expect("hex") | 1 << 63) as i64
}

/// A claim inside a transaction that meets its key's lock held by another transaction (a concurrent
/// retry answering from the record holds it until it commits) answers from the record as committed: a
/// completed key replays, another payload is refused, and a new key is "in flight" with nothing
/// written. Found by review of the lock's first version, which answered "in flight" to every claim that
/// met it, so a burst of transactional retries of a completed key got 409s instead of its replay.
async fn a_transactional_retry_that_meets_the_keys_lock_answers_from_the_record(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let run = |name: &'static str, payload: Value| {
        let (h, scope, k) = (&h, scope.clone(), key(name));
        async move {
            let outcome = h.store.run_once_in_tx(&scope, &k, &payload, |tx| {
                Box::pin(async move { sqlx::query_scalar::<_, i64>("SELECT 7::int8").fetch_one(tx).await })
            });
            outcome.await.expect("answer")
        }
    };
    assert_eq!(run("locked-done", json!({})).await, RunOutcome::Executed(7));
    if mode == Mode::TwoTier {
        // Redis's copy would answer first: Postgres is asked on a miss.
        let mut conn = h.redis_connection().await;
        let _: i64 =
            redis::cmd("DEL").arg(h.redis_key(&scope, &key("locked-done"))).query_async(&mut conn).await.expect("DEL");
    }
    let mut holder = h.pool.begin().await.expect("begin");
    for name in ["locked-done", "locked-new"] {
        let lock = sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1)").bind(key_lock(
            &h,
            &scope,
            &key(name),
        ));
        assert!(lock.fetch_one(&mut *holder).await.expect("lock"), "the test holds {name}'s lock");
    }
    assert_eq!(run("locked-done", json!({})).await, RunOutcome::Replayed(7));
    assert_eq!(run("locked-done", json!({"other": 1})).await, RunOutcome::Mismatch);
    assert!(matches!(run("locked-new", json!({})).await, RunOutcome::InFlight { .. }));
    // A released record past its expiry, which the lock's holder may be re-acquiring with any payload:
    // "in flight", not refused.
    let released = key("locked-released");
    match h.store.begin(&scope, &released, &fingerprint("{}")).await.expect("begin") {
        Begin::Acquired(owner) => owner.release().await.expect("release"),
        other => panic!("{other:?}"),
    }
    h.pass_retention(&scope, &released).await;
    let lock =
        sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1)").bind(key_lock(&h, &scope, &released));
    assert!(lock.fetch_one(&mut *holder).await.expect("lock"));
    assert!(matches!(run("locked-released", json!({"other": 1})).await, RunOutcome::InFlight { .. }));
    assert!(h.store.admin().lookup(&scope, &key("locked-new")).await.expect("lookup").is_none(), "nothing written");
    holder.rollback().await.expect("rollback");
    assert_eq!(run("locked-new", json!({})).await, RunOutcome::Executed(7));
}
