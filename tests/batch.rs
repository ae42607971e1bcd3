//! Batch claims (`Store::begin_many`, `Store::complete_many`): a verdict per item, new keys in one
//! statement, one winner per key across concurrent batches. Real Redis and Postgres, both modes.

use crate::support;

use std::collections::HashMap;

use futures::future::join;
use idemstore::{BatchBegin, Begin, Fingerprint, FingerprintOptions, IdempotencyKey, InputError, Mode, StoreError};
use support::{Harness, key};

suite!(
    a_batch_answers_each_item_and_claims_new_keys_in_one_statement,
    concurrent_batches_of_overlapping_keys_acquire_each_key_once,
    a_batch_past_its_limit_is_refused_before_anything_is_written,
);

fn fingerprint(amount: u32) -> Fingerprint {
    let body = format!(r#"{{"amount":{amount}}}"#);
    Fingerprint::of_json(body.as_bytes(), &FingerprintOptions::default()).expect("fingerprint")
}

/// Statements of one kind sent so far in this process.
fn statements(statement: &str) -> f64 {
    support::labelled("idemstore_postgres_statements_total", &[("statement", statement)])
}

fn items(names: &[(&str, u32)]) -> Vec<(IdempotencyKey, Fingerprint)> {
    names.iter().map(|(name, amount)| (key(name), fingerprint(*amount))).collect()
}

/// New keys are acquired (in one claim statement), a completed key replays, a key whose owner works is
/// in flight, a completed key with another payload is refused, and a key repeated in the batch is a
/// duplicate of its first item (refused with another payload: it would get the first item's answer);
/// the acquired owners complete in one statement, and the batch sent again replays every item.
async fn a_batch_answers_each_item_and_claims_new_keys_in_one_statement(mode: Mode) {
    // It counts the process's statements: under `cargo test`, in a process of its own.
    if support::rerun_alone(mode, module_path!(), "a_batch_answers_each_item_and_claims_new_keys_in_one_statement") {
        return;
    }
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let Begin::Acquired(done) = h.store.begin(&scope, &key("done"), &fingerprint(1)).await.expect("claim") else {
        panic!()
    };
    done.complete(b"done before").await.expect("complete");
    let Begin::Acquired(paid) = h.store.begin(&scope, &key("paid"), &fingerprint(1)).await.expect("claim") else {
        panic!()
    };
    paid.complete(b"paid before").await.expect("complete");
    let Begin::Acquired(_busy) = h.store.begin(&scope, &key("busy"), &fingerprint(1)).await.expect("claim") else {
        panic!()
    };
    let (claims, completions) = (statements("claim"), statements("complete"));
    let batch = items(&[
        ("new-1", 1),
        ("new-2", 1),
        ("done", 1),
        ("busy", 1),
        ("new-1", 2),
        ("paid", 2),
        ("new-3", 1),
        ("new-2", 1),
    ]);
    let verdicts = h.store.begin_many(&scope, &batch).await.expect("batch");
    let mut owners = Vec::new();
    let mut seen = Vec::new();
    for verdict in verdicts {
        seen.push(match verdict {
            BatchBegin::Begun(Begin::Acquired(owner)) => {
                let response = format!("ran {}", owner.key().as_str()).into_bytes();
                owners.push((owner, response));
                "acquired".to_owned()
            }
            BatchBegin::Begun(Begin::Replayed(stored)) => {
                format!("replayed {}", String::from_utf8_lossy(stored.as_bytes()))
            }
            BatchBegin::Begun(Begin::InFlight { .. }) => "in flight".to_owned(),
            BatchBegin::Begun(Begin::Mismatch) => "mismatch".to_owned(),
            BatchBegin::Duplicate { of } => format!("duplicate of {of}"),
            other => format!("{other:?}"),
        });
    }
    let expected = [
        "acquired",
        "acquired",
        "replayed done before",
        "in flight",
        "mismatch",
        "mismatch",
        "acquired",
        "duplicate of 1",
    ];
    assert_eq!(seen, expected);
    // Two-tier: Redis answers the keys that have records; Postgres-only: each asks with one statement.
    let asked_alone = if mode == Mode::TwoTier { 0.0 } else { 3.0 };
    assert_eq!(statements("claim") - claims, 1.0 + asked_alone, "the new keys in one statement");

    let stored = h.store.complete_many(owners).await;
    assert!(stored.iter().all(Result::is_ok), "{stored:?}");
    assert_eq!(statements("complete") - completions, 1.0, "three completions in one statement");
    let again = h.store.begin_many(&scope, &items(&[("new-1", 1), ("new-2", 1), ("new-3", 1)])).await.expect("batch");
    for (verdict, name) in again.iter().zip(["new-1", "new-2", "new-3"]) {
        let BatchBegin::Begun(Begin::Replayed(stored)) = verdict else { panic!("{name}: {verdict:?}") };
        assert_eq!(stored.as_bytes(), format!("ran {name}").as_bytes());
    }
}

/// Two batches sent at once whose keys overlap by half: every key is acquired by exactly one of them,
/// and the other is told it is in flight (or, once completed, replays it).
async fn concurrent_batches_of_overlapping_keys_acquire_each_key_once(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let names: Vec<String> = (0..75).map(|i| format!("overlap-{i}")).collect();
    let batch = |range: std::ops::Range<usize>| -> Vec<(IdempotencyKey, Fingerprint)> {
        names[range].iter().map(|name| (key(name), fingerprint(1))).collect()
    };
    let (a, b) = (batch(0..50), batch(25..75));
    let (first, second) = join(h.store.begin_many(&scope, &a), h.store.begin_many(&scope, &b)).await;
    let mut acquired: HashMap<String, usize> = HashMap::new();
    let mut owners = Vec::new();
    for (items, verdicts) in [(&a, first.expect("batch a")), (&b, second.expect("batch b"))] {
        for ((k, _), verdict) in items.iter().zip(verdicts) {
            match verdict {
                BatchBegin::Begun(Begin::Acquired(owner)) => {
                    *acquired.entry(k.as_str().to_owned()).or_default() += 1;
                    owners.push((owner, b"once".to_vec()));
                }
                BatchBegin::Begun(Begin::InFlight { .. } | Begin::Replayed(_)) => {}
                other => panic!("{k:?}: {other:?}"),
            }
        }
    }
    assert_eq!(acquired.len(), 75, "every key acquired");
    assert!(acquired.values().all(|&n| n == 1), "a key acquired twice: {acquired:?}");
    assert!(h.store.complete_many(owners).await.iter().all(Result::is_ok));
}

/// More items than one batch takes: a typed refusal, and nothing of the batch is recorded.
async fn a_batch_past_its_limit_is_refused_before_anything_is_written(mode: Mode) {
    let h = Harness::start(mode).await;
    let scope = h.scope("acme");
    let names: Vec<String> = (0..=idemstore::MAX_BATCH_ITEMS).map(|i| format!("big-{i}")).collect();
    let batch: Vec<_> = names.iter().map(|name| (key(name), fingerprint(1))).collect();
    let refused = h.store.begin_many(&scope, &batch).await;
    assert!(
        matches!(refused, Err(StoreError::Input(InputError::BatchTooLarge { items, max })) if items == max + 1),
        "{refused:?}"
    );
    assert_eq!(h.store.admin().lookup(&scope, &key("big-0")).await.expect("lookup"), None);
}
