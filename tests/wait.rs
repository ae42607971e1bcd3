//! Claims that wait for an in-flight duplicate (`RunOptions::wait_in_flight`, the layer's
//! `with_wait_in_flight`): woken by the owner's settlement in another store (another process), through
//! Redis pub/sub or Postgres `NOTIFY`, not by polling. Real Redis and Postgres, both modes.

use crate::support;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idemstore::http::{IdempotencyLayer, RequestBody};
use idemstore::{Begin, Fingerprint, FingerprintOptions, IdempotencyKey, Mode, Policy, RunOptions, Scope, Store};
use redis::AsyncCommands;
use support::{Harness, Servers, key};
use tokio::sync::Notify;
use tower::{Layer, ServiceExt};

suite!(
    a_waiter_in_another_store_is_woken_when_the_owner_completes,
    a_waiter_is_woken_when_the_owner_releases_and_claims_the_key,
    a_waiter_answers_in_flight_at_its_bound,
    an_http_retry_waits_for_the_first_response,
    a_transactional_http_retry_waits_for_the_first_response,
    transactional_retries_after_a_failed_first_request_run_it_once,
    a_client_shortens_the_wait_never_lengthens_it,
    shutdown_stops_the_followers_though_redis_is_down,
);

const WAKEUPS: &str = "idemstore_wait_wakeups_total";

