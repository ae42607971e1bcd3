//! The outbox relay holds no transaction across its sink: a slow sink under an idle-in-transaction
//! timeout, a sink that panics, keys that survive a sequence reset, and the cost of many topics. Real
//! Postgres (and Redis), both modes.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemstore::{Message, Mode, Policy};
use serde_json::json;
use support::{Harness, Servers};

suite!(
    a_slow_sink_outlasts_an_idle_in_transaction_timeout,
    a_panicking_sink_is_a_failed_delivery,
    keys_do_not_repeat_after_a_sequence_reset,
    a_drain_over_a_thousand_topics_costs_a_few_statements_per_topic,
);

async fn enqueue(h: &Harness, rows: &[(&str, i64)]) {
    let outbox = h.store.outbox();
    let mut tx = h.pool.begin().await.expect("begin");
    for (topic, n) in rows {
        outbox.enqueue(&mut tx, topic, &json!({ "n": n })).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
}

/// The database ends any transaction idle for 300 ms, and the sink takes 500 ms per row: every row is
/// delivered once and settled (before: the drain's transaction stayed open across the sink's calls, the
/// server ended it, the settlement failed, and the batch came back on every drain with `attempts` never
/// growing).
async fn a_slow_sink_outlasts_an_idle_in_transaction_timeout(mode: Mode) {
    let h = Harness::start(mode).await;
    sqlx::raw_sql(
        "DO $$ BEGIN
           EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = ''300ms''', current_database());
         END $$",
    )
    .execute(&h.pool)
    .await
    .expect("set the timeout");
    enqueue(&h, &[("slow", 1), ("slow", 2), ("slow", 3)]).await;
    // A new store: its connections start after the setting.
    let store = h.new_store(Policy::default());
    let delivered = AtomicUsize::new(0);
    let drained = store
        .outbox()
        .drain(|_: Message| {
            delivered.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, String>(())
            }
        })
        .await
        .expect("the drain settles its batch");
    assert_eq!((drained.delivered, drained.failed), (3, 0));
    assert_eq!(delivered.load(Ordering::SeqCst), 3, "each row once");
    assert!(store.outbox().backlog().await.expect("backlog").is_empty());
}

/// A sink that panics fails that delivery (counted, backing off) instead of tearing the drain down
/// (before: the panic unwound through the drain and its transaction rolled back, counting nothing).
async fn a_panicking_sink_is_a_failed_delivery(mode: Mode) {
    let h = Harness::start(mode).await;
    let topic = format!("panics-{}", h.id());
    enqueue(&h, &[(&topic, 1)]).await;
    let outbox = h.store.outbox();
    let drained = outbox
        .drain(|_: Message| async {
            if true {
                panic!("a sink bug");
            }
            Ok::<_, String>(())
        })
        .await
        .expect("the drain survives the panic");
    assert_eq!((drained.delivered, drained.failed), (0, 1));
    let backlog = outbox.backlog().await.expect("backlog");
    assert_eq!((backlog[0].head_attempts, backlog[0].head_error.as_deref()), (1, Some("the sink panicked")));
    assert!(backlog[0].retry_in > Duration::ZERO, "it backs off");
    assert_eq!(support::labelled("idemstore_outbox_failures_total", &[("topic", &topic)]), 1.0);
}

/// Row ids restart (TRUNCATE ... RESTART IDENTITY, as a restored backup or an upgrade by logical
/// replication can do): the new row 1 gets a key the old row 1 never had (before: both were
/// `outbox-1`, and a downstream deduplicating on it dropped the new message).
async fn keys_do_not_repeat_after_a_sequence_reset(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    let mut keys = Vec::new();
    for _ in 0..2 {
        enqueue(&h, &[("mail", 1)]).await;
        let drained = h
            .store
            .outbox()
            .drain(|m: Message| {
                keys.push((m.id, m.idempotency_key().to_string()));
                std::future::ready(Ok::<_, String>(()))
            })
            .await
            .expect("drain");
        assert_eq!(drained.delivered, 1);
        sqlx::query("TRUNCATE idempotency_outbox RESTART IDENTITY").execute(&h.pool).await.expect("reset");
    }
    assert_eq!(keys[0].0, keys[1].0, "the same row id, twice: {keys:?}");
    assert_ne!(keys[0].1, keys[1].1, "two keys: {keys:?}");
}

/// 1,000 topics of one row each (`RELAY_TOPICS` sets another count), four workers: every row is
/// delivered, with a few statements and index scans per topic (each worker walks the topics once from its
/// cursor; before, every batch walked every topic to find the oldest head, so a drain cost topics² index
/// probes: 1,000 topics, a million, a thousand per topic where the bound is 50).
async fn a_drain_over_a_thousand_topics_costs_a_few_statements_per_topic(mode: Mode) {
    // It counts the process's statements.
    if support::rerun_alone(mode, module_path!(), "a_drain_over_a_thousand_topics_costs_a_few_statements_per_topic") {
        return;
    }
    let h = Harness::start(mode).await;
    let topics: i64 = std::env::var("RELAY_TOPICS").ok().and_then(|n| n.parse().ok()).unwrap_or(1000);
    sqlx::query(
        "INSERT INTO idempotency_outbox (topic, payload)
         SELECT 'topic-' || lpad(n::text, 6, '0'), '{}' FROM generate_series(1, $1) AS n",
    )
    .bind(topics)
    .execute(&h.pool)
    .await
    .expect("the topics");
    let started = std::time::Instant::now();
    let statements = || support::total("idemstore_postgres_statements_total");
    let before = statements();
    let drained = h.store.outbox().drain(|_: Message| std::future::ready(Ok::<_, String>(()))).await.expect("drain");
    let elapsed = started.elapsed();
    assert_eq!((drained.delivered, drained.failed), (topics as u64, 0));
    let per_topic = (statements() - before) / topics as f64;
    // next, lease, read, settle per topic; a worker that loses a race for a topic asks again.
    assert!(per_topic < 8.0, "{per_topic} statements per topic");
    // The store's connections flush their statistics as they close.
    h.store.pg_pool().close().await;
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&h.pool).await.expect("fresh statistics");
    let scans: i64 =
        sqlx::query_scalar("SELECT idx_scan FROM pg_stat_user_tables WHERE relname = 'idempotency_outbox'")
            .fetch_one(&h.pool)
            .await
            .expect("index scans");
    let scans_per_topic = scans as f64 / topics as f64;
    println!(
        "{topics} topics drained in {elapsed:?}: {per_topic:.2} statements and {scans_per_topic:.1} index scans per topic"
    );
    assert!(scans_per_topic < 50.0, "{scans_per_topic} index scans per topic");
}
