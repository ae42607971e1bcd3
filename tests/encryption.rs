//! Responses encrypted at rest (`StoreBuilder::encryption`), against real Redis and Postgres in both
//! modes: no plaintext canary in either tier by any write path, rotation, tampered or moved ciphertext
//! refused without running the work again.

use crate::support;
use support::payments;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use idemstore::admin::Resolution;
use idemstore::http::problem_types;
use idemstore::{
    Begin, Encryption, EncryptionError, Fingerprint, LeaseExpiry, Mode, Policy, RunError, RunOutcome, Scope, State,
    Store, StoreError,
};
use serde_json::{Value, json};
use support::{Harness, key};

suite!(
    no_tier_holds_a_response_in_clear,
    a_store_without_encryption_holds_the_canary_in_both_tiers,
    rotated_keys_open_old_responses_until_retired,
    tampered_or_moved_ciphertext_is_refused_and_nothing_runs_again,
    responses_in_clear_are_refused_unless_accepted,
    an_operator_replaces_a_response_written_in_clear,
    an_operator_without_the_key_cannot_resolve_in_clear,
    a_store_without_the_key_refuses_to_write_in_clear_where_responses_are_sealed,
    the_demo_with_an_encryption_key_stores_no_charge_in_clear,
    a_store_without_the_key_never_hands_out_ciphertext,
);

/// Store A (encrypted) completes a key; store B on the same servers, built without `.encryption()`,
/// never hands the sealed bytes out as a response: its claim (from Redis's copy, then from Postgres once
/// Redis lost it) and its lookup answer `UnknownKey`, and the work does not run (before: B answered
/// `Replayed` with the ciphertext, or failed to decode it, and `lookup` showed it).
async fn a_store_without_the_key_never_hands_out_ciphertext(mode: Mode) {
    let h = Harness::start(mode).await;
    let encrypted = sealing(&h, keys(&[KEY_A]));
    let plain = without_encryption(&h);
    let (scope, k, payload) = (h.scope("acme"), key("sealed-elsewhere"), json!({"amount": 1}));
    let result = || async { Ok::<_, std::io::Error>(json!({ "canary": CANARY })) };
    let first = encrypted.run_once(&scope, &k, &payload, result).await;
    assert!(matches!(first, Ok(RunOutcome::Executed(_))), "{first:?}");
    let unknown = |outcome: &Result<RunOutcome<Value>, RunError<std::io::Error>>| {
        matches!(outcome, Err(RunError::Store(StoreError::Encryption(EncryptionError::UnknownKey { .. }))))
    };
    let ran = std::sync::atomic::AtomicUsize::new(0);
    let counted = || async {
        ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, std::io::Error>(json!({}))
    };
    let from_redis = plain.run_once(&scope, &k, &payload, counted).await;
    assert!(unknown(&from_redis), "{from_redis:?}");
    if mode == Mode::TwoTier {
        let mut conn = h.redis_connection().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
        let from_postgres = plain.run_once(&scope, &k, &payload, counted).await;
        assert!(unknown(&from_postgres), "{from_postgres:?}");
    }
    let looked_up = plain.admin().lookup(&scope, &k).await;
    assert!(matches!(looked_up, Err(StoreError::Encryption(EncryptionError::UnknownKey { .. }))), "{looked_up:?}");
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0, "nothing ran again");
}

const CANARY: &str = "CANARY-4242-4242-4242-4242";
const KEY_A: [u8; 32] = [0xA1; 32];
const KEY_B: [u8; 32] = [0xB2; 32];

/// Another store on the harness's servers, sealing with `keys` (newest first).
fn sealing(h: &Harness, encryption: Encryption) -> Store {
    let mut builder = Store::builder()
        .database_url(&h.store_url)
        .key_prefix(&h.prefix)
        .redis_cooldown(std::time::Duration::from_millis(50))
        .encryption(encryption);
    if let Some(url) = &h.redis_url {
        builder = builder.redis_url(url);
    }
    builder.build().expect("store")
}

