//! The behaviour suite of the store, against real Redis and Postgres, run once per mode.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::join_all;
use idemstore::{
    Begin, Fingerprint, FingerprintOptions, InputError, LeaseExpiry, Mode, Policy, Received, RunError, RunOptions,
    RunOutcome, Scope, State, StoreError,
};
use serde_json::{Value, json};
use support::{Harness, Servers, key};

type Outcome = Result<RunOutcome<Value>, RunError<sqlx::Error>>;

suite!(
    exactly_once_under_64_concurrent_calls,
    replay_after_completion,
    mismatch_is_refused,
    tenants_are_isolated,
    series_exist_at_zero_before_their_first_increment,
    keep_alive_stops_with_its_owner,
    one_outcome_per_claim,
    redis_flushed_after_completion_is_reconciled,
    redis_down_degrades_to_postgres,
    redis_restart_reloads_scripts,
    stale_owner_is_fenced_after_takeover,
    expired_lease_marks_indeterminate_under_that_policy,
    release_after_failure_lets_a_retry_run,
    short_redis_ttl_falls_back_to_postgres,
    bad_input_gets_typed_errors_and_loses_nothing,
    heartbeat_keeps_a_slow_owner,
    in_flight_duplicate_waits_for_the_result,
    postgres_down_fails_closed,
    run_once_in_tx_executes_once_under_64_concurrent_calls,
    run_once_in_tx_commits_nothing_when_the_work_fails,
    run_once_in_tx_replays_from_both_tiers,
    inbox_handles_a_redelivered_event_once,
    a_result_that_cannot_be_stored_is_never_run_again,
);

/// A result JSON cannot hold: a map whose keys are not strings.
type Unencodable = std::collections::HashMap<Vec<u8>, i32>;

fn unencodable_in_tx(tx: &mut sqlx::PgConnection) -> idemstore::TxFuture<'_, Unencodable, sqlx::Error> {
    Box::pin(async move {
        sqlx::query("INSERT INTO effects (tenant, key) VALUES ('acme', 'unencodable-tx')").execute(&mut *tx).await?;
        Ok(Unencodable::from([(vec![1u8], 1)]))
    })
}

/// A work whose result does not serialize (a map with byte-string keys): it ran once, the call that ran
/// it gets `RunError::Encode`, and a retry gets `NotReplayable`, never a second run (before: the key was
/// released, and the retry ran the work and its effect again). The same through `run_once_in_tx`.
async fn a_result_that_cannot_be_stored_is_never_run_again(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k, payload) = (h.scope("acme"), key("unencodable"), json!({"amount": 1}));
    let work = || async { h.charge("acme", &k).await.map(|_| Unencodable::from([(vec![1u8], 1)])) };
    let first = h.store.run_once(&scope, &k, &payload, work).await;
    assert!(matches!(first, Err(RunError::Encode(_))), "{first:?}");
    let retry = h.store.run_once(&scope, &k, &payload, work).await;
    assert!(matches!(retry, Ok(RunOutcome::NotReplayable)), "{retry:?}");
    assert_eq!(h.effects("acme", &k).await, 1);

    let in_tx = key("unencodable-tx");
    let first = h.store.run_once_in_tx(&scope, &in_tx, &payload, unencodable_in_tx).await;
    assert!(matches!(first, Err(RunError::Encode(_))), "{first:?}");
    let retry = h.store.run_once_in_tx(&scope, &in_tx, &payload, unencodable_in_tx).await;
    assert!(matches!(retry, Ok(RunOutcome::NotReplayable)), "{retry:?}");
    assert_eq!(h.effects("acme", &in_tx).await, 1);
}

