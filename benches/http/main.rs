//! The layer as users meet it: one axum app, with and without `IdempotencyLayer`, driven over loopback by
//! `wrk` (a load generator in its own process; `apt install wrk`).
//!
//! ```text
//! cargo bench --bench http                 # full run: 3 rounds x 5 s per cell, 16 and 64 connections
//! cargo bench --bench http -- --quick      # a smoke run of a few seconds (CI)
//! cargo bench --bench http -- --subjects two-tier --workloads replay --concurrency 64 --seconds 30
//! cargo bench --bench http -- --replot docs/bench/http.json   # the tables again, from a saved run
//! ```
//! Subjects: the bare app (no layer), the layer over a two-tier store, the layer over a Postgres-only
//! store, and the same two layers on the transactional path (`with_claim_transaction`: the handler's
//! insert in the claim's transaction, one commit per new key; no in-flight cells, whose held requests
//! would each hold a pooled connection). The handler inserts a charge and answers 201 with about 150 bytes of JSON; the bare app's
//! replay row is a route answering the same bytes without the insert, which is what a replay should
//! cost at best. Then the bytes per completed record in each tier (`footprint`). Durable servers (fsync and synchronous commit on), as in `compare`. Subjects change
//! places between rounds (each round starts further along the list). Results: `target/bench/http.{json,md}`.

#[path = "../common/cost.rs"]
mod cost;
mod footprint;
mod report;
#[path = "../common/rounds.rs"]
mod rounds;
#[path = "../common/spread.rs"]
mod spread;
#[path = "../common/wrk.rs"]
mod wrk;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use clap::Parser;
use idemstore::Store;
use idemstore::http::{ClaimTx, IdempotencyLayer};
use idemstore_testkit::{PostgresServer, RedisServer};
use sqlx::PgPool;
use wrk::{Keys, Load, Summary};

#[global_allocator]
static ALLOCATOR: cost::CountingAllocator = cost::CountingAllocator;

#[derive(Parser, Debug)]
struct Args {
    /// A smoke run: one round, one second per cell, 16 connections.
    #[arg(long)]
    quick: bool,
    /// Open connections (comma separated).
    #[arg(long, value_delimiter = ',')]
    concurrency: Option<Vec<usize>>,
    /// Rounds; each measures every cell once.
    #[arg(long)]
    rounds: Option<usize>,
    /// Whole seconds per cell (wrk's `-d`).
    #[arg(long)]
    seconds: Option<u32>,
    /// Workloads to run (default: all).
    #[arg(long, value_delimiter = ',', value_enum)]
    workloads: Option<Vec<Workload>>,
    /// Subjects to run (default: all).
    #[arg(long, value_delimiter = ',', value_enum)]
    subjects: Option<Vec<Subject>>,
    /// Rewrites the tables from a saved `http.json` instead of measuring.
    #[arg(long)]
    replot: Option<std::path::PathBuf>,
    /// Passed by `cargo bench`; without it the run is a quick one.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The plan of a run, with the defaults of full and quick runs applied.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    quick: bool,
    concurrency: Vec<usize>,
    rounds: usize,
    seconds: u32,
    workloads: Vec<Workload>,
    subjects: Vec<Subject>,
}

