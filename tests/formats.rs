//! What a payload's fingerprint holds: exact amounts told apart, numbers JSON cannot hold refused. Real
//! Redis and Postgres, both modes.

use crate::support;

use idemstore::{Mode, RunOutcome};
use support::{Harness, key};

suite!(amounts_beyond_64_bits_are_different_requests, non_finite_numbers_are_refused,);

/// Two amounts that differ only in the 21st digit, under one key: the second is refused as a different
/// payload (before: both had one fingerprint, and the second request got the first one's response).
async fn amounts_beyond_64_bits_are_different_requests(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("wei"));
    #[derive(serde::Serialize)]
    struct Transfer {
        amount_wei: u128,
    }
    let first = Transfer { amount_wei: 100_000_000_000_000_000_001 };
    let second = Transfer { amount_wei: 100_000_000_000_000_000_000 };
    let ran = h.store.run_once(&scope, &k, &first, || h.charge("acme", &k)).await.expect("first");
    assert!(matches!(ran, RunOutcome::Executed(_)), "{ran:?}");
    let again = h.store.run_once(&scope, &k, &second, || h.charge("acme", &k)).await;
    assert!(matches!(again, Ok(RunOutcome::Mismatch)), "{again:?}");
    assert_eq!(h.effects("acme", &k).await, 1);
}

/// NaN and infinities are refused with a typed error before anything runs (before: serde_json wrote them
/// as `null`, so `{"amount": NaN}` was the request `{"amount": null}`); the outbox refuses them too.
async fn non_finite_numbers_are_refused(mode: Mode) {
    let h = Harness::start(mode).await;
    let (scope, k) = (h.scope("acme"), key("nan"));
    for amount in [f64::NAN, f64::INFINITY] {
        let payload = std::collections::BTreeMap::from([("amount", amount)]);
        let refused = h.store.run_once(&scope, &k, &payload, || h.charge("acme", &k)).await;
        assert!(
            matches!(
                refused,
                Err(idemstore::RunError::Store(idemstore::StoreError::Input(idemstore::InputError::NonFiniteNumber)))
            ),
            "{refused:?}"
        );
    }
    assert_eq!(h.effects("acme", &k).await, 0);
    let mut tx = h.pool.begin().await.expect("begin");
    let enqueued = h.store.outbox().enqueue(&mut tx, "mail", &[f64::NAN]).await;
    assert!(
        matches!(enqueued, Err(idemstore::StoreError::Input(idemstore::InputError::NonFiniteNumber))),
        "{enqueued:?}"
    );
}
