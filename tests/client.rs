//! The client crate (`idemstore-client`) against the payments demo: a client killed mid-request and
//! restarted with its file journal, retries across a Postgres restart, a Redis kill and pause, and a
//! request in flight, refusals that are never retried, and the retry budget. Real Redis and Postgres, both modes.

use crate::support;
use support::payments;

use std::io::BufRead as _;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use idemstore::{Mode, State};
use idemstore_client::{
    ClientError, FileJournal, IdempotencyMiddleware, KeyJournal, MemoryJournal, Operation, RetryPolicy, Stop,
    was_replayed,
};
use payments::{charge, charges, post_payment, wait_for_state, wait_in_flight};
use reqwest_middleware::ClientWithMiddleware;
use serde_json::Value;
use support::{Harness, Servers};
use tower::ServiceExt;

suite!(
    a_client_killed_mid_request_sends_the_same_key_after_its_restart,
    a_retry_during_a_postgres_restart_waits_as_asked_and_charges_once,
    a_retry_of_a_request_in_flight_gets_the_first_answer,
    refusals_are_never_retried;
    two_tier only:
    operations_sent_across_a_redis_kill_and_a_pause_are_charged_once,
);

/// The demo, served so that a request runs to its end even when its client goes away (as behind a
/// proxy), with every answer it gave: when its request arrived, its status, and the request's `Prefer`.
async fn serve_detached(h: &Harness) -> (String, Answers) {
    let demo = payments::demo(h).await;
    let answers = Answers::default();
    let seen = answers.clone();
    let detached = tower::service_fn(move |request: axum::extract::Request| {
        let (demo, seen) = (demo.clone(), seen.clone());
        async move {
            let arrived = Instant::now();
            let request_prefer = request.headers().get("prefer").cloned();
            let response = tokio::spawn(demo.oneshot(request)).await.expect("no panic")?;
            let prefer = request_prefer.map(|value| value.to_str().unwrap_or_default().to_owned());
            seen.lock().expect("answers").push((arrived, response.status(), prefer));
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, Router::new().fallback_service(detached)).await });
    (format!("http://{address}"), answers)
}

type Answers = Arc<Mutex<Vec<(Instant, http::StatusCode, Option<String>)>>>;

/// A client whose backoff is short, so that a wait longer than it was asked for by the server.
fn client(journal: impl KeyJournal) -> ClientWithMiddleware {
    let policy = RetryPolicy::default().backoff(Duration::from_millis(10), Duration::from_millis(100));
    reqwest_middleware::ClientBuilder::new(direct())
        .with(IdempotencyMiddleware::with_journal(journal).policy(policy))
        .build()
}

/// A client that ignores any proxy the environment names: the demo is on loopback.
fn direct() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().expect("a client")
}

fn memory() -> MemoryJournal {
    MemoryJournal::new(Duration::from_secs(60))
}

/// A charge of the demo, as the middleware sends it.
fn payment(client: &ClientWithMiddleware, base: &str, amount: i64) -> reqwest_middleware::RequestBuilder {
    client
        .post(format!("{base}/payments"))
        .bearer_auth("acme")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&charge(amount)).expect("json"))
}

/// The child of `a_client_killed_mid_request_...`: one charge for operation `order-1/charge` with the
/// file journal at `CLIENT_JOURNAL`, its answer printed.
#[tokio::test]
#[ignore = "a child process of a client test"]
async fn client_process() {
    let (Ok(base), Ok(journal)) = (std::env::var("CLIENT_BASE_URL"), std::env::var("CLIENT_JOURNAL")) else {
        return;
    };
    let delay = std::env::var("CLIENT_DELAY_MS").unwrap_or_default();
    let client = client(FileJournal::open(journal, Duration::from_secs(3600)).expect("the journal"));
    println!("SENDING");
    let request = payment(&client, &base, 1200).header("x-demo-delay-ms", delay);
    let response = request.with_extension(Operation::new("order-1/charge")).send().await.expect("an answer");
    let replayed = was_replayed(&response);
    println!("ANSWER {} replayed={replayed} {}", response.status(), response.text().await.expect("the body"));
}

