//! The records table hash-partitioned by tenant (`Store::partition_by_tenant`): existing records and a
//! live owner survive the conversion, names stay as the migrations gave them, tenants spread over the
//! partitions. (CI also runs the whole suite on this layout: `IDEMSTORE_TEST_PARTITIONS`.)

#[macro_use]
mod support;

use idemstore::{Begin, Fingerprint, Mode, RunOutcome, StoreError};
use serde_json::json;
use support::{Harness, key};

suite!(converting_keeps_records_owners_and_names);

/// Index and constraint names of the records table, sorted.
async fn names(h: &Harness) -> Vec<String> {
    let sql = "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = 'idempotency_records'::regclass
               UNION ALL
               SELECT conname::text FROM pg_constraint WHERE conrelid = 'idempotency_records'::regclass
               ORDER BY 1";
    sqlx::query_scalar(sql).fetch_all(&h.pool).await.expect("names")
}

async fn converting_keeps_records_owners_and_names(mode: Mode) {
    let h = Harness::start(mode).await;
    // Under CI's partitioned pass the harness converted the table already: the same count is a no-op.
    let partitions: u16 = std::env::var("IDEMSTORE_TEST_PARTITIONS").ok().and_then(|n| n.parse().ok()).unwrap_or(4);
    let scope = h.scope("acme");
    let done = key("done");
    let executed = h.store.run_once(&scope, &done, &json!({"n": 1}), || h.charge("acme", &done)).await;
    assert!(matches!(executed, Ok(RunOutcome::Executed(_))), "{executed:?}");
    let live = key("live");
    let fingerprint = Fingerprint::of_serialize(&json!({"n": 2}), h.store.policy(&h.operation).fingerprint());
    let fingerprint = fingerprint.expect("fingerprint");
    let Begin::Acquired(owner) = h.store.begin(&scope, &live, &fingerprint).await.expect("begin") else {
        panic!("the key is new")
    };
    // An application role with its grants, as a deployment that migrates under another role has.
    let role = format!("app_{}", h.id());
    for statement in
        [format!("CREATE ROLE {role}"), format!("GRANT SELECT, INSERT, UPDATE ON idempotency_records TO {role}")]
    {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&h.pool).await.expect("a role and its grants");
    }
    let can_write = format!("SELECT has_table_privilege('{role}', 'idempotency_records', 'UPDATE')");
    let table_owner = "SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = 'idempotency_records'::regclass";
    let owner_before: String = sqlx::query_scalar(table_owner).fetch_one(&h.pool).await.expect("owner");
    let before = names(&h).await;
    for name in ["idempotency_records_pkey", "idempotency_records_state_check", "idempotency_records_expires_at"] {
        assert!(before.iter().any(|n| n == name), "{name} in {before:?}");
    }

    h.store.partition_by_tenant(partitions).await.expect("partition");

    let kind: String = sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE relname = 'idempotency_records'")
        .fetch_one(&h.pool)
        .await
        .expect("relkind");
    assert_eq!(kind, "p", "partitioned");
    assert_eq!(names(&h).await, before, "later migrations find the names they expect");
    let granted: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(can_write)).fetch_one(&h.pool).await.expect("privilege");
    assert!(granted, "the application role keeps its grants");
    assert_eq!(sqlx::query_scalar::<_, String>(table_owner).fetch_one(&h.pool).await.expect("owner"), owner_before);
    let replayed = h.store.run_once(&scope, &done, &json!({"n": 1}), || h.charge("acme", &done)).await;
    assert!(matches!(replayed, Ok(RunOutcome::Replayed(_))), "{replayed:?}");
    assert_eq!(h.effects("acme", &done).await, 1);
    assert!(matches!(h.store.begin(&scope, &live, &fingerprint).await, Ok(Begin::InFlight { .. })));
    owner.complete(b"{\"late\":true}").await.expect("the owner's fence still matches its row");
    assert!(matches!(h.store.begin(&scope, &live, &fingerprint).await, Ok(Begin::Completed(_))));

    for tenant in 0..32 {
        let (tenant, k) = (format!("tenant-{tenant}"), key("spread"));
        let ran = h.store.run_once(&h.scope(&tenant), &k, &json!({}), || async { Ok::<_, &str>(1) }).await;
        assert!(matches!(ran, Ok(RunOutcome::Executed(1))), "{ran:?}");
    }
    let used: i64 = sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM idempotency_records")
        .fetch_one(&h.pool)
        .await
        .expect("partitions used");
    assert!(used > 1, "tenants spread over the partitions: {used}");

    h.store.partition_by_tenant(partitions).await.expect("the same count again does nothing");
    let refused = h.store.partition_by_tenant(if partitions < 1024 { partitions + 1 } else { 1 }).await;
    assert!(matches!(refused, Err(StoreError::Migrate(_))), "{refused:?}");
    assert!(matches!(h.store.partition_by_tenant(0).await, Err(StoreError::Config(_))));
}
