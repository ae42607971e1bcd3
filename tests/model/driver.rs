//! The real side of the model test: the servers of one test, and each case run on them. Every step goes
//! to the store, its answer to its key's reference model, and after every step what Postgres holds for
//! each key is compared with the key's model.
//!
//! Stores that seal and stores without the key share the database, as they do while encryption is
//! turned on or off or a second service lacks the key; a run's work writes an effect row, counted after
//! the run.
//!
//! Time moves only in steps, in the servers' data (the harness's `pass_lease`, `pass_retention` and
//! `pass_tombstone_horizon`): server time stays the only clock and no case waits for a lease. The stores'
//! leases and retentions are long enough that nothing runs out by itself during a case.
//!
//! The stores reach Postgres through a proxy that the Postgres faults stall or cut; the checker's own
//! looks (what Postgres holds, the effect rows) go around it. A call that fails closed may still land
//! once the stall heals: before looking, the case waits until Postgres has nothing of the stores' in
//! progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use idemstore::admin::Resolution;
use idemstore::http::{ClaimTx, IdempotencyLayer, KeySpace, problem_types};
use idemstore::{
    Begin, Encryption, EncryptionError, Fingerprint, FingerprintOptions, IdempotencyKey, LeaseExpiry, Mode, Owner,
    Policy, Quota, Record, RunError, RunOptions, RunOutcome, Scope, State, Store, StoreError, TxFuture,
};
use idemstore_testkit::ProxyMode;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Value, json};
use sqlx::PgConnection;
use tower::ServiceExt;

use super::history::{Effect, History, Span};
use super::reference::{
    Answer, Call, Model, Outcome, Payload, Pending, Rule, Sealing, Seen, SeenRecord, Settle, Stage, Write,
};
use super::steps::{CLIENTS, KEYS, Path, Script, Step, Work};
use crate::support::{self, Harness, Servers};

const LEASE: Duration = Duration::from_secs(60);
const REDIS_TTL: Duration = Duration::from_secs(600);
const RETENTION: Duration = Duration::from_secs(3600);
/// A paused Redis costs a call this much before it degrades to Postgres, and is then skipped for the
/// cool-down: short, so that pauses keep cases fast.
const REDIS_BUDGET: Duration = Duration::from_millis(100);
const REDIS_COOLDOWN: Duration = Duration::from_millis(20);
/// Longer than the budget, so that the calls of the step during the pause degrade.
const REDIS_PAUSE_MS: u64 = 250;
/// After a pause ends, the commands Redis queued meanwhile run and the stores' cool-down ends; the next
/// step waits for both.
const AFTER_PAUSE: Duration = Duration::from_millis(50);
/// How long the stores wait for Postgres, and how long a stall holds their connections: longer, so that
/// the calls of the step during a stall fail closed (or, for a settlement, are asked again).
const POSTGRES_TIMEOUT: Duration = Duration::from_millis(300);
const POSTGRES_STALL: Duration = Duration::from_millis(500);
/// How long a begin waits for an in-flight owner: the owner settles at once, and a waiter that missed
/// its wake-up asks again within a second.
const WAIT: Duration = Duration::from_millis(1500);
/// How long a begin waits when no client of the case is there to settle the key.
const WAIT_FOR_NOBODY: Duration = Duration::from_millis(200);
/// The checker's own looks are never the ones to fail on a loaded machine.
const LOOKER_TIMEOUT: Duration = Duration::from_secs(10);

/// Purges and recoveries meet only the current case's keys (each case removes its records at its end).
const BATCH: u32 = 100;

/// The operation of the cases under a quota: at most one live key per tenant.
const QUOTA_OPERATION: &str = "model-quota";

/// What `run_once` stores for a work whose result did not serialize (its private marker, read back
/// through `inspect` and `begin`).
const NOT_REPLAYABLE: &str = "\0idemstore:not-replayable";

/// One row per run of a work, written by the work: plainly, or in the claim's transaction.
const EFFECTS: &str = "CREATE TABLE IF NOT EXISTS model_effects (tenant text NOT NULL, step int NOT NULL)";
const ADD_EFFECT: &str = "INSERT INTO model_effects (tenant, step) VALUES ($1, $2)";
const COUNT_EFFECTS: &str = "SELECT count(*) FROM model_effects WHERE tenant = $1";
const FORGET_EFFECTS: &str = "DELETE FROM model_effects WHERE tenant = $1";
const FORGET_RECORDS: &str = "DELETE FROM idempotency_records WHERE tenant = $1";
/// The key's record as stored, for the comparison with Redis's copy.
const STORED: &str = "SELECT state, fingerprint, owner, response, lease_expires_at > now() AS live
    FROM idempotency_records WHERE digest = idempotency_key_digest($1, $2, $3) AND tenant = $1";
/// The type of Redis's copy of a key and its fields (a completed string; a marker's state, fingerprint
/// and owner), read at once.
const READ_COPY: &str = "local kind = redis.call('TYPE', KEYS[1]).ok
    if kind == 'string' then return {kind, {redis.call('GET', KEYS[1])}} end
    if kind == 'hash' then return {kind, redis.call('HMGET', KEYS[1], 's', 'h', 't')} end
    return {kind, {}}";
const FALLBACKS: &str = "idemstore_redis_fallbacks_total";
/// For how many steps after a Redis fallback a store may still delete the key's copy.
const FALLBACK_WINDOW: usize = 3;
/// The name the stores' connections give the server.
const STORES_APPLICATION: &str = "model-stores";
/// Of the stores' connections on the server: those that listen for settlements (`wait_in_flight`
/// through Postgres, idle between notifications), and those busy with a statement or a transaction.
const LISTENING_AND_BUSY: &str = "SELECT count(*) FILTER (WHERE state = 'idle' AND query LIKE 'LISTEN %'),
        count(*) FILTER (WHERE state <> 'idle')
    FROM pg_stat_activity WHERE application_name = 'model-stores'";
const FORGET_TOMBSTONE: &str = "DELETE FROM idempotency_tombstones WHERE digest = idempotency_key_digest($1, $2, $3)";

/// What a campaign ran: cases, steps, faults among them, calls that failed closed, and those of them
/// that landed after their caller gave up.
#[derive(Debug)]
pub struct Counts {
    pub cases: u64,
    pub steps: u64,
    pub faults: u64,
    pub failed_closed: u64,
    pub landed_late: u64,
    pub requests: u64,
    pub handled: u64,
    pub refused_by_quota: u64,
    pub woken: u64,
}

/// The servers of one test and the stores on them. Cases run one after another, each under a tenant of
/// its own, so that they are independent and a shrunk case replays cleanly.
pub struct World {
    harness: Harness,
    /// One store per lease rule (as two services with different policies for the same operation have)
    /// and per sealing: `stores[rule][sealing]`. They reach Postgres through the harness's proxy.
    stores: [[Store; 2]; 2],
    /// The checker's stores (sealing, and without the key), straight to Postgres and without Redis: they
    /// look, whatever the faults.
    lookers: [Store; 2],
    fingerprints: [(Payload, Fingerprint); 2],
    /// The HTTP layer in front of each store, plain and with the handler's writes in the claim's
    /// transaction: `routers[rule][sealing][path]`.
    routers: [[[Router; 2]; 2]; 2],
    /// The fingerprints the layer gives the payloads' requests (its own: the request's method, target
    /// and body), learnt from a request of each at the start.
    layer_fingerprints: Vec<(Payload, Vec<u8>)>,
    /// Cases run so far, shrinking included: the next case's tenant.
    cases: AtomicU64,
    /// Steps run so far, how many of them were faults, how many calls failed closed and how many of
    /// those landed all the same, for the campaign's report: faults that never hit a call prove little.
    steps: AtomicU64,
    faults: AtomicU64,
    failed_closed: AtomicU64,
    landed_late: AtomicU64,
    /// Requests through the HTTP layer, and those of them the handler answered (it ran).
    requests: AtomicU64,
    handled: AtomicU64,
    /// Claims the live-key quota refused, and waiting begins answered after the owner's settlement.
    refused_by_quota: AtomicU64,
    woken: AtomicU64,
    /// The checker's connection for reading Redis's copies, made again after a restart.
    redis_reader: tokio::sync::Mutex<Option<redis::aio::MultiplexedConnection>>,
}

