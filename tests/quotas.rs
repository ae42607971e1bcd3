//! Per-tenant quotas (`Policy::quota`), against real Redis and Postgres in both modes: beyond a limit
//! nothing runs and nothing is recorded, answers that need no execution are untouched, other tenants and
//! operations are not held back, and a place frees when a key leaves the window or a lease ends.

use crate::support;

use std::time::Duration;

use idemstore::{
    Begin, Fingerprint, FingerprintOptions, Mode, Policy, Quota, QuotaLimit, RunOptions, RunOutcome, Scope, Store,
};
use serde_json::{Value, json};
use support::{Harness, Servers, key};

suite!(
    new_keys_beyond_the_window_are_refused_and_nothing_runs,
    live_keys_count_leases_in_progress_only,
    a_burst_past_the_limit_leaves_no_trace_of_refused_keys,
    keys_started_again_are_not_new_and_transactional_claims_count_once_committed,
    open_transactional_claims_count_as_live_keys,
    a_duplicate_of_an_open_transactional_claim_holds_no_slot,
    the_previous_window_weighs_as_much_as_the_sliding_window_still_covers,
);

const HOUR: Duration = Duration::from_secs(3600);

async fn harness(mode: Mode, quota: Quota) -> Harness {
    Harness::with(mode, Policy::builder().quota(quota).build().expect("policy"), Servers::Any).await
}

fn fingerprint(n: u64) -> Fingerprint {
    Fingerprint::of_serialize(&json!({ "n": n }), &FingerprintOptions::default()).expect("fingerprint")
}

/// `run_once` of a charge for `tenant` under the harness's operation, or `operation` (under the same
/// policy).
async fn run(h: &Harness, tenant: &str, operation: Option<&str>, name: &str, payload: Value) -> RunOutcome<Value> {
    let scope = Scope::new(tenant, operation.unwrap_or(&h.operation)).expect("scope");
    let options = RunOptions::default().policy(h.store.policy(&h.operation).clone());
    let key = key(name);
    let charged = h.store.run_once_with(&scope, &key, &payload, &options, || h.charge(tenant, &key)).await;
    charged.expect("answer")
}

/// The time from now until `at` windows (of an hour) after the start of the current one, by the
/// database's clock.
async fn windows_until(h: &Harness, at: f64) -> Duration {
    let elapsed: f64 = sqlx::query_scalar("SELECT (mod(extract(epoch FROM now()), 3600) / 3600)::float8")
        .fetch_one(&h.pool)
        .await
        .expect("clock");
    HOUR.mul_f64(at - elapsed)
}

fn assert_close(actual: Duration, expected: Duration) {
    assert!(actual.abs_diff(expected) < Duration::from_secs(5), "{actual:?}, expected {expected:?}");
}

/// Whether the store holds anything for the key: a record in Postgres, a copy or marker in Redis.
async fn holds(h: &Harness, store: &Store, tenant: &str, name: &str) -> bool {
    let (scope, key) = (h.scope(tenant), key(name));
    let in_postgres = store.admin().lookup(&scope, &key).await.expect("lookup").is_some();
    let in_redis = h.mode == Mode::TwoTier && h.redis_keys().await.contains(&h.redis_key(&scope, &key));
    in_postgres || in_redis
}