/// A lease far longer than any test: only a settlement (or the wait's bound) ends a wait.
fn long_lease() -> Policy {
    Policy::builder().lease(Duration::from_secs(60)).build().expect("valid policy")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of_json(br#"{"amount":1}"#, &FingerprintOptions::default()).expect("fingerprint")
}

/// Starts a claim on `store` that waits up to `wait` for the key's owner.
fn wait_on(store: &Store, scope: &Scope, k: &IdempotencyKey, wait: Duration) -> tokio::task::JoinHandle<Begin> {
    let (store, scope, k) = (store.clone(), scope.clone(), k.clone());
    tokio::spawn(async move {
        let options = RunOptions::default().wait_in_flight(wait);
        store.begin_with(&scope, &k, &fingerprint(), &options).await.expect("the waiting claim")
    })
}

/// A second store (a second process) waits for the owner of a 60 s lease; the owner completes and the
/// waiter replays its result, woken by the notification (its 1 s re-check never fired).
async fn a_waiter_in_another_store_is_woken_when_the_owner_completes(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("awaited"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint()).await.expect("claim") else { panic!() };
    let waiter = wait_on(&h.new_store(long_lease()), &scope, &k, Duration::from_secs(30));
    h.wait_until_flagged(&scope, &k, mode == Mode::TwoTier).await;
    owner.complete(b"the result").await.expect("complete");
    let Begin::Replayed(stored) = waiter.await.expect("join") else { panic!("the waiter replays") };
    assert_eq!(stored.as_bytes(), b"the result");
    assert_eq!(h.counter(WAKEUPS, &[("by", "notification")]), 1.0);
    assert_eq!(h.counter(WAKEUPS, &[("by", "timer")]), 0.0, "woken by the owner, not by a re-check");
    assert_eq!(h.counter("idemstore_outcomes_total", &[("outcome", "replayed")]), 1.0);
}

/// The owner's work failed and it released the key: the waiter hears of it and claims the key itself.
async fn a_waiter_is_woken_when_the_owner_releases_and_claims_the_key(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("released"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint()).await.expect("claim") else { panic!() };
    let waiter = wait_on(&h.new_store(long_lease()), &scope, &k, Duration::from_secs(30));
    h.wait_until_flagged(&scope, &k, mode == Mode::TwoTier).await;
    owner.release().await.expect("release");
    let Begin::Acquired(next) = waiter.await.expect("join") else { panic!("the waiter claims the released key") };
    next.complete(b"second try").await.expect("the waiter completes");
    assert_eq!(h.counter(WAKEUPS, &[("by", "notification")]), 1.0);
    assert_eq!(h.counter(WAKEUPS, &[("by", "timer")]), 0.0);
}

/// An owner that never settles: the waiter answers "in flight" once its wait is over, woken by its
/// timer only.
async fn a_waiter_answers_in_flight_at_its_bound(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("stuck"));
    let Begin::Acquired(_owner) = h.store.begin(&scope, &k, &fingerprint()).await.expect("claim") else { panic!() };
    let started = Instant::now();
    let answer = wait_on(&h.store, &scope, &k, Duration::from_millis(300)).await.expect("join");
    assert!(matches!(answer, Begin::InFlight { .. }), "{answer:?}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(h.counter(WAKEUPS, &[("by", "timer")]) >= 1.0);
    assert_eq!(h.counter(WAKEUPS, &[("by", "notification")]), 0.0);
}

/// Through the layer: a retry that arrives while the first request runs gets the first request's 201
/// (not 409), and the handler runs once.
async fn an_http_retry_waits_for_the_first_response(mode: Mode) {
    http_retry_waits_for_the_first_response(mode, false).await;
}

/// The same on the transactional path (`with_claim_transaction`), where the first request's record is
/// written only with its commit: the retry ends its own transaction and attaches, holding no connection,
/// and answers the committed 201. Before, the route's wait did not apply there and the retry got 409.
async fn a_transactional_http_retry_waits_for_the_first_response(mode: Mode) {
    http_retry_waits_for_the_first_response(mode, true).await;
}

async fn http_retry_waits_for_the_first_response(mode: Mode, transactional: bool) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let entered = std::sync::Arc::new(Notify::new());
    let finish = std::sync::Arc::new(Notify::new());
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = {
        let (entered, finish, runs) = (entered.clone(), finish.clone(), runs.clone());
        tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
            let (entered, finish, runs) = (entered.clone(), finish.clone(), runs.clone());
            async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                entered.notify_one();
                finish.notified().await;
                let mut response = Response::new(Full::new(Bytes::from_static(b"charged")));
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(response)
            }
        })
    };
    let tenant = |_: &http::request::Parts| Some("acme".to_owned());
    let layer = IdempotencyLayer::new(h.store.clone(), tenant)
        .with_operation(h.operation.clone())
        .with_wait_in_flight(Duration::from_secs(30));
    let service = if transactional { layer.with_claim_transaction() } else { layer }.layer(handler);
    let request = || {
        let body = Full::new(Bytes::from_static(b"{}"));
        Request::post("/charges").header("idempotency-key", "waited-over-http").body(body).expect("request")
    };
    let first = tokio::spawn(service.clone().oneshot(request()));
    entered.notified().await;
    let retry = tokio::spawn(service.clone().oneshot(request()));
    if transactional {
        // The retry attaches: there is no record to flag, it asks again until the first one commits.
        while h.counter("idemstore_wait_wakeups_total", &[]) < 1.0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    } else {
        h.wait_until_flagged(&h.scope("acme"), &key("waited-over-http"), mode == Mode::TwoTier).await;
    }
    finish.notify_one();
    for answer in [first.await.expect("join"), retry.await.expect("join")] {
        let response = answer.expect("infallible");
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.into_body().collect().await.expect("body").to_bytes().as_ref(), b"charged");
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    if transactional {
        assert_eq!(h.counter("idemstore_attaches_total", &[("answer", "replayed")]), 1.0);
    } else {
        assert_eq!(h.counter(WAKEUPS, &[("by", "notification")]), 1.0);
    }
}

