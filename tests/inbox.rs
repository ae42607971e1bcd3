//! The inbox keyed by event id: re-deliveries with changed bookkeeping, compared fields and the
//! transactional receive. Real Redis and Postgres, both modes.

use crate::support;

use idemstore::{InputError, Mode, Received, RunError, SignatureScheme, StoreError, WebhookVerifier};
use serde_json::{Value, json};
use support::{Harness, key};

suite!(
    a_redelivery_with_changed_bookkeeping_is_handled_after_a_failure,
    a_redelivery_with_changed_bookkeeping_is_a_duplicate_after_success,
    compared_fields_decide_a_conflict,
    receive_in_tx_commits_the_handlers_writes_with_the_record,
    a_delivery_verified_by_one_inbox_is_refused_by_another,
);

/// A Stripe event as delivered `pending` deliveries before the last.
fn event(pending: u32) -> Value {
    json!({"id": "evt_1", "type": "payment_intent.succeeded", "data": {"amount": 1200}, "pending_webhooks": pending})
}

/// The first delivery's handler fails; the provider re-delivers with `pending_webhooks` counted down:
/// the handler runs (before: the body's fingerprint changed, so this and every later delivery for 7 days
/// was a conflict and the event was never handled).
async fn a_redelivery_with_changed_bookkeeping_is_handled_after_a_failure(mode: Mode) {
    let h = Harness::start(mode).await;
    let inbox = h.store.inbox(format!("stripe-{}", h.id())).expect("inbox");
    let failed = inbox.receive("evt_1", None, &event(2), || async { Err::<Value, _>("downstream unavailable") }).await;
    assert!(matches!(failed, Err(RunError::Work(_))), "{failed:?}");
    let k = key("evt_1");
    let handled = inbox.receive("evt_1", None, &event(1), || h.charge("stripe", &k)).await.expect("second");
    assert!(matches!(handled, Received::Executed(_)), "{handled:?}");
    assert_eq!(h.effects("stripe", &k).await, 1);
}

/// The first delivery was handled but its 200 was lost: re-deliveries are acknowledged as duplicates
/// (before: conflicts, until the provider disabled the endpoint).
async fn a_redelivery_with_changed_bookkeeping_is_a_duplicate_after_success(mode: Mode) {
    let h = Harness::start(mode).await;
    let inbox = h.store.inbox(format!("stripe-{}", h.id())).expect("inbox");
    let k = key("evt_1");
    let first = inbox.receive("evt_1", Some(7), &event(2), || h.charge("stripe", &k)).await.expect("first");
    let Received::Executed(outcome) = first else { panic!("{first:?}") };
    for pending in [1, 0] {
        let again = inbox.receive("evt_1", Some(8), &event(pending), || h.charge("stripe", &k)).await;
        assert_eq!(again.expect("re-delivery"), Received::Replayed { result: outcome.clone(), sequence: Some(7) });
    }
    assert_eq!(h.effects("stripe", &k).await, 1);
}

/// With compared fields, a change there is a conflict; a change elsewhere is not.
async fn compared_fields_decide_a_conflict(mode: Mode) {
    let h = Harness::start(mode).await;
    let inbox = h.store.inbox(format!("stripe-{}", h.id())).expect("inbox");
    let inbox = inbox.compare_fields(["/type", "/data/amount"]).expect("pointers");
    let k = key("evt_1");
    let first = inbox.receive("evt_1", None, &event(2), || h.charge("stripe", &k)).await.expect("first");
    assert!(matches!(first, Received::Executed(_)));
    let recounted = inbox.receive("evt_1", None, &event(1), || h.charge("stripe", &k)).await.expect("second");
    assert!(matches!(recounted, Received::Replayed { .. }), "{recounted:?}");
    let mut altered = event(1);
    altered["data"]["amount"] = json!(1300);
    let conflict = inbox.receive("evt_1", None, &altered, || h.charge("stripe", &k)).await.expect("third");
    assert_eq!(conflict, Received::Mismatch);
    assert_eq!(h.effects("stripe", &k).await, 1);
}