/// A provider delivering one event five times at once: the handler runs once, every other delivery is
/// acknowledged (or asked to come back); the record keeps the provider's sequence number.
async fn inbox_handles_a_redelivered_event_once(mode: Mode) {
    let h = Harness::start(mode).await;
    let consumer = format!("stripe-{}", h.id());
    let inbox = h.store.inbox(consumer.clone()).expect("inbox");
    let (event, payload) = (key("evt_1"), json!({"type": "payment_intent.succeeded", "id": "evt_1"}));
    let deliveries = (0..5).map(|_| inbox.receive("evt_1", Some(7), &payload, || h.charge(&consumer, &event)));
    let received = join_all(deliveries).await;
    let handled = received.iter().filter(|r| matches!(r, Ok(Received::Executed(_)))).count();
    assert_eq!(handled, 1, "{received:?}");
    assert!(
        received
            .iter()
            .all(|r| matches!(r, Ok(Received::Executed(_) | Received::Replayed { .. } | Received::InFlight { .. })))
    );
    assert_eq!(h.effects(&consumer, &event).await, 1);
    let again: Result<Received<Value>, _> =
        inbox.receive("evt_1", Some(9), &payload, || h.charge(&consumer, &event)).await;
    assert!(matches!(again, Ok(Received::Replayed { sequence: Some(7), .. })), "{again:?}");
    // The event id is the identity: another body is the same event (compared fields: tests/inbox.rs).
    let altered = inbox.receive("evt_1", None, &json!({"type": "other"}), || h.charge(&consumer, &event)).await;
    assert!(matches!(altered, Ok(Received::Replayed { .. })), "{altered:?}");
    // A failed handler records nothing: the next delivery runs it.
    let failing: Result<Received<Value>, _> =
        inbox.receive("evt_2", None, &payload, || async { Err(sqlx::Error::RowNotFound) }).await;
    assert!(matches!(failing, Err(RunError::Work(_))));
    let second = key("evt_2");
    let retried = inbox.receive("evt_2", None, &payload, || h.charge(&consumer, &second)).await;
    assert!(matches!(retried, Ok(Received::Executed(_))), "{retried:?}");
    assert!(matches!(h.store.inbox("").map(drop), Err(InputError::InvalidScope { .. })));
}

/// The work of `run_once_in_tx`: the effect row, written in the claim's transaction.
fn charge_in_tx(
    tx: &mut sqlx::PgConnection,
    key: idemstore::IdempotencyKey,
    fail: bool,
) -> idemstore::TxFuture<'_, Value, sqlx::Error> {
    Box::pin(async move {
        let id: i64 = sqlx::query_scalar("INSERT INTO effects (tenant, key) VALUES ('acme', $1) RETURNING id")
            .bind(key.as_str())
            .fetch_one(&mut *tx)
            .await?;
        if fail {
            return Err(sqlx::Error::RowNotFound);
        }
        Ok(json!({ "charge": id }))
    })
}

/// 64 concurrent calls of the transactional run-once on one key: one effect row, one completed record,
/// and every other call in flight or replayed.
async fn run_once_in_tx_executes_once_under_64_concurrent_calls(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k, payload) = (h.scope("acme"), key("tx-64"), json!({"amount": 64}));
    let calls = (0..64).map(|_| h.store.run_once_in_tx(&scope, &k, &payload, |tx| charge_in_tx(tx, k.clone(), false)));
    let outcomes = join_all(calls).await;
    let executed = outcomes.iter().filter(|o| matches!(o, Ok(RunOutcome::Executed(_)))).count();
    assert_eq!(executed, 1, "{outcomes:?}");
    assert!(outcomes.iter().all(|o| o.is_ok()), "{outcomes:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("record");
    // Not fence 1: a losing claim's INSERT draws from the fence sequence before its conflict is found.
    assert_eq!(record.state, State::Completed);
}

/// When the work fails, the claim rolls back with it: no record, no effect, and the retry executes.
async fn run_once_in_tx_commits_nothing_when_the_work_fails(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k, payload) = (h.scope("acme"), key("tx-fail"), json!({"amount": 1}));
    let failed: Outcome = h.store.run_once_in_tx(&scope, &k, &payload, |tx| charge_in_tx(tx, k.clone(), true)).await;
    assert!(matches!(failed, Err(RunError::Work(sqlx::Error::RowNotFound))), "{failed:?}");
    assert_eq!(h.store.admin().lookup(&scope, &k).await.expect("lookup"), None, "the claim rolled back too");
    assert_eq!(h.effects("acme", &k).await, 0);
    if mode == Mode::TwoTier {
        assert!(h.redis_keys().await.is_empty(), "no marker left behind");
    }
    let retry = h.store.run_once_in_tx(&scope, &k, &payload, |tx| charge_in_tx(tx, k.clone(), false)).await;
    assert!(matches!(retry, Ok(RunOutcome::Executed(_))), "{retry:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// The result of a transactional run is replayed from Redis, and from Postgres when Redis lost it.
async fn run_once_in_tx_replays_from_both_tiers(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k, payload) = (h.scope("acme"), key("tx-replay"), json!({"amount": 2}));
    let first = h.store.run_once_in_tx(&scope, &k, &payload, |tx| charge_in_tx(tx, k.clone(), false)).await;
    let Ok(RunOutcome::Executed(value)) = first else { panic!("{first:?}") };
    let replay = h.store.run_once_in_tx(&scope, &k, &payload, |tx| charge_in_tx(tx, k.clone(), false)).await;
    assert_eq!(replay.expect("replay"), RunOutcome::Replayed(value.clone()));
    if mode == Mode::TwoTier {
        assert_eq!(h.counter("idemstore_redis_lookups_total", &[("result", "hit")]), 1.0, "from Redis");
        let mut conn = h.redis_connection().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
    }
    let replay: Outcome = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await;
    assert_eq!(replay.expect("replay"), RunOutcome::Replayed(value), "the plain API sees the same record");
    assert_eq!(h.effects("acme", &k).await, 1);
}