impl World {
    /// Starts servers this test owns (it flushes, pauses and restarts Redis, and stalls and cuts the
    /// stores' connections to Postgres).
    pub async fn start(mode: Mode) -> Self {
        let harness = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Proxied).await;
        // The stores without the key write in clear on purpose.
        harness.clear_allowed.store(true, Ordering::Relaxed);
        sqlx::query(EFFECTS).execute(&harness.pool).await.expect("create the effect table");
        let fingerprints = [Payload::A, Payload::B].map(|payload| {
            let body = body(payload);
            (payload, Fingerprint::of_serialize(&body, &FingerprintOptions::default()).expect("fingerprint"))
        });
        // Named, so that the quiescence check can tell their connections on the server.
        let separator = if harness.store_url.contains('?') { '&' } else { '?' };
        let stores_url = format!("{}{separator}application_name={STORES_APPLICATION}", harness.store_url);
        let stores = [LeaseExpiry::TakeOver, LeaseExpiry::MarkIndeterminate].map(|expiry| {
            [Sealing::Sealed, Sealing::Clear]
                .map(|sealing| store(&harness, &stores_url, POSTGRES_TIMEOUT, expiry, sealing))
        });
        // Without Redis: a look at Postgres never waits for a paused Redis (the step after a pause runs
        // during it).
        let lookers = [Sealing::Sealed, Sealing::Clear].map(|sealing| {
            store_with(&harness, &harness.database_url, LOOKER_TIMEOUT, LeaseExpiry::TakeOver, sealing, false)
        });
        let routers = stores.each_ref().map(|by_sealing| {
            by_sealing.each_ref().map(|store| [Path::Plain, Path::InTx].map(|path| router(&harness, store, path)))
        });
        let mut world = Self {
            stores,
            lookers,
            harness,
            fingerprints,
            routers,
            layer_fingerprints: Vec::new(),
            cases: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            failed_closed: AtomicU64::new(0),
            landed_late: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            handled: AtomicU64::new(0),
            refused_by_quota: AtomicU64::new(0),
            woken: AtomicU64::new(0),
            redis_reader: tokio::sync::Mutex::default(),
        };
        world.layer_fingerprints = world.learn_layer_fingerprints().await;
        world
    }

    /// A request of each payload through the layer, under a tenant of its own, and the fingerprint its
    /// record holds; the records and effect rows are removed.
    async fn learn_layer_fingerprints(&self) -> Vec<(Payload, Vec<u8>)> {
        const TENANT: &str = "layer-fingerprints";
        let scope = self.harness.scope(TENANT);
        let mut learnt = Vec::new();
        for payload in [Payload::A, Payload::B] {
            let key = support::key(&format!("{payload:?}"));
            let request = http_request(TENANT, &key, payload, 0, Work::Replayable, "learn");
            let router = self.routers[Rule::TakeOver as usize][Sealing::Sealed as usize][Path::Plain as usize].clone();
            let response = router.oneshot(request).await.expect("infallible");
            assert_eq!(response.status(), StatusCode::CREATED, "a first request executes");
            let inspection = self.lookers[Sealing::Sealed as usize].admin().inspect(&scope, &key).await;
            let record = inspection.expect("inspect").postgres.expect("the request's record");
            learnt.push((payload, record.fingerprint));
        }
        for forget in [FORGET_RECORDS, FORGET_EFFECTS] {
            sqlx::query(forget).bind(TENANT).execute(&self.harness.pool).await.expect("forget the requests");
        }
        learnt
    }

    fn router(&self, rule: Rule, sealing: Sealing, path: Path) -> Router {
        self.routers[rule as usize][sealing as usize][path as usize].clone()
    }

    /// What ran so far.
    pub fn counts(&self) -> Counts {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Counts {
            cases: load(&self.cases),
            steps: load(&self.steps),
            faults: load(&self.faults),
            failed_closed: load(&self.failed_closed),
            landed_late: load(&self.landed_late),
            requests: load(&self.requests),
            handled: load(&self.handled),
            refused_by_quota: load(&self.refused_by_quota),
            woken: load(&self.woken),
        }
    }

    /// The stores' Redis fallbacks so far, under both operations of the cases.
    fn fallbacks(&self) -> f64 {
        let h = &self.harness;
        h.counter(FALLBACKS, &[]) + support::counter(QUOTA_OPERATION, FALLBACKS, &[])
    }

    pub fn mode(&self) -> Mode {
        self.harness.mode
    }

    /// Runs one case; `Err` says what the store did that the model does not allow, with the history.
    pub async fn run_case(&self, script: &Script) -> Result<(), String> {
        let steps = &script.steps;
        self.faults.fetch_add(steps.iter().filter(|(_, step)| step.is_fault()).count() as u64, Ordering::Relaxed);
        self.steps.fetch_add(steps.len() as u64, Ordering::Relaxed);
        let mut case = Case::new(self, self.cases.fetch_add(1, Ordering::Relaxed), script.quota);
        case.through_http = steps.iter().any(|(_, step)| matches!(step, Step::Http { .. }));
        let verdict = case.run(steps).await;
        let settled = case.settle().await;
        case.forget().await;
        verdict.and(settled)
    }

    fn store(&self, rule: Rule, sealing: Sealing) -> &Store {
        &self.stores[rule as usize][sealing as usize]
    }

    /// The store that purges, recovers and looks.
    fn operator(&self) -> &Store {
        self.store(Rule::TakeOver, Sealing::Sealed)
    }

    fn fingerprint(&self, payload: Payload) -> &Fingerprint {
        let (_, fingerprint) = self.fingerprints.iter().find(|(p, _)| *p == payload).expect("both payloads");
        fingerprint
    }

    /// The payload of a stored fingerprint, the store's or the layer's (a tombstone keeps a prefix of it).
    fn payload_of(&self, stored: &[u8]) -> Option<Payload> {
        let stores = self.fingerprints.iter().map(|(payload, f)| (*payload, &f.as_bytes()[..]));
        let layers = self.layer_fingerprints.iter().map(|(payload, f)| (*payload, &f[..]));
        let mut known = stores.chain(layers);
        known.find(|(_, f)| !stored.is_empty() && f.starts_with(stored)).map(|(payload, _)| payload)
    }

    /// What Postgres holds for the key, its response opened by whichever store can open it.
    async fn inspect(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Seen, String> {
        let mut sealing = Sealing::Sealed;
        let mut found = self.lookers[Sealing::Sealed as usize].admin().inspect(scope, key).await;
        if matches!(&found, Ok(inspection) if matches!(inspection.unreadable, Some(EncryptionError::Unsealed))) {
            sealing = Sealing::Clear;
            found = self.lookers[Sealing::Clear as usize].admin().inspect(scope, key).await;
        }
        let inspection = found.map_err(|error| format!("inspect failed: {error:?}"))?;
        if let Some(error) = inspection.unreadable {
            return Err(format!("the stored response opens in no store: {error:?}"));
        }
        match inspection.postgres {
            Some(record) => self.seen(record, sealing),
            None => Ok(Seen::Nothing),
        }
    }

    fn seen(&self, record: Record, sealing: Sealing) -> Result<Seen, String> {
        let payload = self.payload_of(&record.fingerprint);
        let stage = match record.state {
            State::Expired => return Ok(Seen::Tombstone { payload, fence: record.fence }),
            State::InProgress => Stage::InProgress,
            State::Completed => Stage::Completed,
            State::Released => Stage::Released,
            State::Indeterminate => Stage::Indeterminate,
            other => return Err(format!("Postgres holds a state the model does not know: {other:?}")),
        };
        Ok(Seen::Record(SeenRecord {
            stage,
            payload,
            fence: record.fence,
            rule: record.lease_expiry.map(rule_of),
            lease_live: record.lease_remaining.is_some_and(|left| !left.is_zero()),
            retention_passed: record.expires_in == Some(Duration::ZERO),
            sealing: record.response.is_some().then_some(sealing),
            response: record.response.map(|response| text(response.as_bytes())),
        }))
    }
}

fn policy(expiry: LeaseExpiry) -> Policy {
    policy_builder(expiry).build().expect("a valid policy")
}

fn policy_builder(expiry: LeaseExpiry) -> idemstore::PolicyBuilder {
    Policy::builder().lease(LEASE).redis_ttl(REDIS_TTL).retention(Some(RETENTION)).lease_expiry(expiry)
}

/// The body a payload stands for.
fn body(payload: Payload) -> Value {
    json!({ "payload": format!("{payload:?}") })
}

/// A store on the harness's Redis prefix and on Postgres at `database_url`, with a short Redis budget and
/// cool-down and `postgres_timeout`, that seals with the model's own key or writes in clear.
fn store(h: &Harness, database_url: &str, postgres_timeout: Duration, expiry: LeaseExpiry, sealing: Sealing) -> Store {
    store_with(h, database_url, postgres_timeout, expiry, sealing, true)
}

/// [`store`], with Redis or without.
fn store_with(
    h: &Harness,
    database_url: &str,
    postgres_timeout: Duration,
    expiry: LeaseExpiry,
    sealing: Sealing,
    redis: bool,
) -> Store {
    let mut builder = Store::builder()
        .database_url(database_url)
        .key_prefix(&h.prefix)
        .redis_budget(REDIS_BUDGET)
        .redis_cooldown(REDIS_COOLDOWN)
        .postgres_timeout(postgres_timeout)
        .policy(&h.operation, policy(expiry))
        .policy(
            QUOTA_OPERATION,
            policy_builder(expiry).quota(Quota::default().live_keys(1)).build().expect("a policy"),
        );
    if let Some(url) = h.redis_url.as_ref().filter(|_| redis) {
        builder = builder.redis_url(url);
    }
    builder = match sealing {
        Sealing::Sealed => builder.encryption(Encryption::new([[7; 32]]).expect("a valid key")),
        Sealing::Clear => builder.clear_responses_allowed(),
    };
    builder.build().expect("build a store")
}

