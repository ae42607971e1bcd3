//! Operations: expiry and recovery jobs, resolution of indeterminate records, tiers recorded per record,
//! and the `idemctl` binary run as a process. Real servers, both modes.

use crate::support;

use std::process::Command;
use std::time::Duration;

use idemstore::admin::Resolution;
use idemstore::config::PolicyConfig;
use idemstore::{Begin, Fingerprint, LeaseExpiry, Mode, Policy, RunOptions, RunOutcome, Scope, State, Store, Tier};
use serde_json::{Value, json};
use support::{Harness, Servers, key};

suite!(
    purge_in_batches_leaves_tombstones_that_refuse_retries,
    a_tombstone_under_a_multibyte_tenant_refuses_its_retry,
    a_tombstone_in_a_latin1_database_refuses_its_retry,
    recover_stale_spares_live_owners,
    recover_stale_reports_a_record_it_cannot_read_and_recovers_the_rest,
    resolve_settles_indeterminate_records,
    tier_is_recorded_with_each_record,
    tiers_are_selected_by_operation_from_a_config_file,
    idemctl_commands,
    http_records_resolve_in_the_layers_format,
    gauges_follow_the_database,
);

fn policy(lease_ms: u64, redis_ttl_ms: u64, retention_ms: u64, expiry: LeaseExpiry) -> Policy {
    Policy::builder()
        .lease(Duration::from_millis(lease_ms))
        .redis_ttl(Duration::from_millis(redis_ttl_ms))
        .retention(Some(Duration::from_millis(retention_ms)))
        .lease_expiry(expiry)
        .build()
        .expect("policy")
}

fn fingerprint(h: &Harness, payload: &Value) -> Fingerprint {
    Fingerprint::of_serialize(payload, h.store.policy(&h.operation).fingerprint()).expect("fingerprint")
}

async fn complete(h: &Harness, name: &str) -> Value {
    let k = key(name);
    match h.store.run_once(&h.scope("acme"), &k, &json!({"n": name}), || h.charge("acme", &k)).await {
        Ok(RunOutcome::Executed(value) | RunOutcome::Replayed(value)) => value,
        other => panic!("{other:?}"),
    }
}

/// Polls until `check` holds (time must pass for leases and retention to run out).
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    for _ in 0..300 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never: {what}");
}

/// 40 expired records are purged 7 at a time while one of them is retried: each leaves a tombstone, and
/// the retry is refused as expired (before or after its record went), never executed again.
async fn purge_in_batches_leaves_tombstones_that_refuse_retries(mode: Mode) {
    let h = Harness::with(mode, policy(100, 200, 400, LeaseExpiry::TakeOver), Servers::Any).await;
    for i in 0..40 {
        complete(&h, &format!("old-{i}")).await;
    }
    eventually("all 40 expired", async || h.store.admin().count_expired().await.expect("count") == 40).await;
    let (retried, scope, payload) = (key("old-7"), h.scope("acme"), json!({"n": "old-7"}));
    let (purged, retry) = tokio::join!(
        h.store.admin().purge_expired(7),
        h.store.run_once(&scope, &retried, &payload, || h.charge("acme", &retried)),
    );
    assert!(matches!(retry, Ok(RunOutcome::<Value>::Expired)), "an expired key is not a new key: {retry:?}");
    assert_eq!(purged.expect("purge"), 40);
    assert_eq!(h.effects("acme", &retried).await, 1, "the retry did not run the work again");
    let tombstone = h.store.admin().lookup(&scope, &retried).await.expect("lookup").expect("a tombstone");
    assert_eq!(tombstone.state, State::Expired);
    let other = h.store.run_once(&scope, &retried, &json!({"n": "other"}), || h.charge("acme", &retried)).await;
    assert!(matches!(other, Ok(RunOutcome::<Value>::Mismatch)), "another payload is still refused: {other:?}");
    assert_eq!(h.store.admin().count_expired().await.expect("count"), 0);
    assert!(support::total("idemstore_purged_records_total") >= 40.0);
}