async fn new_keys_beyond_the_window_are_refused_and_nothing_runs(mode: Mode) {
    let h = harness(mode, Quota::default().new_keys(3, HOUR)).await;
    let charge = |tenant: &'static str, name: &'static str| run(&h, tenant, None, name, json!({ "k": name }));
    for name in ["a", "b", "c"] {
        assert!(matches!(charge("acme", name).await, RunOutcome::Executed(_)), "{name}");
    }
    let refused = charge("acme", "d").await;
    let RunOutcome::QuotaExceeded { limit, retry_after } = refused else { panic!("not refused: {refused:?}") };
    assert_eq!(limit, QuotaLimit::NewKeys);
    // Three keys in this window: the estimate falls below the limit once the next window is a third
    // gone (this window's three then weigh two), if nothing else starts.
    assert_close(retry_after, windows_until(&h, 4.0 / 3.0).await);
    assert_eq!(h.effects("acme", &key("d")).await, 0, "nothing ran");
    assert!(!holds(&h, &h.store, "acme", "d").await, "nothing recorded for the refused key");
    assert_eq!(h.counter("idemstore_quota_refusals_total", &[("limit", "new_keys")]), 1.0);
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "quota_exceeded")]), 1.0);

    // What needs no execution is answered as before: a replay, a mismatch.
    assert!(matches!(charge("acme", "a").await, RunOutcome::Replayed(_)));
    assert_eq!(run(&h, "acme", None, "a", json!({ "other": 1 })).await, RunOutcome::Mismatch);
    // Another tenant, and the same tenant under another operation, have quotas of their own.
    assert!(matches!(charge("globex", "d").await, RunOutcome::Executed(_)));
    let elsewhere = run(&h, "acme", Some("refund"), "d", json!({ "k": "d" })).await;
    assert!(matches!(elsewhere, RunOutcome::Executed(_)));

    // Two windows later the earlier keys no longer count: three more may start, then no more.
    sqlx::query("UPDATE idempotency_quota_usage SET window_index = window_index - 2 WHERE tenant = 'acme'")
        .execute(&h.pool)
        .await
        .expect("let two windows pass");
    for name in ["d", "e", "f"] {
        assert!(matches!(charge("acme", name).await, RunOutcome::Executed(_)), "{name}");
    }
    assert!(matches!(charge("acme", "g").await, RunOutcome::QuotaExceeded { .. }));
    // A counter is kept until its window and the next have passed, then purged (not counted as a record).
    let (kept_for, current): (f64, i64) = sqlx::query_as(
        "SELECT max(abs(extract(epoch FROM expires_at - to_timestamp((window_index + 2) * window_ms / 1000.0))))
                    FILTER (WHERE window_index = (SELECT max(window_index) FROM idempotency_quota_usage))::float8,
                count(*) FILTER (WHERE window_index = (SELECT max(window_index) FROM idempotency_quota_usage))
         FROM idempotency_quota_usage",
    )
    .fetch_one(&h.pool)
    .await
    .expect("counters");
    assert!(kept_for < 0.001 && current > 0, "expiry off by {kept_for} s, {current} in this window");
    let spent = "UPDATE idempotency_quota_usage SET expires_at = now() - interval '1 second'
                 WHERE window_index < (SELECT max(window_index) FROM idempotency_quota_usage)";
    sqlx::query(spent).execute(&h.pool).await.expect("spend the old counters");
    assert_eq!(h.store.admin().purge_expired(100).await.expect("purge"), 0, "no record expired");
    let counters = "SELECT count(*) FILTER (WHERE expires_at <= now()), count(*) FROM idempotency_quota_usage";
    let (spent, left): (i64, i64) = sqlx::query_as(counters).fetch_one(&h.pool).await.expect("count");
    assert_eq!((spent, left), (0, current), "the spent counters went, this window's stayed");
}