fn policy(lease_ms: u64, redis_ttl_ms: u64) -> Policy {
    Policy::builder()
        .lease(Duration::from_millis(lease_ms))
        .redis_ttl(Duration::from_millis(redis_ttl_ms))
        .build()
        .expect("valid policy")
}

async fn charge_once(h: &Harness, tenant: &str, k: &idemstore::IdempotencyKey, payload: &Value) -> Outcome {
    h.store.run_once(&h.scope(tenant), k, payload, || h.charge(tenant, k)).await
}

/// 64 concurrent calls with one key execute the work once; every other call is told in flight or replayed.
async fn exactly_once_under_64_concurrent_calls(mode: Mode) {
    let h = Harness::start(mode).await;
    let k = key("order-64");
    let payload = json!({"amount": 100});
    let calls = (0..64).map(|_| charge_once(&h, "acme", &k, &payload));
    let outcomes = join_all(calls).await;
    let executed = outcomes.iter().filter(|o| matches!(o, Ok(RunOutcome::Executed(_)))).count();
    let others_ok = outcomes
        .iter()
        .all(|o| matches!(o, Ok(RunOutcome::Executed(_) | RunOutcome::Replayed(_) | RunOutcome::InFlight { .. })));
    assert_eq!(executed, 1, "{outcomes:?}");
    assert!(others_ok, "{outcomes:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "executed")]), 1.0);
}

/// A retry after completion replays the stored result without executing again.
async fn replay_after_completion(mode: Mode) {
    let h = Harness::start(mode).await;
    let k = key("order-1");
    let payload = json!({"amount": 100, "currency": "EUR"});
    let Ok(RunOutcome::Executed(first)) = charge_once(&h, "acme", &k, &payload).await else {
        panic!("first call executes")
    };
    // The same request with another member order and spelling of numbers is the same request.
    let respelled = json!({"currency": "EUR", "amount": 100.0});
    let second = charge_once(&h, "acme", &k, &respelled).await.expect("replay");
    assert_eq!(second, RunOutcome::Replayed(first));
    assert_eq!(h.effects("acme", &k).await, 1);
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "replayed")]), 1.0);
    if mode == Mode::TwoTier {
        assert_eq!(h.counter("idemstore_redis_lookups_total", &[("result", "hit")]), 1.0, "replayed from Redis");
    }
}

/// The same key with a different payload is refused, and the original result stays.
async fn mismatch_is_refused(mode: Mode) {
    let h = Harness::start(mode).await;
    let k = key("order-2");
    let Ok(RunOutcome::Executed(first)) = charge_once(&h, "acme", &k, &json!({"amount": 100})).await else { panic!() };
    let other = charge_once(&h, "acme", &k, &json!({"amount": 999})).await.expect("an answer");
    assert_eq!(other, RunOutcome::Mismatch);
    assert_eq!(h.effects("acme", &k).await, 1);
    let again = charge_once(&h, "acme", &k, &json!({"amount": 100})).await.expect("replay");
    assert_eq!(again, RunOutcome::Replayed(first));
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "mismatch")]), 1.0);
}

