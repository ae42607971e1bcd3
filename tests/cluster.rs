//! The store on a real Redis Cluster (three masters, three replicas on loopback): every script on
//! every shard, and the retrying workload of the fault suite meeting a manual failover, a master
//! SIGKILLed, and a slot migrated mid-load. Each fault: no duplicate execution, no lost completion,
//! every request answered.

use crate::support;
use support::payments;

use std::sync::Arc;
use std::time::Duration;

use idemstore::{Begin, Fingerprint, LeaseExpiry, Policy, RunError, RunOptions, RunOutcome};
use idemstore_testkit::RedisCluster;
use serde_json::json;
use support::chaos::{Load, assert_once, fallbacks, load_across_fault, print};
use support::{Harness, key, short_lease};

async fn start() -> (Arc<RedisCluster>, Harness) {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.expect("join").expect("start a cluster");
    let h = Harness::on_cluster(&cluster, short_lease(LeaseExpiry::TakeOver)).await;
    (Arc::new(cluster), h)
}

/// Runs a blocking cluster control (failover, kill, migrate) off the async workers.
async fn control<T: Send + 'static>(
    cluster: &Arc<RedisCluster>,
    step: impl FnOnce(&RedisCluster) -> T + Send + 'static,
) -> T {
    let cluster = Arc::clone(cluster);
    tokio::task::spawn_blocking(move || step(&cluster)).await.expect("join the cluster control")
}

/// The master that holds `chaos-0`, the key every client of the load starts near.
async fn master_of_first_key(cluster: &Arc<RedisCluster>, h: &Harness) -> u16 {
    let record_key = h.redis_key(&h.scope("acme"), &key("chaos-0"));
    control(cluster, move |c| c.master_of_slot(c.slot_of(&record_key)?)).await.expect("the key's master")
}

fn hits(h: &Harness) -> f64 {
    h.counter("idemstore_redis_lookups_total", &[("result", "hit")])
}

/// Keys on every master take every script: a claim (begin.lua) and its completion (put.lua), a replay
/// and a mismatch answered from Redis, a failed work's release (release.lua), a long work's lease
/// extension (extend.lua); records spread over all three masters, and nothing degraded to Postgres.
/// After every node forgot its scripts (SCRIPT FLUSH), replays are still answered by Redis: NOSCRIPT is
/// answered with EVAL on the key's node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_script_runs_on_every_shard() {
    let (cluster, h) = start().await;
    let scope = h.scope("acme");
    let keys: Vec<_> = (0..48).map(|i| key(&format!("spread-{i}"))).collect();
    for k in &keys {
        let executed = h.store.run_once(&scope, k, &json!({"n": 1}), || h.charge("acme", k)).await;
        assert!(matches!(executed, Ok(RunOutcome::Executed(_))), "{executed:?}");
    }
    let before = hits(&h);
    for k in &keys {
        let replayed = h.store.run_once(&scope, k, &json!({"n": 1}), || h.charge("acme", k)).await;
        assert!(matches!(replayed, Ok(RunOutcome::Replayed(_))), "{replayed:?}");
        let refused = h.store.run_once(&scope, k, &json!({"n": 2}), || h.charge("acme", k)).await;
        assert!(matches!(refused, Ok(RunOutcome::Mismatch)), "{refused:?}");
        assert_eq!(h.effects("acme", k).await, 1);
    }
    assert!(hits(&h) >= before + 96.0, "replays and mismatches answered by Redis");

    // release.lua: the work fails, the key is free again, and the next claim runs it.
    let failing = key("fails-once");
    let failed = h.store.run_once(&scope, &failing, &json!({}), || async { Err::<i64, _>("declined") }).await;
    assert!(matches!(failed, Err(RunError::Work("declined"))), "{failed:?}");
    let retried = h.store.run_once(&scope, &failing, &json!({}), || async { Ok::<_, &str>(7) }).await;
    assert!(matches!(retried, Ok(RunOutcome::Executed(7))), "{retried:?}");

    // extend.lua: a work longer than its lease keeps it: its marker, on the key's node, is still there
    // past the first lease only because the heartbeat extended it there.
    let slow = key("slow");
    let client = redis::cluster::ClusterClient::new(cluster.seed_urls()).expect("a cluster client");
    let mut conn = client.get_async_connection().await.expect("a cluster connection");
    let (marker, conn) = (h.redis_key(&scope, &slow), &mut conn);
    let ran = h
        .store
        .run_once(&scope, &slow, &json!({}), || async move {
            tokio::time::sleep(Duration::from_millis(2_500)).await;
            let exists: bool = redis::cmd("EXISTS").arg(&marker).query_async(conn).await.expect("EXISTS");
            Ok::<_, &str>(exists)
        })
        .await;
    assert!(matches!(ran, Ok(RunOutcome::Executed(true))), "the marker outlived its 2 s lease: {ran:?}");

    let masters = control(&cluster, |c| c.master_ports()).await.expect("masters");
    assert_eq!(masters.len(), 3);
    for port in masters {
        let held = control(&cluster, move |c| c.key_count(port)).await.expect("DBSIZE");
        assert!(held > 0, "master {port} holds no record: {held}");
    }
    assert_eq!(fallbacks(&h), 0.0, "a healthy cluster answers every call");

    control(&cluster, |c| c.flush_scripts()).await.expect("SCRIPT FLUSH");
    let before = hits(&h);
    for k in &keys {
        let replayed = h.store.run_once(&scope, k, &json!({"n": 1}), || h.charge("acme", k)).await;
        assert!(matches!(replayed, Ok(RunOutcome::Replayed(_))), "{replayed:?}");
    }
    assert_eq!(hits(&h), before + keys.len() as f64, "NOSCRIPT answered by EVAL on the key's node");
    assert_eq!(fallbacks(&h), 0.0);
}