/// The transactional path: the first request fails (500, a released status: its writes roll back and
/// the key is given up) while two retries wait for it; one of them runs the handler and the other
/// replays its 201: three requests, two runs, one stored answer.
async fn transactional_retries_after_a_failed_first_request_run_it_once(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    let (entered, finish) = (std::sync::Arc::new(Notify::new()), std::sync::Arc::new(Notify::new()));
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = {
        let (entered, finish, runs) = (entered.clone(), finish.clone(), runs.clone());
        tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
            let (entered, finish, runs) = (entered.clone(), finish.clone(), runs.clone());
            async move {
                let mut response = Response::new(Full::new(Bytes::from_static(b"charged")));
                if runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    entered.notify_one();
                    finish.notified().await;
                    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                } else {
                    *response.status_mut() = StatusCode::CREATED;
                }
                Ok::<_, Infallible>(response)
            }
        })
    };
    let tenant = |_: &http::request::Parts| Some("acme".to_owned());
    let service = IdempotencyLayer::new(h.store.clone(), tenant)
        .with_operation(h.operation.clone())
        .with_wait_in_flight(Duration::from_secs(30))
        .with_claim_transaction()
        .layer(handler);
    let request = || {
        let body = Full::new(Bytes::from_static(b"{}"));
        Request::post("/charges").header("idempotency-key", "failed-first").body(body).expect("request")
    };
    let first = tokio::spawn(service.clone().oneshot(request()));
    entered.notified().await;
    let retries = [tokio::spawn(service.clone().oneshot(request())), tokio::spawn(service.clone().oneshot(request()))];
    // Both retries attached (each woke at least once) before the first one fails.
    while h.counter(WAKEUPS, &[]) < 2.0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    finish.notify_one();
    assert_eq!(first.await.expect("join").expect("infallible").status(), StatusCode::INTERNAL_SERVER_ERROR);
    let mut replayed = 0;
    for retry in retries {
        let response = retry.await.expect("join").expect("infallible");
        assert_eq!(response.status(), StatusCode::CREATED);
        replayed += usize::from(response.headers().contains_key("idempotent-replayed"));
        assert_eq!(response.into_body().collect().await.expect("body").to_bytes().as_ref(), b"charged");
    }
    assert_eq!((runs.load(std::sync::atomic::Ordering::SeqCst), replayed), (2, 1), "one retry ran, one replayed");
}

