//! The layer outside axum: the tonic example's gRPC service behind `Server::layer` (its charge written in
//! the claim's transaction), called by a real tonic client over HTTP/2, against real Redis and Postgres, in both modes; and the client crate's
//! gRPC layer around the channel, retrying as the server asks.

use crate::support;
#[allow(dead_code)]
#[path = "../examples/grpc.rs"]
mod example;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use idemstore::{Mode, Policy};
use idemstore_client::{IdempotencyGrpcLayer, IdempotencyMiddleware, RetryPolicy};
use support::{Harness, Servers};
use tonic::Code;
use tonic::body::Body;
use tower::Layer as _;

suite!(
    concurrent_grpc_retries_create_one_charge,
    grpc_statuses_are_stored_or_released_by_code,
    the_client_layer_retries_unavailable_as_far_as_its_policy_allows,
    the_client_layer_waits_out_a_call_in_flight_for_its_answer,
    the_client_layer_retries_through_a_postgres_restart_and_charges_once,
);

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
    let busy = example::create_behaving(address, &account, "busy", 1200, Some("unavailable")).await;
    assert_eq!(busy.map_err(|status| status.code()).err(), Some(Code::Unavailable));
    let (charge, replayed) = example::create(address, &account, "busy", 1200).await.expect("the retry runs");
    assert!(!replayed && charge.amount == 1200);
    for attempt in 0..2 {
        let refused = example::create_behaving(address, &account, "refused", 7, Some("invalid")).await;
        let status = refused.expect_err("INVALID_ARGUMENT");
        assert_eq!(status.code(), Code::InvalidArgument, "attempt {attempt}");
        // A handler run again would answer the same code: only the replay header tells a replay.
        let replayed = status.metadata().get("idempotent-replayed").is_some_and(|v| v == "true");
        assert_eq!(replayed, attempt > 0, "attempt {attempt} replayed: {status:?}");
    }
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
}

/// The HTTP status of every answer that came up the channel, one per attempt.
type Seen = Arc<Mutex<Vec<http::StatusCode>>>;

/// A client of the example through the client crate's layer (a short backoff), over a channel that
/// notes every attempt's answer.
async fn layered(address: std::net::SocketAddr, policy: RetryPolicy) -> (example::Client, Seen) {
    let seen = Seen::default();
    let noted = seen.clone();
    let channel = example::channel(address).await.expect("a channel");
    let noting = tower::ServiceBuilder::new()
        .map_response(move |response: http::Response<Body>| {
            noted.lock().expect("seen").push(response.status());
            response
        })
        .service(channel);
    let policy = policy.backoff(Duration::from_millis(10), Duration::from_millis(50));
    let layer = IdempotencyGrpcLayer::new(IdempotencyMiddleware::new().policy(policy), [example::CREATE]);
    (example::client(layer.layer(noting)), seen)
}

fn attempts(seen: &Seen) -> usize {
    seen.lock().expect("seen").len()
}

/// UNAVAILABLE (a trailers-only answer, as tonic sends a handler's error) is retried until the policy's attempts run out, and the caller
/// gets it; INVALID_ARGUMENT is handed back after one attempt; the released key then runs once.
async fn the_client_layer_retries_unavailable_as_far_as_its_policy_allows(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Any).await;
    let address = example::serve(h.store.clone()).await.expect("serve");
    let account = format!("acct-{}", h.prefix);
    let (mut client, seen) = layered(address, RetryPolicy::default().max_attempts(3)).await;
    let busy = example::call(&mut client, &account, "busy", 1200, Some("unavailable")).await;
    assert_eq!(busy.map_err(|status| status.code()).err(), Some(Code::Unavailable));
    assert_eq!(attempts(&seen), 3, "UNAVAILABLE is retried, three attempts in all");
    let refused = example::call(&mut client, &account, "refused", 7, Some("invalid")).await;
    assert_eq!(refused.map_err(|status| status.code()).err(), Some(Code::InvalidArgument));
    assert_eq!(attempts(&seen), 4, "INVALID_ARGUMENT is final: one attempt");
    let (charge, replayed) = example::call(&mut client, &account, "busy", 1200, None).await.expect("runs");
    assert!(!replayed && charge.amount == 1200);
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
}

/// A retry that meets the first call still running (the layer answers 409 `in-flight`) polls until
/// the first call's answer is stored, and gets it: one charge, one answer.
async fn the_client_layer_waits_out_a_call_in_flight_for_its_answer(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Any).await;
    let address = example::serve(h.store.clone()).await.expect("serve");
    let account = format!("acct-{}", h.prefix);
    let (mut client, seen) = layered(address, RetryPolicy::default()).await;
    let first = example::create_behaving(address, &account, "slow-1", 300, Some("slow"));
    let retry = async {
        // The claim is in the first call's open transaction, which holds it while the handler runs.
        support::payments::wait_for_open_claim(&h).await;
        example::call(&mut client, &account, "slow-1", 300, None).await
    };
    let (first, retried) = tokio::join!(first, retry);
    let ((first, _), (retried, replayed)) = (first.expect("the first call"), retried.expect("its answer"));
    assert_eq!(retried, first);
    assert!(replayed, "the retry got the first call's answer");
    assert!(seen.lock().expect("seen").contains(&http::StatusCode::CONFLICT), "it met the call in flight");
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
}

/// Postgres down: the layer in front of the service answers 503 with `Retry-After`; the client layer
/// waits and retries, and once Postgres is back the call charges once.
async fn the_client_layer_retries_through_a_postgres_restart_and_charges_once(mode: Mode) {
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    let address = example::serve(h.store.clone()).await.expect("serve");
    let account = format!("acct-{}", h.prefix);
    let (mut client, seen) = layered(address, RetryPolicy::default()).await;
    let postgres = h.postgres.as_ref().expect("owned");
    postgres.stop().expect("stop Postgres");
    let call = example::call(&mut client, &account, "through-1", 800, None);
    let restart = async {
        let waited = Instant::now();
        while attempts(&seen) == 0 {
            assert!(waited.elapsed() < Duration::from_secs(10), "the service never answered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        postgres.restart().expect("restart Postgres");
    };
    let (called, ()) = tokio::join!(call, restart);
    let (charge, replayed) = called.expect("charged once Postgres was back");
    assert!(!replayed && charge.amount == 800);
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen[0], http::StatusCode::SERVICE_UNAVAILABLE, "Postgres was down: {seen:?}");
    assert_eq!(example::charges_of(&h.store, &account).await.expect("count"), 1);
}