/// A manual failover of the master holding the hot key, mid-load: its replica takes over in agreement.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn manual_failover_mid_load() {
    let (cluster, h) = start().await;
    let master = master_of_first_key(&cluster, &h).await;
    let report = load_across_fault(&h, Load::default(), || async {
        control(&cluster, move |c| c.failover(master)).await.expect("fail over");
    })
    .await;
    print("cluster-failover", &h, &report);
    assert_once(&report);
    assert_ne!(master_of_first_key(&cluster, &h).await, master, "the replica serves the slot now");
    assert_redis_serves_again(&h).await;
}

/// A master SIGKILLed mid-load: its slots answer CLUSTERDOWN (then its replica takes over after the
/// node timeout); calls degrade to Postgres meanwhile, and the load goes on past the takeover. The old
/// master is restarted afterwards and rejoins as a replica; Redis serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn master_killed_mid_load() {
    let (cluster, h) = start().await;
    let master = master_of_first_key(&cluster, &h).await;
    let report = load_across_fault(&h, Load::default(), || async {
        control(&cluster, move |c| {
            c.kill(master);
            c.wait_for_takeover_of(master)
        })
        .await
        .expect("kill a master, wait for its takeover");
    })
    .await;
    print("cluster-master-killed", &h, &report);
    assert_once(&report);
    assert!(fallbacks(&h) > 0.0, "calls to the dead master degraded to Postgres");
    control(&cluster, move |c| c.restart(master)).await.expect("restart the old master");
    assert_redis_serves_again(&h).await;
}

/// The slot of the hot key moves to another master mid-load, key by key with a pause (requests meet
/// ASK), then for good (requests meet MOVED until the client refreshes its map).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slot_migrated_mid_load() {
    let (cluster, h) = start().await;
    let record_key = h.redis_key(&h.scope("acme"), &key("chaos-0"));
    let slot = control(&cluster, move |c| c.slot_of(&record_key)).await.expect("slot");
    let source = master_of_first_key(&cluster, &h).await;
    let masters = control(&cluster, |c| c.master_ports()).await.expect("masters");
    let target = masters.into_iter().find(|port| *port != source).expect("another master");
    let report = load_across_fault(&h, Load::default(), || async {
        control(&cluster, move |c| c.migrate_slot(slot, target, Duration::from_millis(300))).await.expect("migrate");
    })
    .await;
    print("cluster-slot-migrated", &h, &report);
    assert_once(&report);
    assert_eq!(master_of_first_key(&cluster, &h).await, target);
    assert_redis_serves_again(&h).await;
}