async fn live_keys_count_leases_in_progress_only(mode: Mode) {
    let h = harness(mode, Quota::default().live_keys(2)).await;
    let scope = h.scope("acme");
    let begin = |name: &'static str, n: u64| {
        let scope = scope.clone();
        let h = &h;
        async move { h.store.begin(&scope, &key(name), &fingerprint(n)).await.expect("begin") }
    };
    let Begin::Acquired(first) = begin("a", 1).await else { panic!("a not acquired") };
    let Begin::Acquired(released) = begin("r", 1).await else { panic!("r not acquired") };
    released.release().await.expect("release");
    let Begin::Acquired(second) = begin("b", 1).await else { panic!("b not acquired") };

    // Two live leases: a new key is refused, and so is the released key, which would start again.
    for name in ["c", "r"] {
        let Begin::QuotaExceeded { limit, retry_after } = begin(name, 1).await else { panic!("{name} not refused") };
        assert_eq!(limit, QuotaLimit::LiveKeys);
        assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(30), "{retry_after:?}");
    }
    assert!(!holds(&h, &h.store, "acme", "c").await, "nothing recorded for the refused key");
    // A duplicate of a live key is told "in flight", as without a quota; another payload, "mismatch" once
    // the key completed.
    assert!(matches!(begin("a", 1).await, Begin::InFlight { .. }));
    assert_eq!(h.counter("idemstore_quota_refusals_total", &[("limit", "live_keys")]), 2.0);

    // A completion frees a place.
    first.complete(b"done").await.expect("complete");
    assert!(matches!(begin("a", 2).await, Begin::Mismatch));
    let Begin::Acquired(third) = begin("c", 1).await else { panic!("c not acquired after a completion") };
    // A lease that ran out is not live: its place is free (and the key can be taken over).
    h.pass_lease(&scope, &key("b")).await;
    let Begin::Acquired(fourth) = begin("r", 1).await else { panic!("r not acquired after a lease ran out") };
    assert!(matches!(begin("d", 1).await, Begin::QuotaExceeded { limit: QuotaLimit::LiveKeys, .. }));
    drop(second);
    third.complete(b"done").await.expect("complete");
    fourth.complete(b"done").await.expect("complete");
    assert!(matches!(begin("d", 1).await, Begin::Acquired(_)));
}

/// Transactional claims of tenant `acme` for the live-key tests: each selects 1 in its claim's
/// transaction; one that waits says so (on the receiver `new` returns) and then waits for a permit of
/// `gate`, holding its claim open.
struct InTx<'h> {
    h: &'h Harness,
    started: tokio::sync::mpsc::UnboundedSender<()>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
}

impl<'h> InTx<'h> {
    fn new(h: &'h Harness) -> (Self, tokio::sync::mpsc::UnboundedReceiver<()>) {
        let (started, opened) = tokio::sync::mpsc::unbounded_channel();
        (Self { h, started, gate: std::sync::Arc::new(tokio::sync::Semaphore::new(0)) }, opened)
    }

    async fn run(&self, name: &str, payload: Value, wait: bool) -> RunOutcome<i64> {
        let (started, gate) = (self.started.clone(), std::sync::Arc::clone(&self.gate));
        let (scope, key) = (self.h.scope("acme"), key(name));
        let outcome = self.h.store.run_once_in_tx(&scope, &key, &payload, move |tx| {
            Box::pin(async move {
                if wait {
                    started.send(()).expect("the test listens");
                    gate.acquire().await.expect("open").forget();
                }
                sqlx::query_scalar::<_, i64>("SELECT 1::int8").fetch_one(tx).await
            })
        });
        outcome.await.expect("answer")
    }
}