/// Another store on the harness's servers that seals nothing and may write in clear where responses
/// are sealed (encryption turned off for good, a second service built so).
fn without_encryption(h: &Harness) -> Store {
    keyless_builder(h).clear_responses_allowed().build().expect("store")
}

/// A store on the harness's servers without the key, as a process started without it is.
fn keyless_builder(h: &Harness) -> idemstore::StoreBuilder {
    let builder = Store::builder().database_url(&h.store_url).key_prefix(&h.prefix);
    match &h.redis_url {
        Some(url) => builder.redis_url(url),
        None => builder,
    }
}

fn keys(keys: &[[u8; 32]]) -> Encryption {
    Encryption::new(keys.iter().copied()).expect("keys")
}

/// Records (Postgres) whose any column holds `needle`, as text or as bytes.
async fn postgres_rows_holding(h: &Harness, needle: &str) -> i64 {
    let hex: String = needle.bytes().map(|b| format!("{b:02x}")).collect();
    sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_records t
         WHERE position($1::bytea IN coalesce(response, '')) > 0 OR t::text LIKE '%' || $2 || '%'
            OR t::text LIKE '%' || $3 || '%'",
    )
    .bind(needle.as_bytes())
    .bind(needle)
    .bind(hex)
    .fetch_one(&h.pool)
    .await
    .expect("scan the records")
}

/// Redis values of this test (strings and hash fields) that hold `needle`.
async fn redis_values_holding(h: &Harness, needle: &str) -> usize {
    if h.mode == Mode::PostgresOnly {
        return 0;
    }
    let mut conn = h.redis_connection().await;
    let mut holding = 0;
    for name in h.redis_keys().await {
        let kind: String = redis::cmd("TYPE").arg(&name).query_async(&mut conn).await.expect("TYPE");
        let values: Vec<Vec<u8>> = match kind.as_str() {
            "string" => vec![redis::cmd("GET").arg(&name).query_async(&mut conn).await.expect("GET")],
            "hash" => redis::cmd("HGETALL").arg(&name).query_async(&mut conn).await.expect("HGETALL"),
            _ => Vec::new(),
        };
        holding += values.iter().filter(|value| value.windows(needle.len()).any(|w| w == needle.as_bytes())).count();
    }
    holding
}

/// Completed records in this test's Redis (the completion was cached there).
async fn redis_copies(h: &Harness) -> usize {
    if h.mode == Mode::PostgresOnly { 0 } else { h.redis_keys().await.len() }
}

/// `run_once` of key `name` with payload `{"n": n}` whose work answers `response`.
async fn run(
    store: &Store,
    scope: &Scope,
    name: &str,
    n: i64,
    response: Value,
) -> Result<RunOutcome<Value>, RunError<std::io::Error>> {
    store.run_once(scope, &key(name), &json!({ "n": n }), || async move { Ok(response) }).await
}

