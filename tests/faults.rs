//! Fault injection: a concurrent workload of retrying clients (see `support::chaos`) meets one fault per
//! test, and the checker reads the real effects. Every test runs in both modes, except the faults of
//! Redis itself, which run in two-tier mode alone: in Postgres-only mode they would be the same load
//! without a fault, passing for nothing.
//!
//! Each test prints its report as `REPORT <fault> <mode> <json>`; `docs/reliability.md` tabulates them.

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemstore::{Begin, Fingerprint, LeaseExpiry, Mode, RunOutcome, Scope, State};
use idemstore_testkit::ProxyMode;
use serde_json::json;
use support::chaos::{
    self, Load, Progress, Report, assert_clean, assert_once, fallbacks, load_with_fault, load_with_fault_at, print,
};
use support::{Harness, Servers, attach_to_parent, child, key, short_lease};

suite!(
    postgres_restarted_mid_load,
    owner_task_aborted_mid_work_is_taken_over,
    owner_task_aborted_mid_work_goes_indeterminate,
    owner_process_killed_mid_work_is_taken_over,
    crash_between_postgres_commit_and_redis_write,
    a_completion_whose_answer_was_lost_replaces_an_indeterminate_marker,
    three_processes_hammer_the_same_keys,
    postgres_connections_cut_mid_load,
    postgres_blackholed_mid_load,
    skewed_clocks_do_not_move_leases,
    owner_process_killed_mid_transaction_leaves_nothing,
    postgres_restart_between_work_and_completion_costs_latency_not_a_rerun;
    two_tier only:
    redis_killed_and_restarted_empty_mid_load,
    redis_flushed_mid_load,
    redis_paused_beyond_the_budget,
    redis_evicting_under_memory_pressure,
    redis_out_of_memory_with_noeviction,
    redis_connection_blackholed_mid_load,
    redis_connections_cut_mid_load,
);

/// Postgres crashes and restarts after the work ran and before its completion: the owner asks again
/// while its lease lasts, so the caller gets `Executed`, a retry gets the replay, and the work ran once
/// (before: the completion failed at once with `StoreUnavailable`, the record stayed in progress, and the
/// first retry after the lease ran the work a second time).
async fn postgres_restart_between_work_and_completion_costs_latency_not_a_rerun(mode: Mode) {
    let policy = idemstore::Policy::builder()
        .lease(Duration::from_secs(20))
        .redis_ttl(Duration::from_secs(600))
        .lease_expiry(LeaseExpiry::TakeOver)
        .build()
        .expect("policy");
    let h = Arc::new(Harness::with(mode, policy, Servers::Owned).await);
    let (scope, k, payload) = (h.scope("acme"), key("blip"), json!({"amount": 1}));
    let (ran, work_ran) = tokio::sync::oneshot::channel();
    let gate = Arc::new(tokio::sync::Notify::new());
    let owner = tokio::spawn({
        let (h, scope, k, payload, gate) = (h.clone(), scope.clone(), k.clone(), payload.clone(), gate.clone());
        async move {
            h.store
                .run_once(&scope, &k, &payload, || async {
                    let charged = h.charge("acme", &k).await;
                    let _ = ran.send(());
                    gate.notified().await;
                    charged
                })
                .await
        }
    });
    work_ran.await.expect("the work ran");
    let postgres = h.postgres.as_ref().expect("owned");
    postgres.stop().expect("crash Postgres");
    gate.notify_one();
    // The completion fails and is asked again: the restart comes only once that was seen.
    while h.counter("idemstore_settle_retries_total", &[]) < 1.0 && !owner.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    postgres.restart().expect("restart Postgres");
    let outcome = owner.await.expect("no panic").expect("completed once Postgres was back");
    assert!(matches!(outcome, RunOutcome::Executed(_)), "{outcome:?}");
    let retry = h.store.run_once(&scope, &k, &payload, || async { h.charge("acme", &k).await }).await;
    assert!(matches!(retry, Ok(RunOutcome::Replayed(_))), "{retry:?}");
    assert_eq!(h.effects("acme", &k).await, 1, "the work ran once");
}

