//! Attach by key (`Store::attach`): a retry reads or awaits its request's answer and never executes or
//! claims anything. Real Redis and Postgres, both modes.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemstore::{Attached, Begin, Fingerprint, FingerprintOptions, Mode, Policy, RunOutcome};
use serde_json::json;
use support::{Harness, Servers, key};
use tokio::sync::Notify;

suite!(
    an_attach_answers_what_the_key_holds_and_claims_nothing,
    an_attach_waits_for_the_owners_answer,
    an_attach_answers_in_flight_at_its_bound,
    an_attach_to_a_transactional_owner_waits_for_its_commit,
    a_transactional_owner_taking_over_another_payloads_record_is_in_flight,
);

const ATTACHES: &str = "idemstore_attaches_total";
const WAKEUPS: &str = "idemstore_wait_wakeups_total";

/// A lease far longer than any test: only a settlement (or the wait's bound) ends a wait.
fn long_lease() -> Policy {
    Policy::builder().lease(Duration::from_secs(60)).build().expect("valid policy")
}

fn fingerprint(amount: u32) -> Fingerprint {
    let body = format!(r#"{{"amount":{amount}}}"#);
    Fingerprint::of_json(body.as_bytes(), &FingerprintOptions::default()).expect("fingerprint")
}

/// At once (a zero wait): vacant for a key nobody claimed (and still nothing recorded), in flight with
/// the owner's lease while it works, a mismatch for another payload, the stored response once completed;
/// vacant again for a key its owner released, which a claim then acquires.
async fn an_attach_answers_what_the_key_holds_and_claims_nothing(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("attached"));
    let attach = |amount| {
        let (store, scope, k) = (h.store.clone(), scope.clone(), k.clone());
        async move { store.attach(&scope, &k, &fingerprint(amount), Duration::ZERO).await.expect("attach") }
    };
    assert!(matches!(attach(1).await, Attached::Vacant));
    assert_eq!(h.store.admin().lookup(&scope, &k).await.expect("lookup"), None, "an attach claims nothing");

    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint(1)).await.expect("claim") else { panic!() };
    let in_flight = attach(1).await;
    assert!(
        matches!(in_flight, Attached::InFlight { retry_after } if retry_after > Duration::from_secs(50)),
        "{in_flight:?}"
    );
    assert!(matches!(attach(2).await, Attached::Mismatch));
    owner.complete(b"the result").await.expect("complete");
    let Attached::Replayed(stored) = attach(1).await else { panic!("the stored response") };
    assert_eq!(stored.as_bytes(), b"the result");
    assert!(matches!(attach(2).await, Attached::Mismatch));

    let released = key("released");
    let Begin::Acquired(owner) = h.store.begin(&scope, &released, &fingerprint(1)).await.expect("claim") else {
        panic!()
    };
    owner.release().await.expect("release");
    let vacant = h.store.attach(&scope, &released, &fingerprint(1), Duration::ZERO).await.expect("attach");
    assert!(matches!(vacant, Attached::Vacant), "{vacant:?}");
    assert!(matches!(h.store.begin(&scope, &released, &fingerprint(1)).await.expect("claim"), Begin::Acquired(_)));
    for (answer, count) in [("vacant", 2.0), ("in_flight", 1.0), ("mismatch", 2.0), ("replayed", 1.0)] {
        assert_eq!(h.counter(ATTACHES, &[("answer", answer)]), count, "{answer}");
    }
}

/// A second store (another process) attaches while the owner of a 60 s lease works; the owner completes
/// and the attach answers its response, woken by the notification (its 1 s re-check never fired).
async fn an_attach_waits_for_the_owners_answer(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("awaited"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint(1)).await.expect("claim") else { panic!() };
    let attaching = {
        let (store, scope, k) = (h.new_store(long_lease()), scope.clone(), k.clone());
        tokio::spawn(async move { store.attach(&scope, &k, &fingerprint(1), Duration::from_secs(30)).await })
    };
    // An attach flags the record in Postgres, whatever the mode.
    h.wait_until_flagged(&scope, &k, false).await;
    owner.complete(b"the result").await.expect("complete");
    let Attached::Replayed(stored) = attaching.await.expect("join").expect("attach") else { panic!("replayed") };
    assert_eq!(stored.as_bytes(), b"the result");
    assert_eq!(h.counter(WAKEUPS, &[("by", "notification")]), 1.0);
    assert_eq!(h.counter(WAKEUPS, &[("by", "timer")]), 0.0, "woken by the owner, not by a re-check");
    assert_eq!(h.counter(ATTACHES, &[("answer", "replayed")]), 1.0);
}

