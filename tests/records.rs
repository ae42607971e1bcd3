//! The records table laid out for writing (#50): what a key costs Postgres, and the transactional claim
//! that reads under the key's lock and writes its record once, where Postgres's isolation allows it.
//! Real servers, both modes.

use crate::support;

use idemstore::{Mode, RunOutcome, Store};
use serde_json::{Value, json};
use support::{Harness, key};

suite!(
    a_replay_costs_at_most_one_claim_statement,
    a_transaction_above_read_committed_claims_by_insert,
    work_that_ends_the_claims_transaction_stores_nothing,
);

/// Claim statements sent so far by this test's stores.
fn claims() -> f64 {
    support::labelled("idemstore_postgres_statements_total", &[("statement", "claim")])
}

/// A replay of a completed key is one claim statement on the Postgres path (Redis answers it in
/// two-tier mode, without one). Before, the claim of a new key found the record, wrote nothing and
/// answered nothing, and the full claim was sent after it: two statements per replay.
async fn a_replay_costs_at_most_one_claim_statement(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k, payload) = (h.scope("acme"), key("replayed"), json!({"amount": 7}));
    let first = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await;
    assert!(matches!(first, Ok(RunOutcome::Executed(_))), "{first:?}");
    let before = claims();
    let replay = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await;
    assert!(matches!(replay, Ok(RunOutcome::Replayed(_))), "{replay:?}");
    let sent = claims() - before;
    let expected = if mode == Mode::PostgresOnly { 1.0 } else { 0.0 };
    assert_eq!(sent, expected, "claim statements for one replay");
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// A transaction that runs above read committed (the database's default isolation, here repeatable
/// read) takes its snapshot before the key's lock: the claim cannot be a read there, and is made by
/// insert, as a claim under a quota is. The work runs once, the record is completed in its commit, and
/// a retry replays.
async fn a_transaction_above_read_committed_claims_by_insert(mode: Mode) {
    let h = Harness::start(mode).await;
    let options: sqlx::postgres::PgConnectOptions = h.store_url.parse().expect("url");
    let pool = idemstore::pool_options()
        .max_connections(4)
        .connect_with(options.options([("default_transaction_isolation", "repeatable read")]))
        .await
        .expect("pool");
    let mut builder = Store::builder().postgres(pool).key_prefix(&h.prefix);
    if let Some(url) = h.redis_url.as_deref() {
        builder = builder.redis_url(url);
    }
    let store = support::sealed(builder).build().expect("store");
    let (scope, k, payload) = (h.scope("acme"), key("repeatable"), json!({"amount": 9}));
    for expected in ["executed", "replayed"] {
        let run = store.run_once_in_tx(&scope, &k, &payload, charged).await;
        let answered = match run {
            Ok(RunOutcome::Executed(_)) => "executed",
            Ok(RunOutcome::Replayed(_)) => "replayed",
            other => panic!("{other:?}"),
        };
        assert_eq!(answered, expected);
    }
    assert_eq!(h.effects("acme", &k).await, 1);
}

fn charged(tx: &mut sqlx::PgConnection) -> idemstore::TxFuture<'_, Value, sqlx::Error> {
    Box::pin(async move {
        sqlx::query("INSERT INTO effects (tenant, key) VALUES ('acme', 'repeatable')").execute(&mut *tx).await?;
        Ok(json!("charged"))
    })
}

/// Work that rolls the claim's transaction back on its own, then answers: its writes are gone, and so
/// is the claim's lock, so the completion runs outside any transaction of the claim. It must store
/// nothing: a stored answer would replay writes that never happened. (On the first cut of the read
/// claim, the completion inserted the completed record on its own and committed it.)
async fn work_that_ends_the_claims_transaction_stores_nothing(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k, payload) = (h.scope("acme"), key("rolled-back"), json!({"amount": 4}));
    let run = h.store.run_once_in_tx(&scope, &k, &payload, rolled_back).await;
    assert!(run.is_err(), "{run:?}");
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup");
    assert!(record.is_none(), "{record:?}");
    assert_eq!(h.effects("acme", &k).await, 0);
}

fn rolled_back(tx: &mut sqlx::PgConnection) -> idemstore::TxFuture<'_, Value, sqlx::Error> {
    Box::pin(async move {
        sqlx::query("INSERT INTO effects (tenant, key) VALUES ('acme', 'rolled-back')").execute(&mut *tx).await?;
        sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await?;
        Ok(json!("answered anyway"))
    })
}