/// A client SIGKILLed while its charge runs, restarted with the same file journal: it sends the same
/// key, gets the first attempt's answer replayed, and the customer is charged once. (Without the
/// journal the restarted client mints another key and the demo charges again.)
async fn a_client_killed_mid_request_sends_the_same_key_after_its_restart(mode: Mode) {
    let h = Harness::start(mode).await;
    let (base, _) = serve_detached(&h).await;
    let dir = tempfile::tempdir().expect("a directory");
    let journal = dir.path().join("keys.jsonl");
    let process = |delay: &str| {
        let mut command = support::child(&h, module_path!(), "client_process");
        command.env("CLIENT_BASE_URL", &base).env("CLIENT_JOURNAL", &journal).env("CLIENT_DELAY_MS", delay);
        command.stdout(Stdio::piped());
        command
    };
    let mut first = process("1500").spawn().expect("spawn the client");
    let mut lines = std::io::BufReader::new(first.stdout.take().expect("stdout")).lines();
    assert!(lines.any(|line| line.expect("stdout").contains("SENDING")), "the client never sent");
    // The key is on disk before the request leaves.
    let written = Instant::now();
    let key = loop {
        let journal = std::fs::read_to_string(&journal).unwrap_or_default();
        if let Some(line) = journal.lines().next() {
            let line: Value = serde_json::from_str(line).expect("a journal line");
            break line["key"].as_str().expect("a key").to_owned();
        }
        assert!(written.elapsed() < Duration::from_secs(10), "the client sent without writing its key");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    wait_in_flight(&h, &key).await;
    first.kill().expect("SIGKILL the client");
    first.wait().expect("reap it");
    wait_for_state(&h, &key, State::Completed).await;

    let restarted = process("0").output().expect("the restarted client");
    let printed = String::from_utf8_lossy(&restarted.stdout);
    let answer = printed.lines().find(|line| line.starts_with("ANSWER")).expect("an answer");
    let charged: i64 = sqlx::query_scalar("SELECT id FROM charges WHERE tenant = $1")
        .bind(payments::app::tenant_of("acme"))
        .fetch_one(&h.pool)
        .await
        .expect("a charge");
    assert!(answer.starts_with("ANSWER 201 Created replayed=true"), "{answer}");
    assert!(answer.contains(&format!("\"id\":{charged}")), "the first attempt's charge: {answer}");
    assert_eq!(charges(&h, "acme").await, 1);
}

/// Postgres down: the demo answers 503 with `Retry-After: 1`, the client waits that second (its own
/// backoff is at most 100 ms), and once Postgres is back the retry charges once.
async fn a_retry_during_a_postgres_restart_waits_as_asked_and_charges_once(mode: Mode) {
    let h = Harness::with(mode, idemstore::Policy::default(), Servers::Owned).await;
    let (base, answers) = serve_detached(&h).await;
    let postgres = h.postgres.as_ref().expect("owned");
    postgres.stop().expect("stop Postgres");
    let client = client(memory());
    let sent = tokio::spawn(payment(&client, &base, 500).send());
    let waited = Instant::now();
    while answers.lock().expect("answers").is_empty() {
        assert!(waited.elapsed() < Duration::from_secs(10), "the demo never answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    postgres.restart().expect("restart Postgres");
    let response = sent.await.expect("no panic").expect("charged once Postgres was back");
    assert_eq!(response.status(), 201);
    assert!(!was_replayed(&response));
    let answers = answers.lock().expect("answers").clone();
    assert_eq!(answers[0].1, 503, "Postgres was down");
    assert_eq!(answers.last().expect("an answer").1, 201);
    let gap = answers[1].0 - answers[0].0;
    assert!(gap >= Duration::from_millis(950), "Retry-After: 1 honoured; waited {gap:?}");
    assert_eq!(charges(&h, "acme").await, 1);
}

/// A retry that meets the first attempt still running (409 in-flight; the first runs 2 s, longer than a
/// duplicate waits for its row lock on the transactional path) waits for it and gets its answer,
/// replayed: one charge, one answer.
async fn a_retry_of_a_request_in_flight_gets_the_first_answer(mode: Mode) {
    let h = Harness::start(mode).await;
    let (base, answers) = serve_detached(&h).await;
    let first = tokio::spawn({
        let base = base.clone();
        async move { post_payment(&direct(), &base, "in-flight-1", "acme", &charge(700), 2000).await }
    });
    wait_in_flight(&h, "in-flight-1").await;
    let client = client(memory());
    let retried = payment(&client, &base, 700).header("idempotency-key", "in-flight-1").send().await;
    let retried = retried.expect("the first attempt's answer");
    let first = first.await.expect("no panic");
    assert_eq!((first.status(), retried.status()), (http::StatusCode::CREATED, http::StatusCode::CREATED));
    assert!(was_replayed(&retried));
    let (first, retried): (Value, Value) = (first.json().await.expect("json"), retried.json().await.expect("json"));
    assert_eq!(first, retried);
    let mut answers = answers.lock().expect("answers").clone();
    // By arrival: the first request, the retry's first attempt (409), then its polls.
    answers.sort_by_key(|(arrived, _, _)| *arrived);
    assert_eq!(answers[1].1, 409, "the retry met the first attempt in flight");
    assert!(answers.len() > 2 && answers[..2].iter().all(|(_, _, prefer)| prefer.is_none()), "{answers:?}");
    // Every poll after the 409 asks the server to hold it for the first answer, within the client's
    // deadline (60 s by default; the demo's route does not wait: it answers as before).
    for (_, _, prefer) in &answers[2..] {
        let wait = prefer.as_deref().and_then(|p| p.strip_prefix("wait=")).and_then(|n| n.parse::<u64>().ok());
        assert!(wait.is_some_and(|wait| wait < 60), "{prefer:?}");
    }
    assert_eq!(charges(&h, "acme").await, 1);
}

/// 422 (the key again with another body) and 400 (a malformed key) come back as typed refusals with
/// their problem documents, after one attempt each.
async fn refusals_are_never_retried(mode: Mode) {
    let h = Harness::start(mode).await;
    let (base, answers) = serve_detached(&h).await;
    let client = client(memory());
    let operation = Operation::new("order-2/charge");
    let first = payment(&client, &base, 100).with_extension(operation.clone()).send().await.expect("charged");
    assert_eq!(first.status(), 201);
    // The same operation with another amount: the journal's key, another body.
    let reused = payment(&client, &base, 999).with_extension(operation).send().await.expect_err("refused");
    let Some(ClientError::Refused { status, problem: Some(problem), .. }) = ClientError::of(&reused) else {
        panic!("{reused:?}");
    };
    assert_eq!(*status, 422);
    assert!(problem.is("key-reused"), "{problem:?}");
    let malformed = payment(&client, &base, 1).header("idempotency-key", "").send().await.expect_err("refused");
    assert!(matches!(ClientError::of(&malformed), Some(ClientError::Refused { status, .. }) if *status == 400));
    assert_eq!(answers.lock().expect("answers").len(), 3, "one attempt each");
    assert_eq!(charges(&h, "acme").await, 1);
}

/// Nothing listens: each request spends a token of the host's budget per failed attempt, and once half
/// the budget is spent the middleware stops retrying at the first failure.
#[tokio::test]
async fn the_budget_stops_a_retry_storm() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address");
    let policy = RetryPolicy::default()
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .max_attempts(100)
        .budget(10, 0.1);
    let client =
        reqwest_middleware::ClientBuilder::new(direct()).with(IdempotencyMiddleware::new().policy(policy)).build();
    let mut attempts = Vec::new();
    for _ in 0..3 {
        let failed = client.post(format!("http://{closed}/payments")).body("{}").send().await.expect_err("no server");
        match ClientError::of(&failed) {
            Some(ClientError::GaveUp { attempts: n, because: Stop::Budget, .. }) => attempts.push(*n),
            other => panic!("{other:?}"),
        }
    }
    // 10 tokens: retries while more than 5 are left after a failure, so 5 attempts, then 1 each.
    assert_eq!(attempts, [5, 1, 1]);
}

/// Named operations sent while Redis is killed (then restarted empty) and while it is paused, each sent
/// again during the fault and after it: every operation is charged once, and every later answer is the
/// first one, replayed.
async fn operations_sent_across_a_redis_kill_and_a_pause_are_charged_once() {
    let h = Harness::with(Mode::TwoTier, idemstore::Policy::default(), Servers::Owned).await;
    let (base, _) = serve_detached(&h).await;
    let client = client(memory());
    let redis = h.redis.as_ref().expect("owned");
    let send = |name: String, amount: i64| {
        let request = payment(&client, &base, amount).with_extension(Operation::new(name));
        async move {
            let response = request.send().await.expect("answered");
            let replayed = was_replayed(&response);
            (response.status(), replayed, response.json::<Value>().await.expect("json"))
        }
    };
    for fault in ["kill", "pause"] {
        let (status, _, warm) = send(format!("{fault}/before"), 100).await;
        assert_eq!(status, 201, "{warm}");
        let fallbacks = support::counter(payments::PAYMENTS, "idemstore_redis_fallbacks_total", &[]);
        match fault {
            "kill" => redis.kill(),
            _ => redis.pause().expect("SIGSTOP"),
        }
        let during = format!("{fault}/during");
        let (status, replayed, first) = send(during.clone(), 200).await;
        assert_eq!((status.as_u16(), replayed), (201, false), "charged while Redis is down: {first}");
        let (_, replayed, again) = send(during.clone(), 200).await;
        assert!(replayed && again == first, "the retry during the fault gets the first answer");
        let degraded = support::counter(payments::PAYMENTS, "idemstore_redis_fallbacks_total", &[]);
        assert!(degraded > fallbacks, "the {fault} hit: the store fell back to Postgres");
        match fault {
            "kill" => redis.restart().expect("restart Redis"),
            _ => redis.resume().expect("SIGCONT"),
        }
        let (_, replayed, after) = send(during, 200).await;
        assert!(replayed && after == first, "and after it");
    }
    assert_eq!(charges(&h, "acme").await, 4, "two operations per fault, each charged once");
}