/// A response as the model's owners store it: JSON text, as `run_once` stores its results, so that a
/// run can replay any completion.
fn response(text: String) -> String {
    serde_json::to_string(&text).expect("a string serializes")
}

/// The text a replayable work of `client` at step `index` returns: every run's differs.
fn reply_text(call: Call, client: usize, index: usize) -> String {
    format!("{:?}:c{client}:s{index}", call.payload)
}

/// The headers by which a request tells the model's handler what to do.
const TENANT_HEADER: &str = "x-model-tenant";
const STEP_HEADER: &str = "x-model-step";
const WORK_HEADER: &str = "x-model-work";
const RUN_HEADER: &str = "x-model-run";

/// The HTTP layer in front of `store`, on one operation-wide key space (every request of a case names
/// the case's record), and the model's handler behind it.
fn router(h: &Harness, store: &Store, path: Path) -> Router {
    let tenant = |parts: &axum::http::request::Parts| {
        parts.headers.get(TENANT_HEADER).and_then(|value| value.to_str().ok()).map(str::to_owned)
    };
    let layer = IdempotencyLayer::new(store.clone(), tenant as fn(&axum::http::request::Parts) -> Option<String>)
        .with_operation(h.operation.clone())
        .with_key_space(KeySpace::Operation);
    match path {
        Path::Plain => Router::new().route("/run", post(plain_handler).route_layer(layer)).with_state(h.pool.clone()),
        Path::InTx => {
            Router::new().route("/run", post(transactional_handler).route_layer(layer.with_claim_transaction()))
        }
    }
}

/// A request of `payload` to the model's handler, which writes its effect row under `tenant` and `step`
/// and answers as `work` says, naming the run `run`.
fn http_request(
    tenant: &str,
    key: &IdempotencyKey,
    payload: Payload,
    step: usize,
    work: Work,
    run: &str,
) -> Request<Body> {
    let work = match work {
        Work::Replayable => "created",
        Work::Unencodable => "refused",
        Work::Fails => "failed",
    };
    Request::post("/run")
        .header("content-type", "application/json")
        .header("idempotency-key", key.as_str())
        .header(TENANT_HEADER, tenant)
        .header(STEP_HEADER, step.to_string())
        .header(WORK_HEADER, work)
        .header(RUN_HEADER, run)
        .body(Body::from(body(payload).to_string()))
        .expect("a request")
}

/// The model's handler behind the plain layer: its effect row on a connection of its own (straight to
/// Postgres: the work's effect is not the store's), then its answer.
async fn plain_handler(AxumState(pool): AxumState<sqlx::PgPool>, headers: HeaderMap) -> axum::response::Response {
    let mut conn = pool.acquire().await.expect("a connection for the handler");
    handle(&mut conn, &headers).await
}

/// The model's handler behind the transactional layer: its effect row in the claim's transaction.
async fn transactional_handler(mut tx: ClaimTx, headers: HeaderMap) -> axum::response::Response {
    handle(&mut tx, &headers).await
}

async fn handle(conn: &mut PgConnection, headers: &HeaderMap) -> axum::response::Response {
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok()).unwrap_or_default().to_owned();
    let step: i32 = header(STEP_HEADER).parse().expect("a step");
    sqlx::query(ADD_EFFECT).bind(header(TENANT_HEADER)).bind(step).execute(conn).await.expect("write the effect row");
    let run = header(RUN_HEADER);
    match header(WORK_HEADER).as_str() {
        "created" => (StatusCode::CREATED, axum::Json(json!({ "run": run }))).into_response(),
        "refused" => (StatusCode::BAD_REQUEST, axum::Json(json!({ "refused": run }))).into_response(),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, run).into_response(),
    }
}

/// What the layer answered, as the model reads it: the handler's answer (it ran), a replay, or a refusal.
fn heard(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Result<Ran, String> {
    if headers.contains_key("idempotent-replayed") {
        // Whole, and with the status it was stored with: every body of the model's names its status.
        let replayed: Value = serde_json::from_slice(body).map_err(|error| format!("a replay's body: {error}"))?;
        let stored_as = match () {
            () if replayed.get("refused").is_some() => StatusCode::BAD_REQUEST,
            () if replayed.get("run").is_some() || replayed.get("resolved").is_some() => StatusCode::CREATED,
            () => return Err(format!("a replay of a body the model never stored: {replayed}")),
        };
        if status != stored_as {
            return Err(format!("a replay of {replayed} answered {status}, but it was stored with {stored_as}"));
        }
        return Ok(Ran::Answered(Answer::ReplayedBody(text(body))));
    }
    let problem = headers
        .get("content-type")
        .is_some_and(|kind| kind.as_bytes().starts_with(b"application/problem+json"))
        .then(|| serde_json::from_slice::<Value>(body).ok())
        .flatten()
        .and_then(|problem| problem["type"].as_str().map(str::to_owned));
    let answer = match problem.as_deref() {
        None => {
            return match status {
                StatusCode::CREATED | StatusCode::BAD_REQUEST => Ok(Ran::Completed(text(body))),
                StatusCode::INTERNAL_SERVER_ERROR => Ok(Ran::Failed),
                other => Err(format!("the layer answered {other} {:?}, which the model does not know", text(body))),
            };
        }
        Some(problem_types::IN_FLIGHT) => Answer::InFlight,
        Some(problem_types::INDETERMINATE) => Answer::Indeterminate,
        Some(problem_types::KEY_REUSED) => Answer::Mismatch,
        Some(problem_types::EXPIRED) => Answer::Expired,
        Some(problem_types::UNREADABLE) => Answer::Unreadable,
        Some(problem_types::UNAVAILABLE) => return Ok(Ran::Unavailable),
        Some(other) => return Err(format!("the layer answered {status} {other}, which the model does not expect")),
    };
    Ok(Ran::Answered(answer))
}

/// A work's result: text, or one that refuses to serialize (as a map with non-string keys does).
#[derive(Debug)]
enum Reply {
    Text(String),
    Unencodable,
}

impl Serialize for Reply {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Reply::Text(text) => serializer.serialize_str(text),
            Reply::Unencodable => Err(serde::ser::Error::custom("this result does not serialize")),
        }
    }
}

impl<'de> Deserialize<'de> for Reply {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Reply::Text)
    }
}

/// A work: its effect row on `conn` (the claim's transaction, or a connection of its own), then its
/// result.
fn work_effect(
    conn: &mut PgConnection,
    tenant: String,
    step: i32,
    result: Result<Reply, String>,
) -> TxFuture<'_, Reply, String> {
    Box::pin(async move {
        sqlx::query(ADD_EFFECT).bind(tenant).bind(step).execute(conn).await.expect("write the effect row");
        result
    })
}

/// Whether `error` is the typed refusal of a store that cannot open a stored response: ciphertext for a
/// store without the key, clear bytes for one that seals.
fn cannot_open(sealing: Sealing, error: &StoreError) -> bool {
    matches!(
        (sealing, error),
        (Sealing::Clear, StoreError::Encryption(EncryptionError::UnknownKey { .. }))
            | (Sealing::Sealed, StoreError::Encryption(EncryptionError::Unsealed))
    )
}

/// Ends a Postgres stall at `until` (none: nothing to end). The fault's length, not a synchronization.
async fn heal(world: &World, until: Option<Instant>) {
    if let Some(until) = until {
        tokio::time::sleep_until(until.into()).await;
        world.harness.postgres_proxy.as_ref().expect("a proxied harness").set(ProxyMode::Pass);
    }
}

/// A store that failed closed: Postgres did not answer in time, or the connection broke.
fn unavailable(error: &StoreError) -> bool {
    matches!(error, StoreError::StoreUnavailable { .. })
}

fn rule_of(expiry: LeaseExpiry) -> Rule {
    if expiry == LeaseExpiry::MarkIndeterminate { Rule::MarkIndeterminate } else { Rule::TakeOver }
}

/// Responses are UTF-8 by construction; text makes histories readable.
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A begin that returned, and what it returned.
struct Begun {
    client: usize,
    call: Call,
    span: Span,
    read: Result<(Answer, Option<Owner>), String>,
}

fn read(begun: Result<Begin, StoreError>, sealing: Sealing) -> Result<(Answer, Option<Owner>), String> {
    let answer = match begun {
        Ok(Begin::Acquired(owner)) => return Ok((Answer::Acquired { fence: owner.fence() }, Some(owner))),
        Ok(Begin::InFlight { .. }) => Answer::InFlight,
        Ok(Begin::Replayed(response)) => Answer::Completed(text(response.as_bytes())),
        Ok(Begin::Mismatch) => Answer::Mismatch,
        Ok(Begin::Indeterminate) => Answer::Indeterminate,
        Ok(Begin::Expired) => Answer::Expired,
        Ok(Begin::QuotaExceeded { .. }) => Answer::QuotaExceeded,
        Ok(other) => return Err(format!("an answer the model does not know: {other:?}")),
        Err(error) if cannot_open(sealing, &error) => Answer::Unreadable,
        Err(error) if unavailable(&error) => Answer::Unavailable,
        Err(error) => return Err(format!("begin failed with an error that is not a refusal: {error:?}")),
    };
    Ok((answer, None))
}

