//! Group commit: concurrent calls share their claims' and completions' statements, and no call is held
//! up, lost or left claimed because it shared one.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::join_all;
use idemstore::{Begin, Fingerprint, FingerprintOptions, Mode, Policy, RunOutcome, Store};
use serde_json::json;
use support::{Harness, key};
use tokio::sync::Notify;

suite!(
    concurrent_new_keys_share_statements,
    a_claim_whose_caller_left_is_given_back,
    shutdown_waits_for_a_claim_given_back,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_held_in_a_transaction_holds_up_no_shared_claim() {
    a_key_held_in_a_transaction_holds_up_no_shared_claim_in(Mode::PostgresOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_claim_whose_caller_left_is_given_back() {
    a_lone_claim_whose_caller_left_is_given_back_in(Mode::PostgresOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_claim_whose_caller_left_takes_its_marker_back() {
    a_lone_claim_whose_caller_left_is_given_back_in(Mode::TwoTier).await;
}

type Outcome = Result<RunOutcome<serde_json::Value>, idemstore::RunError<sqlx::Error>>;

async fn store_run(store: &Store, h: &Harness, scope: &idemstore::Scope, k: &idemstore::IdempotencyKey) -> Outcome {
    store.run_once(scope, k, &json!({"amount": 3}), || h.charge("acme", k)).await
}

/// Statements of one kind sent for this test's store so far.
fn statements(statement: &str) -> f64 {
    support::labelled("idemstore_postgres_statements_total", &[("statement", statement)])
}

/// A store on the harness's servers and `pool`, sharing its writes or not.
fn store_on(h: &Harness, pool: sqlx::PgPool, group_commit: bool) -> Store {
    let store = support::sealed(
        Store::builder()
            .postgres(pool)
            .key_prefix(&h.prefix)
            .postgres_timeout(Duration::from_secs(2))
            .policy(&h.operation, Policy::default())
            .group_commit(group_commit),
    );
    match &h.redis_url {
        Some(url) => store.redis_url(url),
        None => store,
    }
    .build()
    .expect("store")
}

/// 64 new keys at once, through a pool of one connection that the test holds until every call is at its
/// claim (so none finds a connection to spare and all but two queue for shared statements), cost fewer
/// than 64 claims and 64 completions (each call alone sends one of each, as the store without group
/// commit shows), and each key's work ran once.
async fn concurrent_new_keys_share_statements(mode: Mode) {
    // It counts the process's statements: under `cargo test`, in a process of its own.
    if support::rerun_alone(mode, module_path!(), "concurrent_new_keys_share_statements") {
        return;
    }
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let keys: Vec<_> = (0..64).map(|i| key(&format!("shared-{i}"))).collect();
    let pool = idemstore::pool_options().max_connections(1).connect(&h.store_url).await.expect("pool");
    let held = pool.acquire().await.expect("the pool's connection");
    let shared = store_on(&h, pool, true);
    let release = async {
        // Two-tier: every call's Redis marker is set, so each is at its Postgres claim.
        if mode == Mode::TwoTier {
            while h.redis_keys().await.len() < keys.len() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        drop(held);
    };
    let (outcomes, ()) = tokio::join!(join_all(keys.iter().map(|k| store_run(&shared, &h, &scope, k))), release);
    assert!(outcomes.iter().all(|o| matches!(o, Ok(RunOutcome::Executed(_)))), "{outcomes:?}");
    let (claims, completions) = (statements("claim"), statements("complete"));
    // Fewer than one each: some were shared (how many depends on how the calls met).
    assert!(claims < 64.0 && completions < 64.0, "{claims} claims and {completions} completions for 64 keys");
    for k in &keys {
        assert_eq!(h.effects("acme", k).await, 1, "{k:?}");
    }

    // The same keys again, through a store that writes alone: every call is answered from its record.
    let pool = idemstore::pool_options().connect(&h.store_url).await.expect("pool");
    let alone = store_on(&h, pool, false);
    let replays = join_all(keys.iter().map(|k| store_run(&alone, &h, &scope, k))).await;
    assert!(replays.iter().all(|o| matches!(o, Ok(RunOutcome::Replayed(_)))), "{replays:?}");
    for k in &keys {
        assert_eq!(h.effects("acme", k).await, 1, "{k:?}");
    }
}

/// Claims a shared statement wrote for calls that were cancelled before they heard of them are taken
/// back: nobody is told "in flight" for work that never started, no record is left, and the key runs at
/// the next call. Before the fix, such records stayed in progress until their leases ran out. The first
/// shared statement's answers are held back after it committed (a failpoint) while the calls are
/// cancelled; the other calls were answered, and their dropped owners released their keys.
async fn a_claim_whose_caller_left_is_given_back(mode: Mode) {
    // Its failpoint and statement count are the process's: under `cargo test`, in a process of its own.
    if support::rerun_alone(mode, module_path!(), "a_claim_whose_caller_left_is_given_back") {
        return;
    }
    let h = Arc::new(Harness::start(mode).await);
    let scope = h.scope("acme");
    let keys: Vec<_> = (0..32).map(|i| key(&format!("cancelled-{i}"))).collect();
    let fingerprint = Fingerprint::of_json(br#"{"amount":5}"#, &FingerprintOptions::default()).expect("fingerprint");
    // The first shared statement's callers hear of it 10 s after it committed.
    fail::cfg("group-commit-before-answers", "1*return(10000)").expect("failpoint");
    let calls: Vec<_> = keys
        .iter()
        .map(|k| {
            let (h, scope, k, fingerprint) = (h.clone(), scope.clone(), k.clone(), fingerprint.clone());
            tokio::spawn(async move { h.store.begin(&scope, &k, &fingerprint).await.map(drop) })
        })
        .collect();
    let count = |states: &'static str| {
        let query = "SELECT count(*) FROM idempotency_records WHERE operation = $1 AND state::text = ANY($2)";
        let states: Vec<String> = states.split(',').map(str::to_owned).collect();
        let (pool, operation) = (&h.pool, &h.operation);
        async move { sqlx::query_scalar::<_, i64>(query).bind(operation).bind(states).fetch_one(pool).await.expect("count") }
    };
    let started = std::time::Instant::now();
    while count("p,r").await < 32 {
        assert!(started.elapsed() < Duration::from_secs(9), "the claims never committed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(statements("claim") < 32.0, "no claim was shared");
    for call in calls {
        call.abort();
        let _ = call.await;
    }
    fail::cfg("group-commit-before-answers", "off").expect("failpoint");

    while count("p").await > 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "a claim nobody heard of was never taken back");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(count("r").await < 32, "the held statement's claims are gone, not released");
    // Two-tier: each cancelled call took its Redis marker back too (before: it answered "in flight" until
    // its lease ended).
    wait_until_no_marker(&h, &scope, &keys[31]).await;
    let begun = h.store.begin(&scope, &keys[31], &fingerprint).await.expect("begin");
    assert!(matches!(begun, Begin::Acquired(_)), "{begun:?}");
}

/// Two-tier: waits until `k` has no Redis marker, for at most 10 s (a marker left behind would stay for
/// its lease, 30 s). Postgres-only: at once.
async fn wait_until_no_marker(h: &Harness, scope: &idemstore::Scope, k: &idemstore::IdempotencyKey) {
    if h.mode != Mode::TwoTier {
        return;
    }
    let (mut conn, name) = (h.redis_connection().await, h.redis_key(scope, k));
    let started = std::time::Instant::now();
    while redis::cmd("EXISTS").arg(&name).query_async::<i64>(&mut conn).await.expect("EXISTS") > 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "a cancelled claim's marker stayed in Redis");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A claim sent alone (the pool had connections to spare) whose caller was cancelled while its statement
/// waited, and which then committed, is given back. The statement waits for another transaction that
/// writes the same key's record, and that transaction ends once the caller is gone:
/// - it rolls back (the key was new): the claim's new record goes whole, and the key runs at the next
///   call. Before the fix the statement ran in the caller's future, and its record stayed in progress
///   until its lease ran out (30 s; the test allows 10);
/// - it commits a released record of the same payload: the claim re-acquires it (a new fence) and is
///   released again, keeping the record (a first version of the fix deleted it).
///
/// In two-tier mode the cancelled call's Redis marker is taken back at once, while its statement still
/// waits (before: it answered "in flight" until its lease ran out, though nothing ran).
async fn a_lone_claim_whose_caller_left_is_given_back_in(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let fingerprint = Fingerprint::of_json(br#"{"amount":5}"#, &FingerprintOptions::default()).expect("fingerprint");
    let record = "SELECT state::text, fence FROM idempotency_records WHERE operation = $1 AND idempotency_key = $2";
    let read = |k: &idemstore::IdempotencyKey| {
        let query = sqlx::query_as::<_, (String, i64)>(record).bind(h.operation.clone()).bind(k.as_str().to_owned());
        async { query.fetch_optional(&h.pool).await.expect("record") }
    };

    let new = key("lone-new");
    cancel_while_held(&h, &scope, &new, &fingerprint, None).await;
    let started = std::time::Instant::now();
    while read(&new).await.is_some() {
        assert!(started.elapsed() < Duration::from_secs(10), "a claim nobody heard of stayed: {:?}", read(&new).await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let begun = h.store.begin(&scope, &new, &fingerprint).await.expect("begin");
    assert!(matches!(begun, Begin::Acquired(_)), "{begun:?}");

    let released = key("lone-released");
    let fence = cancel_while_held(&h, &scope, &released, &fingerprint, Some(fingerprint.as_bytes())).await;
    let started = std::time::Instant::now();
    loop {
        match read(&released).await {
            Some((state, now)) if state == "r" && now > fence.expect("committed") => break,
            seen => {
                let waited = started.elapsed();
                assert!(waited < Duration::from_secs(10), "the re-acquired record was not released: {seen:?}");
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A shutdown waits for the give-back of a claim whose caller left before it heard of it, so that a
/// process may exit as soon as `shutdown` returns: the key is free by then, not in progress until its
/// lease runs out (or indeterminate after it). The give-back is held back 1 s (a failpoint) after the
/// claim committed. Before the fix the give-back was spawned untracked: `shutdown` returned at once and
/// the record was still in progress.
async fn shutdown_waits_for_a_claim_given_back(mode: Mode) {
    // Its failpoint is the process's: under `cargo test`, in a process of its own.
    if support::rerun_alone(mode, module_path!(), "shutdown_waits_for_a_claim_given_back") {
        return;
    }
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("given-back-at-shutdown"));
    let fingerprint = Fingerprint::of_json(br#"{"amount":5}"#, &FingerprintOptions::default()).expect("fingerprint");
    fail::cfg("give-back", "1*return(1000)").expect("failpoint");
    cancel_while_held(&h, &scope, &k, &fingerprint, None).await;
    h.store.shutdown().await;
    let left = "SELECT state::text FROM idempotency_records WHERE operation = $1 AND idempotency_key = $2";
    let left: Option<String> =
        sqlx::query_scalar(left).bind(&h.operation).bind(k.as_str()).fetch_optional(&h.pool).await.expect("record");
    fail::cfg("give-back", "off").expect("failpoint");
    assert_eq!(left, None, "shutdown returned before the claim nobody heard of was given back");
}

/// Writes `k`'s record in a transaction of its own (released with `fingerprint` when given, else in
/// progress), starts a lone claim of `k` that waits for it, cancels that claim's caller, then ends the
/// transaction (commits a released record, rolls back the other) and waits for the claim's statement to
/// finish. The released record's fence, when committed.
async fn cancel_while_held(
    h: &Harness,
    scope: &idemstore::Scope,
    k: &idemstore::IdempotencyKey,
    fingerprint: &Fingerprint,
    released_with: Option<&[u8; 32]>,
) -> Option<i64> {
    let mut holder = h.pool.begin().await.expect("begin");
    let insert = "INSERT INTO idempotency_records
                      (digest, tenant, operation, idempotency_key, fingerprint, state, fence, tier, on_lease_expiry)
                  VALUES (idempotency_key_digest($1, $2, $3), $1, $2, $3, $4, $5::\"char\",
                          nextval('idempotency_fences'), 'standard', 't') RETURNING fence";
    let (state, bytes) = released_with.map_or(("p", &[0u8; 32][..]), |f| ("r", &f[..]));
    let fence: i64 = sqlx::query_scalar(insert)
        .bind(scope.tenant())
        .bind(scope.operation())
        .bind(k.as_str())
        .bind(bytes)
        .bind(state)
        .fetch_one(&mut *holder)
        .await
        .expect("the holder's record");
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.expect("pid");
    let call = {
        let (store, scope, k, fingerprint) = (h.store.clone(), scope.clone(), k.clone(), fingerprint.clone());
        tokio::spawn(async move { store.begin(&scope, &k, &fingerprint).await.map(drop) })
    };
    let started = std::time::Instant::now();
    let blocked = "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))";
    let waiting = loop {
        let waiting: Option<i32> =
            sqlx::query_scalar(blocked).bind(holder_pid).fetch_optional(&h.pool).await.expect("pids");
        if let Some(pid) = waiting {
            break pid;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the call's claim never waited for the holder");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    call.abort();
    assert!(call.await.is_err_and(|e| e.is_cancelled()), "the call was answered while its claim waited");
    wait_until_no_marker(h, scope, k).await;
    let committed = released_with.is_some();
    if committed { holder.commit().await } else { holder.rollback().await }.expect("the holder ends");
    // The waiting statement goes on, and commits a claim its caller never hears of.
    let active = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'";
    while sqlx::query_scalar::<_, i64>(active).bind(waiting).fetch_one(&h.pool).await.expect("activity") > 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "the call's claim never finished");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    committed.then_some(fence)
}

/// The work of the transaction that holds a key: its effect, then it waits for `released` (at most 20 s).
fn hold(
    tx: &mut sqlx::PgConnection,
    holding: tokio::sync::oneshot::Sender<()>,
    released: Arc<Notify>,
    still_held: Arc<AtomicBool>,
) -> idemstore::TxFuture<'_, i64, sqlx::Error> {
    Box::pin(async move {
        sqlx::query("INSERT INTO effects (tenant, key) VALUES ('acme', 'held')").execute(&mut *tx).await?;
        let _ = holding.send(());
        let _ = tokio::time::timeout(Duration::from_secs(20), released.notified()).await;
        still_held.store(false, Ordering::SeqCst);
        Ok(1)
    })
}

/// A key whose claim is open in another transaction (`run_once_in_tx`, its work under way) is left out of
/// a shared claim that carries a duplicate of it (the key's lock is the transaction's), and the other
/// keys of that statement are answered while the transaction is still open, not after the store's lock
/// timeout; the duplicates are answered "in flight" at once. Before the fix they waited for the transaction (here, the holder lets
/// go after 20 s without them; the store's lock timeout is 30 s).
async fn a_key_held_in_a_transaction_holds_up_no_shared_claim_in(mode: Mode) {
    let h = Harness::start(mode).await;
    let store = support::sealed(
        Store::builder()
            .database_url(&h.store_url)
            .key_prefix(&h.prefix)
            .postgres_timeout(Duration::from_secs(60))
            .policy(&h.operation, Policy::default()),
    )
    .build()
    .expect("store");
    let (scope, held, payload) = (h.scope("acme"), key("held"), json!({"amount": 1}));
    const FREE: usize = 40;
    let free_left = AtomicUsize::new(FREE);
    let (all_free_answered, still_held) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(true)));
    let (holding, held_now) = tokio::sync::oneshot::channel::<()>();
    let (answered_signal, held_flag) = (all_free_answered.clone(), still_held.clone());
    let holder = store.run_once_in_tx(&scope, &held, &payload, |tx| hold(tx, holding, answered_signal, held_flag));
    let others = async {
        held_now.await.expect("the holder claimed");
        // Duplicates of the held key among the free ones, so that they share statements.
        join_all((0..FREE + 8).map(|i| {
            let k = if i % 6 == 0 { held.clone() } else { key(&format!("free-{i}")) };
            let (store, scope, payload, h, held) = (&store, &scope, &payload, &h, &held);
            let (free_left, all_free_answered, still_held) = (&free_left, &all_free_answered, &still_held);
            async move {
                let outcome = store.run_once(scope, &k, payload, || h.charge("acme", &k)).await;
                let while_held = still_held.load(Ordering::SeqCst);
                if k != *held && free_left.fetch_sub(1, Ordering::SeqCst) == 1 {
                    all_free_answered.notify_one();
                }
                (k, outcome, while_held)
            }
        }))
        .await
    };
    let (held_done, answered) = tokio::join!(holder, others);
    assert!(matches!(held_done, Ok(RunOutcome::Executed(1))), "{held_done:?}");
    assert_eq!(answered.iter().filter(|(k, ..)| *k != held).count(), FREE);
    for (k, outcome, while_held) in answered {
        if k == held {
            // The key's lock, which the holder's transaction holds, answers them at once.
            assert!(matches!(outcome, Ok(RunOutcome::InFlight { .. })), "{k:?}: {outcome:?}");
            assert!(while_held, "a duplicate of the held key waited for its transaction");
        } else {
            assert!(matches!(outcome, Ok(RunOutcome::Executed(_))), "{k:?}: {outcome:?}");
            assert!(while_held, "{k:?} was answered only after the held key's transaction ended");
            assert_eq!(h.effects("acme", &k).await, 1, "{k:?}");
        }
    }
    assert_eq!(h.effects("acme", &held).await, 1);
}