/// A process SIGKILLed inside `run_once_in_tx`, after its work's insert and before the commit, leaves
/// nothing behind: no record, no effect; the retry executes exactly once.
async fn owner_process_killed_mid_transaction_leaves_nothing(mode: Mode) {
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Any).await;
    support::kill_child_at(&h, module_path!(), "child_tx_owner", "OWNER IN TRANSACTION");
    let (scope, k, payload) = (h.scope("acme"), key("in-tx"), json!({"amount": 1}));
    assert_eq!(h.store.admin().lookup(&scope, &k).await.expect("lookup"), None, "the claim never committed");
    let executed = loop {
        let outcome = h.store.run_once_in_tx(&scope, &k, &payload, |tx| effect_in_tx(tx, "in-tx"));
        match outcome.await.expect("the store answers") {
            RunOutcome::InFlight { .. } => tokio::time::sleep(Duration::from_millis(25)).await,
            other => break other,
        }
    };
    assert!(matches!(executed, RunOutcome::Executed(_)), "{executed:?}");
    assert_eq!(h.effects("acme", &k).await, 1, "the killed owner's insert rolled back with its claim");
}

fn effect_in_tx<'c>(tx: &'c mut sqlx::PgConnection, key: &'static str) -> idemstore::TxFuture<'c, i64, sqlx::Error> {
    Box::pin(async move {
        sqlx::query_scalar("INSERT INTO effects (tenant, key) VALUES ('acme', $1) RETURNING id")
            .bind(key)
            .fetch_one(&mut *tx)
            .await
    })
}

/// Child process of `owner_process_killed_mid_transaction_leaves_nothing`: inserts its effect inside the
/// claim's transaction, announces it, and hangs until killed.
#[tokio::test]
#[ignore = "run as a child process by the fault tests"]
async fn child_tx_owner() {
    let Some(h) = attach_to_parent().await else { return };
    let scope = Scope::new("acme", h.operation.clone()).expect("scope");
    let _ = h
        .store
        .run_once_in_tx(&scope, &key("in-tx"), &json!({"amount": 1}), |tx| {
            Box::pin(async move {
                let id = effect_in_tx(tx, "in-tx").await?;
                println!("OWNER IN TRANSACTION");
                std::future::pending::<()>().await;
                Ok::<_, sqlx::Error>(id)
            })
        })
        .await;
}

/// Redis is SIGKILLed mid-load and restarted empty (script cache included): the Postgres path answers
/// meanwhile, the scripts are reloaded, and nothing runs twice.
async fn redis_killed_and_restarted_empty_mid_load() {
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::Owned).await;
    let report = load_with_fault(&h, || async {
        let redis = h.redis.as_ref().expect("owned");
        redis.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        redis.restart().expect("restart Redis");
    })
    .await;
    print("redis-killed", &h, &report);
    assert_once(&report);
    assert!(fallbacks(&h) > 0.0);
    assert_redis_serves_again(&h).await;
}

/// After a Redis fault, a replay is soon answered by Redis again (reconciled once, then a hit).
async fn assert_redis_serves_again(h: &Harness) {
    let hits = h.counter("idemstore_redis_lookups_total", &[("result", "hit")]);
    let (scope, k) = (h.scope("acme"), key("chaos-0"));
    let fp = Fingerprint::of_serialize(
        &json!({ "amount": 100, "currency": "EUR" }),
        h.store.policy(&h.operation).fingerprint(),
    );
    let fp = fp.expect("fp");
    for _ in 0..100 {
        assert!(matches!(h.store.begin(&scope, &k, &fp).await, Ok(Begin::Replayed(_))));
        if h.counter("idemstore_redis_lookups_total", &[("result", "hit")]) > hits {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("Redis never served again");
}

/// FLUSHALL + SCRIPT FLUSH mid-load: Postgres arbitrates every key Redis forgot and Redis is repaired.
async fn redis_flushed_mid_load() {
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::Any).await;
    let report = load_with_fault(&h, || async {
        let mut conn = h.redis_connection().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.expect("SCRIPT FLUSH");
    })
    .await;
    print("redis-flushed", &h, &report);
    assert_once(&report);
    assert!(h.counter("idemstore_reconciliations_total", &[]) > 0.0);
}

/// Redis stops answering (SIGSTOP) for three seconds: requests degrade to Postgres within the budget
/// instead of waiting for Redis, and nothing runs twice.
async fn redis_paused_beyond_the_budget() {
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::Owned).await;
    let pause = Duration::from_secs(3);
    let report = load_with_fault(&h, || async {
        let redis = h.redis.as_ref().expect("owned");
        redis.pause().expect("SIGSTOP");
        tokio::time::sleep(pause).await;
        redis.resume().expect("SIGCONT");
    })
    .await;
    print("redis-paused", &h, &report);
    assert_once(&report);
    assert!(report.slowest_attempt_ms < pause.as_millis() as u64 / 2, "no attempt waited for Redis: {report:#?}");
    let timeouts = h.counter("idemstore_redis_fallbacks_total", &[("reason", "timeout")]);
    assert!(timeouts > 0.0, "the budget ran out at least once");
}