/// The claim finds a tombstone by the digest the application computes, and the purge writes it with
/// Postgres's `idempotency_key_digest`: the two agree for names of several bytes per character too
/// (`octet_length` and `str::len` count bytes), so a purged key stays refused.
async fn a_tombstone_under_a_multibyte_tenant_refuses_its_retry(mode: Mode) {
    let h = Harness::with(mode, policy(100, 200, 300, LeaseExpiry::TakeOver), Servers::Any).await;
    let (tenant, retried, payload) = ("café-Ω-東京", key("multibyte"), json!({"n": 1}));
    let scope = h.scope(tenant);
    let first = h.store.run_once(&scope, &retried, &payload, || h.charge(tenant, &retried)).await;
    assert!(matches!(first, Ok(RunOutcome::<Value>::Executed(_))), "{first:?}");
    eventually("the record expired", async || h.store.admin().count_expired().await.expect("count") == 1).await;
    assert_eq!(h.store.admin().purge_expired(10).await.expect("purge"), 1);
    let tombstone = h.store.admin().lookup(&scope, &retried).await.expect("lookup");
    assert_eq!(tombstone.map(|t| t.state), Some(State::Expired), "the lookup finds the tombstone");
    let retry = h.store.run_once(&scope, &retried, &payload, || h.charge(tenant, &retried)).await;
    assert!(matches!(retry, Ok(RunOutcome::<Value>::Expired)), "the claim finds the tombstone: {retry:?}");
    assert_eq!(h.effects(tenant, &retried).await, 1, "the retry did not run the work again");
}

/// The same in a database that is not UTF8 (here LATIN1, where "café" is 4 bytes, not 5): the purge's
/// digest counts UTF-8 bytes as the application's does (before: `octet_length` counted LATIN1 bytes, the
/// claim never found the tombstone, and the retry ran the work again).
async fn a_tombstone_in_a_latin1_database_refuses_its_retry(mode: Mode) {
    let h = Harness::with(mode, policy(100, 200, 300, LeaseExpiry::TakeOver), Servers::Any).await;
    let database = format!("latin1_{}", h.prefix);
    let create = format!("CREATE DATABASE {database} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0");
    sqlx::query(sqlx::AssertSqlSafe(create)).execute(&h.pool).await.expect("a LATIN1 database");
    let url = h.database_url.parse::<sqlx::postgres::PgConnectOptions>().expect("the URL").database(&database);
    let pool = sqlx::PgPool::connect_with(url).await.expect("connect to the LATIN1 database");
    let mut builder = Store::builder()
        .postgres(pool)
        .key_prefix(format!("{}-latin1", h.prefix))
        .default_policy(policy(100, 200, 300, LeaseExpiry::TakeOver));
    if let Some(redis_url) = &h.redis_url {
        builder = builder.redis_url(redis_url);
    }
    let store = support::sealed(builder).build().expect("store");
    store.migrate().await.expect("migrate");
    let (scope, retried, payload) = (Scope::new("café", "charge").expect("scope"), key("latin1"), json!({"n": 1}));
    let runs = std::sync::atomic::AtomicU32::new(0);
    let work = || async {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, std::io::Error>(json!({"charged": true}))
    };
    let first = store.run_once(&scope, &retried, &payload, work).await;
    assert!(matches!(first, Ok(RunOutcome::<Value>::Executed(_))), "{first:?}");
    eventually("the record expired", async || store.admin().count_expired().await.expect("count") == 1).await;
    assert_eq!(store.admin().purge_expired(10).await.expect("purge"), 1);
    let retry = store.run_once(&scope, &retried, &payload, work).await;
    assert!(matches!(retry, Ok(RunOutcome::<Value>::Expired)), "the claim finds the tombstone: {retry:?}");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "the retry did not run the work again");
}

/// A stale record whose key the store would refuse (written around it) is counted as unreadable and left
/// for an operator; the stale record beside it is released (before: the whole batch failed with the
/// key's InputError, and so did every later run, since the bad row comes first again).
async fn recover_stale_reports_a_record_it_cannot_read_and_recovers_the_rest(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    for (key, lease_ended) in [("bad\u{1}key", "2 seconds"), ("good", "1 second")] {
        sqlx::query(
            "INSERT INTO idempotency_records (digest, tenant, operation, idempotency_key, fingerprint, state, fence,
                 owner, lease_expires_at, tier, on_lease_expiry)
             VALUES (idempotency_key_digest($1, $2, $3), $1, $2, $3, decode(repeat('00', 32), 'hex'), 'p',
                     nextval('idempotency_fences'), 'gone',
                     now() - $4::interval, 'standard', 't')",
        )
        .bind(scope.tenant())
        .bind(scope.operation())
        .bind(key)
        .bind(lease_ended)
        .execute(&h.pool)
        .await
        .expect("a stale record");
    }
    let recovery = h.store.admin().recover_stale(10).await.expect("the readable record is recovered");
    assert_eq!((recovery.found, recovery.released, recovery.unreadable), (2, 1, 1), "{recovery:?}");
    let good = h.store.admin().lookup(&scope, &key("good")).await.expect("lookup").expect("a record");
    assert_eq!(good.state, idemstore::State::Released);
}