/// Two tenants with the same key and operation get two executions and never each other's result.
async fn tenants_are_isolated(mode: Mode) {
    let h = Harness::start(mode).await;
    let k = key("shared-key");
    let Ok(RunOutcome::Executed(a)) = charge_once(&h, "tenant-a", &k, &json!({"amount": 1})).await else { panic!() };
    // Another payload under the same key is no mismatch for another tenant: it is another record.
    let Ok(RunOutcome::Executed(b)) = charge_once(&h, "tenant-b", &k, &json!({"amount": 2})).await else { panic!() };
    assert_ne!(a, b);
    assert_eq!(charge_once(&h, "tenant-a", &k, &json!({"amount": 1})).await.expect("replay"), RunOutcome::Replayed(a));
    assert_eq!(charge_once(&h, "tenant-b", &k, &json!({"amount": 2})).await.expect("replay"), RunOutcome::Replayed(b));
    // Names cannot be forged with separators into another scope's Redis or Postgres key.
    let fp = Fingerprint::of_json(b"1", &FingerprintOptions::default()).expect("fp");
    let (first, second) = (Scope::new("t", "a:b").expect("scope"), Scope::new("t:a", "b").expect("scope"));
    let Begin::Acquired(lease) = h.store.begin(&first, &k, &fp).await.expect("begin") else { panic!() };
    lease.complete(b"1").await.expect("complete");
    assert!(matches!(h.store.begin(&second, &k, &fp).await.expect("begin"), Begin::Acquired(_)));
    assert_eq!(h.effects("tenant-a", &k).await, 1);
    assert_eq!(h.effects("tenant-b", &k).await, 1);
}

/// Redis loses everything (FLUSHALL + SCRIPT FLUSH) after a completion: the retry is replayed from
/// Postgres, counted as a reconciliation, and Redis is repaired so the next retry is a Redis hit.
async fn redis_flushed_after_completion_is_reconciled(mode: Mode) {
    let h = Harness::start(mode).await;
    let k = key("order-3");
    let payload = json!({"amount": 5});
    let Ok(RunOutcome::Executed(first)) = charge_once(&h, "acme", &k, &payload).await else { panic!() };
    if mode == Mode::TwoTier {
        let mut conn = h.redis_connection().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.expect("SCRIPT FLUSH");
    }
    assert_eq!(charge_once(&h, "acme", &k, &payload).await.expect("replay"), RunOutcome::Replayed(first.clone()));
    assert_eq!(charge_once(&h, "acme", &k, &payload).await.expect("replay"), RunOutcome::Replayed(first));
    assert_eq!(h.effects("acme", &k).await, 1);
    if mode == Mode::TwoTier {
        assert_eq!(h.counter("idemstore_reconciliations_total", &[]), 1.0);
        assert_eq!(h.counter("idemstore_redis_lookups_total", &[("result", "hit")]), 1.0, "repaired");
    }
}

/// With Redis killed, 64 concurrent calls still execute once (on the Postgres path), and the fallback
/// metric says so; a completed result stays replayable.
async fn redis_down_degrades_to_postgres(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    if let Some(redis) = h.redis.as_ref() {
        redis.kill();
    }
    let k = key("order-4");
    let payload = json!({"amount": 7});
    let outcomes = join_all((0..64).map(|_| charge_once(&h, "acme", &k, &payload))).await;
    let executed = outcomes.iter().filter(|o| matches!(o, Ok(RunOutcome::Executed(_)))).count();
    assert_eq!(executed, 1, "{outcomes:?}");
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert!(matches!(charge_once(&h, "acme", &k, &payload).await, Ok(RunOutcome::Replayed(_))));
    assert_eq!(h.effects("acme", &k).await, 1);
    let fallbacks = h.counter("idemstore_redis_fallbacks_total", &[]);
    match mode {
        Mode::TwoTier => assert!(fallbacks >= 65.0, "every call fell back: {fallbacks}"),
        _ => assert_eq!(fallbacks, 0.0),
    }
}