impl From<Args> for Plan {
    fn from(args: Args) -> Self {
        let quick = args.quick || !args.bench;
        Plan {
            quick,
            concurrency: args.concurrency.unwrap_or_else(|| if quick { vec![16] } else { vec![16, 64] }),
            rounds: args.rounds.unwrap_or(if quick { 1 } else { 3 }),
            seconds: args.seconds.unwrap_or(if quick { 1 } else { 5 }),
            workloads: args.workloads.unwrap_or_else(|| vec![Workload::New, Workload::Replay, Workload::Inflight]),
            subjects: args.subjects.unwrap_or_else(|| {
                vec![
                    Subject::Bare,
                    Subject::TwoTier,
                    Subject::PostgresOnly,
                    Subject::TwoTierTx,
                    Subject::PostgresOnlyTx,
                ]
            }),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Every request a fresh key: the handler's insert runs each time.
    New,
    /// Retries of 256 keys that completed before the cell.
    Replay,
    /// Duplicates of 32 keys whose first request is still in the handler (409).
    Inflight,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Subject {
    /// The app without the layer.
    Bare,
    /// The layer over Redis and Postgres.
    TwoTier,
    /// The layer over Postgres alone.
    PostgresOnly,
    /// The transactional layer over Redis and Postgres.
    TwoTierTx,
    /// The transactional layer over Postgres alone.
    PostgresOnlyTx,
}

/// One timed cell, as wrk reported it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Cell {
    workload: Workload,
    subject: Subject,
    concurrency: usize,
    round: usize,
    requests: u64,
    /// Answers with another status than the workload's (0 in a sound run).
    unexpected: u64,
    socket_errors: u64,
    throughput: f64,
    p50_us: u64,
    p99_us: u64,
    p999_us: u64,
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS http_bench_charges (
    id BIGSERIAL PRIMARY KEY, tenant TEXT NOT NULL, amount BIGINT NOT NULL, customer TEXT NOT NULL)";
const REPLAY_KEYS: usize = 256;
/// Signalled by each held request once it is inside the handler, i.e. once its key is claimed.
static HOLDING: tokio::sync::Notify = tokio::sync::Notify::const_new();
const HELD_KEYS: usize = 32;

#[derive(serde::Deserialize)]
struct NewCharge {
    amount: i64,
    currency: String,
    customer: String,
}

/// The handler every subject shares: one durable insert (in the claim's transaction on the
/// transactional path), 201 with the charge. A request with `x-hold` never finishes (it holds its key
/// in flight for the in-flight workload).
async fn create_charge(
    State(pg): State<PgPool>,
    claim: Option<ClaimTx>,
    headers: HeaderMap,
    body: axum::Json<NewCharge>,
) -> Response {
    if headers.contains_key("x-hold") {
        HOLDING.notify_one();
        std::future::pending::<()>().await;
    }
    let insert = sqlx::query_scalar::<_, i64>(
        "INSERT INTO http_bench_charges (tenant, amount, customer) VALUES ('bench', $1, $2) RETURNING id",
    )
    .bind(body.amount)
    .bind(&body.customer);
    let inserted = match claim {
        Some(mut tx) => insert.fetch_one(&mut *tx).await,
        None => insert.fetch_one(&pg).await,
    };
    match inserted {
        Ok(id) => (StatusCode::CREATED, charge_json(id, body.amount, &body.currency, &body.customer)).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

fn charge_json(id: i64, amount: i64, currency: &str, customer: &str) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "id": id, "object": "charge", "amount": amount, "currency": currency, "customer": customer,
        "status": "succeeded", "created": 1_796_000_000,
    }))
}

/// The bytes a replay serves, without the store: the bare app's replay row.
async fn static_charge() -> Response {
    (StatusCode::CREATED, charge_json(1, 1250, "eur", "cus_bench")).into_response()
}

fn app(pg: PgPool, store: Option<Store>, transactional: bool) -> Router {
    let charges = post(create_charge);
    let charges = match store {
        Some(store) => {
            let layer = IdempotencyLayer::new(store, |_: &axum::http::request::Parts| Some("bench".to_owned()));
            charges.route_layer(if transactional { layer.with_claim_transaction() } else { layer })
        }
        None => charges,
    };
    Router::new().route("/charges", charges).route("/static", post(static_charge)).with_state(pg)
}

/// The plan's subjects, each an app on a port of its own over `pg`.
fn serve_subjects(
    plan: &Plan,
    pg: &PgPool,
    redis_url: &str,
) -> Result<Vec<(Subject, SocketAddr)>, Box<dyn std::error::Error>> {
    let redis_pool = deadpool_redis::Config::from_url(redis_url).create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
    let two_tier = Store::builder().postgres(pg.clone()).redis(redis_pool).key_prefix("bench").build()?;
    let postgres_only = Store::builder().postgres(pg.clone()).build()?;
    let apps = [
        (Subject::Bare, app(pg.clone(), None, false)),
        (Subject::TwoTier, app(pg.clone(), Some(two_tier.clone()), false)),
        (Subject::PostgresOnly, app(pg.clone(), Some(postgres_only.clone()), false)),
        (Subject::TwoTierTx, app(pg.clone(), Some(two_tier), true)),
        (Subject::PostgresOnlyTx, app(pg.clone(), Some(postgres_only), true)),
    ];
    let mut subjects = Vec::new();
    for (subject, app) in apps.into_iter().filter(|(subject, _)| plan.subjects.contains(subject)) {
        subjects.push((subject, serve(app)?));
    }
    Ok(subjects)
}

/// What a request cost one subject, from the counted pass.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CostCell {
    workload: Workload,
    subject: Subject,
    requests: u64,
    cost: cost::Cost,
}