/// What a run answered, as a begin's answer and what the run did after it.
enum Ran {
    /// The work did not run.
    Answered(Answer),
    /// The work ran and its result (or the not-replayable marker) was stored.
    Completed(String),
    /// The work failed; the key was released (plain), or nothing was written (in the transaction).
    Failed,
    /// The store failed closed: the work did not run, or (in the transaction) its commit's answer was
    /// lost; the effect rows say which.
    Unavailable,
}

fn ran(outcome: Result<RunOutcome<Reply>, RunError<String>>, sealing: Sealing) -> Result<Ran, String> {
    let answered = |answer| Ok(Ran::Answered(answer));
    match outcome {
        Ok(RunOutcome::Executed(Reply::Text(text))) => Ok(Ran::Completed(response(text))),
        Ok(RunOutcome::Replayed(Reply::Text(text))) => answered(Answer::Completed(response(text))),
        Ok(RunOutcome::NotReplayable) => answered(Answer::Completed(NOT_REPLAYABLE.to_owned())),
        Ok(RunOutcome::InFlight { .. }) => answered(Answer::InFlight),
        Ok(RunOutcome::Mismatch) => answered(Answer::Mismatch),
        Ok(RunOutcome::Indeterminate) => answered(Answer::Indeterminate),
        Ok(RunOutcome::Expired) => answered(Answer::Expired),
        Ok(RunOutcome::QuotaExceeded { .. }) => answered(Answer::QuotaExceeded),
        Err(RunError::Encode(_)) => Ok(Ran::Completed(NOT_REPLAYABLE.to_owned())),
        Err(RunError::Work(_)) => Ok(Ran::Failed),
        Err(RunError::Store(error)) if cannot_open(sealing, &error) => answered(Answer::Unreadable),
        Err(RunError::Store(error)) if unavailable(&error) => Ok(Ran::Unavailable),
        other => Err(format!("a run's answer the model does not expect: {other:?}")),
    }
}

/// What a run's work commits with it, when that commit landed although the run failed closed.
enum Committed {
    /// Nothing can have: the path answers only after the work's commit and the settlement's, which is
    /// asked again through a blip (the plain paths).
    Nothing,
    Write(Write),
    /// The HTTP layer's stored form of the handler's answer naming `run`, as Postgres holds it, written
    /// by a store that seals or not.
    AsStored {
        sealing: Sealing,
        run: String,
    },
}

/// A run that answered, as the history tells it.
struct Followed {
    index: usize,
    span: Span,
    call: Call,
    path: Path,
    call_said: String,
    said: String,
}

/// One key of a case: its model, the clients' leases of it, and what the tiers held for it.
struct Keyed {
    key: IdempotencyKey,
    model: Model,
    /// The owner each client is, with the call that acquired the key.
    leases: [Option<(Owner, Call)>; CLIENTS],
    /// What Postgres held for the key after the last step.
    last_seen: Seen,
    /// Redis was paused in this case, or a store fell back from it, and the key's copy has not agreed
    /// with Postgres since: a marker written before may be behind Postgres until a store's background
    /// task deletes it (docs/protocol.md, "Not guaranteed").
    redis_behind: bool,
}

/// One case: keys under a tenant of its own, each with its model and the clients' leases, and the
/// history.
struct Case<'w> {
    world: &'w World,
    tenant: String,
    scope: Scope,
    keys: Vec<Keyed>,
    /// The key of the current step.
    at: usize,
    history: History,
    /// Runs of a work whose effect row committed.
    effects: i64,
    /// When the current Redis pause ends.
    paused_until: Option<Instant>,
    /// When the current Postgres stall ends.
    stalled_until: Option<Instant>,
    /// A call of this step failed closed, or a fault left statements on their way: wait for Postgres to
    /// finish them before looking.
    unquiet: bool,
    /// A run of this step that failed closed, and what it stores if its work's commit landed.
    unanswered_run: Option<(Call, Committed)>,
    /// The case's requests go through the HTTP layer (a key is used through one interface).
    through_http: bool,
    /// The stores' Redis fallbacks as of the end of the last step, and the last step in which there
    /// were any.
    fallbacks_seen: f64,
    fell_back_at: Option<usize>,
}

impl<'w> Case<'w> {
    fn new(world: &'w World, number: u64, quota: bool) -> Self {
        let tenant = format!("m{number}");
        let operation = if quota { QUOTA_OPERATION } else { &world.harness.operation };
        let keys = (0..KEYS).map(|key| Keyed {
            key: support::key(&format!("k{key}")),
            model: Model::new(quota),
            leases: Default::default(),
            last_seen: Seen::Nothing,
            redis_behind: false,
        });
        Self {
            world,
            scope: Scope::new(tenant.as_str(), operation).expect("a valid scope"),
            tenant,
            keys: keys.collect(),
            at: 0,
            history: History::start(),
            effects: 0,
            paused_until: None,
            stalled_until: None,
            unquiet: false,
            unanswered_run: None,
            through_http: false,
            fallbacks_seen: world.fallbacks(),
            fell_back_at: None,
        }
    }

    async fn run(&mut self, steps: &[(usize, Step)]) -> Result<(), String> {
        for (index, &(key, step)) in steps.iter().enumerate() {
            self.turn_to(key);
            // The step after a stall runs during it, and the stall heals on time, whatever the step waits for.
            // A stall during a stall lasts until the later one ends.
            let (world, stall) = (self.world, self.stalled_until.take());
            if matches!(step, Step::PostgresStall) {
                self.step(index, step).await.map_err(|violation| self.report(index, &violation))?;
                self.stalled_until = self.stalled_until.max(stall);
                continue;
            }
            let (stepped, ()) = tokio::join!(self.step(index, step), heal(world, stall));
            stepped.map_err(|violation| self.report(index, &violation))?;
            self.settle_postgres().await.map_err(|violation| self.report(index, &violation))?;
            self.check_effects(index).await.map_err(|violation| self.report(index, &violation))?;
            // A restart empties Redis: only writes skipped or late (a pause, a call past its budget) leave a
            // marker behind.
            let fallbacks = self.world.fallbacks();
            let fell_back = fallbacks > std::mem::replace(&mut self.fallbacks_seen, fallbacks);
            if fell_back {
                self.fell_back_at = Some(index);
            }
            // Every key, named by the step or not: a step must not touch another key.
            for key in 0..KEYS {
                self.turn_to(key);
                self.keys[key].redis_behind |= fell_back || matches!(step, Step::RedisPause);
                self.compare_with_the_tiers(index).await.map_err(|violation| self.report(index, &violation))?;
            }
            // The step after a pause runs during it.
            if !matches!(step, Step::RedisPause) {
                self.settle().await.map_err(|violation| self.report(index, &violation))?;
            }
        }
        self.history.check().map_err(|violation| self.report(steps.len(), &format!("the history: {violation}")))
    }

    /// Makes `key` the current step's key; under a quota, its model learns whether another key holds the
    /// operation's one live lease.
    fn turn_to(&mut self, key: usize) {
        self.at = key;
        self.history.key = key;
        let elsewhere =
            self.keys.iter().enumerate().any(|(other, keyed)| other != key && keyed.model.holds_a_live_lease());
        self.keys[key].model.set_quota_full(elsewhere);
    }

    /// Compares what Postgres holds for the current key with its model (the calls that failed closed
    /// decided), then Redis's copy with Postgres.
    async fn compare_with_the_tiers(&mut self, index: usize) -> Result<(), String> {
        let before = self.keys[self.at].last_seen.clone();
        let seen = self.look().await?;
        let landed =
            self.keys[self.at].model.observe(&seen).map_err(|violation| format!("after the step, {violation}"))?;
        for (call, fence) in landed {
            self.world.landed_late.fetch_add(1, Ordering::Relaxed);
            self.landed(index, &before, call, fence);
        }
        self.compare_redis().await.map_err(|violation| format!("after the step, {violation}"))
    }