/// A Redis restart empties it, script cache included: the scripts are reloaded (NOSCRIPT) and Redis
/// serves replays again after one reconciliation.
async fn redis_restart_reloads_scripts(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    let k = key("order-5");
    let payload = json!({"amount": 8});
    let Ok(RunOutcome::Executed(first)) = charge_once(&h, "acme", &k, &payload).await else { panic!() };
    if let Some(redis) = h.redis.as_ref() {
        redis.restart().expect("restart Redis");
    }
    let hits_before = h.counter("idemstore_redis_lookups_total", &[("result", "hit")]);
    // The pool's connection died with the server: the first calls may fall back until the circuit
    // closes again, and every answer meanwhile must still be the replay.
    for _ in 0..100 {
        assert_eq!(charge_once(&h, "acme", &k, &payload).await.expect("replay"), RunOutcome::Replayed(first.clone()));
        if mode == Mode::PostgresOnly || h.counter("idemstore_redis_lookups_total", &[("result", "hit")]) > hits_before
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if mode == Mode::TwoTier {
        assert!(h.counter("idemstore_redis_lookups_total", &[("result", "hit")]) > hits_before, "Redis serves again");
    }
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// Polls `begin` until the first owner's lease runs out and the answer is no longer "in flight".
async fn begin_after_lease(h: &Harness, scope: &Scope, k: &idemstore::IdempotencyKey, fp: &Fingerprint) -> Begin {
    for _ in 0..200 {
        match h.store.begin(scope, k, fp).await.expect("begin") {
            Begin::InFlight { .. } => tokio::time::sleep(Duration::from_millis(10)).await,
            other => return other,
        }
    }
    panic!("the lease never ran out");
}

/// An owner whose lease ran out is taken over with a higher fence; its late completion is rejected with
/// LeaseLost, and retries get the new owner's result.
async fn stale_owner_is_fenced_after_takeover(mode: Mode) {
    let h = Harness::with(mode, policy(200, 60_000), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("order-6"));
    let fp = Fingerprint::of_json(br#"{"amount":1}"#, &FingerprintOptions::default()).expect("fp");
    let Begin::Acquired(stale) = h.store.begin(&scope, &k, &fp).await.expect("begin") else { panic!() };
    let Begin::Acquired(staler) = begin_after_lease(&h, &scope, &k, &fp).await else { panic!("takeover") };
    let Begin::Acquired(fresh) = begin_after_lease(&h, &scope, &k, &fp).await else { panic!("takeover") };
    assert!(fresh.fence() > staler.fence() && staler.fence() > stale.fence());
    assert_eq!(fresh.derive_key("psp.charge"), stale.derive_key("psp.charge"), "downstream keys survive takeovers");
    assert!(matches!(stale.complete(b"\"stale\"").await, Err(StoreError::LeaseLost { .. })));
    assert!(matches!(staler.release().await, Err(StoreError::LeaseLost { .. })));
    fresh.complete(b"\"fresh\"").await.expect("the new owner completes");
    let Begin::Replayed(stored) = h.store.begin(&scope, &k, &fp).await.expect("begin") else { panic!() };
    assert_eq!(stored.as_bytes(), b"\"fresh\"");
    assert_eq!(h.counter("idemstore_lease_takeovers_total", &[]), 2.0);
    assert_eq!(h.counter("idemstore_settle_failures_total", &[("reason", "lease_lost")]), 2.0);
}

/// Under MarkIndeterminate, a lease that ran out makes the record indeterminate: nothing executes, and
/// only the original owner (or an operator) can still settle it.
async fn expired_lease_marks_indeterminate_under_that_policy(mode: Mode) {
    let strict = Policy::builder()
        .lease(Duration::from_millis(200))
        .lease_expiry(LeaseExpiry::MarkIndeterminate)
        .build()
        .expect("policy");
    let h = Harness::with(mode, strict, Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("order-7"));
    let fp = Fingerprint::of_json(br#"{"amount":1}"#, &FingerprintOptions::default()).expect("fp");
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fp).await.expect("begin") else { panic!() };
    assert!(matches!(begin_after_lease(&h, &scope, &k, &fp).await, Begin::Indeterminate));
    assert!(matches!(h.store.begin(&scope, &k, &fp).await.expect("begin"), Begin::Indeterminate));
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("a record");
    assert_eq!(record.state, State::Indeterminate);
    owner.complete(b"\"late\"").await.expect("the owner settles its own record");
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("a record");
    assert_eq!(record.state, State::Completed);
}

/// A failed execution releases the key: the retry executes (and is not told "in flight").
async fn release_after_failure_lets_a_retry_run(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("order-8"));
    let payload = json!({"amount": 3});
    let failed: Outcome = h.store.run_once(&scope, &k, &payload, || async { Err(sqlx::Error::PoolTimedOut) }).await;
    assert!(matches!(failed, Err(RunError::Work(sqlx::Error::PoolTimedOut))));
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("a record");
    assert_eq!(record.state, State::Released);
    assert!(matches!(charge_once(&h, "acme", &k, &payload).await, Ok(RunOutcome::Executed(_))));
    assert!(matches!(charge_once(&h, "acme", &k, &payload).await, Ok(RunOutcome::Replayed(_))));
    assert_eq!(h.effects("acme", &k).await, 1);
    // A released key still belongs to its payload.
    assert_eq!(charge_once(&h, "acme", &k, &json!({"amount": 4})).await.expect("answer"), RunOutcome::Mismatch);
}

/// A result whose Redis TTL ran out is still replayed, from Postgres, and counted as a reconciliation.
async fn short_redis_ttl_falls_back_to_postgres(mode: Mode) {
    let h = Harness::with(mode, policy(100, 300), Servers::Any).await;
    let k = key("order-9");
    let payload = json!({"amount": 9});
    let Ok(RunOutcome::Executed(first)) = charge_once(&h, "acme", &k, &payload).await else { panic!() };
    if mode == Mode::TwoTier {
        for _ in 0..100 {
            if h.redis_keys().await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(h.redis_keys().await.is_empty(), "the Redis TTL ran out");
    }
    assert_eq!(charge_once(&h, "acme", &k, &payload).await.expect("replay"), RunOutcome::Replayed(first));
    assert_eq!(h.effects("acme", &k).await, 1);
    if mode == Mode::TwoTier {
        assert_eq!(h.counter("idemstore_reconciliations_total", &[]), 1.0);
    }
}

/// Oversized, too deeply nested and malformed payloads get typed errors, run nothing, and leave the
/// stored record as it was.
async fn bad_input_gets_typed_errors_and_loses_nothing(mode: Mode) {
    let small =
        Policy::builder().fingerprint(FingerprintOptions::default().with_max_bytes(1024)).build().expect("policy");
    let h = Harness::with(mode, small, Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("order-10"));
    let Ok(RunOutcome::Executed(first)) = charge_once(&h, "acme", &k, &json!({"amount": 1})).await else { panic!() };

    let ran = AtomicBool::new(false);
    let work = || async {
        ran.store(true, Ordering::SeqCst);
        Ok::<_, sqlx::Error>(json!(null))
    };
    let huge = json!({"amount": 1, "note": "x".repeat(2000)});
    let too_large = h.store.run_once(&scope, &k, &huge, work).await;
    assert!(matches!(too_large, Err(RunError::Store(StoreError::Input(InputError::PayloadTooLarge { .. })))));
    let mut deep = json!(1);
    for _ in 0..100 {
        deep = json!([deep]);
    }
    let too_deep = h.store.run_once(&scope, &k, &deep, work).await;
    assert!(matches!(too_deep, Err(RunError::Store(StoreError::Input(InputError::TooDeep { limit: 64 })))));
    assert!(!ran.load(Ordering::SeqCst), "no work ran on bad input");

    let options = h.store.policy(&h.operation).fingerprint().clone();
    assert!(matches!(Fingerprint::of_json(br#"{"a":1,"a":1}"#, &options), Err(InputError::DuplicateMember { .. })));
    assert!(matches!(Fingerprint::of_json(b"{\"amount\":", &options), Err(InputError::InvalidJson(_))));
    for bad in ["", "has space", "ünïcode", &"k".repeat(256)] {
        assert!(idemstore::IdempotencyKey::new(bad).is_err(), "{bad:?}");
    }
    assert!(Scope::new("", "op").is_err());

    assert_eq!(charge_once(&h, "acme", &k, &json!({"amount": 1})).await.expect("replay"), RunOutcome::Replayed(first));
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// A live owner that works for several leases keeps its key through the heartbeat: duplicates meanwhile
/// are told "in flight" and nothing executes twice.
async fn heartbeat_keeps_a_slow_owner(mode: Mode) {
    // A 1 s lease, extended every third of it: a busy CI machine can stall a heartbeat for a while.
    let h = Arc::new(Harness::with(mode, policy(1000, 60_000), Servers::Any).await);
    let k = key("order-11");
    let payload = json!({"amount": 11});
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let owner = {
        let (h, k, payload) = (h.clone(), k.clone(), payload.clone());
        tokio::spawn(async move {
            h.store
                .run_once(&h.scope("acme"), &k, &payload, || async {
                    let result = h.charge("acme", &k).await;
                    let _ = finished.await;
                    result
                })
                .await
        })
    };
    // 3.6 s, several leases long: without the heartbeat a call below would take the key over.
    let mut in_flight = 0;
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        match charge_once(&h, "acme", &k, &payload).await.expect("answer") {
            RunOutcome::InFlight { .. } => in_flight += 1,
            other => panic!("the slow owner lost its key: {other:?}"),
        }
    }
    finish.send(()).expect("owner waiting");
    assert!(matches!(owner.await.expect("join"), Ok(RunOutcome::Executed(_))));
    assert_eq!(in_flight, 12);
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// A duplicate that may wait gets the owner's result once it completes, instead of "in flight".
async fn in_flight_duplicate_waits_for_the_result(mode: Mode) {
    let h = Arc::new(Harness::start(mode).await);
    let k = key("order-12");
    let payload = json!({"amount": 12});
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let (started, owner_started) = tokio::sync::oneshot::channel::<()>();
    let owner = {
        let (h, k, payload) = (h.clone(), k.clone(), payload.clone());
        tokio::spawn(async move {
            h.store
                .run_once(&h.scope("acme"), &k, &payload, || async {
                    let _ = started.send(());
                    let result = h.charge("acme", &k).await;
                    let _ = finished.await;
                    result
                })
                .await
        })
    };
    owner_started.await.expect("owner started");
    let waiter = {
        let (h, k, payload) = (h.clone(), k.clone(), payload.clone());
        tokio::spawn(async move {
            let options = RunOptions::default().wait_in_flight(Duration::from_secs(10));
            let outcome: Outcome =
                h.store.run_once_with(&h.scope("acme"), &k, &payload, &options, || h.charge("acme", &k)).await;
            outcome
        })
    };
    assert!(matches!(charge_once(&h, "acme", &k, &payload).await, Ok(RunOutcome::InFlight { .. })));
    finish.send(()).expect("owner waiting");
    let Ok(RunOutcome::Executed(value)) = owner.await.expect("join") else { panic!("owner executes") };
    assert_eq!(waiter.await.expect("join").expect("answer"), RunOutcome::Replayed(value));
    assert_eq!(h.effects("acme", &k).await, 1);
    // One outcome per call: the waiter's polls are not each an "in flight" (only the probe above is).
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "in_flight")]), 1.0);
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "replayed")]), 1.0);
}