/// The payments demo on the cluster, while the master of its hot key fails over: every retry of one
/// payment is answered 201 (the first) or with the replay (or 409 in flight, retried), and the charge
/// is made once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn demo_answers_every_retry_during_a_failover() {
    let (cluster, h) = start().await;
    let base = payments::serve(&h).await;
    let client = reqwest::Client::new();
    let record_key = h.redis_key(&payments::acme(), &key("order-1"));
    let master = control(&cluster, move |c| c.master_of_slot(c.slot_of(&record_key)?)).await.expect("master");
    let failover = control(&cluster, move |c| c.failover(master));
    let retries = async {
        let mut statuses = Vec::new();
        for _ in 0..60 {
            let response = payments::post_payment(&client, &base, "order-1", "acme", &payments::charge(42), 0).await;
            statuses.push((response.status().as_u16(), response.headers().contains_key("idempotent-replayed")));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        statuses
    };
    let (failed_over, statuses) = tokio::join!(failover, retries);
    failed_over.expect("fail over");
    assert_eq!(payments::charges(&h, "acme").await, 1, "{statuses:?}");
    assert_eq!(statuses[0], (201, false), "{statuses:?}");
    assert!(statuses[1..].iter().all(|answer| *answer == (201, true)), "every retry replays: {statuses:?}");
}

/// A replay is soon answered by Redis again after the fault.
async fn assert_redis_serves_again(h: &Harness) {
    let before = hits(h);
    let scope = h.scope("acme");
    for _ in 0..100 {
        let k = key("chaos-0");
        let replayed =
            h.store.run_once(&scope, &k, &json!({ "amount": 100, "currency": "EUR" }), || h.charge("acme", &k)).await;
        assert!(matches!(replayed, Ok(RunOutcome::Replayed(_))), "{replayed:?}");
        if hits(h) > before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reasons: Vec<_> = ["error", "timeout", "cluster", "circuit_open"]
        .into_iter()
        .map(|reason| (reason, h.counter("idemstore_redis_fallbacks_total", &[("reason", reason)])))
        .collect();
    panic!("Redis never served again; fallbacks {reasons:?}");
}

/// A prefix with a brace would put every record in one slot: refused when a cluster store is built (a
/// single Redis takes it).
#[test]
fn a_key_prefix_with_a_brace_is_refused() {
    let built = idemstore::Store::builder()
        .database_url("postgres://localhost/db")
        .redis_cluster(["redis://127.0.0.1:7000"])
        .key_prefix("app{1}")
        .build();
    assert!(matches!(built, Err(idemstore::ConfigError::KeyPrefix { .. })), "{built:?}");
}

/// A claim waiting for an in-flight owner on a cluster store (no Redis subscription there) flags the
/// record in Postgres and is woken by the owner's completion through `LISTEN`/`NOTIFY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_on_a_cluster_is_woken_through_postgres() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.expect("join").expect("start a cluster");
    let long_lease = Policy::builder().lease(Duration::from_secs(60)).build().expect("policy");
    let h = Harness::on_cluster(&cluster, long_lease).await;
    let (scope, k) = (h.scope("acme"), key("awaited"));
    let fingerprint = Fingerprint::of_serialize(&json!({"n": 1}), h.store.policy(&h.operation).fingerprint());
    let fingerprint = fingerprint.expect("fingerprint");
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint).await.expect("claim") else {
        panic!("the key is new")
    };
    let waiter = {
        let (store, scope, k, fingerprint) = (h.store.clone(), scope.clone(), k.clone(), fingerprint.clone());
        tokio::spawn(async move {
            let options = RunOptions::default().wait_in_flight(Duration::from_secs(30));
            store.begin_with(&scope, &k, &fingerprint, &options).await.expect("the waiting claim")
        })
    };
    h.wait_until_flagged(&scope, &k, false).await;
    owner.complete(b"the result").await.expect("complete");
    let Begin::Replayed(stored) = waiter.await.expect("join") else { panic!("the waiter replays") };
    assert_eq!(stored.as_bytes(), b"the result");
    assert_eq!(h.counter("idemstore_wait_wakeups_total", &[("by", "notification")]), 1.0);
}