/// Connections per counted cell.
const COUNTED_CONCURRENCY: usize = 16;

/// A pass apart from the timed cells, through apps whose Postgres connections go through a proxy that
/// counts round trips: each subject and workload for one second at 16 connections, after a warm-up (a
/// smoke run: new keys only, not warmed up). Per
/// request over the requests wrk saw answered (those still in flight at the end add under 2% here).
async fn count_costs(
    plan: &Plan,
    database_url: &str,
    redis_url: &str,
    direct: &PgPool,
) -> Result<Vec<CostCell>, Box<dyn std::error::Error>> {
    let options: sqlx::postgres::PgConnectOptions = database_url.parse()?;
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await?
        .next()
        .ok_or("the Postgres host has no address")?;
    let proxy = cost::RoundTripCounter::start(upstream).await?;
    let pg = idemstore::pool_options().max_connections(16).connect_with(proxy.options(database_url)?).await?;
    let counted = Plan { seconds: 1, ..plan.clone() };
    let redis_urls = [redis_url.to_owned()];
    let run_id = std::process::id();
    let mut costs = Vec::new();
    // A smoke run counts new keys only, without a warm-up: the cost table's columns are checked, not read.
    let workloads = if plan.quick { vec![Workload::New] } else { plan.workloads.clone() };
    for (subject, address) in serve_subjects(plan, &pg, redis_url)? {
        if let Some(request) = request_of(Workload::New, subject).filter(|_| !plan.quick) {
            wrk(&counted, address, request, COUNTED_CONCURRENCY, &format!("r{run_id}-cost-warm-{subject:?}"));
        }
        for &workload in &workloads {
            let Some(request) = request_of(workload, subject) else { continue };
            let prefix = format!("r{run_id}-cost-{workload:?}-{subject:?}");
            let held = prepare(address, workload, &prefix).await?;
            let before = cost::Counters::read(&proxy, direct, &redis_urls).await?;
            let summary = wrk(&counted, address, request, COUNTED_CONCURRENCY, &prefix);
            let after = cost::Counters::read(&proxy, direct, &redis_urls).await?;
            held.iter().for_each(|request| request.abort());
            let cost = before.per_request(&after, summary.requests);
            costs.push(CostCell { workload, subject, requests: summary.requests, cost });
        }
    }
    Ok(costs)
}

fn serve(app: Router) -> std::io::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(address)
}

/// What a cell sends: its route, its keys and the status it expects.
fn request_of(workload: Workload, subject: Subject) -> Option<(&'static str, Keys, u16)> {
    Some(match (workload, subject) {
        (Workload::New, Subject::Bare) => ("/charges", Keys::None, 201),
        (Workload::New, _) => ("/charges", Keys::Unique, 201),
        (Workload::Replay, Subject::Bare) => ("/static", Keys::None, 201),
        (Workload::Replay, _) => ("/charges", Keys::Cycle(REPLAY_KEYS), 201),
        (Workload::Inflight, Subject::Bare | Subject::TwoTierTx | Subject::PostgresOnlyTx) => return None,
        (Workload::Inflight, _) => ("/charges", Keys::Cycle(HELD_KEYS), 409),
    })
}

const BODY: &str = r#"{"amount":1250,"currency":"eur","customer":"cus_bench","description":"benchmark charge"}"#;