/// A Redis that evicts (allkeys-lru, 2 MB, filled by another writer) loses live markers: Postgres still
/// arbitrates, nothing runs twice.
async fn redis_evicting_under_memory_pressure() {
    let args = &["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"];
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::OwnedRedisWith(args)).await;
    let filler = spawn_filler(&h).await;
    let report = load_with_fault(&h, || async {}).await;
    let evicted = stop_filler(&h, filler).await;
    print("redis-evicting", &h, &report);
    assert_once(&report);
    assert!(evicted > 0, "the filler made Redis evict");
    // Evictions of the filler's own keys alone would prove nothing: the store's records were evicted
    // too, and Postgres answered the keys Redis had lost.
    let reconciled = h.counter("idemstore_reconciliations_total", &[]);
    assert!(reconciled > 0.0, "a record the store wrote was evicted and reconciled: {report:#?}");
}

/// A full Redis with `noeviction` answers OOM to every write: the store treats that as "Redis
/// unavailable", falls back to Postgres and counts it.
async fn redis_out_of_memory_with_noeviction() {
    let args = &["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"];
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::OwnedRedisWith(args)).await;
    // Fill it up until writes are refused.
    let mut conn = h.redis_connection().await;
    let junk = vec![b'x'; 16 << 10];
    for i in 0.. {
        let set: redis::RedisResult<()> =
            redis::cmd("SET").arg(format!("junk:{i}")).arg(&junk).query_async(&mut conn).await;
        if set.is_err() {
            break;
        }
    }
    let report = load_with_fault(&h, || async {}).await;
    print("redis-oom", &h, &report);
    assert_once(&report);
    assert!(h.counter("idemstore_redis_fallbacks_total", &[("reason", "error")]) > 0.0);
}

/// A writer of 16 KB values into Redis, to keep it at its memory limit.
type Filler = (tokio::task::JoinHandle<()>, tokio::sync::oneshot::Sender<()>);