/// `Prefer: wait=N` (RFC 7240) within the route's bound: `wait=0` answers 409 at once on a route that
/// waits 30 s, and a wait longer than a route's 300 ms bound is capped there (409 after the bound, not
/// after the client's 30 s). Both paths.
async fn a_client_shortens_the_wait_never_lengthens_it(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Any).await;
    // The first request holds the key: its handler waits until the test ends.
    let (entered, never) = (std::sync::Arc::new(Notify::new()), std::sync::Arc::new(Notify::new()));
    let handler = tower::service_fn(move |_: Request<RequestBody<Full<Bytes>>>| {
        let (entered, never) = (entered.clone(), never.clone());
        async move {
            entered.notify_one();
            never.notified().await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ran"))))
        }
    });
    let tenant = |_: &http::request::Parts| Some("acme".to_owned());
    let request = |preferred: &str| {
        Request::post("/charges")
            .header("idempotency-key", "held")
            .header("prefer", preferred)
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    let layer = || IdempotencyLayer::new(h.store.clone(), tenant).with_operation(h.operation.clone());
    let mut first = tokio::spawn(layer().layer(handler.clone()).oneshot(request("")));
    while h.store.admin().lookup(&h.scope("acme"), &key("held")).await.expect("lookup").is_none() {
        assert!(!first.is_finished(), "the first request ended: {:?}", (&mut first).await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for transactional in [false, true] {
        for (bound, preferred, at_least) in [(30_000, "wait=0", 0), (300, "wait=30", 300)] {
            let layer = layer().with_wait_in_flight(Duration::from_millis(bound));
            let service = if transactional { layer.with_claim_transaction() } else { layer }.layer(handler.clone());
            let started = Instant::now();
            let response = service.oneshot(request(preferred)).await.expect("infallible");
            let (took, case) =
                (started.elapsed(), format!("{preferred} on a {bound} ms route, transactional {transactional}"));
            assert_eq!(response.status(), StatusCode::CONFLICT, "{case}");
            assert!(took >= Duration::from_millis(at_least) && took < Duration::from_secs(10), "{case}: {took:?}");
        }
    }
    first.abort();
}

/// Two-tier, with the owner's marker lost from Redis: the waiter is told "in flight" by Postgres, so it
/// asks Postgres to announce the settlement, and the owner's completion reaches it by `NOTIFY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_follows_postgres_when_redis_lost_the_marker() {
    let h = Harness::with(Mode::TwoTier, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("marker-lost"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint()).await.expect("claim") else { panic!() };
    let _: () = h.redis_connection().await.del(h.redis_key(&scope, &k)).await.expect("drop the marker");
    let waiter = wait_on(&h.new_store(long_lease()), &scope, &k, Duration::from_secs(30));
    h.wait_until_flagged(&scope, &k, false).await;
    owner.complete(b"the result").await.expect("complete");
    let Begin::Replayed(stored) = waiter.await.expect("join") else { panic!("the waiter replays") };
    assert_eq!(stored.as_bytes(), b"the result");
    assert_eq!(h.counter(WAKEUPS, &[("by", "notification")]), 1.0);
    assert_eq!(h.counter(WAKEUPS, &[("by", "timer")]), 0.0);
}

/// Two-tier, the owner's marker lost, two waiters: each one's stand-in marker (written while Postgres
/// decides, then taken back) must not wake the other (before: taking it back published the other's
/// digest, both asked again, wrote new markers, and woke each other in a loop until the owner finished).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_do_not_wake_each_other_in_turn() {
    let h = Harness::with(Mode::TwoTier, long_lease(), Servers::Any).await;
    let (scope, k) = (h.scope("acme"), key("two-waiters"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint()).await.expect("claim") else { panic!() };
    let _: () = h.redis_connection().await.del(h.redis_key(&scope, &k)).await.expect("drop the marker");
    let waiters = h.new_store(long_lease());
    let first = wait_on(&waiters, &scope, &k, Duration::from_secs(30));
    let second = wait_on(&waiters, &scope, &k, Duration::from_secs(30));
    h.wait_until_flagged(&scope, &k, false).await;
    // What the waiters do while the owner works: a loop shows as hundreds of wake-ups in this window.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let woken = h.counter(WAKEUPS, &[]);
    assert!(woken <= 2.0, "{woken} wake-ups while the owner worked");
    owner.complete(b"the result").await.expect("complete");
    for waiter in [first, second] {
        assert!(matches!(waiter.await.expect("join"), Begin::Replayed(_)));
    }
}

/// `Store::shutdown` stops the tasks a store runs for its life and returns: the subscription a waiter
/// opened, and (two-tier) the repair of the Redis copy that a completion could not update, which retries
/// as long as Redis stays unreachable. The store still answers afterwards.
async fn shutdown_stops_the_followers_though_redis_is_down(mode: Mode) {
    let h = Harness::with(mode, long_lease(), Servers::Proxied).await;
    let (scope, k) = (h.scope("acme"), key("followed"));
    let Begin::Acquired(owner) = h.store.begin(&scope, &k, &fingerprint()).await.expect("claim") else { panic!() };
    let waiter = wait_on(&h.store, &scope, &k, Duration::from_secs(30));
    // The waiter's subscription, on Redis or (if Redis did not open it within its budget) Postgres.
    subscribed(&h, |(redis, postgres)| redis + postgres > 0).await;
    if let Some(proxy) = &h.redis_proxy {
        proxy.set(idemstore_testkit::ProxyMode::Blackhole);
    }
    owner.complete(b"the result").await.expect("Postgres completes");
    let Begin::Replayed(_) = waiter.await.expect("join") else { panic!("the waiter replays") };
    tokio::time::timeout(Duration::from_secs(10), h.store.shutdown()).await.expect("the shutdown ends");
    if let Some(proxy) = &h.redis_proxy {
        proxy.set(idemstore_testkit::ProxyMode::Pass);
    }
    subscribed(&h, |(redis, postgres)| redis + postgres == 0).await;
    let again = h.store.begin(&scope, &k, &fingerprint()).await.expect("an answer after the shutdown");
    assert!(matches!(again, Begin::Replayed(ref stored) if stored.as_bytes() == b"the result"), "{again:?}");
}

/// Waits (at most 10 s) until the store's wake-up subscriptions, counted on the servers (Redis
/// subscribers of its channel, Postgres sessions that ran `LISTEN`), satisfy `until`.
async fn subscribed(h: &Harness, until: impl Fn((i64, i64)) -> bool) {
    let started = Instant::now();
    loop {
        let redis = if h.mode == Mode::TwoTier {
            let channel = format!("{}:settled", h.prefix);
            let counts: Vec<(String, i64)> = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(&channel)
                .query_async(&mut h.redis_connection().await)
                .await
                .expect("PUBSUB NUMSUB");
            counts.iter().map(|(_, n)| n).sum()
        } else {
            0
        };
        let postgres: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
        )
        .fetch_one(&h.pool)
        .await
        .expect("count the listeners");
        if until((redis, postgres)) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "subscriptions: Redis {redis}, Postgres {postgres}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