/// An owner that never settles: the attach answers "in flight" once its wait is over, and nothing else
/// happened to the key.
async fn an_attach_answers_in_flight_at_its_bound(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("stuck"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint(1)).await.expect("claim") else { panic!() };
    let started = Instant::now();
    let answer = h.store.attach(&scope, &k, &fingerprint(1), Duration::from_millis(300)).await.expect("attach");
    assert!(matches!(answer, Attached::InFlight { .. }), "{answer:?}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    let record = h.store.admin().lookup(&scope, &k).await.expect("lookup").expect("record");
    assert_eq!(record.fence, owner.fence(), "the owner still holds the key");
    assert_eq!(h.counter(ATTACHES, &[("answer", "in_flight")]), 1.0);
}

/// An owner inside a transaction (`run_once_in_tx`) writes its record only with its commit: while it
/// works the attach answers "in flight", not "vacant" (it sees the key's lock), and an attach that waits
/// answers the committed result.
async fn an_attach_to_a_transactional_owner_waits_for_its_commit(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("in-tx"));
    let payload = json!({"amount": 1});
    let fingerprint = Fingerprint::of_serialize(&payload, h.store.policy(scope.operation()).fingerprint()).expect("fp");
    let (entered, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let owner = {
        let (store, scope, k, entered, finish) =
            (h.store.clone(), scope.clone(), k.clone(), entered.clone(), finish.clone());
        tokio::spawn(async move {
            store
                .run_once_in_tx(&scope, &k, &payload, move |tx| {
                    Box::pin(async move {
                        let charged = sqlx::query_scalar::<_, i64>("SELECT 7::int8").fetch_one(&mut *tx).await?;
                        entered.notify_one();
                        finish.notified().await;
                        Ok::<_, sqlx::Error>(charged)
                    })
                })
                .await
        })
    };
    entered.notified().await;
    let at_once = h.store.attach(&scope, &k, &fingerprint, Duration::ZERO).await.expect("attach");
    assert!(matches!(at_once, Attached::InFlight { .. }), "{at_once:?}");
    let attaching = {
        let (store, scope, k, fingerprint) = (h.store.clone(), scope.clone(), k.clone(), fingerprint.clone());
        tokio::spawn(async move { store.attach(&scope, &k, &fingerprint, Duration::from_secs(30)).await })
    };
    finish.notify_one();
    assert!(matches!(owner.await.expect("join").expect("run"), RunOutcome::Executed(7)));
    let answer = attaching.await.expect("join").expect("attach");
    assert!(matches!(answer, Attached::Replayed(ref stored) if !stored.as_bytes().is_empty()), "{answer:?}");
    assert_eq!(h.counter(ATTACHES, &[("answer", "vacant")]), 0.0, "never vacant while the transaction worked");
}

/// A released record of another payload, past its retention, is taken over by a transactional owner
/// (whose row changes only with its commit): the owner's own retry attaches "in flight", not "mismatch"
/// (the record as committed still holds the old payload). Before the fix it was told the key was reused.
async fn a_transactional_owner_taking_over_another_payloads_record_is_in_flight(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("taken-over"));
    let insert = "INSERT INTO idempotency_records
                      (digest, tenant, operation, idempotency_key, fingerprint, state, fence, tier, on_lease_expiry,
                       expires_at)
                  VALUES (idempotency_key_digest($1, $2, $3), $1, $2, $3, $4, 'r', nextval('idempotency_fences'),
                          'standard', 't', now() - interval '1 second')";
    let old = fingerprint(9);
    let inserted =
        sqlx::query(insert).bind(scope.tenant()).bind(scope.operation()).bind(k.as_str()).bind(old.as_bytes());
    inserted.execute(&h.pool).await.expect("a released record of another payload");
    let payload = json!({"amount": 1});
    let fingerprint = Fingerprint::of_serialize(&payload, h.store.policy(scope.operation()).fingerprint()).expect("fp");
    let (entered, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let owner = {
        let (store, scope, k, entered, finish) =
            (h.store.clone(), scope.clone(), k.clone(), entered.clone(), finish.clone());
        tokio::spawn(async move {
            store
                .run_once_in_tx(&scope, &k, &payload, move |_| {
                    Box::pin(async move {
                        entered.notify_one();
                        finish.notified().await;
                        Ok::<_, sqlx::Error>(1)
                    })
                })
                .await
        })
    };
    entered.notified().await;
    let retry = h.store.attach(&scope, &k, &fingerprint, Duration::ZERO).await.expect("attach");
    assert!(matches!(retry, Attached::InFlight { .. }), "{retry:?}");
    let other = h.store.attach(&scope, &k, &old, Duration::ZERO).await.expect("attach");
    assert!(matches!(other, Attached::InFlight { .. }), "the key is being claimed: {other:?}");
    finish.notify_one();
    assert!(matches!(owner.await.expect("join").expect("run"), RunOutcome::Executed(1)));
    let settled = h.store.attach(&scope, &k, &fingerprint, Duration::ZERO).await.expect("attach");
    assert!(matches!(settled, Attached::Replayed(_)), "{settled:?}");
}