/// Writes 16 KB values into Redis until stopped.
async fn spawn_filler(h: &Harness) -> Filler {
    let mut conn = h.redis_connection().await;
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let junk = vec![b'x'; 16 << 10];
        for i in 0u64.. {
            if stopped.try_recv().is_ok() {
                break;
            }
            let _: redis::RedisResult<()> =
                redis::cmd("SET").arg(format!("junk:{i}")).arg(&junk).query_async(&mut conn).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    (task, stop)
}

/// Stops the filler; returns how many keys Redis evicted.
async fn stop_filler(h: &Harness, (task, stop): Filler) -> u64 {
    let _ = stop.send(());
    task.await.expect("filler");
    let mut conn = h.redis_connection().await;
    let info: String = redis::cmd("INFO").arg("stats").query_async(&mut conn).await.expect("INFO");
    info.lines().find_map(|l| l.strip_prefix("evicted_keys:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Postgres crashes (immediate stop) and restarts mid-load: requests fail closed with a retryable error
/// meanwhile, and retries complete. A work that committed its effect while its own completion failed is
/// re-executed after its lease, under TakeOver: that is the documented at-least-once case, so duplicates
/// are bounded by the takeovers, and every answer still matches what Postgres holds.
async fn postgres_restarted_mid_load(mode: Mode) {
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Owned).await;
    // Early in the load, while most keys are still being claimed (later, Redis answers most of them).
    let report = load_with_fault_at(&h, 50, || async {
        let postgres = h.postgres.as_ref().expect("owned");
        postgres.stop().expect("crash Postgres");
        // Longer than the pool's 3 s acquire timeout, so waiting requests fail closed.
        tokio::time::sleep(Duration::from_millis(3500)).await;
        postgres.restart().expect("restart Postgres");
    })
    .await;
    print("postgres-restarted", &h, &report);
    let takeovers = h.counter("idemstore_lease_takeovers_total", &[]);
    assert!(report.errors_surfaced > 0, "the crash was seen: {report:#?}");
    assert!(report.duplicate_executions as f64 <= takeovers, "every duplicate follows a takeover: {report:#?}");
    assert_clean(&report);
}

/// The network to Redis stops carrying packets for two seconds (a partition, through the proxy):
/// requests degrade to Postgres within the budget, nothing runs twice.
async fn redis_connection_blackholed_mid_load() {
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let report = load_with_fault(&h, || async {
        let proxy = h.redis_proxy.as_ref().expect("proxied");
        proxy.set(ProxyMode::Blackhole);
        tokio::time::sleep(Duration::from_secs(2)).await;
        proxy.set(ProxyMode::Pass);
    })
    .await;
    print("redis-blackholed", &h, &report);
    assert_once(&report);
    assert!(report.slowest_attempt_ms < 1000, "no attempt waited out the partition: {report:#?}");
    assert!(h.counter("idemstore_redis_fallbacks_total", &[("reason", "timeout")]) > 0.0);
}

/// Every connection to Redis is cut at once mid-load: calls fail, degrade, and reconnect.
async fn redis_connections_cut_mid_load() {
    let h = Harness::with(Mode::TwoTier, short_lease(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let cut = AtomicUsize::new(0);
    let report = load_with_fault(&h, || async {
        cut.store(h.redis_proxy.as_ref().expect("proxied").cut(), Ordering::Relaxed);
    })
    .await;
    print("redis-cut", &h, &report);
    assert_once(&report);
    assert!(cut.into_inner() > 0, "the cut closed the store's connections");
    assert!(fallbacks(&h) > 0.0, "a call met the cut and fell back to Postgres");
    assert_redis_serves_again(&h).await;
}

/// Every connection to Postgres is cut at once, early in the load: calls in flight fail closed, retries
/// complete, and duplicates can only follow a takeover (a work whose completion was cut).
async fn postgres_connections_cut_mid_load(mode: Mode) {
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let proxy = h.postgres_proxy.as_ref().expect("proxied");
    let (cut, accepted_by_then) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let report = load_with_fault_at(&h, 50, || async {
        cut.store(proxy.cut(), Ordering::Relaxed);
        accepted_by_then.store(proxy.accepted(), Ordering::Relaxed);
    })
    .await;
    print("postgres-cut", &h, &report);
    assert!(cut.into_inner() > 0, "the cut closed the store's connections");
    // Whether a call was on the wire at the cut is timing; that the store had to connect again is not.
    assert!(proxy.accepted() > accepted_by_then.into_inner(), "the store reconnected after the cut");
    assert!(report.duplicate_executions as f64 <= h.counter("idemstore_lease_takeovers_total", &[]), "{report:#?}");
    assert_clean(&report);
}

/// Postgres stops answering for three seconds (a partition, through the proxy): calls fail closed at
/// the store's Postgres timeout instead of hanging, and retries complete.
async fn postgres_blackholed_mid_load(mode: Mode) {
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Proxied).await;
    let report = load_with_fault_at(&h, 50, || async {
        let proxy = h.postgres_proxy.as_ref().expect("proxied");
        proxy.set(ProxyMode::Blackhole);
        tokio::time::sleep(Duration::from_secs(3)).await;
        proxy.set(ProxyMode::Pass);
    })
    .await;
    print("postgres-blackholed", &h, &report);
    assert!(report.errors_surfaced > 0, "the partition was seen: {report:#?}");
    assert!(report.slowest_attempt_ms < 3000, "calls failed at the timeout, not after the partition: {report:#?}");
    assert!(report.duplicate_executions as f64 <= h.counter("idemstore_lease_takeovers_total", &[]), "{report:#?}");
    assert_clean(&report);
}

/// Starts an owner whose work inserts its effect and then hangs; returns once the effect is written.
async fn hanging_owner(h: &Arc<Harness>, name: &str) -> tokio::task::JoinHandle<()> {
    let (started, owner_started) = tokio::sync::oneshot::channel();
    let task = {
        let (h, k) = (h.clone(), key(name));
        tokio::spawn(async move {
            let _ = h
                .store
                .run_once(&h.scope("acme"), &k, &json!({"amount": 1}), || async {
                    let effect = h.charge("acme", &k).await;
                    let _ = started.send(());
                    std::future::pending::<()>().await;
                    effect
                })
                .await;
        })
    };
    owner_started.await.expect("the owner ran its work");
    task
}

/// Eight concurrent retries, each retrying until it gets a final answer.
async fn retry_storm(h: &Harness, name: &str) -> Vec<RunOutcome<serde_json::Value>> {
    let k = key(name);
    let retries = (0..8).map(|_| async {
        loop {
            let outcome = h.store.run_once(&h.scope("acme"), &k, &json!({"amount": 1}), || h.charge("acme", &k)).await;
            match outcome.expect("the store answers") {
                RunOutcome::InFlight { .. } => tokio::time::sleep(Duration::from_millis(25)).await,
                other => return other,
            }
        }
    });
    futures::future::join_all(retries).await
}

/// The owner's task is aborted after its effect: the dropped owner gives the key up at once (no wait for
/// its 2 s lease, so no takeover), exactly one retry executes again (the documented at-least-once of
/// TakeOver: two effects), the others replay it.
async fn owner_task_aborted_mid_work_is_taken_over(mode: Mode) {
    let h = Arc::new(Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Any).await);
    let owner = hanging_owner(&h, "aborted").await;
    owner.abort();
    assert!(owner.await.is_err_and(|e| e.is_cancelled()), "the owner's future was dropped");
    let outcomes = retry_storm(&h, "aborted").await;
    let executed = outcomes.iter().filter(|o| matches!(o, RunOutcome::Executed(_))).count();
    let replayed = outcomes.iter().filter(|o| matches!(o, RunOutcome::Replayed(_))).count();
    println!("REPORT owner-aborted-takeover {mode:?} executed={executed} replayed={replayed}");
    assert_eq!((executed, replayed), (1, 7), "{outcomes:?}");
    assert_eq!(h.effects("acme", &key("aborted")).await, 2);
    assert_eq!(h.counter("idemstore_lease_takeovers_total", &[]), 0.0, "released, not taken over");
}

/// Under MarkIndeterminate the same crash executes nothing again: every retry is told indeterminate.
async fn owner_task_aborted_mid_work_goes_indeterminate(mode: Mode) {
    let h = Arc::new(Harness::with(mode, short_lease(LeaseExpiry::MarkIndeterminate), Servers::Any).await);
    hanging_owner(&h, "aborted").await.abort();
    let outcomes = retry_storm(&h, "aborted").await;
    assert!(outcomes.iter().all(|o| matches!(o, RunOutcome::Indeterminate)), "{outcomes:?}");
    assert_eq!(h.effects("acme", &key("aborted")).await, 1);
    let record = h.store.admin().lookup(&h.scope("acme"), &key("aborted")).await.expect("lookup").expect("record");
    assert_eq!(record.state, State::Indeterminate);
}

/// A separate OS process claims a key, writes its effect and is SIGKILLed mid-work: after its lease,
/// exactly one retry executes.
async fn owner_process_killed_mid_work_is_taken_over(mode: Mode) {
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Any).await;
    support::kill_child_at(&h, module_path!(), "child_owner", "OWNER WORKING");
    let outcomes = retry_storm(&h, "killed").await;
    let executed = outcomes.iter().filter(|o| matches!(o, RunOutcome::Executed(_))).count();
    assert_eq!(executed, 1, "{outcomes:?}");
    assert_eq!(h.effects("acme", &key("killed")).await, 2, "the killed owner's effect, then the takeover's");
}

/// The owner's process "dies" right after the completion commit, before Redis hears of it (failpoint):
/// retries are told "in flight" until the owner's marker expires, then get the replay from Postgres,
/// and Redis is repaired.
async fn crash_between_postgres_commit_and_redis_write(mode: Mode) {
    // Its failpoint is the process's: under `cargo test`, no other test's completion may meet it.
    if support::rerun_alone(mode, module_path!(), "crash_between_postgres_commit_and_redis_write") {
        return;
    }
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("crash"));
    fail::cfg("complete-before-redis", "return").expect("failpoint");
    let first = h.store.run_once(&scope, &k, &json!({"amount": 1}), || h.charge("acme", &k)).await;
    fail::remove("complete-before-redis");
    let Ok(RunOutcome::Executed(value)) = first else { panic!("{first:?}") };
    let replay = retry_storm(&h, "crash").await;
    assert!(replay.iter().all(|o| *o == RunOutcome::Replayed(value.clone())), "{replay:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
    if mode == Mode::TwoTier {
        assert_eq!(h.counter("idemstore_reconciliations_total", &[]), 1.0);
        let fp = Fingerprint::of_serialize(&json!({"amount": 1}), h.store.policy(scope.operation()).fingerprint());
        let hits = h.counter("idemstore_redis_lookups_total", &[("result", "hit")]);
        assert!(matches!(h.store.begin(&scope, &k, &fp.expect("fp")).await, Ok(Begin::Replayed(_))));
        assert_eq!(h.counter("idemstore_redis_lookups_total", &[("result", "hit")]), hits + 1.0, "repaired");
    }
}

/// The owner of a lease that ran out (`MarkIndeterminate`) completes after another claim marked its
/// record indeterminate (which Redis then holds), and the completion's answer is lost though it landed
/// (failpoint): its retry finds its own write, and Redis gets the completed copy, so a retry replays.
/// Before, the retry only took its own marker back, the indeterminate copy stayed, and Redis answered
/// "indeterminate" over the completed record (a model-checker counterexample).
async fn a_completion_whose_answer_was_lost_replaces_an_indeterminate_marker(mode: Mode) {
    if support::rerun_alone(mode, module_path!(), "a_completion_whose_answer_was_lost_replaces_an_indeterminate_marker")
    {
        return;
    }
    // A lease the owner still holds by its own clock, so that it asks again (the record's moves on).
    let policy = idemstore::Policy::builder()
        .lease(Duration::from_secs(20))
        .redis_ttl(Duration::from_secs(600))
        .lease_expiry(LeaseExpiry::MarkIndeterminate)
        .build();
    let h = Harness::with(mode, policy.expect("policy"), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("lost-answer"));
    let fp = Fingerprint::of_serialize(&json!({"amount": 1}), h.store.policy(scope.operation()).fingerprint());
    let fp = fp.expect("fingerprint");
    let Ok(Begin::Acquired(owner)) = h.store.begin(&scope, &k, &fp).await else { panic!("a new key") };
    h.pass_lease(&scope, &k).await;
    assert!(matches!(h.store.begin(&scope, &k, &fp).await, Ok(Begin::Indeterminate)));
    fail::cfg("complete-answer-lost", "1*return").expect("failpoint");
    let completed = owner.complete(b"the answer").await;
    fail::remove("complete-answer-lost");
    completed.expect("the write landed: the owner's own");
    let Ok(Begin::Replayed(stored)) = h.store.begin(&scope, &k, &fp).await else { panic!("the stored answer") };
    assert_eq!(stored.as_bytes(), b"the answer");
}

/// Three OS processes, each with its own pools, run the retrying load on the same keys.
async fn three_processes_hammer_the_same_keys(mode: Mode) {
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Any).await;
    let children: Vec<_> = (0..3)
        .map(|_| child(&h, module_path!(), "child_load").stdout(Stdio::piped()).spawn().expect("spawn a load process"))
        .collect();
    let mut total = Report::default();
    for child in children {
        let output = child.wait_with_output().expect("load process");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stdout));
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout.lines().find_map(|l| l.strip_prefix("CHILD REPORT ")).expect("a report line");
        let report: serde_json::Value = serde_json::from_str(line).expect("json");
        total.requests += report["requests"].as_u64().unwrap_or(0);
        total.mismatches_refused += report["mismatches_refused"].as_u64().unwrap_or(0);
        total.errors_surfaced += report["errors_surfaced"].as_u64().unwrap_or(0);
        total.unanswered += report["unanswered"].as_u64().unwrap_or(0);
        total.wrong_answers += report["wrong_answers"].as_u64().unwrap_or(0);
        total.lost_completions += report["lost_completions"].as_u64().unwrap_or(0);
    }
    // The effects are shared: count them once, across all processes.
    let keys = Load::default().keys;
    for k in 0..keys {
        let executions = h.effects("acme", &key(&format!("chaos-{k}"))).await as u64;
        total.executions += executions;
        total.duplicate_executions += executions.saturating_sub(1);
    }
    total.keys = keys;
    print("three-processes", &h, &total);
    assert_once(&total);
}