/// Sends the first request of keys `prefix-0 .. prefix-(count-1)`: completed ones for replays, held ones
/// (their handler never returns) for in-flight duplicates. Returns the held requests, to abort later.
async fn prepare(
    address: SocketAddr,
    workload: Workload,
    prefix: &str,
) -> Result<Vec<tokio::task::JoinHandle<()>>, Box<dyn std::error::Error>> {
    let client = reqwest::Client::new();
    let send = |key: String, hold: bool| {
        let mut request = client
            .post(format!("http://{address}/charges"))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(BODY);
        if hold {
            request = request.header("x-hold", "1");
        }
        request.send()
    };
    match workload {
        Workload::New => Ok(Vec::new()),
        Workload::Replay => {
            for key in 0..REPLAY_KEYS {
                let status = send(format!("{prefix}-{key}"), false).await?.status();
                assert_eq!(status, 201, "preparing replay keys");
            }
            Ok(Vec::new())
        }
        Workload::Inflight => {
            let mut held = Vec::new();
            for key in 0..HELD_KEYS {
                let first = send(format!("{prefix}-{key}"), true);
                held.push(tokio::spawn(async move {
                    let _ = first.await;
                }));
                HOLDING.notified().await;
            }
            Ok(held)
        }
    }
}

fn wrk(plan: &Plan, address: SocketAddr, request: (&str, Keys, u16), concurrency: usize, prefix: &str) -> Summary {
    let (path, keys, expect) = request;
    let load = Load { path, keys, prefix, expect, cookie: None };
    wrk::run(address, &load, concurrency, plan.seconds).unwrap_or_else(|error| panic!("{error}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(saved) = &args.replot {
        let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(saved)?)?;
        let plan: Plan = serde_json::from_value(saved["plan"].clone())?;
        let cells: Vec<Cell> = serde_json::from_value(saved["cells"].clone())?;
        let footprint: footprint::Footprint = serde_json::from_value(saved["footprint"].clone())?;
        let costs: Vec<CostCell> = serde_json::from_value(saved["costs"].clone()).unwrap_or_default();
        return report::write(&plan, &cells, &footprint, &costs);
    }
    let plan = Plan::from(args);
    let postgres = PostgresServer::start_durable()?;
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"])?;
    let pg = idemstore::pool_options().max_connections(16).connect(&postgres.url()).await?;
    Store::builder().postgres(pg.clone()).build()?.migrate().await?;
    sqlx::raw_sql(SCHEMA).execute(&pg).await?;
    let subjects = serve_subjects(&plan, &pg, &redis.url())?;

    // Warm-up, not recorded: every connection opened and statement prepared in every subject.
    let warm_up = Plan { seconds: 1, ..plan.clone() };
    for &(subject, address) in &subjects {
        if let Some(request) = request_of(Workload::New, subject) {
            wrk(&warm_up, address, request, plan.concurrency.iter().copied().max().unwrap_or(16), "warm");
        }
    }

    let run_id = std::process::id();
    let mut cells = Vec::new();
    for round in 0..plan.rounds {
        for &concurrency in &plan.concurrency {
            for &workload in &plan.workloads {
                for (subject, address) in rounds::round_order(subjects.clone(), round, plan.rounds) {
                    let Some(request) = request_of(workload, subject) else { continue };
                    let prefix = format!("r{run_id}-{round}-{concurrency}-{workload:?}-{subject:?}");
                    let held = prepare(address, workload, &prefix).await?;
                    let summary = wrk(&plan, address, request, concurrency, &prefix);
                    held.iter().for_each(|request| request.abort());
                    cells.push(Cell {
                        workload,
                        subject,
                        concurrency,
                        round,
                        requests: summary.requests,
                        unexpected: summary.unexpected,
                        socket_errors: summary.socket_errors,
                        throughput: summary.throughput(),
                        p50_us: summary.p50_us,
                        p99_us: summary.p99_us,
                        p999_us: summary.p999_us,
                    });
                }
            }
            eprintln!("round {} concurrency {concurrency}: done", round + 1);
        }
    }
    // Best effort: a pass that cannot count costs the table, not the run.
    let costs = count_costs(&plan, &postgres.url(), &redis.url(), &pg).await.unwrap_or_else(|error| {
        eprintln!("the counted pass failed, the report has no cost table: {error}");
        Vec::new()
    });
    let footprint = footprint::measure(&pg, &redis.url(), "bench").await?;
    report::write(&plan, &cells, &footprint, &costs)?;
    Ok(spread::refuse_unexpected(cells.iter().map(|cell| cell.unexpected).sum())?)
}
