//! The layer outside axum: the tonic example's gRPC service behind `Server::layer`, called by a real
//! tonic client over HTTP/2, against real Redis and Postgres, in both modes.

use crate::support;
#[allow(dead_code)]
#[path = "../examples/grpc.rs"]
mod example;

use futures::future::join_all;
use idemstore::{Mode, Policy};
use support::{Harness, Servers};
use tonic::Code;

suite!(concurrent_grpc_retries_create_one_charge, grpc_statuses_are_stored_or_released_by_code);

/// Eight concurrent calls with one key create one charge; the others are refused as in flight or replay
/// it; a later retry replays it, `grpc-status` trailer included (without it the client fails the call);
/// the same key with another amount is refused.
async fn concurrent_grpc_retries_create_one_charge(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Any).await;
    let address = example::serve(h.store.clone()).await.expect("serve");
    let account = format!("acct-{}", h.prefix);
    let calls = join_all((0..8).map(|_| example::create(address, &account, "order-1", 1200))).await;
    let answered: Vec<_> = calls.iter().filter_map(|call| call.as_ref().ok()).collect();
    assert!(!answered.is_empty(), "{calls:?}");
    let (charge, replayed) = example::create(address, &account, "order-1", 1200).await.expect("the retry");
    assert!(replayed, "the retry is a replay");
    assert!(answered.iter().all(|(answer, _)| *answer == charge), "{calls:?}");
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
    let reused = example::create(address, &account, "order-1", 9900).await;
    assert!(reused.is_err(), "another amount under the key is refused: {reused:?}");
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
}

/// A gRPC call answers HTTP 200 whatever happened, so the layer reads `grpc-status`: UNAVAILABLE releases
/// the key and the retry runs (and creates the charge); INVALID_ARGUMENT is stored and every retry gets
/// it back with its code (before: both were stored without their status, and retries failed with a
/// protocol error).
async fn grpc_statuses_are_stored_or_released_by_code(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Any).await;
    let address = example::serve(h.store.clone()).await.expect("serve");
    let account = format!("acct-{}", h.prefix);
    let busy = example::create_failing(address, &account, "busy", 1200, Some("unavailable")).await;
    assert_eq!(busy.map_err(|status| status.code()).err(), Some(Code::Unavailable));
    let (charge, replayed) = example::create(address, &account, "busy", 1200).await.expect("the retry runs");
    assert!(!replayed && charge.amount == 1200);
    for attempt in 0..2 {
        let refused = example::create_failing(address, &account, "refused", 7, Some("invalid")).await;
        let status = refused.expect_err("INVALID_ARGUMENT");
        assert_eq!(status.code(), Code::InvalidArgument, "attempt {attempt}");
        // A handler run again would answer the same code: only the replay header tells a replay.
        let replayed = status.metadata().get("idempotent-replayed").is_some_and(|v| v == "true");
        assert_eq!(replayed, attempt > 0, "attempt {attempt} replayed: {status:?}");
    }
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
}