/// Claims made inside a transaction are in no snapshot until they commit: each holds one of the limit's
/// slots instead. Two held open fill a limit of two, so a third transactional claim is refused and
/// nothing of it is recorded, while a completed key is still replayed; once both commit (completed, not
/// live) places are free again (before: the third passed, and a tenant could hold any number of pool
/// connections in transactional claims). A plain claim counts the committed leases only: with both kinds
/// at once a tenant holds at most twice the limit (documented on `Quota::live_keys`).
async fn open_transactional_claims_count_as_live_keys(mode: Mode) {
    let h = harness(mode, Quota::default().live_keys(2)).await;
    let scope = h.scope("acme");
    let (claims, mut opened) = InTx::new(&h);
    let in_tx = |name: &'static str, wait: bool| claims.run(name, json!({}), wait);
    assert_eq!(in_tx("done", false).await, RunOutcome::Executed(1));
    let held = futures::future::join(in_tx("held-1", true), in_tx("held-2", true));
    let refused = async {
        opened.recv().await.expect("first open");
        opened.recv().await.expect("second open");
        let third = in_tx("third", false).await;
        let plain = h.store.begin(&scope, &key("plain"), &fingerprint(1)).await.expect("begin");
        let plain = match plain {
            Begin::Acquired(owner) => {
                owner.release().await.expect("release");
                "acquired"
            }
            other => panic!("a plain claim counts committed leases only: {other:?}"),
        };
        // A key with a record is answered from it, slots or not (it starts nothing).
        let replay = in_tx("done", false).await;
        claims.gate.add_permits(2);
        (third, plain, replay)
    };
    let ((first, second), (third, plain, replay)) = tokio::join!(held, refused);
    assert_eq!(replay, RunOutcome::Replayed(1));
    assert_eq!((first, second), (RunOutcome::Executed(1), RunOutcome::Executed(1)));
    assert!(matches!(third, RunOutcome::QuotaExceeded { limit: QuotaLimit::LiveKeys, .. }), "{third:?}");
    assert_eq!(plain, "acquired");
    assert!(!holds(&h, &h.store, "acme", "third").await, "nothing recorded for the refused claim");
    assert_eq!(in_tx("third", false).await, RunOutcome::Executed(1));
}

async fn a_burst_past_the_limit_leaves_no_trace_of_refused_keys(mode: Mode) {
    const LIMIT: u32 = 5;
    let h = harness(mode, Quota::default().new_keys(LIMIT, HOUR)).await;
    let names: Vec<String> = (0..24).map(|i| format!("burst-{i}")).collect();
    let runs = names.iter().map(|name| async { (key(name), run(&h, "acme", None, name, json!({})).await) });
    let outcomes = futures::future::join_all(runs).await;
    let mut executed = 0;
    for (key, outcome) in &outcomes {
        match outcome {
            RunOutcome::Executed(_) => executed += 1,
            RunOutcome::QuotaExceeded { limit: QuotaLimit::NewKeys, .. } => {
                assert_eq!(h.effects("acme", key).await, 0);
                assert!(!holds(&h, &h.store, "acme", key.as_str()).await, "{key:?} left a trace");
            }
            other => panic!("{key:?}: {other:?}"),
        }
    }
    // Concurrent claims do not see each other's rows: the limit may be passed by the burst's overlap,
    // never undercut, and sequential claims after it are held to it. The overlap is at most the claims
    // that run at once less one (the store's pool holds 16 connections): the last claim that executed
    // saw fewer than LIMIT executed before it, with at most 15 others in flight.
    assert!(executed >= LIMIT as usize, "{executed} executed");
    assert!(executed <= LIMIT as usize + 15, "{executed} of {} executed", names.len());
    assert!(matches!(run(&h, "acme", None, "after", json!({})).await, RunOutcome::QuotaExceeded { .. }));
}

async fn keys_started_again_are_not_new_and_transactional_claims_count_once_committed(mode: Mode) {
    let h = harness(mode, Quota::default().new_keys(2, HOUR)).await;
    let scope = h.scope("acme");
    // A key released and claimed again (its work failed, the retry runs it) is one new key, not two.
    let Begin::Acquired(owner) = h.store.begin(&scope, &key("retried"), &fingerprint(1)).await.expect("begin") else {
        panic!("not acquired")
    };
    owner.release().await.expect("release");
    for attempt in 0..3 {
        let Begin::Acquired(owner) = h.store.begin(&scope, &key("retried"), &fingerprint(1)).await.expect("begin")
        else {
            panic!("attempt {attempt} not acquired")
        };
        owner.release().await.expect("release");
    }
    // The transactional path counts its new key when it commits: one more fits, then none.
    let in_tx = |name: &'static str| {
        let (scope, key) = (scope.clone(), key(name));
        let h = &h;
        async move {
            let payload = json!({});
            let outcome = h.store.run_once_in_tx(&scope, &key, &payload, |tx| {
                Box::pin(async move { sqlx::query_scalar::<_, i64>("SELECT 1::int8").fetch_one(tx).await })
            });
            outcome.await.expect("answer")
        }
    };
    assert_eq!(in_tx("in-tx").await, RunOutcome::Executed(1));
    assert!(matches!(in_tx("in-tx-2").await, RunOutcome::QuotaExceeded { limit: QuotaLimit::NewKeys, .. }));
    assert!(matches!(run(&h, "acme", None, "plain", json!({})).await, RunOutcome::QuotaExceeded { .. }));
}