/// With Postgres down nothing executes: the caller gets a transient StoreUnavailable and no Redis marker
/// is left behind; after recovery the retry executes once.
async fn postgres_down_fails_closed(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    let (scope, k) = (h.scope("acme"), key("order-13"));
    let payload = json!({"amount": 13});
    // A first claim while Postgres is up: the failure below is then the claim's own, not the one-off
    // question of a store without encryption (whether the deployment seals its responses).
    assert!(matches!(charge_once(&h, "acme", &key("warm-up"), &payload).await, Ok(RunOutcome::Executed(_))));
    h.postgres.as_ref().expect("owned").stop().expect("stop Postgres");
    let ran = AtomicBool::new(false);
    let down = h
        .store
        .run_once(&scope, &k, &payload, || async {
            ran.store(true, Ordering::SeqCst);
            Ok::<_, sqlx::Error>(json!(null))
        })
        .await;
    match down {
        Err(RunError::Store(error @ StoreError::StoreUnavailable { .. })) => assert!(error.is_transient()),
        other => panic!("expected StoreUnavailable, got {other:?}"),
    }
    assert!(!ran.load(Ordering::SeqCst));
    if mode == Mode::TwoTier {
        let marker = h.redis_key(&scope, &k);
        assert!(!h.redis_keys().await.contains(&marker), "the Redis marker was taken back");
    }
    h.postgres.as_ref().expect("owned").restart().expect("restart Postgres");
    let after = charge_once(&h, "acme", &k, &payload).await;
    assert!(matches!(after, Ok(RunOutcome::Executed(_))), "{after:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// Every outcome (and, in two-tier mode, every Redis lookup result and fallback reason) of an operation is
/// rendered at 0 once the operation was first seen, so Prometheus's `rate()` counts the first mismatch,
/// the first in-flight answer and the first fallback (before: each series appeared with its first
/// increment, which `rate()` never sees).
async fn series_exist_at_zero_before_their_first_increment(mode: Mode) {
    let h = Harness::start(mode).await;
    let outcome = charge_once(&h, "acme", &key("first-seen"), &json!({"amount": 1})).await.expect("charge");
    assert!(matches!(outcome, RunOutcome::Executed(_)));
    let page = support::recorder().render();
    let series = |name: &str, label: &str, value: &str| {
        let wanted = format!("operation=\"{}\"", h.operation);
        page.lines().any(|line| {
            line.starts_with(name) && line.contains(&wanted) && line.contains(&format!("{label}=\"{value}\""))
        })
    };
    for outcome in ["mismatch", "in_flight", "replayed", "indeterminate", "expired", "quota_exceeded", "error"] {
        assert!(series("idemstore_outcomes_total", "outcome", outcome), "no {outcome} series:\n{page}");
        assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", outcome)]), 0.0);
    }
    for limit in ["new_keys", "live_keys"] {
        assert!(series("idemstore_quota_refusals_total", "limit", limit), "no {limit} series:\n{page}");
    }
    let redis = mode == Mode::TwoTier;
    assert_eq!(series("idemstore_redis_fallbacks_total", "reason", "timeout"), redis);
    assert_eq!(series("idemstore_redis_lookups_total", "result", "hit"), redis);
}

/// A `keep_alive` guard that outlives its owner stops extending: an abandoned owner's lease runs out and
/// the key is taken over (before: the guard kept extending it, and the key stayed "in flight").
async fn keep_alive_stops_with_its_owner(mode: Mode) {
    let h = Harness::with(mode, policy(300, 60_000), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("kept-alive"));
    let fp = Fingerprint::of_json(br#"{"amount":1}"#, &FingerprintOptions::default()).expect("fp");
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fp).await.expect("begin") else { panic!() };
    let _guard = owner.keep_alive();
    owner.abandon();
    let Begin::Acquired(next) = begin_after_lease(&h, &scope, &k, &fp).await else { panic!("a takeover") };
    next.complete(b"1").await.expect("the new owner completes");
}

/// Exactly one outcome per claim: a waiter's wake-ups count as wake-ups and a stale owner's failed
/// completion as a settle failure, so the outcomes sum to the claims made (before: every poll added an
/// `in_flight`, and the failed completion a `lease_lost`, skewing the duplicate and conflict ratios).
async fn one_outcome_per_claim(mode: Mode) {
    let h = Harness::with(mode, policy(300, 60_000), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("counted"));
    let fingerprint = |body: &[u8]| Fingerprint::of_json(body, &FingerprintOptions::default()).expect("fp");
    let fp = fingerprint(br#"{"amount":1}"#);
    let Begin::Acquired(stale) = h.store.begin(&scope, &k, &fp).await.expect("claim 1") else { panic!() };
    let waiting = RunOptions::default().wait_in_flight(Duration::from_secs(10));
    let Begin::Acquired(fresh) = h.store.begin_with(&scope, &k, &fp, &waiting).await.expect("claim 2") else {
        panic!("the waiter takes over once the lease ran out")
    };
    assert!(matches!(stale.complete(b"1").await, Err(StoreError::LeaseLost { .. })));
    fresh.complete(b"2").await.expect("the new owner completes");
    assert!(matches!(h.store.begin(&scope, &k, &fp).await.expect("claim 3"), Begin::Replayed(_)));
    let other = fingerprint(br#"{"amount":2}"#);
    assert!(matches!(h.store.begin(&scope, &k, &other).await.expect("claim 4"), Begin::Mismatch));
    assert_eq!(h.counter("idemstore_outcomes_total", &[]), 4.0, "one outcome per claim");
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "executed")]), 2.0);
    let by_timer = h.counter("idemstore_wait_wakeups_total", &[("by", "timer")]);
    assert!(by_timer >= 1.0, "the waiter woke when the lease ran out");
    let failed = [("step", "complete"), ("reason", "lease_lost")];
    assert_eq!(h.counter("idemstore_settle_failures_total", &failed), 1.0);
}