/// A process whose clock runs two hours ahead (libfaketime) neither takes over a live lease of a process
/// with a right clock, nor loses its own early to it: leases are measured by the servers' clocks only.
async fn skewed_clocks_do_not_move_leases(mode: Mode) {
    idemstore_testkit::ensure_installed("faketime", "faketime").expect("faketime");
    let h = Harness::with(mode, short_lease(LeaseExpiry::TakeOver), Servers::Any).await;
    let fp = Fingerprint::of_serialize(&json!({"amount": 1}), h.store.policy(&h.operation).fingerprint()).expect("fp");
    let Ok(Begin::Acquired(held)) = h.store.begin(&h.scope("acme"), &key("skew-held"), &fp).await else { panic!() };

    // libfaketime preloaded into the child itself (the `faketime` wrapper forks, and killing it would
    // leave the child running). Only the wall clock is skewed: that is what disagrees between machines;
    // monotonic clocks are never compared across them.
    let mut child = child(&h, module_path!(), "child_skewed_clock")
        .env("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
        .env("FAKETIME", "+2h")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the skewed process");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines().map(|l| l.expect("stdout"));
    let clock =
        lines.find_map(|l| l.strip_prefix("CLOCK ").and_then(|c| c.parse::<u64>().ok())).expect("the child's clock");
    assert!(clock > unix_seconds() + 3600, "the child's clock runs ahead");
    let challenger = lines.find(|l| l.starts_with("CHALLENGER")).expect("the challenger's answer");
    assert_eq!(challenger, "CHALLENGER in_flight", "a clock ahead does not expire another's lease");
    assert!(lines.any(|l| l.contains("OWNER WORKING")));
    let answer = h.store.begin(&h.scope("acme"), &key("skew-owned"), &fp).await.expect("begin");
    assert!(
        matches!(answer, Begin::InFlight { .. }),
        "a clock behind does not expire the skewed owner's lease: {answer:?}"
    );
    child.kill().expect("kill");
    child.wait().expect("reap");
    held.complete(b"1").await.expect("the held lease is still ours");
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Child process of `skewed_clocks_do_not_move_leases`, run under libfaketime: challenges the parent's
/// lease, then holds a lease of its own until killed.
#[tokio::test]
#[ignore = "run as a child process by the fault tests"]
async fn child_skewed_clock() {
    let Some(h) = attach_to_parent().await else { return };
    println!("CLOCK {}", unix_seconds());
    let scope = Scope::new("acme", h.operation.clone()).expect("scope");
    let fp = Fingerprint::of_serialize(&json!({"amount": 1}), h.store.policy(&h.operation).fingerprint()).expect("fp");
    match h.store.begin(&scope, &key("skew-held"), &fp).await {
        Ok(Begin::InFlight { .. }) => println!("CHALLENGER in_flight"),
        other => println!("CHALLENGER {other:?}"),
    }
    let Ok(Begin::Acquired(_lease)) = h.store.begin(&scope, &key("skew-owned"), &fp).await else { return };
    println!("OWNER WORKING");
    std::future::pending::<()>().await;
}

/// Child process of `owner_process_killed_mid_work_is_taken_over`: claims, writes its effect, announces
/// it, and hangs until killed.
#[tokio::test]
#[ignore = "run as a child process by the fault tests"]
async fn child_owner() {
    let Some(h) = attach_to_parent().await else { return };
    let k = key("killed");
    let scope = Scope::new("acme", h.operation.clone()).expect("scope");
    let _ = h
        .store
        .run_once(&scope, &k, &json!({"amount": 1}), || async {
            let effect = h.charge("acme", &k).await;
            println!("OWNER WORKING");
            std::future::pending::<()>().await;
            effect
        })
        .await;
}

/// Child process of `three_processes_hammer_the_same_keys`: runs the load and prints its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by the fault tests"]
async fn child_load() {
    let Some(h) = attach_to_parent().await else { return };
    let report = chaos::run(&h, &h.store, "acme", Load::default(), &Progress::new()).await;
    println!("CHILD REPORT {}", serde_json::to_string(&report).expect("json"));
}