/// The three ways a response gets stored: `run_once`, `run_once_in_tx`, an operator's `resolve`.
async fn store_canaries(h: &Harness, store: &Store, scope: &Scope) {
    let stored = run(store, scope, "run-once", 1, json!({ "card": CANARY })).await;
    assert!(matches!(stored, Ok(RunOutcome::Executed(_))));
    let in_tx = store
        .run_once_in_tx(scope, &key("in-tx"), &json!({"n": 2}), |_tx| {
            Box::pin(async { Ok::<_, std::io::Error>(json!({ "card": CANARY })) })
        })
        .await;
    assert!(matches!(in_tx, Ok(RunOutcome::Executed(_))), "{in_tx:?}");
    let fingerprint = idemstore::Fingerprint::of_json(br#"{"n":3}"#, &Default::default()).expect("fingerprint");
    let Ok(Begin::Acquired(owner)) = store.begin(scope, &key("resolved"), &fingerprint).await else { panic!() };
    owner.abandon();
    h.pass_lease(scope, &key("resolved")).await;
    sqlx::query("UPDATE idempotency_records SET state = 'i' WHERE idempotency_key = 'resolved'")
        .execute(&h.pool)
        .await
        .expect("mark indeterminate");
    let resolution = Resolution::Completed(json!({ "card": CANARY }).to_string().into_bytes());
    assert!(store.admin().resolve(scope, &key("resolved"), resolution).await.expect("resolve"));
}

/// Every write path stores ciphertext in both tiers, and every read path replays the plaintext: from
/// Redis, from Postgres after Redis lost the copy, through `lookup`.
async fn no_tier_holds_a_response_in_clear(mode: Mode) {
    let h = Harness::start(mode).await;
    let store = sealing(&h, keys(&[KEY_A]));
    let scope = h.scope("acme");
    store_canaries(&h, &store, &scope).await;
    // A replay of each (the resolved one repairs Redis from Postgres on its way).
    for (name, n) in [("run-once", 1), ("in-tx", 2)] {
        let replay = run(&store, &scope, name, n, json!(0)).await;
        assert_eq!(replay.expect("replay"), RunOutcome::Replayed(json!({ "card": CANARY })), "{name}");
    }
    let record = store.admin().lookup(&scope, &key("resolved")).await.expect("lookup").expect("record");
    assert!(String::from_utf8_lossy(record.response.expect("response").as_bytes()).contains(CANARY));
    if mode == Mode::TwoTier {
        assert!(redis_copies(&h).await >= 2, "Redis holds the completions");
        h.store.admin().evict(&scope, &key("run-once")).await.expect("evict");
    }
    let from_postgres = run(&store, &scope, "run-once", 1, json!(0)).await;
    assert_eq!(from_postgres.expect("replay"), RunOutcome::Replayed(json!({ "card": CANARY })));
    assert_eq!(postgres_rows_holding(&h, CANARY).await, 0, "Postgres holds no canary");
    assert_eq!(redis_values_holding(&h, CANARY).await, 0, "Redis holds no canary");
    assert_eq!(postgres_rows_holding(&h, "card").await, 0, "nor any part of a response");

    // The operator's view: idemctl opens the response with the key, and says why without it.
    let inspect = |keys: &[[u8; 32]]| {
        let encoded: Vec<String> = keys.iter().map(|key| BASE64.encode(key)).collect();
        let mut command = std::process::Command::new(support::idemctl());
        command.args(["--json", "--key-prefix", &h.prefix, "inspect", "acme", &h.operation, "run-once", "--response"]);
        command.env("DATABASE_URL", &h.database_url).env("IDEMSTORE_ENCRYPTION_KEY", encoded.join(","));
        let output = command.output().expect("run idemctl");
        serde_json::from_slice::<Value>(&output.stdout).expect("JSON")["postgres"].clone()
    };
    let opened = inspect(&[KEY_B, KEY_A]);
    assert!(opened["response"].as_str().expect("response").contains(CANARY), "{opened}");
    let unopened = inspect(&[KEY_B]);
    assert_eq!(unopened["response"], Value::Null);
    assert!(unopened["response_error"].as_str().expect("why").contains("not configured"), "{unopened}");
    let without_key = inspect(&[]);
    assert!(without_key["response_error"].as_str().expect("why").contains("set IDEMSTORE_ENCRYPTION_KEY"));
}

/// The control: the same writes without encryption leave the canary in both tiers, so the scans above
/// can see it.
async fn a_store_without_encryption_holds_the_canary_in_both_tiers(mode: Mode) {
    let h = Harness::start(mode).await;
    h.clear_allowed.store(true, std::sync::atomic::Ordering::Relaxed);
    let scope = h.scope("acme");
    store_canaries(&h, &without_encryption(&h), &scope).await;
    assert_eq!(postgres_rows_holding(&h, CANARY).await, 3);
    if mode == Mode::TwoTier {
        assert_eq!(redis_values_holding(&h, CANARY).await, 2, "run_once and run_once_in_tx cached it");
    }
}

/// New responses use the newest key; responses of the previous key replay while it is listed; once it
/// is removed they are refused as `UnknownKey`, and the work does not run again.
async fn rotated_keys_open_old_responses_until_retired(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let k = key("rotated");
    let before = sealing(&h, keys(&[KEY_A]));
    let first = before.run_once(&scope, &k, &json!({"n": 1}), || h.charge("acme", &k)).await.expect("run");
    let RunOutcome::Executed(answer) = first else { panic!("{first:?}") };

    let rotating = sealing(&h, keys(&[KEY_B, KEY_A]));
    for from in ["redis", "postgres"] {
        if from == "postgres" && mode == Mode::TwoTier {
            h.store.admin().evict(&scope, &k).await.expect("evict");
        }
        let replay = rotating.run_once(&scope, &k, &json!({"n": 1}), || h.charge("acme", &k)).await.expect("replay");
        assert_eq!(replay, RunOutcome::Replayed(answer.clone()), "from {from}");
    }
    let newer = key("after-rotation");
    rotating.run_once(&scope, &newer, &json!({"n": 2}), || h.charge("acme", &newer)).await.expect("run");

    let retired = sealing(&h, keys(&[KEY_B]));
    let refused = retired.run_once(&scope, &k, &json!({"n": 1}), || h.charge("acme", &k)).await;
    let a_id = keys(&[KEY_A]).key_ids()[0];
    assert!(
        matches!(&refused, Err(RunError::Store(StoreError::Encryption(EncryptionError::UnknownKey { id }))) if *id == a_id),
        "{refused:?}"
    );
    let replay = retired.run_once(&scope, &newer, &json!({"n": 2}), || h.charge("acme", &newer)).await;
    assert!(matches!(replay, Ok(RunOutcome::Replayed(_))), "sealed with the newest key: {replay:?}");
    assert_eq!(h.effects("acme", &k).await, 1, "the refused retry did not run the work again");
    let unreadable =
        |tier| h.counter("idemstore_unreadable_responses_total", &[("tier", tier), ("reason", "unknown_key")]);
    assert_eq!(unreadable("postgres"), 1.0);
    // Redis's copy did not open either: dropped, and Postgres asked (which refused).
    assert_eq!(unreadable("redis"), if mode == Mode::TwoTier { 1.0 } else { 0.0 });
}

/// A changed byte of the stored ciphertext, a ciphertext copied from another record of the same tenant,
/// or a fingerprint changed beside it (another payload would get this answer) is refused, and nothing
/// runs again. A Redis copy that does not open is dropped and Postgres answers with its own.
async fn tampered_or_moved_ciphertext_is_refused_and_nothing_runs_again(mode: Mode) {
    let h = Harness::start(mode).await;
    let store = sealing(&h, keys(&[KEY_A]));
    let (scope, victim) = (h.scope("acme"), key("victim"));
    for name in ["victim", "donor"] {
        let k = key(name);
        store.run_once(&scope, &k, &json!({"n": 1}), || h.charge("acme", &k)).await.expect("run");
    }
    if mode == Mode::TwoTier {
        // Redis's copy of the victim changed in place (a byte of the ciphertext), then its fingerprint
        // replaced by another payload's: neither opens, and Postgres answers each time.
        let mut conn = h.redis_connection().await;
        let name = h.redis_key(&scope, &victim);
        let other = idemstore::Fingerprint::of_serialize(&json!({"n": 2}), &Default::default()).expect("fingerprint");
        let original = json!({"charge": 1, "tenant": "acme"});
        for change in ["ciphertext", "fingerprint"] {
            let mut stored: Vec<u8> = redis::cmd("GET").arg(&name).query_async(&mut conn).await.expect("GET");
            match change {
                "ciphertext" => *stored.last_mut().expect("bytes") ^= 1,
                _ => stored[..32].copy_from_slice(other.as_bytes()),
            }
            let () =
                redis::cmd("SET").arg(&name).arg(&stored).arg("KEEPTTL").query_async(&mut conn).await.expect("SET");
            let payload = if change == "fingerprint" { json!({"n": 2}) } else { json!({"n": 1}) };
            let answer = store.run_once(&scope, &victim, &payload, || h.charge("acme", &victim)).await;
            let expected =
                if change == "fingerprint" { RunOutcome::Mismatch } else { RunOutcome::Replayed(original.clone()) };
            assert_eq!(answer.expect(change), expected, "{change}: Postgres answered");
            // The copy was dropped; the next request repairs it from Postgres.
            let again = store.run_once(&scope, &victim, &json!({"n": 1}), || h.charge("acme", &victim)).await;
            assert_eq!(again.expect("replay"), RunOutcome::Replayed(original.clone()));
            let repaired: Vec<u8> = redis::cmd("GET").arg(&name).query_async(&mut conn).await.expect("GET");
            assert!(!repaired.is_empty() && repaired != stored, "{change}: repaired from Postgres");
        }
        let counted = h.counter("idemstore_unreadable_responses_total", &[("tier", "redis"), ("reason", "tampered")]);
        assert_eq!(counted, 2.0);
    }
    let moves = [
        "UPDATE idempotency_records SET response = set_byte(response, 40, get_byte(response, 40) # 1) WHERE idempotency_key = 'victim'",
        "UPDATE idempotency_records v SET response = d.response FROM idempotency_records d
         WHERE v.idempotency_key = 'victim' AND d.idempotency_key = 'donor'",
    ];
    for change in moves {
        sqlx::query(change).execute(&h.pool).await.expect("change the stored response");
        if mode == Mode::TwoTier {
            h.store.admin().evict(&scope, &victim).await.expect("evict"); // Redis still holds the good copy
        }
        let refused = store.run_once(&scope, &victim, &json!({"n": 1}), || h.charge("acme", &victim)).await;
        assert!(
            matches!(refused, Err(RunError::Store(StoreError::Encryption(EncryptionError::Tampered)))),
            "{refused:?}"
        );
        let inspected = store.admin().inspect(&scope, &key("victim")).await.expect("inspect");
        assert_eq!(inspected.unreadable, Some(EncryptionError::Tampered));
    }
    assert_eq!(h.effects("acme", &key("victim")).await, 1, "refusals never run the work again");

    // An operator settles it: the completed record's unreadable response is replaced, and replayed.
    let repaired = Resolution::Completed(json!({ "charge": "restored" }).to_string().into_bytes());
    assert!(store.admin().resolve(&scope, &victim, repaired).await.expect("resolve"));
    let replay = store.run_once(&scope, &victim, &json!({"n": 1}), || h.charge("acme", &victim)).await;
    assert_eq!(replay.expect("replay"), RunOutcome::Replayed(json!({ "charge": "restored" })));
    // A readable completed record is not the operator's to change.
    let again = Resolution::Completed(b"\"other\"".to_vec());
    assert!(!store.admin().resolve(&scope, &victim, again).await.expect("resolve"));
    assert_eq!(h.effects("acme", &victim).await, 1);
}

/// Records stored before encryption was turned on hold responses in clear: refused by default (nobody
/// who can write a tier can plant a replay), replayed with `accept_unsealed`.
async fn responses_in_clear_are_refused_unless_accepted(mode: Mode) {
    let h = Harness::start(mode).await;
    // The response stays in clear: that is this test's subject.
    h.clear_allowed.store(true, std::sync::atomic::Ordering::Relaxed);
    let scope = h.scope("acme");
    let clear = without_encryption(&h);
    assert!(matches!(run(&clear, &scope, "from-before", 1, json!("before")).await, Ok(RunOutcome::Executed(_))));
    let strict = run(&sealing(&h, keys(&[KEY_A])), &scope, "from-before", 1, json!(0)).await;
    assert!(matches!(strict, Err(RunError::Store(StoreError::Encryption(EncryptionError::Unsealed)))), "{strict:?}");
    let lenient = sealing(&h, keys(&[KEY_A]).accept_unsealed());
    let replay = run(&lenient, &scope, "from-before", 1, json!(0)).await;
    assert_eq!(replay.expect("replay"), RunOutcome::Replayed(json!("before")));
}

/// A response written in clear into an encrypted deployment (an operator's `resolve` without the key, a
/// store built without `.encryption()`) is refused on every retry; the encrypted store's `resolve`
/// replaces it, as it replaces tampered ciphertext (before: it matched nothing, and the key stayed
/// unreadable until its retention ended; forever on the ledger tier).
async fn an_operator_replaces_a_response_written_in_clear(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let clear = without_encryption(&h);
    assert!(matches!(run(&clear, &scope, "in-clear", 1, json!("clear")).await, Ok(RunOutcome::Executed(_))));
    let encrypted = sealing(&h, keys(&[KEY_A]));
    let refused = run(&encrypted, &scope, "in-clear", 1, json!(0)).await;
    assert!(matches!(refused, Err(RunError::Store(StoreError::Encryption(EncryptionError::Unsealed)))), "{refused:?}");
    let repaired = Resolution::Completed(json!("sealed now").to_string().into_bytes());
    assert!(
        encrypted.admin().resolve(&scope, &key("in-clear"), repaired).await.expect("resolve"),
        "the clear response is replaced"
    );
    let replay = run(&encrypted, &scope, "in-clear", 1, json!(0)).await;
    assert_eq!(replay.expect("replay"), RunOutcome::Replayed(json!("sealed now")));
    assert_eq!(postgres_rows_holding(&h, "sealed now").await, 0, "the replacement is sealed");
}

/// An operator without the key (`idemctl resolve` without `IDEMSTORE_ENCRYPTION_KEY`, or any store built
/// without `.encryption()`) cannot settle a key in clear where the operation's responses are sealed: it
/// is refused with `WouldWriteClear` and the record is untouched (before: the clear response was stored,
/// and every store with the key answered each retry `unreadable-response`), for any tenant and operation
/// of the deployment.
async fn an_operator_without_the_key_cannot_resolve_in_clear(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let strict = Policy::builder().lease_expiry(LeaseExpiry::MarkIndeterminate).build().expect("policy");
    let mut builder = Store::builder()
        .database_url(&h.store_url)
        .key_prefix(&h.prefix)
        .encryption(keys(&[KEY_A]))
        .policy(&h.operation, strict);
    if let Some(url) = &h.redis_url {
        builder = builder.redis_url(url);
    }
    let encrypted = builder.build().expect("store");
    assert!(matches!(run(&encrypted, &scope, "paid", 1, json!("sealed")).await, Ok(RunOutcome::Executed(_))));
    // A key whose owner's lease ran out under `MarkIndeterminate`: it awaits an operator.
    let stuck = key("stuck");
    let fingerprint = Fingerprint::of_serialize(&json!({ "n": 1 }), encrypted.policy(&h.operation).fingerprint());
    let fingerprint = fingerprint.expect("fingerprint");
    let Ok(Begin::Acquired(owner)) = encrypted.begin(&scope, &stuck, &fingerprint).await else { panic!("claim") };
    owner.abandon();
    h.pass_lease(&scope, &stuck).await;
    assert!(matches!(encrypted.begin(&scope, &stuck, &fingerprint).await, Ok(Begin::Indeterminate)));

    let settled = || Resolution::Completed(json!("by hand").to_string().into_bytes());
    let keyless = keyless_builder(&h).build().expect("store");
    let refused = keyless.admin().resolve(&scope, &stuck, settled()).await;
    assert!(matches!(refused, Err(StoreError::Encryption(EncryptionError::WouldWriteClear))), "{refused:?}");
    let record = encrypted.admin().lookup(&scope, &stuck).await.expect("lookup").expect("record");
    assert_eq!(record.state, State::Indeterminate, "the refused resolve changed nothing");
    assert!(
        encrypted.admin().resolve(&scope, &stuck, settled()).await.expect("resolve"),
        "the key's holder resolves it"
    );
    assert_eq!(
        run(&encrypted, &scope, "stuck", 1, json!(0)).await.expect("replay"),
        RunOutcome::Replayed(json!("by hand"))
    );
    // Another tenant and operation, with no response of their own yet: the deployment seals all the same.
    let elsewhere = Scope::new("newcomer", "another-operation").expect("scope");
    let refused = keyless.admin().resolve(&elsewhere, &stuck, settled()).await;
    assert!(matches!(refused, Err(StoreError::Encryption(EncryptionError::WouldWriteClear))), "{refused:?}");
}

/// A process started without the key, where responses are sealed, refuses every claim before its work
/// runs (`WouldWriteClear`; the HTTP layer answers 503, nothing executed), in the run-once API and in a
/// claim's transaction alike: before, it ran the work and stored its response in clear, which every
/// store with the key then refused to replay. Built with `clear_responses_allowed`, it runs.
async fn a_store_without_the_key_refuses_to_write_in_clear_where_responses_are_sealed(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let encrypted = sealing(&h, keys(&[KEY_A]));
    assert!(matches!(run(&encrypted, &scope, "sealed", 1, json!("sealed")).await, Ok(RunOutcome::Executed(_))));
    let keyless = keyless_builder(&h).build().expect("store");
    let ran = std::sync::atomic::AtomicUsize::new(0);
    let work = || async {
        ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, std::io::Error>(json!("in clear"))
    };
    let refused = keyless.run_once(&scope, &key("fresh"), &json!({ "n": 2 }), work).await;
    let would_write_clear = |outcome: &Result<RunOutcome<Value>, RunError<std::io::Error>>| {
        matches!(outcome, Err(RunError::Store(StoreError::Encryption(EncryptionError::WouldWriteClear))))
    };
    assert!(would_write_clear(&refused), "{refused:?}");
    let in_tx = keyless
        .run_once_in_tx(&scope, &key("fresh-in-tx"), &json!({ "n": 3 }), |_tx| {
            Box::pin(async { Ok::<_, std::io::Error>(json!("in clear")) })
        })
        .await;
    assert!(
        matches!(in_tx, Err(RunError::Store(StoreError::Encryption(EncryptionError::WouldWriteClear)))),
        "{in_tx:?}"
    );
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 0, "no work ran");
    assert_eq!(encrypted.admin().lookup(&scope, &key("fresh")).await.expect("lookup"), None, "nothing was claimed");
    h.clear_allowed.store(true, std::sync::atomic::Ordering::Relaxed);
    let allowed = without_encryption(&h).run_once(&scope, &key("fresh"), &json!({ "n": 2 }), work).await;
    assert!(matches!(allowed, Ok(RunOutcome::Executed(_))), "{allowed:?}");
}