async fn the_previous_window_weighs_as_much_as_the_sliding_window_still_covers(mode: Mode) {
    let h = harness(mode, Quota::default().new_keys(3, HOUR)).await;
    // A million keys in the previous window: their weight keeps the tenant over its limit until all
    // but the last two millionths of this window are gone.
    sqlx::query(
        "INSERT INTO idempotency_quota_usage (tenant, operation, window_ms, window_index, backend, claims, expires_at)
         SELECT 'acme', $1, 3600000, floor(extract(epoch FROM now()) / 3600)::bigint - 1, 0, 1000000,
                now() + interval '2 hours'",
    )
    .bind(&h.operation)
    .execute(&h.pool)
    .await
    .expect("a busy previous window");
    let refused = run(&h, "acme", None, "a", json!({})).await;
    let RunOutcome::QuotaExceeded { limit: QuotaLimit::NewKeys, retry_after } = refused else { panic!("{refused:?}") };
    assert_close(retry_after, windows_until(&h, 1.0 - 2.0 / 1_000_000.0).await);
    // Once its window is two back, it weighs nothing.
    sqlx::query("UPDATE idempotency_quota_usage SET window_index = window_index - 1")
        .execute(&h.pool)
        .await
        .expect("age");
    assert!(matches!(run(&h, "acme", None, "a", json!({})).await, RunOutcome::Executed(_)));
}

/// A duplicate of a key that another transaction claims now, with another payload (so that Redis's marker
/// does not answer it: it asks Postgres), is told "in flight" at once and holds nothing: a new key within
/// the tenant's live-key limit still starts while the owner works. Before the fix the duplicate took a
/// live-key slot, then waited on the owner's row lock for the whole lock timeout (2.5 s by default) with
/// a pool connection, and the new key was refused `QuotaExceeded` meanwhile.
async fn a_duplicate_of_an_open_transactional_claim_holds_no_slot(mode: Mode) {
    let h = harness(mode, Quota::default().live_keys(2)).await;
    let (claims, mut opened) = InTx::new(&h);
    let in_tx = |name: &'static str, payload: Value, wait: bool| claims.run(name, payload, wait);
    let held = in_tx("held", json!({}), true);
    let others = async {
        opened.recv().await.expect("the owner works");
        // The duplicate's answer, or the moment it waits on a lock (before the fix, for 2.5 s).
        let waiting =
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
        let mut duplicate = std::pin::pin!(in_tx("held", json!({"other": 1}), false));
        let answered = loop {
            tokio::select! {
                answer = &mut duplicate => break Some(answer),
                _ = tokio::time::sleep(Duration::from_millis(5)) => {
                    let waiters: i64 = sqlx::query_scalar(waiting).fetch_one(&h.pool).await.expect("activity");
                    if waiters > 0 {
                        break None;
                    }
                }
            }
        };
        let fresh = in_tx("fresh", json!({}), false).await;
        let duplicate = match answered {
            Some(answer) => answer,
            None => duplicate.await,
        };
        claims.gate.add_permits(1);
        (fresh, duplicate)
    };
    let (held, (fresh, duplicate)) = tokio::join!(held, others);
    assert_eq!(fresh, RunOutcome::Executed(1), "a new key within the limit starts while a duplicate is answered");
    assert!(matches!(duplicate, RunOutcome::InFlight { .. }), "{duplicate:?}");
    assert_eq!(held, RunOutcome::Executed(1));
}