/// Two senders' inboxes, each with its own verifier (here, carelessly, of one secret): a delivery the
/// first verified is refused by the second, and so is a bare id or the delivery's id alone given to an
/// inbox with a verifier; nothing runs there. Its own inbox handles it (before: a verified delivery was
/// a bare event id, which any inbox took as its own event).
async fn a_delivery_verified_by_one_inbox_is_refused_by_another(mode: Mode) {
    let h = Harness::start(mode).await;
    let verifier =
        || WebhookVerifier::new(SignatureScheme::StandardWebhooks, ["whsec_c2VjcmV0LW9uZQ"]).expect("verifier");
    let stripe = h.store.inbox(format!("stripe-{}", h.id())).expect("inbox").verified_by(verifier());
    let github = h.store.inbox(format!("github-{}", h.id())).expect("inbox").verified_by(verifier());
    let body = serde_json::to_vec(&event(1)).expect("json");
    let headers = verifier().sign("evt_1", std::time::SystemTime::now(), &body);
    let headers: Vec<(&str, &str)> = headers.iter().map(|(name, value)| (*name, value.as_str())).collect();
    let delivery = stripe.verify(headers.as_slice(), &body).expect("signed with stripe's secret");
    let k = key("evt_1");
    let unverified = |answer: &Result<Received<Value>, RunError<_>>| {
        matches!(answer, Err(RunError::Store(StoreError::Input(InputError::UnverifiedDelivery))))
    };
    let elsewhere = github.receive(&delivery, None, &event(1), || h.charge("github", &k)).await;
    assert!(unverified(&elsewhere), "{elsewhere:?}");
    for bare in [
        github.receive("evt_1", None, &event(1), || h.charge("github", &k)).await,
        stripe.receive(&delivery.event_id, None, &event(1), || h.charge("stripe", &k)).await,
    ] {
        assert!(unverified(&bare), "{bare:?}");
    }
    assert_eq!((h.effects("github", &k).await, h.effects("stripe", &k).await), (0, 0));
    let handled = stripe.receive(&delivery, None, &event(1), || h.charge("stripe", &k)).await.expect("own inbox");
    assert!(matches!(handled, Received::Executed(_)), "{handled:?}");
    assert_eq!(h.effects("stripe", &k).await, 1);
}

/// The handler's insert commits with the record: five concurrent deliveries write one row; a handler
/// that fails after its insert leaves no row and no record, and the next delivery handles the event.
async fn receive_in_tx_commits_the_handlers_writes_with_the_record(mode: Mode) {
    let h = Harness::start(mode).await;
    let consumer = format!("stripe-{}", h.id());
    let inbox = h.store.inbox(consumer.clone()).expect("inbox");
    let failed = inbox.receive_in_tx("evt_tx", None, &event(2), insert(consumer.clone(), "evt_tx", true)).await;
    assert!(matches!(failed, Err(RunError::Work(_))), "{failed:?}");
    assert_eq!(h.effects(&consumer, &key("evt_tx")).await, 0, "rolled back with the claim");
    let redelivered = event(1);
    let deliveries =
        (0..5).map(|_| inbox.receive_in_tx("evt_tx", None, &redelivered, insert(consumer.clone(), "evt_tx", false)));
    let received = futures::future::join_all(deliveries).await;
    let handled = received.iter().filter(|r| matches!(r, Ok(Received::Executed(_)))).count();
    assert_eq!(handled, 1, "{received:?}");
    assert!(
        received
            .iter()
            .all(|r| matches!(r, Ok(Received::Executed(_) | Received::Replayed { .. } | Received::InFlight { .. })))
    );
    assert_eq!(h.effects(&consumer, &key("evt_tx")).await, 1);
}

/// A handler that inserts an effect row in the record's transaction, and fails after it if `fail`.
fn insert(
    consumer: String,
    event: &'static str,
    fail: bool,
) -> impl for<'c> FnOnce(&'c mut sqlx::PgConnection) -> idemstore::TxFuture<'c, i64, sqlx::Error> {
    move |tx| {
        Box::pin(async move {
            let id: i64 = sqlx::query_scalar("INSERT INTO effects (tenant, key) VALUES ($1, $2) RETURNING id")
                .bind(consumer)
                .bind(event)
                .fetch_one(&mut *tx)
                .await?;
            if fail {
                return Err(sqlx::Error::Protocol("the handler failed after its insert".into()));
            }
            Ok(id)
        })
    }
}