/// The demo's charges through the HTTP layer, with an encrypting store: the customer id of the charge
/// (in the stored response) is in neither tier, and the retry replays it.
async fn the_demo_with_an_encryption_key_stores_no_charge_in_clear(mode: Mode) {
    let h = Harness::start(mode).await;
    let serve = |store: Store| async move {
        payments::app::migrate(&store).await.expect("migrations");
        let router = payments::app::router(payments::app::App {
            store,
            metrics: support::recorder().clone(),
            webhook_senders: payments::app::WebhookSenders::demo(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move { axum::serve(listener, router).await });
        base
    };
    let base = serve(sealing(&h, keys(&[KEY_A]))).await;
    let client = reqwest::Client::new();
    let body = json!({"amount": 1200, "currency": "EUR", "customer": CANARY});
    let first = payments::post_payment(&client, &base, "encrypted-1", "acme", &body, 0).await;
    assert_eq!(first.status(), reqwest::StatusCode::CREATED);
    let first = first.bytes().await.expect("body");
    let retry = payments::post_payment(&client, &base, "encrypted-1", "acme", &body, 0).await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.bytes().await.expect("body"), first);
    assert!(String::from_utf8_lossy(&first).contains(CANARY));
    assert_eq!(postgres_rows_holding(&h, CANARY).await, 0);
    assert_eq!(redis_values_holding(&h, CANARY).await, 0);

    // Its key retired too early: the retry is a 500 that says why, not a 503 to retry, and no new charge.
    let retired = serve(sealing(&h, keys(&[KEY_B]))).await;
    let refused = payments::post_payment(&client, &retired, "encrypted-1", "acme", &body, 0).await;
    assert_eq!(refused.status(), reqwest::StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(payments::problem_type(&refused.bytes().await.expect("body")), problem_types::UNREADABLE);
    assert_eq!(payments::charges(&h, "acme").await, 1);
}