    async fn step(&mut self, index: usize, step: Step) -> Result<(), String> {
        let world: &'w World = self.world;
        let h = &world.harness;
        match step {
            Step::Begin { client, call } => return self.begin(index, client, call).await,
            Step::BeginTogether { first, second } => return self.begin_together(index, &[first, second]).await,
            Step::EveryoneBegins { calls } => {
                let calls: Vec<(usize, Call)> = calls.into_iter().enumerate().collect();
                return self.begin_together(index, &calls).await;
            }
            Step::Wait { client, call, complete } => return self.wait(index, client, call, complete).await,
            Step::Run { client, call, path, work } => return self.run_work(index, client, call, path, work).await,
            Step::Http { client, call, path, work } => return self.request(index, client, call, path, work).await,
            Step::Complete { client } => return self.fenced(index, client, self.completion_by(client, index)).await,
            Step::Release { client } => return self.fenced(index, client, Write::Release).await,
            Step::Extend { client } => return self.fenced(index, client, Write::Extend).await,
            Step::Purge => return self.purge(index).await,
            Step::RecoverStale => return self.recover_stale(index).await,
            Step::Resolve { completed, sealing } => return self.resolve(index, completed, sealing).await,
            Step::Drop { client } => {
                let dropped = self.abandon(client);
                self.history.note(index, format!("c{client} forgets its lease"), format!("{dropped:?}"));
            }
            Step::ExpireLease => {
                h.pass_lease(&self.scope, &self.keys[self.at].key).await;
                self.keys[self.at].model.expire_lease();
                self.history.note(index, "the lease runs out", "");
            }
            Step::PassRetention => {
                h.pass_retention(&self.scope, &self.keys[self.at].key).await;
                self.keys[self.at].model.pass_retention();
                self.history.note(index, "the retention passes", "");
            }
            Step::PassTombstoneHorizon => {
                h.pass_tombstone_horizon(&self.scope, &self.keys[self.at].key).await;
                self.keys[self.at].model.pass_horizon();
                self.history.note(index, "the tombstone's horizon passes", "");
            }
            Step::RedisFlush => self.flush_redis(index).await,
            Step::RedisRestart => self.restart_redis(index),
            Step::RedisPause => self.pause_redis(index).await,
            Step::PostgresStall => {
                self.unquiet = true;
                h.postgres_proxy.as_ref().expect("a proxied harness").set(ProxyMode::Blackhole);
                self.stalled_until = Some(Instant::now() + POSTGRES_STALL);
                self.history.note(index, format!("Postgres stalls for {} ms", POSTGRES_STALL.as_millis()), "");
            }
            Step::PostgresCut => {
                let cut = h.postgres_proxy.as_ref().expect("a proxied harness").cut();
                self.unquiet = true;
                self.history.note(index, "the stores' connections to Postgres break", format!("{cut} cut"));
            }
        }
        Ok(())
    }

    async fn begin(&mut self, index: usize, client: usize, call: Call) -> Result<(), String> {
        let begun = self.send_begin(client, call, &RunOptions::default()).await;
        self.follow_begin(index, begun)
    }

    /// Checks a begin's answer against the model, and keeps the lease it acquired.
    fn follow_begin(&mut self, index: usize, begun: Begun) -> Result<(), String> {
        let call = begun.call;
        let verdict = match &begun.read {
            Ok((answer, _)) => self.keys[self.at].model.begin(call, answer),
            Err(error) => Err(error.clone()),
        };
        self.log(index, &begun);
        verdict?;
        self.keep(begun);
        Ok(())
    }

    /// Begins sent at the same time, one per client in `calls`.
    async fn begin_together(&mut self, index: usize, calls: &[(usize, Call)]) -> Result<(), String> {
        // A begin writes a marker only when Redis has no settled copy to answer from: only then may
        // another be told "in flight" by it.
        // During a pause, Redis cannot be read without waiting for its end: the begins may meet it back.
        // A caller whose store cannot open the completed copy (sealed, or in clear) deletes it and asks
        // Postgres: the others may then meet a marker (the model checker found this one).
        // (Another payload is told "mismatch" before any opening.)
        let evicted = match &self.keys[self.at].last_seen {
            Seen::Record(SeenRecord { sealing: Some(sealing), payload, .. }) => {
                calls.iter().any(|(_, call)| call.sealing != *sealing && Some(call.payload) == *payload)
            }
            _ => false,
        };
        // A store whose Redis call failed lately deletes the key's copy later (it may lag behind Postgres):
        // in the background once Redis answers, or before its next call on the key. The same.
        let fell_back = self.fell_back_at.is_some_and(|step| index <= step + FALLBACK_WINDOW);
        let redis_in_front = self.world.mode() == Mode::TwoTier
            && (self.paused_until.is_some() || evicted || fell_back || !self.redis_holds_a_settled_copy().await);
        let options = RunOptions::default();
        let sent = calls.iter().map(|(client, call)| self.send_begin(*client, *call, &options));
        let mut begun: Vec<Option<Begun>> = futures::future::join_all(sent).await.into_iter().map(Some).collect();
        let answers: Result<Vec<(Call, &Answer)>, String> = (begun.iter().flatten())
            .map(|begun| begun.read.as_ref().map(|(answer, _)| (begun.call, answer)).map_err(Clone::clone))
            .collect();
        let verdict = answers.and_then(|answers| self.keys[self.at].model.begin_together(&answers, redis_in_front));
        let verdict = verdict.map_err(|refusal| format!("{refusal}\n  (Redis in front: {redis_in_front})"));
        // In the order the model found, which is the order the history's checks must read them in.
        let order = verdict.as_ref().map_or_else(|_| (0..begun.len()).collect(), Clone::clone);
        for position in &order {
            let begun = begun[*position].as_ref().expect("each once");
            self.log(index, begun);
        }
        verdict?;
        for position in order {
            self.keep(begun[position].take().expect("each once"));
        }
        Ok(())
    }

    async fn send_begin(&self, client: usize, call: Call, options: &RunOptions) -> Begun {
        let store = self.world.store(call.rule, call.sealing);
        let fingerprint = self.world.fingerprint(call.payload);
        let begin = store.begin_with(&self.scope, &self.keys[self.at].key, fingerprint, options);
        let (begun, span) = self.history.timed(begin).await;
        Begun { client, call, span, read: read(begun, call.sealing) }
    }

