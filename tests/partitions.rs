//! The records table hash-partitioned by tenant (`Admin::partition_by_tenant`): existing records and a
//! live owner survive the conversion, names stay as the migrations gave them, tenants spread over the
//! partitions. (CI also runs the whole suite on this layout: `IDEMSTORE_TEST_PARTITIONS`.)

use crate::support;

use idemstore::{Begin, Fingerprint, Mode, RunOutcome, StoreError};
use serde_json::json;
use support::{Harness, key};

suite!(converting_keeps_records_owners_and_names);

/// `r` for a plain table, `p` for a partitioned one.
async fn relkind(h: &Harness) -> String {
    let sql = "SELECT relkind::text FROM pg_class WHERE oid = 'idempotency_records'::regclass";
    sqlx::query_scalar(sql).fetch_one(&h.pool).await.expect("relkind")
}

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
    // A table owned by a role of its own (a name that needs quoting), with an application role's grants
    // (one with grant option), a grant to PUBLIC and a storage parameter: what a deployment that
    // migrates under another role has. Only where this test converts the table itself (not in CI's
    // partitioned pass, where the harness did).
    let converting = relkind(&h).await == "r";
    let (owner_role, app_role) = (format!("App-Owner-{}", h.id()), format!("app_{}", h.id()));
    let setup = [
        format!(r#"CREATE ROLE "{owner_role}""#),
        format!("CREATE ROLE {app_role}"),
        format!(r#"ALTER TABLE idempotency_records OWNER TO "{owner_role}""#),
        format!("GRANT SELECT, INSERT, UPDATE ON idempotency_records TO {app_role} WITH GRANT OPTION"),
        "GRANT SELECT ON idempotency_records TO PUBLIC".to_owned(),
        "ALTER TABLE idempotency_records SET (fillfactor = 90)".to_owned(),
    ];
    for statement in setup.into_iter().filter(|_| converting) {
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&h.pool).await.expect("roles, grants, parameters");
    }
    let before = names(&h).await;
    for name in ["idempotency_records_pkey", "idempotency_records_state_check", "idempotency_records_expires_at"] {
        assert!(before.iter().any(|n| n == name), "{name} in {before:?}");
    }

    h.store.admin().partition_by_tenant(partitions).await.expect("partition");

    assert_eq!(relkind(&h).await, "p", "partitioned");
    assert_eq!(names(&h).await, before, "later migrations find the names they expect");
    if converting {
        let kept = format!(
            "SELECT pg_get_userbyid(relowner) = '{owner_role}'
                    AND has_table_privilege('{app_role}', 'idempotency_records', 'UPDATE WITH GRANT OPTION')
                    AND has_table_privilege('public', 'idempotency_records', 'SELECT')
             FROM pg_class WHERE oid = 'idempotency_records'::regclass"
        );
        let kept: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(kept)).fetch_one(&h.pool).await.expect("owner, grants");
        assert!(kept, "the table keeps its owner and grants");
        let parameters = "SELECT bool_and(c.reloptions @> '{fillfactor=90}' AND pg_get_userbyid(c.relowner) = $1)
                          FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                          WHERE i.inhparent = 'idempotency_records'::regclass";
        let parameters: bool =
            sqlx::query_scalar(parameters).bind(&owner_role).fetch_one(&h.pool).await.expect("partitions");
        assert!(parameters, "every partition has the table's owner and storage parameters");
        let cleanup = format!(
            r#"REASSIGN OWNED BY "{owner_role}", {app_role} TO CURRENT_USER;
               DROP OWNED BY "{owner_role}", {app_role}; DROP ROLE "{owner_role}"; DROP ROLE {app_role}"#
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(cleanup)).execute(&h.pool).await.expect("drop the roles");
    }
    let replayed = h.store.run_once(&scope, &done, &json!({"n": 1}), || h.charge("acme", &done)).await;
    assert!(matches!(replayed, Ok(RunOutcome::Replayed(_))), "{replayed:?}");
    assert_eq!(h.effects("acme", &done).await, 1);
    assert!(matches!(h.store.begin(&scope, &live, &fingerprint).await, Ok(Begin::InFlight { .. })));
    owner.complete(b"{\"late\":true}").await.expect("the owner's fence still matches its row");
    assert!(matches!(h.store.begin(&scope, &live, &fingerprint).await, Ok(Begin::Replayed(_))));

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

    h.store.admin().partition_by_tenant(partitions).await.expect("the same count again does nothing");
    let refused = h.store.admin().partition_by_tenant(if partitions < 1024 { partitions + 1 } else { 1 }).await;
    assert!(matches!(refused, Err(StoreError::Migrate(_))), "{refused:?}");
    assert!(matches!(h.store.admin().partition_by_tenant(0).await, Err(StoreError::Config(_))));
}