/// A dead owner's stale record is released; a live owner that keeps extending is left alone; a record
/// claimed under MarkIndeterminate is marked, whatever the recoverer's own configuration says.
async fn recover_stale_spares_live_owners(mode: Mode) {
    if support::rerun_alone(mode, module_path!(), "recover_stale_spares_live_owners") {
        return;
    }
    let h = Harness::with(mode, policy(300, 60_000, 600_000, LeaseExpiry::TakeOver), Servers::Any).await;
    let (scope, payload) = (h.scope("acme"), json!({"n": 1}));
    let fp = fingerprint(&h, &payload);
    let Ok(Begin::Acquired(_dead)) = h.store.begin(&scope, &key("dead"), &fp).await else { panic!() };
    let Ok(Begin::Acquired(live)) = h.store.begin(&scope, &key("live"), &fp).await else { panic!() };
    let strict = policy(300, 60_000, 600_000, LeaseExpiry::MarkIndeterminate);
    let Ok(Begin::Acquired(_strict)) =
        h.store.begin_with(&scope, &key("strict"), &fp, &RunOptions::default().policy(strict.clone())).await
    else {
        panic!()
    };
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let heartbeat = tokio::spawn(async move {
        while stopped.try_recv().is_err() {
            live.extend().await.expect("the live owner keeps its lease");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        live
    });
    eventually("the dead and strict leases ran out", async || {
        let mut ran_out = true;
        for name in ["dead", "strict"] {
            let record = h.store.admin().lookup(&scope, &key(name)).await.expect("lookup").expect("record");
            ran_out &= record.lease_remaining == Some(Duration::ZERO);
        }
        ran_out
    })
    .await;
    assert_eq!(h.store.admin().count_stale().await.expect("count"), 2, "counting changes nothing");
    let recovery = h.store.admin().recover_stale(100).await.expect("recover");
    assert_eq!((recovery.found, recovery.released, recovery.marked_indeterminate), (2, 1, 1));
    let state =
        async |name: &str| h.store.admin().lookup(&scope, &key(name)).await.expect("lookup").expect("record").state;
    assert_eq!(state("dead").await, State::Released);
    assert_eq!(state("strict").await, State::Indeterminate);
    assert_eq!(state("live").await, State::InProgress);
    stop.send(()).expect("stop the heartbeat");
    let live = heartbeat.await.expect("heartbeat");
    live.complete(b"\"done\"").await.expect("the live owner completes");
    assert_eq!(support::total("idemstore_recovered_records_total"), 2.0);
    assert_eq!(support::total("idemstore_indeterminate_records"), 1.0);
}

/// An indeterminate record settled as completed replays the operator's response; settled as released,
/// the next request executes. Settling anything else changes nothing.
async fn resolve_settles_indeterminate_records(mode: Mode) {
    let h = Harness::with(mode, policy(200, 60_000, 600_000, LeaseExpiry::MarkIndeterminate), Servers::Any).await;
    let (scope, payload) = (h.scope("acme"), json!({"n": 1}));
    let fp = fingerprint(&h, &payload);
    for name in ["settle-done", "settle-redo"] {
        let Ok(Begin::Acquired(_abandoned)) = h.store.begin(&scope, &key(name), &fp).await else { panic!() };
    }
    eventually("both are indeterminate", async || {
        let a = h.store.begin(&scope, &key("settle-done"), &fp).await;
        let b = h.store.begin(&scope, &key("settle-redo"), &fp).await;
        matches!((a, b), (Ok(Begin::Indeterminate), Ok(Begin::Indeterminate)))
    })
    .await;
    let done =
        h.store.admin().resolve(&scope, &key("settle-done"), Resolution::Completed(b"\"by hand\"".to_vec())).await;
    assert!(done.expect("resolve"));
    let Ok(Begin::Replayed(stored)) = h.store.begin(&scope, &key("settle-done"), &fp).await else { panic!() };
    assert_eq!(stored.as_bytes(), b"\"by hand\"");
    assert!(h.store.admin().resolve(&scope, &key("settle-redo"), Resolution::Released).await.expect("resolve"));
    let k = key("settle-redo");
    let again = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await;
    assert!(matches!(again, Ok(RunOutcome::Executed(_))), "{again:?}");
    assert!(!h.store.admin().resolve(&scope, &k, Resolution::Released).await.expect("resolve"), "completed: untouched");
}

/// The tier a record was stored under is recorded with it, and a ledger record never expires.
async fn tier_is_recorded_with_each_record(mode: Mode) {
    let h = Harness::with(mode, Policy::tier(Tier::Ledger), Servers::Any).await;
    complete(&h, "ledger-1").await;
    let record = h.store.admin().lookup(&h.scope("acme"), &key("ledger-1")).await.expect("lookup").expect("record");
    assert_eq!((record.tier.as_deref(), record.expires_in), (Some("ledger"), None));
    let custom = Policy::builder().tier(Tier::Webhook).name("partner-webhooks").build().expect("policy");
    let other = h.new_store(custom);
    let k = key("hook-1");
    other.run_once(&h.scope("acme"), &k, &json!({}), || h.charge("acme", &k)).await.expect("run");
    let record = h.store.admin().lookup(&h.scope("acme"), &k).await.expect("lookup").expect("record");
    assert_eq!(record.tier.as_deref(), Some("partner-webhooks"));
    assert!(record.expires_in.is_some_and(|d| d > Duration::from_secs(6 * 86_400)), "7 days: {record:?}");
}

/// A TOML file maps operations (exact, or `prefix*`) to tiers; records carry the tier they got.
async fn tiers_are_selected_by_operation_from_a_config_file(mode: Mode) {
    let h = Harness::start(mode).await;
    let text = format!(
        "default = \"ephemeral\"\n[tiers.ledger]\nlease = \"45s\"\n[operations]\n\"{}\" = \"ledger\"\n\"POST /webhooks/*\" = \"webhook\"\n",
        h.operation
    );
    let mut builder = Store::builder().postgres(h.pool.clone()).key_prefix(h.prefix.clone());
    if let Some(url) = &h.redis_url {
        builder = builder.redis_url(url.clone());
    }
    let store = support::sealed(builder.policies(PolicyConfig::from_toml(&text).expect("valid config")));
    let store = store.build().expect("store");
    assert_eq!(
        (store.policy(&h.operation).name(), store.policy(&h.operation).lease()),
        ("ledger", Duration::from_secs(45))
    );
    assert_eq!(store.policy("POST /webhooks/{provider}").name(), "webhook");
    assert_eq!(store.policy("POST /refunds").name(), "ephemeral");
    let k = key("configured");
    store.run_once(&h.scope("acme"), &k, &json!({}), || h.charge("acme", &k)).await.expect("run");
    let record = store.admin().lookup(&h.scope("acme"), &k).await.expect("lookup").expect("record");
    assert_eq!((record.tier.as_deref(), record.expires_in), (Some("ledger"), None));
}

/// Runs `idemctl --json` against the test's servers; returns the exit code and the parsed document.
fn idemctl(h: &Harness, args: &[&str]) -> (i32, Value) {
    let mut command = Command::new(support::idemctl());
    command.args(["--json", "--key-prefix", &h.prefix]).args(args).env("DATABASE_URL", &h.database_url);
    // The harness's stores' keys, when this run encrypts.
    if let Ok(keys) = std::env::var("IDEMSTORE_TEST_ENCRYPTION_KEY") {
        command.env("IDEMSTORE_ENCRYPTION_KEY", keys);
    }
    match &h.redis_url {
        Some(url) => command.env("REDIS_URL", url),
        None => command.env_remove("REDIS_URL"),
    };
    let output = command.output().expect("run idemctl");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let document = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"));
    (output.status.code().unwrap_or(-1), document)
}

/// Every idemctl command, run as a process with `--json`, against real data.
async fn idemctl_commands(mode: Mode) {
    let h = Harness::with(mode, policy(200, 400, 800, LeaseExpiry::MarkIndeterminate), Servers::Any).await;
    let op = h.operation.clone();
    assert_eq!(idemctl(&h, &["migrate"]), (0, json!({ "migrated": true })));
    // Partitioned by tenant (CI's partitioned pass did it already with its own count: the same is a no-op).
    let partitions = std::env::var("IDEMSTORE_TEST_PARTITIONS").unwrap_or_else(|_| "4".into());
    let partitioned = idemctl(&h, &["migrate", "--partitions", &partitions]);
    assert_eq!(partitioned, (0, json!({ "migrated": true, "partitions": partitions.parse::<u16>().expect("n") })));
    // Bad usage exits 2, as the usage says: a missing DATABASE_URL included (before: 1).
    let bare = Command::new(support::idemctl()).args(["--json", "stats"]).env_remove("DATABASE_URL").output();
    assert_eq!(bare.expect("run idemctl").status.code(), Some(2));
    // A password typed on the command line is warned about (before: silently taken); not one from the
    // environment.
    let typed = Command::new(support::idemctl())
        .args(["--database-url", "postgres://app:secret@127.0.0.1:1/none", "--json", "stats"])
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idemctl");
    assert!(String::from_utf8_lossy(&typed.stderr).contains("carries a password"), "{typed:?}");
    let from_env = Command::new(support::idemctl())
        .args(["--json", "stats"])
        .env("DATABASE_URL", "postgres://app:secret@127.0.0.1:1/none")
        .output()
        .expect("run idemctl");
    assert!(!String::from_utf8_lossy(&from_env.stderr).contains("carries a password"), "{from_env:?}");

    complete(&h, "kept").await;
    let (code, inspected) = idemctl(&h, &["inspect", "acme", &op, "kept"]);
    assert_eq!(code, 0);
    assert_eq!(inspected["postgres"]["state"], "completed");
    assert_eq!(inspected["postgres"]["fence"], 1);
    match mode {
        Mode::TwoTier => assert_eq!(inspected["redis"]["state"], "completed"),
        _ => assert!(inspected["redis"].is_null()),
    }

    // A key the HTTP layer kept per request path, named with --target (percent-encoding normalized).
    let targeted = key("sent").for_target("/accounts/A/transfers");
    let fp = fingerprint(&h, &json!({"n": 2}));
    let Ok(Begin::Acquired(owner)) = h.store.begin(&h.scope("acme"), &targeted, &fp).await else { panic!() };
    owner.complete(b"{}").await.expect("complete");
    let (code, inspected) = idemctl(&h, &["inspect", "acme", &op, "sent", "--target", "/accounts/%41/transfers"]);
    assert_eq!((code, &inspected["postgres"]["state"]), (0, &json!("completed")), "{inspected}");

    let (code, stats) = idemctl(&h, &["stats", "--window", "1h"]);
    assert_eq!(code, 0);
    assert_eq!(stats["rows"][0]["operation"], op.as_str());
    assert_eq!(stats["rows"][0]["records"], 2);

    let fp = fingerprint(&h, &json!({"n": 1}));
    let Ok(Begin::Acquired(_abandoned)) = h.store.begin(&h.scope("acme"), &key("stuck"), &fp).await else { panic!() };
    eventually("the lease ran out", async || idemctl(&h, &["recover", "--dry-run"]).1["found"] == 1).await;
    assert_eq!(idemctl(&h, &["recover"]).1["marked_indeterminate"], 1);
    let response = std::env::temp_dir().join(format!("idemctl-{}.json", h.prefix));
    std::fs::write(&response, b"{\"settled\":true}").expect("write the response file");
    let path = response.to_string_lossy().into_owned();
    assert_eq!(idemctl(&h, &["resolve", "acme", &op, "stuck", "--complete-with", &path]).1["resolved"], true);
    let _ = std::fs::remove_file(&response);
    let Ok(Begin::Replayed(stored)) = h.store.begin(&h.scope("acme"), &key("stuck"), &fp).await else { panic!() };
    assert_eq!(stored.as_bytes(), b"{\"settled\":true}");

    eventually("both records expired", async || idemctl(&h, &["purge", "--dry-run"]).1["expired"] == 2).await;
    assert_eq!(idemctl(&h, &["purge", "--batch", "1"]).1["purged"], 2);

    complete(&h, "cached").await;
    let (code, evicted) = idemctl(&h, &["evict", "acme", &op, "cached"]);
    match mode {
        Mode::TwoTier => assert_eq!((code, evicted), (0, json!({ "evicted": true }))),
        _ => assert_eq!(code, 1, "Postgres-only has nothing to evict: {evicted}"),
    }
    let outbox = h.store.outbox();
    let mut tx = h.pool.begin().await.expect("begin");
    for (topic, n) in [("mail", 1), ("mail", 2), ("hooks", 3)] {
        outbox.enqueue(&mut tx, topic, &json!({ "n": n })).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
    let (code, status) = idemctl(&h, &["outbox", "status"]);
    assert_eq!((code, &status["topics"][1]["topic"], &status["topics"][1]["pending"]), (0, &json!("mail"), &json!(2)));
    let sent = std::env::temp_dir().join(format!("idemctl-outbox-{}.log", h.prefix));
    let exec = format!("(cat; printf ' %s %s\\n' \"$IDEMPOTENCY_KEY\" \"$OUTBOX_TOPIC\") >> '{}'", sent.display());
    let (code, drained) = idemctl(&h, &["outbox", "drain", "--topic", "mail", "--concurrency", "2", "--exec", &exec]);
    assert_eq!((code, drained), (0, json!({ "delivered": 2, "failed": 0 })));
    let log = std::fs::read_to_string(&sent).expect("the delivery command ran");
    let _ = std::fs::remove_file(&sent);
    let lines: Vec<_> = log.lines().map(|line| line.split(' ').collect::<Vec<_>>()).collect();
    assert_eq!(lines.len(), 2, "{log}");
    for (line, (payload, id)) in lines.iter().zip([("{\"n\":1}", 1), ("{\"n\":2}", 2)]) {
        assert_eq!((line[0], line[2]), (payload, "mail"), "{log}");
        assert!(line[1].starts_with(&format!("outbox-{id}-")), "{log}");
    }
    let (code, drained) = idemctl(&h, &["outbox", "drain", "--exec", "exit 3"]);
    assert_eq!((code, drained), (0, json!({ "delivered": 0, "failed": 1 })));
    let status = idemctl(&h, &["outbox", "status"]).1;
    let hooks = &status["topics"][0];
    assert_eq!((&hooks["topic"], &hooks["pending"], &hooks["head_attempts"]), (&json!("hooks"), &json!(1), &json!(1)));
    assert!(hooks["head_error"].as_str().is_some_and(|e| e.contains("exit status: 3")), "{status}");
    assert_eq!(hooks["head_id"], 3);
    assert_eq!(idemctl(&h, &["outbox", "retry", "hooks"]), (0, json!({ "retried": 1 })));
    let retried = idemctl(&h, &["outbox", "status"]).1;
    assert_eq!(retried["topics"][0]["retry_in_seconds"], 0.0, "{retried}");
    let discarded = json!({ "discarded": true, "id": 3, "topic": "hooks", "payload": { "n": 3 } });
    assert_eq!(idemctl(&h, &["outbox", "discard", "3"]), (0, discarded));
    assert_eq!(idemctl(&h, &["outbox", "discard", "3"]), (0, json!({ "discarded": false })));
    assert_eq!(idemctl(&h, &["outbox", "status"]), (0, json!({ "topics": [] })));

    let (code, refused) = idemctl(&h, &["inspect", "acme", &op, "bad key"]);
    assert_eq!(code, 2);
    assert!(refused["error"].as_str().is_some_and(|e| e.contains("visible ASCII")), "{refused}");
}

/// A request of the HTTP layer dropped mid-handler under MarkIndeterminate is recovered as indeterminate,
/// then resolved with `idemctl resolve --status --header --body`: the retry gets that response, replayed
/// by the layer. Raw bytes (`--complete-with`) for such a record are refused with a clear error (before:
/// they were written, and the record answered 409 not-replayable forever).
async fn http_records_resolve_in_the_layers_format(mode: Mode) {
    use axum::body::Body;
    use axum::routing::post;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let strict = policy(200, 400, 800, LeaseExpiry::MarkIndeterminate);
    let h = Harness::with(mode, strict.clone(), Servers::Any).await;
    let operation = format!("POST /orders-{}", h.id());
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    let handler = {
        let started = std::sync::Arc::clone(&started);
        move || async move {
            started.notify_one();
            std::future::pending::<&'static str>().await
        }
    };
    let tenant = |_: &axum::http::request::Parts| Some("acme".to_owned());
    let layer = idemstore::http::IdempotencyLayer::new(h.store.clone(), tenant).with_operation(&operation);
    let router = axum::Router::new().route("/orders", post(handler).route_layer(layer.with_policy(strict)));
    let request = || {
        let request = axum::http::Request::post("/orders").header("idempotency-key", "dropped");
        request.body(Body::from("{}")).expect("request")
    };
    let dropped = tokio::spawn(router.clone().oneshot(request()));
    started.notified().await;
    dropped.abort();
    eventually("the lease ran out", async || idemctl(&h, &["recover", "--dry-run"]).1["found"] == 1).await;
    assert_eq!(idemctl(&h, &["recover"]).1["marked_indeterminate"], 1);

    let file = std::env::temp_dir().join(format!("idemctl-http-{}.json", h.prefix));
    std::fs::write(&file, b"{\"order\":\"o_1\"}").expect("write the body file");
    let path = file.to_string_lossy().into_owned();
    let (code, refused) = idemctl(&h, &["resolve", "acme", &operation, "dropped", "--complete-with", &path]);
    assert_eq!(code, 2, "{refused}");
    assert!(refused["error"].as_str().is_some_and(|e| e.contains("--status")), "{refused}");
    let resolve = ["resolve", "acme", &operation, "dropped", "--status", "201"];
    let (code, resolved) =
        idemctl(&h, &[&resolve[..], &["--header", "content-type: application/json", "--body", &path]].concat());
    let _ = std::fs::remove_file(&file);
    assert_eq!((code, resolved), (0, json!({ "resolved": true })));

    let replay = router.oneshot(request()).await.expect("infallible");
    assert_eq!(replay.status(), axum::http::StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["content-type"], "application/json");
    let body = replay.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body.as_ref(), b"{\"order\":\"o_1\"}");
}

/// The gauges follow Postgres, not the job runner: the request path raises the indeterminate gauge when it
/// marks a record; a resolution by `idemctl` (another process) reaches this process's gauge at its next
/// `refresh_gauges`; the outbox gauges give the oldest pending row's enqueue time (before: the
/// indeterminate gauge moved only when this process ran `recover_stale` or `resolve`).
async fn gauges_follow_the_database(mode: Mode) {
    if support::rerun_alone(mode, module_path!(), "gauges_follow_the_database") {
        return;
    }
    let h = Harness::with(mode, policy(200, 400, 800, LeaseExpiry::MarkIndeterminate), Servers::Any).await;
    let gauge = |name: &str| support::total(name);
    h.store.admin().refresh_gauges().await.expect("refresh");
    assert_eq!(gauge("idemstore_indeterminate_records"), 0.0);

    let (scope, fp) = (h.scope("acme"), fingerprint(&h, &json!({"n": 1})));
    let Ok(Begin::Acquired(owner)) = h.store.begin(&scope, &key("stuck"), &fp).await else { panic!() };
    owner.abandon();
    h.pass_lease(&scope, &key("stuck")).await;
    assert!(matches!(h.store.begin(&scope, &key("stuck"), &fp).await, Ok(Begin::Indeterminate)));
    assert_eq!(gauge("idemstore_indeterminate_records"), 1.0, "raised by the request path");

    assert_eq!(idemctl(&h, &["resolve", "acme", &h.operation, "stuck", "--release"]).1["resolved"], true);
    assert_eq!(gauge("idemstore_indeterminate_records"), 1.0, "another process resolved it");
    h.store.admin().refresh_gauges().await.expect("refresh");
    assert_eq!(gauge("idemstore_indeterminate_records"), 0.0, "counted from Postgres");

    let mut tx = h.pool.begin().await.expect("begin");
    h.store.outbox().enqueue(&mut tx, "receipts", &json!({"n": 1})).await.expect("enqueue");
    tx.commit().await.expect("commit");
    h.store.admin().refresh_gauges().await.expect("refresh");
    assert_eq!(gauge("idemstore_outbox_pending_rows"), 1.0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    let enqueued = gauge("idemstore_outbox_oldest_pending_enqueued_timestamp_seconds");
    assert!((now - 60.0..=now + 1.0).contains(&enqueued), "{enqueued} vs {now}");
}