    fn log(&mut self, index: usize, begun: &Begun) {
        match begun.read {
            Ok((Answer::Unavailable, _)) => self.count_failed_closed(),
            Ok((Answer::QuotaExceeded, _)) => {
                self.world.refused_by_quota.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        let (answer, effect) = match &begun.read {
            Ok((answer, _)) => (format!("{answer:?}"), self.effect_of(answer)),
            Err(error) => (error.clone(), Effect::None),
        };
        self.history.record(index, begun.span, format!("c{} {}", begun.client, begun.call), answer, effect);
    }

    /// What a begin's answer means to the history.
    fn effect_of(&self, answer: &Answer) -> Effect {
        match answer {
            Answer::Acquired { .. } if self.keys[self.at].last_seen == Seen::Nothing => Effect::NewLife,
            Answer::Completed(response) => Effect::Replay(response.clone()),
            Answer::ReplayedBody(body) => Effect::ReplayBody(body.clone()),
            Answer::Expired => Effect::Expired,
            _ => Effect::None,
        }
    }

    /// The client forgets its owner, as a crashed process would: the lease is left to run out.
    fn abandon(&mut self, client: usize) -> Option<i64> {
        self.keys[self.at].leases[client].take().map(|(owner, _)| {
            let fence = owner.fence();
            owner.abandon();
            fence
        })
    }

    fn keep(&mut self, begun: Begun) {
        if let Ok((_, Some(owner))) = begun.read {
            self.abandon(begun.client);
            self.keys[self.at].leases[begun.client] = Some((owner, begun.call));
        }
    }

    /// A completion that names who stored it, so that every completion's bytes differ.
    fn completion_by(&self, client: usize, index: usize) -> Write {
        match &self.keys[self.at].leases[client] {
            Some((lease, call)) => {
                let text = format!("{:?}:c{client}:f{}:s{index}", call.payload, lease.fence());
                Write::Complete(response(text), call.sealing)
            }
            None => Write::Complete(String::new(), Sealing::Sealed),
        }
    }

    async fn fenced(&mut self, index: usize, client: usize, write: Write) -> Result<(), String> {
        // Completing or releasing spends the owner (a second try is not expressible); extending keeps it.
        let owner = match write {
            Write::Extend => None,
            _ => self.keys[self.at].leases[client].take().map(|(owner, _)| owner),
        };
        let held = self.keys[self.at].leases[client].as_ref().map(|(owner, _)| owner);
        let Some(fence) = owner.as_ref().or(held).map(Owner::fence) else {
            self.history.note(index, format!("c{client} {write}"), "holds no lease: nothing sent");
            return Ok(());
        };
        let (written, span) = self.history.timed(self.send_write(client, owner, &write)).await;
        let outcome = self.outcome_of(&write, written)?;
        self.record_write(index, span, client, fence, &write, outcome);
        self.keys[self.at].model.write(fence, &write, outcome)
    }

    /// An owner's write: a completion or a release spends `owner`; an extension uses the client's lease.
    async fn send_write(&self, client: usize, owner: Option<Owner>, write: &Write) -> Result<(), StoreError> {
        match (write, owner) {
            (Write::Complete(response, _), Some(owner)) => owner.complete(response.as_bytes()).await,
            (Write::Release, Some(owner)) => owner.release().await,
            _ => self.keys[self.at].leases[client].as_ref().map(|(owner, _)| owner).expect("held").extend().await,
        }
    }

    /// How a fenced write ended, as the model reads it.
    fn outcome_of(&mut self, write: &Write, written: Result<(), StoreError>) -> Result<Outcome, String> {
        match written {
            Ok(()) => Ok(Outcome::Done),
            Err(StoreError::LeaseLost { .. }) => Ok(Outcome::LeaseLost),
            Err(error) if unavailable(&error) => {
                self.count_failed_closed();
                Ok(Outcome::Unavailable)
            }
            Err(error) => Err(format!("{write} failed with an error that is not a refusal: {error:?}")),
        }
    }

    fn record_write(&mut self, index: usize, span: Span, client: usize, fence: i64, write: &Write, outcome: Outcome) {
        let effect = match (outcome, write) {
            (Outcome::Done, Write::Complete(response, _)) => Effect::Completion(response.clone()),
            _ => Effect::None,
        };
        self.history.record(index, span, format!("c{client} {write} (fence {fence})"), format!("{outcome:?}"), effect);
    }

    /// A begin that waits for the key's owner (`wait_in_flight`) while the client that owns the record
    /// Postgres holds (by its fence) settles it. Some order of the two explains both answers, and a
    /// waiter is told "in flight" only while a live lease still holds the key after the settlement.
    async fn wait(&mut self, index: usize, client: usize, call: Call, complete: bool) -> Result<(), String> {
        // The owner of the record Postgres holds, if another client is it.
        let keyed = &self.keys[self.at];
        let fence = match &keyed.last_seen {
            Seen::Record(record) => Some(record.fence),
            _ => None,
        };
        let owns = |other: usize| keyed.leases[other].as_ref().is_some_and(|(owner, _)| Some(owner.fence()) == fence);
        let Some(holder) = (0..CLIENTS).find(|&other| other != client && owns(other)) else {
            // Nobody here to settle: a begin that waits for an owner that is gone or is the waiter itself,
            // or for nothing. Briefly: nobody settles it.
            let begun = self.send_begin(client, call, &RunOptions::default().wait_in_flight(WAIT_FOR_NOBODY)).await;
            return self.follow_begin(index, begun);
        };
        let waiting = RunOptions::default().wait_in_flight(WAIT);
        let write = if complete { self.completion_by(holder, index) } else { Write::Release };
        let (owner, _) = self.keys[self.at].leases[holder].take().expect("held");
        let fence = owner.fence();
        let settle = self.history.timed(self.send_write(holder, Some(owner), &write));
        let (begun, (written, span)) = tokio::join!(self.send_begin(client, call, &waiting), settle);
        let outcome = match self.outcome_of(&write, written) {
            Ok(outcome) => outcome,
            Err(error) => {
                self.history.note(
                    index,
                    format!("c{holder} {write} (fence {fence})"),
                    "an error that is not a refusal",
                );
                self.log(index, &begun);
                return Err(error);
            }
        };
        let verdict = match &begun.read {
            Ok((answer, _)) => self.keys[self.at].model.wait_for(call, answer, fence, &write, outcome),
            Err(error) => Err(error.clone()),
        };
        // A waiter answered with the settlement's result (a replay, or the key after a release) after the
        // settlement ended, having begun before: it waited for it.
        let with_the_result = matches!(begun.read, Ok((Answer::Completed(_) | Answer::Acquired { .. }, _)));
        if verdict == Ok(true) && with_the_result && begun.span.waited_for(span) {
            self.world.woken.fetch_add(1, Ordering::Relaxed);
        }
        // In the order the model found (the settlement first when none did).
        if verdict.as_ref().is_ok_and(|settled_first| !settled_first) {
            self.log(index, &begun);
            self.record_write(index, span, holder, fence, &write, outcome);
        } else {
            self.record_write(index, span, holder, fence, &write, outcome);
            self.log(index, &begun);
        }
        verdict?;
        self.keep(begun);
        Ok(())
    }

    async fn purge(&mut self, index: usize) -> Result<(), String> {
        let (purged, span) = self
            .history
            .timed(std::future::IntoFuture::into_future(self.world.operator().admin().purge_expired(BATCH)))
            .await;
        match purged {
            Ok(purged) => {
                self.history.record(index, span, "purge", format!("{purged} purged"), Effect::None);
                self.keys.iter_mut().for_each(|keyed| keyed.model.purge());
            }
            Err(error) if unavailable(&error) => self.failed_closed(index, span, "purge", &error, Pending::Purge),
            Err(error) => return Err(format!("purge failed: {error:?}")),
        }
        Ok(())
    }

    async fn recover_stale(&mut self, index: usize) -> Result<(), String> {
        let (recovered, span) = self.history.timed(self.world.operator().admin().recover_stale(BATCH)).await;
        let call = "recover stale leases";
        match recovered {
            Ok(recovered) => {
                self.history.record(index, span, call, format!("{recovered:?}"), Effect::None);
                self.keys.iter_mut().for_each(|keyed| keyed.model.recover_stale());
            }
            Err(error) if unavailable(&error) => self.failed_closed(index, span, call, &error, Pending::RecoverStale),
            Err(error) => return Err(format!("recover_stale failed: {error:?}")),
        }
        Ok(())
    }

    async fn resolve(&mut self, index: usize, completed: bool, sealing: Sealing) -> Result<(), String> {
        let (settle, resolution) = if completed {
            // In the stored form of the interface the case uses, so that its requests can replay it.
            let bytes = if self.through_http {
                let body = json!({ "resolved": format!("s{index}") }).to_string().into_bytes();
                idemstore::http::stored_response(StatusCode::CREATED, &HeaderMap::new(), body)
            } else {
                response(format!("resolved:s{index}")).into_bytes()
            };
            (Settle::Completed(text(&bytes)), Resolution::Completed(bytes))
        } else {
            (Settle::Released, Resolution::Released)
        };
        let admin = self.world.store(Rule::TakeOver, sealing).admin();
        let resolve = admin.resolve(&self.scope, &self.keys[self.at].key, resolution);
        let (resolved, span) = self.history.timed(resolve).await;
        let call = format!("resolve {settle:?} ({sealing:?})");
        let resolved = match resolved {
            Ok(resolved) => resolved,
            Err(error) if unavailable(&error) => {
                // A completion that lands late is the record's first or a replacement: the history
                // cannot tell which before the look, so it records neither.
                self.failed_closed(index, span, call, &error, Pending::Resolve(settle, sealing));
                return Ok(());
            }
            Err(error) => return Err(format!("resolve failed: {error:?}")),
        };
        let replaced =
            matches!(&self.keys[self.at].last_seen, Seen::Record(record) if record.stage == Stage::Completed);
        let effect = match &settle {
            Settle::Completed(response) if resolved && replaced => Effect::Replacement(response.clone()),
            Settle::Completed(response) if resolved => Effect::Completion(response.clone()),
            _ => Effect::None,
        };
        self.history.record(index, span, call, resolved.to_string(), effect);
        self.keys[self.at].model.resolve(&settle, sealing, resolved)
    }

    /// A call of this step failed closed: Postgres must finish what it sent before the look.
    fn count_failed_closed(&mut self) {
        self.world.failed_closed.fetch_add(1, Ordering::Relaxed);
        self.unquiet = true;
    }

    /// Records in the history a call that failed closed and landed all the same.
    fn landed(&mut self, index: usize, before: &Seen, call: Pending, fence: Option<i64>) {
        let completed_before = matches!(before, Seen::Record(record) if record.stage == Stage::Completed);
        let new_life = fence.is_some() && *before == Seen::Nothing;
        if new_life && matches!(call, Pending::Run(..)) {
            self.history.record_now(index, "  (its claim landed)", "", Effect::NewLife);
        }
        let effect = match (&call, fence) {
            (Pending::Begin(_), Some(_)) if new_life => Effect::NewLife,
            (Pending::Run(_, Write::Complete(response, _)), _) => Effect::Completion(response.clone()),
            (Pending::Resolve(Settle::Completed(response), _), _) if completed_before => {
                Effect::Replacement(response.clone())
            }
            (Pending::Resolve(Settle::Completed(response), _), _) => Effect::Completion(response.clone()),
            _ => Effect::None,
        };
        self.history.record_now(index, format!("  (landed late: {call:?})"), format!("fence {fence:?}"), effect);
    }

    /// An operator's call that failed closed: the model decides at the next look whether it landed.
    fn failed_closed(
        &mut self,
        index: usize,
        span: Span,
        call: impl Into<String>,
        error: &StoreError,
        pending: Pending,
    ) {
        self.history.record(index, span, call, format!("{error}"), Effect::None);
        match pending {
            // They meet every key.
            Pending::Purge | Pending::RecoverStale => {
                self.keys.iter_mut().for_each(|keyed| keyed.model.failed_closed(pending.clone()));
            }
            pending => self.keys[self.at].model.failed_closed(pending),
        }
        self.count_failed_closed();
    }

    /// A run through the run-once API. The model reads it as a begin and, when the work ran, the
    /// owner's completion or release right after it; the effect rows must count the runs that
    /// committed one.
    async fn run_work(
        &mut self,
        index: usize,
        client: usize,
        call: Call,
        path: Path,
        work: Work,
    ) -> Result<(), String> {
        let store = self.world.store(call.rule, call.sealing);
        let body = body(call.payload);
        let result = match work {
            Work::Replayable => Ok(Reply::Text(reply_text(call, client, index))),
            Work::Unencodable => Ok(Reply::Unencodable),
            Work::Fails => Err("the work failed".to_owned()),
        };
        let (tenant, step) = (self.tenant.clone(), index as i32);
        let run = async {
            match path {
                Path::Plain => {
                    let pool = self.world.harness.pool.clone();
                    let work = || async move {
                        let mut conn = pool.acquire().await.expect("a connection for the work");
                        work_effect(&mut conn, tenant, step, result).await
                    };
                    store.run_once(&self.scope, &self.keys[self.at].key, &body, work).await
                }
                Path::InTx => {
                    let (scope, key) = (&self.scope, &self.keys[self.at].key);
                    store.run_once_in_tx(scope, key, &body, move |tx| work_effect(tx, tenant, step, result)).await
                }
            }
        };
        let (outcome, span) = self.history.timed(run).await;
        let said = format!("{outcome:?}");
        let ran = ran(outcome, call.sealing);
        let call_said = format!("c{client} run {:?} {work:?} ({:?}, {:?})", call.payload, call.rule, call.sealing);
        let ran = match ran {
            Ok(ran) => ran,
            Err(error) => {
                self.history.record(index, span, call_said, said, Effect::None);
                return Err(error);
            }
        };
        // What the run stores if its work's commit landed although it failed closed (the effect rows say).
        let stores = match work {
            Work::Replayable => Write::Complete(response(reply_text(call, client, index)), call.sealing),
            Work::Unencodable => Write::Complete(NOT_REPLAYABLE.to_owned(), call.sealing),
            Work::Fails => Write::Release,
        };
        let stores = if path == Path::InTx { Committed::Write(stores) } else { Committed::Nothing };
        let run = Followed { index, span, call, path, call_said, said };
        self.follow(run, ran, stores).await
    }

    /// A request through the HTTP layer. An answer of the handler's is read as a run whose settlement
    /// Postgres shows (its stored form holds the body the client got); a replay must hold the body of
    /// the key's one completion.
    async fn request(&mut self, index: usize, client: usize, call: Call, path: Path, work: Work) -> Result<(), String> {
        let run_text = reply_text(call, client, index);
        let request = http_request(&self.tenant, &self.keys[self.at].key, call.payload, index, work, &run_text);
        let router = self.world.router(call.rule, call.sealing, path);
        let sent = async {
            let (parts, body) = router.oneshot(request).await.expect("infallible").into_parts();
            (parts, body.collect().await.map(|collected| collected.to_bytes()))
        };
        let ((parts, body), span) = self.history.timed(sent).await;
        let body = body.map_err(|error| format!("the answer's body failed: {error}"))?;
        let said = format!("{} {}", parts.status, text(&body));
        let call_said =
            format!("c{client} {path:?} request {:?} {work:?} ({:?}, {:?})", call.payload, call.rule, call.sealing);
        let heard = heard(parts.status, &parts.headers, &body);
        self.world.requests.fetch_add(1, Ordering::Relaxed);
        if matches!(heard, Ok(Ran::Completed(_) | Ran::Failed)) {
            self.world.handled.fetch_add(1, Ordering::Relaxed);
        }
        let ran = match heard {
            Ok(Ran::Completed(answered)) => {
                let stored = match self.world.inspect(&self.scope, &self.keys[self.at].key).await? {
                    Seen::Record(SeenRecord { stage: Stage::Completed, response: Some(stored), .. }) => stored,
                    other => return Err(format!("the handler answered {said}, but Postgres holds {other:?}")),
                };
                if !stored.contains(&answered) {
                    return Err(format!("the client got {answered:?}, but the stored response is {stored:?}"));
                }
                Ran::Completed(stored)
            }
            Ok(ran) => ran,
            Err(error) => {
                self.history.record(index, span, call_said, said, Effect::None);
                return Err(error);
            }
        };
        let stores = match path {
            Path::InTx => Committed::AsStored { sealing: call.sealing, run: run_text },
            Path::Plain => Committed::Nothing,
        };
        let run = Followed { index, span, call, path, call_said, said };
        self.follow(run, ran, stores).await
    }

    /// Follows a run (of the run-once API or through the HTTP layer) from what it answered: the effect
    /// row its work committed, and the claim and settlement the model reads in its answer.
    async fn follow(&mut self, run: Followed, ran: Ran, stores: Committed) -> Result<(), String> {
        let Followed { index, span, call, path, call_said, said } = run;
        let committed = match (&ran, path) {
            (Ran::Answered(_) | Ran::Unavailable, _) | (Ran::Failed, Path::InTx) => 0,
            (Ran::Completed(_), _) | (Ran::Failed, Path::Plain) => 1,
        };
        self.effects += committed;
        match &ran {
            Ran::Unavailable => {
                self.history.record(index, span, call_said, said, Effect::None);
                self.unanswered_run = Some((call, stores));
                self.count_failed_closed();
                self.keys[self.at].model.failed_closed(Pending::Begin(call));
                Ok(())
            }
            // In the claim's transaction the mark commits with it, and a commit that fails (or whose answer
            // is lost) is not said: the record is marked, or still holds the lease that ran out.
            Ran::Answered(Answer::Indeterminate) if path == Path::InTx => {
                self.history.record(index, span, call_said, said, Effect::None);
                self.unquiet = true;
                self.keys[self.at].model.indeterminate_in_tx(call)
            }
            Ran::Answered(answer) => {
                if *answer == Answer::QuotaExceeded {
                    self.world.refused_by_quota.fetch_add(1, Ordering::Relaxed);
                }
                let effect = self.effect_of(answer);
                self.history.record(index, span, call_said, said, effect);
                self.keys[self.at].model.begin(call, answer)
            }
            // Rolled back: no claim was durable, nothing changed; but the work ran, so the claim must
            // have been allowed.
            Ran::Failed if path == Path::InTx => {
                self.history.record(index, span, call_said, said, Effect::None);
                self.keys[self.at].model.may_acquire(call)
            }
            Ran::Completed(_) | Ran::Failed => self.ran(index, span, call_said, said, call, &ran).await,
        }
    }

    /// Follows a run whose work ran and settled: its claim, then its completion or release, under the
    /// fence Postgres now holds.
    async fn ran(
        &mut self,
        index: usize,
        span: Span,
        call_said: String,
        said: String,
        call: Call,
        ran: &Ran,
    ) -> Result<(), String> {
        let fence = match self.world.inspect(&self.scope, &self.keys[self.at].key).await? {
            Seen::Record(record) => record.fence,
            other => return Err(format!("a run settled, but Postgres holds {other:?}")),
        };
        let acquired = Answer::Acquired { fence };
        let effect = self.effect_of(&acquired);
        self.history.record(index, span, call_said, said, effect);
        self.keys[self.at].model.begin(call, &acquired)?;
        let write = match ran {
            Ran::Completed(response) => {
                self.history.record(index, span, "  (its completion)", "Done", Effect::Completion(response.clone()));
                Write::Complete(response.clone(), call.sealing)
            }
            _ => Write::Release,
        };
        self.keys[self.at].model.write(fence, &write, Outcome::Done)
    }

    /// The effect rows must be the runs that committed one: a work that ran without the store saying so,
    /// or a rolled-back transaction that kept its row, shows here. A run that failed closed committed
    /// one only if its commit landed after its caller gave up: its claim and settlement landed with it.
    async fn check_effects(&mut self, index: usize) -> Result<(), String> {
        let rows: i64 = sqlx::query_scalar(COUNT_EFFECTS)
            .bind(&self.tenant)
            .fetch_one(&self.world.harness.pool)
            .await
            .expect("count the effect rows");
        let unanswered = self.unanswered_run.take();
        match (rows - self.effects, unanswered) {
            (0, _) => Ok(()),
            (1, Some((call, stores))) => {
                let settle = match stores {
                    Committed::Nothing => {
                        return Err(format!(
                            "{call} failed closed, but its work committed an effect: on this path the work runs \
                             only after a durable claim, and its settlement outlives a blip (invariant 10)"
                        ));
                    }
                    Committed::Write(write) => write,
                    Committed::AsStored { sealing, run } => {
                        match self.world.inspect(&self.scope, &self.keys[self.at].key).await? {
                            Seen::Record(SeenRecord { stage: Stage::Completed, response: Some(response), .. })
                                if response.contains(&format!("\"{run}\"")) =>
                            {
                                Write::Complete(response, sealing)
                            }
                            other => {
                                return Err(format!("request {run:?}'s work committed, but Postgres holds {other:?}"));
                            }
                        }
                    }
                };
                self.effects = rows;
                self.history.note(index, "  (the run's effect row committed)", "");
                self.keys[self.at].model.ran_after_all(call, settle);
                Ok(())
            }
            _ => Err(format!(
                "the works wrote {rows} effect rows, but the runs' answers say {} committed one",
                self.effects
            )),
        }
    }

    /// Ends a Postgres stall once its time is up, and waits until Postgres finished what the stores sent
    /// (a statement held by the stall, or sent by a call that gave up, lands now or never).
    async fn settle_postgres(&mut self) -> Result<(), String> {
        if let Some(until) = self.stalled_until.take() {
            heal(self.world, Some(until)).await;
        }
        if !std::mem::take(&mut self.unquiet) {
            return Ok(());
        }
        // Every connection of the stores back in its pool: sqlx returns one only once the server answered
        // what was sent on it (a ping after the statement its caller gave up on), so nothing of theirs is
        // on its way any more. A store that waited for an owner through Postgres keeps one out of its pool
        // for the store's life, listening for settlements: the server says how many listen, asked before
        // and after the pools are read (a listener that connects meanwhile is not taken for another), and
        // that none of the stores' connections is busy. Polled: the pools signal nothing.
        let deadline = Instant::now() + Duration::from_secs(20);
        let pools = || self.world.stores.iter().flatten().map(Store::pg_pool);
        let server = || async {
            let query = sqlx::query_as::<_, (i64, i64)>(LISTENING_AND_BUSY).fetch_one(&self.world.harness.pool);
            query.await.expect("read the stores' connections on the server")
        };
        loop {
            let (listening_before, _) = server().await;
            let out: Vec<usize> = pools().map(|pool| (pool.size() as usize).saturating_sub(pool.num_idle())).collect();
            let (listening_after, busy) = server().await;
            let listening = listening_before.min(listening_after) as usize;
            // At most one listener per store.
            if out.iter().all(|&out| out <= 1) && out.iter().sum::<usize>() <= listening && busy == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err("the stores' connections did not come back from Postgres in 20 s".to_owned());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn flush_redis(&mut self, index: usize) {
        if self.world.harness.redis.is_some() {
            let mut conn = self.world.harness.redis_connection().await;
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
        }
        self.history.note(index, "Redis loses every key", "");
    }

    /// A real restart: the stores' connections break and Redis forgets its scripts.
    fn restart_redis(&mut self, index: usize) {
        if let Some(redis) = &self.world.harness.redis {
            redis.restart().expect("restart Redis");
            self.paused_until = None;
        }
        self.history.note(index, "Redis restarts empty", "");
    }

    async fn pause_redis(&mut self, index: usize) {
        if self.world.harness.redis.is_some() {
            let mut conn = self.world.harness.redis_connection().await;
            let _: () = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(REDIS_PAUSE_MS)
                .arg("ALL")
                .query_async(&mut conn)
                .await
                .expect("CLIENT PAUSE");
            let until = Instant::now() + Duration::from_millis(REDIS_PAUSE_MS);
            self.paused_until = Some(self.paused_until.map_or(until, |earlier| earlier.max(until)));
        }
        self.history.note(index, format!("Redis pauses for {REDIS_PAUSE_MS} ms"), "");
    }

    /// Waits for a Redis pause to end and for what it queued to run, and for a Postgres stall to end.
    async fn settle(&mut self) -> Result<(), String> {
        if let Some(until) = self.paused_until.take() {
            tokio::time::sleep_until((until + AFTER_PAUSE).into()).await;
        }
        self.settle_postgres().await
    }

    /// What Postgres holds for the key, as it is stored (not as `lookup` presents a record past its
    /// retention).
    async fn look(&mut self) -> Result<Seen, String> {
        let seen = self.world.inspect(&self.scope, &self.keys[self.at].key).await?;
        self.keys[self.at].last_seen = seen.clone();
        Ok(seen)
    }

    /// Whether Redis holds a completed or indeterminate copy of the key, which answers a begin without a
    /// marker.
    async fn redis_holds_a_settled_copy(&self) -> bool {
        match self.redis_copy().await {
            (kind, _) if kind == "string" => true,
            (kind, fields) => kind == "hash" && fields.first().is_some_and(|state| state.as_deref() == Some(b"i")),
        }
    }

    /// Redis's copy of the key, read at once: its type and its fields (a completed string; a marker's
    /// state, fingerprint and owner).
    async fn redis_copy(&self) -> (String, Vec<Option<Vec<u8>>>) {
        let h = &self.world.harness;
        let record_key = h.redis_key(&self.scope, &self.keys[self.at].key);
        let mut reader = self.world.redis_reader.lock().await;
        // Once more on a new connection when Redis restarted under the last one.
        for _ in 0..2 {
            let conn = match reader.as_mut() {
                Some(conn) => conn,
                None => reader.insert(h.redis_connection().await),
            };
            match redis::Script::new(READ_COPY).key(&record_key).invoke_async(conn).await {
                Ok(copy) => return copy,
                Err(_) => *reader = None,
            }
        }
        panic!("Redis's copy could not be read on a new connection")
    }

    /// Compares Redis's copy of the key with what Postgres holds. A copy may always be missing (Redis
    /// forgets; the next miss repairs it). A completed copy is Postgres's completion, byte for byte (so
    /// a replay from Redis is one Postgres would give); a marker is the live owner's or the indeterminate
    /// record's, unless Redis was paused or restarted in the case (a marker then may lag until deleted).
    async fn compare_redis(&mut self) -> Result<(), String> {
        let h = &self.world.harness;
        // While Redis is paused a read would wait for the pause to end, and the next step must run
        // during it.
        if h.redis.is_none() || self.paused_until.is_some() {
            return Ok(());
        }
        let (kind, fields) = self.redis_copy().await;
        let stored = sqlx::query_as::<_, (i8, Vec<u8>, Option<String>, Option<Vec<u8>>, Option<bool>)>(STORED)
            .bind(&self.tenant)
            .bind(self.scope.operation())
            .bind(self.keys[self.at].key.as_str())
            .fetch_optional(&h.pool)
            .await
            .expect("read the record");
        let postgres = stored.as_ref().map(|(state, fingerprint, owner, response, live)| {
            (*state as u8 as char, &fingerprint[..], owner.as_deref(), response.as_deref(), live.unwrap_or(false))
        });
        match (kind.as_str(), &fields[..]) {
            ("none", _) => {
                self.keys[self.at].redis_behind = false;
                Ok(())
            }
            ("string", [Some(copy)]) => {
                let (fingerprint, response) = copy.split_at(copy.len().min(32));
                match postgres {
                    Some(('c', held, _, Some(bytes), _)) if held == fingerprint && bytes == response => {
                        self.keys[self.at].redis_behind = false;
                        Ok(())
                    }
                    _ => Err(format!(
                        "Redis holds a completed copy ({:?}), but Postgres holds {:?}: a replay from Redis must \
                         be Postgres's completion",
                        text(response),
                        postgres.map(|(state, _, _, response, _)| (state, response.map(text)))
                    )),
                }
            }
            ("hash", [state, fingerprint, owner]) => {
                let (state, owner) = (state.as_deref().map(text), owner.as_deref().map(text));
                let agrees = match (state.as_deref(), postgres) {
                    (Some("p"), Some(('p', held, live_owner, _, true))) => {
                        fingerprint.as_deref() == Some(held) && owner.as_deref() == live_owner
                    }
                    (Some("i"), Some(('i', held, _, _, _))) => fingerprint.as_deref() == Some(held),
                    _ => false,
                };
                if agrees {
                    // What lagged behind a pause has caught up (or was deleted).
                    self.keys[self.at].redis_behind = false;
                    return Ok(());
                }
                if self.keys[self.at].redis_behind {
                    return Ok(());
                }
                Err(format!(
                    "Redis holds a marker in state {state:?} (owner {owner:?}), but Postgres holds {:?}: a marker \
                     is the live owner's, or the indeterminate record's",
                    postgres.map(|(state, _, owner, _, live)| (state, owner, live))
                ))
            }
            (other, _) => Err(format!("Redis holds a {other} for the key, or a malformed copy")),
        }
    }

    /// Removes what the case left in both tiers, so that later cases' purges and recoveries meet only
    /// their own key.
    async fn forget(&mut self) {
        for key in 0..KEYS {
            self.turn_to(key);
            for client in 0..CLIENTS {
                self.abandon(client);
            }
        }
        let h = &self.world.harness;
        let records = sqlx::query(FORGET_RECORDS).bind(&self.tenant).execute(&h.pool);
        records.await.expect("delete the case's records");
        let effects = sqlx::query(FORGET_EFFECTS).bind(&self.tenant).execute(&h.pool);
        effects.await.expect("delete the case's effect rows");
        for Keyed { key, .. } in &self.keys {
            let tombstone = sqlx::query(FORGET_TOMBSTONE).bind(&self.tenant).bind(self.scope.operation());
            tombstone.bind(key.as_str()).execute(&h.pool).await.expect("delete the case's tombstones");
            if h.redis.is_some() {
                let mut conn = h.redis_connection().await;
                let record_key = h.redis_key(&self.scope, key);
                let _: i64 =
                    redis::cmd("DEL").arg(record_key).query_async(&mut conn).await.expect("delete its Redis copy");
            }
        }
    }

    fn report(&self, step: usize, violation: &str) -> String {
        format!(
            "{mode:?}, case {tenant}, step {step}: {violation}\n\nhistory (step, ms into the case, call -> answer):\n\
             {history}models (per key) after the last step they accepted: {models:#?}",
            mode = self.world.mode(),
            tenant = self.tenant,
            history = self.history,
            models = self.keys.iter().map(|keyed| &keyed.model).collect::<Vec<_>>(),
        )
    }
}
