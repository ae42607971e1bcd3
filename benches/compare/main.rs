//! Two-tier vs Postgres-only, side by side in one run, against the raw floor of each server.
//!
//! ```text
//! cargo bench --bench compare                 # full run: 3 rounds x 3 s per cell, concurrency 1,16,64
//! cargo bench --bench compare -- --quick      # a smoke run of about half a minute (CI)
//! cargo bench --bench compare -- --concurrency 8,32 --rounds 5 --seconds 2
//! ```
//! Starts throwaway servers with durable settings (fsync and synchronous commit on; Redis without
//! persistence, `noeviction`) and a six-node Redis Cluster, or uses `IDEMSTORE_BENCH_REDIS_URL` /
//! `IDEMSTORE_BENCH_DATABASE_URL` / `IDEMSTORE_BENCH_REDIS_CLUSTER` (comma-separated seeds).
//! The subjects change places between rounds (each round starts further along the list) so that
//! machine drift hits all of them. Results go
//! to `target/bench/compare.{json,md,svg}`; the table is printed too.

#[path = "../common/cost.rs"]
mod cost;
mod report;
#[path = "../common/rounds.rs"]
mod rounds;
#[path = "../common/spread.rs"]
mod spread;
mod workload;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use idemstore::Store;
use idemstore_testkit::{PostgresServer, RedisCluster, RedisServer};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use workload::{Fixture, NewKeyPath, Subject, Workload};

#[global_allocator]
static ALLOCATOR: cost::CountingAllocator = cost::CountingAllocator;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// A smoke run: one round, half a second per cell, concurrency 1 and 16.
    #[arg(long)]
    quick: bool,
    /// Concurrent requests in flight (comma separated).
    #[arg(long, value_delimiter = ',')]
    concurrency: Option<Vec<usize>>,
    /// Rounds; each measures every cell once.
    #[arg(long)]
    rounds: Option<usize>,
    /// Seconds per cell.
    #[arg(long)]
    seconds: Option<f64>,
    /// Workloads to run (default: all).
    #[arg(long, value_delimiter = ',', value_enum)]
    workloads: Option<Vec<Workload>>,
    /// Rewrites the table and plot from a saved `compare.json` instead of measuring.
    #[arg(long)]
    replot: Option<std::path::PathBuf>,
    /// Passed by `cargo bench`. Without it (`cargo test --all-targets` runs this binary too) the run is a
    /// quick smoke run, as with `--quick`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The plan of a run, with the defaults of full and quick runs applied.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    quick: bool,
    concurrency: Vec<usize>,
    rounds: usize,
    seconds: f64,
    workloads: Vec<Workload>,
}

impl From<Args> for Plan {
    fn from(args: Args) -> Self {
        let quick = args.quick || !args.bench;
        Plan {
            quick,
            concurrency: args.concurrency.unwrap_or_else(|| if quick { vec![1, 16] } else { vec![1, 16, 64] }),
            rounds: args.rounds.unwrap_or(if quick { 1 } else { 3 }),
            seconds: args.seconds.unwrap_or(if quick { 0.5 } else { 3.0 }),
            workloads: args.workloads.unwrap_or_else(|| {
                vec![Workload::New, Workload::Replay, Workload::Inflight, Workload::Mismatch, Workload::Mixed]
            }),
        }
    }
}

/// One timed cell.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Cell {
    workload: Option<Workload>,
    subject: Subject,
    concurrency: usize,
    round: usize,
    requests: u64,
    /// Requests whose answer was not the one the workload expects (0 in a sound run).
    unexpected: u64,
    throughput: f64,
    p50_us: u64,
    p95_us: u64,
    p99_us: u64,
    p999_us: u64,
    /// Statements the store sent to Postgres per request (the work's own insert not included).
    postgres_per_request: f64,
    /// Scripts the store ran on Redis per request.
    redis_per_request: f64,
    /// Redis calls that degraded to the Postgres path (over budget, errors): 0 in a healthy run.
    redis_fallbacks: f64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if let Some(saved) = &args.replot {
        let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(saved)?)?;
        let plan: Plan = serde_json::from_value(saved["plan"].clone())?;
        let cells: Vec<Cell> = serde_json::from_value(saved["cells"].clone())?;
        let relay: Vec<RelayCell> = serde_json::from_value(saved["relay"].clone()).unwrap_or_default();
        let costs: Vec<CostCell> = serde_json::from_value(saved["costs"].clone()).unwrap_or_default();
        return report::write(&plan, &cells, &relay, &costs);
    }
    let plan = Plan::from(args);
    let metrics = PrometheusBuilder::new().install_recorder()?;

    // Durable servers, unless the environment names some.
    let mut owned: (Option<PostgresServer>, Option<RedisServer>) = (None, None);
    let database_url = match std::env::var("IDEMSTORE_BENCH_DATABASE_URL") {
        Ok(url) => url,
        Err(_) => owned.0.insert(PostgresServer::start_durable()?).url(),
    };
    let redis_url = match std::env::var("IDEMSTORE_BENCH_REDIS_URL") {
        Ok(url) => url,
        Err(_) => owned.1.insert(RedisServer::start_with(&["--maxmemory-policy", "noeviction"])?).url(),
    };
    let mut owned_cluster = None;
    let seeds: Vec<String> = match std::env::var("IDEMSTORE_BENCH_REDIS_CLUSTER") {
        Ok(seeds) => seeds.split(',').map(str::to_owned).collect(),
        Err(_) => owned_cluster.insert(RedisCluster::start()?).seed_urls(),
    };
    let redis_client = redis::Client::open(redis_url.as_str())?;
    let redis = deadpool_redis::Config::from_url(&redis_url).create_pool(Some(deadpool_redis::Runtime::Tokio1))?;
    let pg = pool(database_url.parse()?).await?;
    let stores = Stores::build(&pg, &redis, &seeds)?;
    let two_tier = &stores.two_tier;
    two_tier.migrate().await?;
    sqlx::raw_sql(workload::SCHEMA).execute(&pg).await?;

    let run_id = std::process::id();
    // Warm-up, not recorded: open every pooled connection and prepare every statement in both modes, so
    // that whichever mode runs first does not pay for it.
    let warm_up = Plan { seconds: plan.seconds.min(0.5), ..plan.clone() };
    let widest = plan.concurrency.iter().copied().max().unwrap_or(1);
    for subject in [
        Subject::TwoTier,
        Subject::TwoTierCluster,
        Subject::TwoTierEncrypted,
        Subject::TwoTierQuota,
        Subject::PostgresOnly,
        Subject::TwoTierAlone,
        Subject::PostgresOnlyAlone,
    ] {
        let store = stores.of(subject);
        for workload in [Workload::New, Workload::Replay] {
            let cell = format!("r{run_id}-warm-{}", subject.name().replace(' ', "_"));
            let fixture = Fixture::library(store.clone(), pg.clone(), workload, NewKeyPath::Separate, cell).await;
            measure(&warm_up, &metrics, fixture, Some(workload), subject, widest, 0).await;
        }
    }

    let mut cells = Vec::new();
    for round in 0..plan.rounds {
        for &concurrency in &plan.concurrency {
            for &workload in &plan.workloads {
                let order = rounds::round_order(subjects_of(workload), round, plan.rounds);
                for subject in order {
                    let store = stores.of(subject);
                    let cell_id = format!("r{run_id}-{round}-{concurrency}-{}", subject.name().replace(' ', "_"));
                    let new_keys = subject.new_key_path();
                    let fixture = Fixture::library(store.clone(), pg.clone(), workload, new_keys, cell_id).await;
                    cells.push(measure(&plan, &metrics, fixture, Some(workload), subject, concurrency, round).await);
                }
            }
            let floors = [
                (Subject::EvalshaFloor, Fixture::evalsha(&redis_client).await),
                (Subject::SqlFloor, Fixture::sql(pg.clone(), format!("r{run_id}-{round}-{concurrency}"))),
            ];
            for (subject, fixture) in floors {
                cells.push(measure(&plan, &metrics, fixture, None, subject, concurrency, round).await);
            }
            eprintln!("round {} concurrency {concurrency}: done", round + 1);
        }
    }
    // Best effort: a pass that cannot count (a server it cannot reach through its proxy) costs the table, not
    // the run.
    let costs = count_costs(&plan, &database_url, &redis, &redis_url, &seeds, &pg).await.unwrap_or_else(|error| {
        eprintln!("the counted pass failed, the report has no cost table: {error}");
        Vec::new()
    });
    let relay = relay_throughput(&plan, two_tier).await?;
    report::write(&plan, &cells, &relay, &costs)?;
    drop((owned, owned_cluster));
    Ok(spread::refuse_unexpected(cells.iter().map(|cell| cell.unexpected).sum())?)
}

/// About 16 connections suit this machine (more lose throughput to the 2 vCPUs).
async fn pool(options: PgConnectOptions) -> Result<PgPool, sqlx::Error> {
    idemstore::pool_options().max_connections(16).connect_with(options).await
}

/// The stores the subjects use, on one Postgres pool.
struct Stores {
    two_tier: Store,
    postgres_only: Store,
    /// On the Redis Cluster instead of one Redis.
    cluster: Store,
    /// Every response sealed, under a fixed key: the bench measures the cost of sealing, not key
    /// management.
    encrypted: Store,
    /// Under a quota the load never reaches: every new key pays for the counting, none is refused.
    quoted: Store,
    /// Group commit off, in each mode.
    two_tier_alone: Store,
    postgres_only_alone: Store,
}

impl Stores {
    fn build(pg: &PgPool, redis: &deadpool_redis::Pool, seeds: &[String]) -> Result<Self, Box<dyn std::error::Error>> {
        // One table for every subject, the encrypted one's sealed responses beside the others' in clear:
        // the subjects without a key write in clear on purpose.
        let clear = || Store::builder().postgres(pg.clone()).clear_responses_allowed();
        let two_tier = || clear().redis(redis.clone()).key_prefix("bench");
        let quota = idemstore::Quota::default().new_keys(1_000_000_000, Duration::from_secs(60)).live_keys(100_000);
        Ok(Self {
            two_tier: two_tier().build()?,
            postgres_only: clear().build()?,
            cluster: clear().redis_cluster(seeds.to_vec()).key_prefix("bench").build()?,
            encrypted: two_tier().encryption(idemstore::Encryption::new([[0x5e; 32]])?).build()?,
            quoted: two_tier().default_policy(idemstore::Policy::builder().quota(quota).build()?).build()?,
            two_tier_alone: two_tier().group_commit(false).build()?,
            postgres_only_alone: clear().group_commit(false).build()?,
        })
    }

    /// The store a library subject runs on (the transactional subjects share the plain ones' stores).
    fn of(&self, subject: Subject) -> &Store {
        match subject {
            Subject::TwoTierCluster => &self.cluster,
            Subject::TwoTierEncrypted => &self.encrypted,
            Subject::TwoTierQuota => &self.quoted,
            Subject::TwoTierAlone => &self.two_tier_alone,
            Subject::PostgresOnlyAlone => &self.postgres_only_alone,
            Subject::PostgresOnly | Subject::PostgresOnlyInTx => &self.postgres_only,
            _ => &self.two_tier,
        }
    }
}

/// The library subjects a workload runs, in a first round's order: A (Q K S) B (C D E F G). Replays and new
/// keys also run on the Redis Cluster (K) and with responses encrypted (S), new keys also under a quota
/// (Q), transactionally in both modes (C, D), with an outbox row (E), and with group commit off in both
/// modes (F, G).
fn subjects_of(workload: Workload) -> Vec<Subject> {
    let mut order = vec![Subject::TwoTier, Subject::PostgresOnly];
    if matches!(workload, Workload::New | Workload::Replay) {
        order.splice(1..1, [Subject::TwoTierCluster, Subject::TwoTierEncrypted]);
    }
    if workload == Workload::New {
        order.insert(1, Subject::TwoTierQuota);
        order.extend([
            Subject::TwoTierInTx,
            Subject::PostgresOnlyInTx,
            Subject::TwoTierInTxOutbox,
            Subject::TwoTierAlone,
            Subject::PostgresOnlyAlone,
        ]);
    }
    order
}

/// What a request of one workload cost one subject, from a counted pass.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CostCell {
    workload: Option<Workload>,
    subject: Subject,
    concurrency: usize,
    requests: u64,
    cost: cost::Cost,
}

/// A pass apart from the timed cells, its Postgres connections through a proxy that counts round trips:
/// each subject (the Redis Cluster left out: only the single Redis is counted) after a warm-up, a fixed
/// number of requests at 16 in flight.
async fn count_costs(
    plan: &Plan,
    database_url: &str,
    redis: &deadpool_redis::Pool,
    redis_url: &str,
    seeds: &[String],
    direct: &PgPool,
) -> Result<Vec<CostCell>, Box<dyn std::error::Error>> {
    let options: PgConnectOptions = database_url.parse()?;
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await?
        .next()
        .ok_or("the Postgres host has no address")?;
    let proxy = cost::RoundTripCounter::start(upstream).await?;
    let pg = pool(proxy.options(database_url)?).await?;
    let stores = Stores::build(&pg, redis, seeds)?;
    let (concurrency, requests) = (16, if plan.quick { 160 } else { 1_600 });
    let redis_urls = [redis_url.to_owned()];
    let run_id = std::process::id();
    let mut costs = Vec::new();
    for workload in &plan.workloads {
        let subjects = subjects_of(*workload).into_iter().filter(|s| *s != Subject::TwoTierCluster);
        for subject in subjects {
            let cell = format!("r{run_id}-cost-{}", subject.name().replace(' ', "_"));
            let fixture =
                Fixture::library(stores.of(subject).clone(), pg.clone(), *workload, subject.new_key_path(), cell).await;
            send(&fixture, concurrency, requests / 4).await;
            let before = cost::Counters::read(&proxy, direct, &redis_urls).await?;
            send(&fixture, concurrency, requests).await;
            let after = cost::Counters::read(&proxy, direct, &redis_urls).await?;
            let cost = before.per_request(&after, requests);
            costs.push(CostCell { workload: Some(*workload), subject, concurrency, requests, cost });
        }
    }
    let floors = [
        (Subject::EvalshaFloor, Fixture::evalsha(&redis::Client::open(redis_url)?).await),
        (Subject::SqlFloor, Fixture::sql(pg.clone(), format!("r{run_id}-cost"))),
    ];
    for (subject, fixture) in floors {
        send(&fixture, concurrency, requests / 4).await;
        let before = cost::Counters::read(&proxy, direct, &redis_urls).await?;
        send(&fixture, concurrency, requests).await;
        let after = cost::Counters::read(&proxy, direct, &redis_urls).await?;
        costs.push(CostCell {
            workload: None,
            subject,
            concurrency,
            requests,
            cost: before.per_request(&after, requests),
        });
    }
    Ok(costs)
}

/// `requests` requests, `concurrency` at a time.
async fn send(fixture: &Arc<Fixture>, concurrency: usize, requests: u64) {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let workers = (0..concurrency).map(|_| {
        let (fixture, next) = (fixture.clone(), next.clone());
        tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
                assert!(fixture.request().await, "a counted request got an answer its workload does not expect");
            }
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker.expect("worker panicked");
    }
}

/// One relay draining a backlog of outbox rows (over 10 topics) with a sink that accepts at once.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RelayCell {
    batch: u32,
    round: usize,
    rows: u64,
    rows_per_second: f64,
}

/// The relay's throughput per batch size, each round on a fresh backlog.
async fn relay_throughput(plan: &Plan, store: &Store) -> Result<Vec<RelayCell>, Box<dyn std::error::Error>> {
    let accept = |_| std::future::ready(Ok::<_, String>(()));
    // The receipts the in-tx + outbox cells wrote: cleared, not timed.
    store.outbox().with_batch_size(1000).drain(accept).await?;
    let backlog = if plan.quick { 2_000 } else { 20_000 };
    let mut cells = Vec::new();
    for round in 0..plan.rounds {
        for batch in [100, 1000] {
            let outbox = store.outbox().with_batch_size(batch);
            let mut tx = store.pg_pool().begin().await?;
            for n in 0..backlog {
                outbox.enqueue(&mut tx, &format!("{}-{}", workload::RECEIPTS, n % 10), &n).await?;
            }
            tx.commit().await?;
            let started = Instant::now();
            let rows = outbox.drain(accept).await?.delivered;
            let rows_per_second = rows as f64 / started.elapsed().as_secs_f64();
            cells.push(RelayCell { batch, round, rows, rows_per_second });
        }
    }
    Ok(cells)
}

/// Runs `concurrency` workers for the plan's duration and measures what they did.
async fn measure(
    plan: &Plan,
    metrics: &PrometheusHandle,
    fixture: Arc<Fixture>,
    workload: Option<Workload>,
    subject: Subject,
    concurrency: usize,
    round: usize,
) -> Cell {
    let before = store_calls(metrics);
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(plan.seconds);
    let workers = (0..concurrency).map(|_| {
        let fixture = fixture.clone();
        tokio::spawn(async move {
            let mut latencies = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            let mut unexpected = 0;
            while Instant::now() < deadline {
                let sent = Instant::now();
                if !fixture.request().await {
                    unexpected += 1;
                }
                latencies.saturating_record(sent.elapsed().as_micros() as u64);
            }
            (latencies, unexpected)
        })
    });
    let mut latencies = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let mut unexpected = 0;
    for worker in futures::future::join_all(workers).await {
        let (worker_latencies, worker_unexpected) = worker.expect("worker panicked");
        latencies.add(worker_latencies).expect("same bounds");
        unexpected += worker_unexpected;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = store_calls(metrics);
    let requests = latencies.len();
    let per_request = |calls: f64| if requests == 0 { 0.0 } else { calls / requests as f64 };
    let (postgres_per_request, redis_per_request) =
        fixture.floor_costs().unwrap_or((per_request(after.0 - before.0), per_request(after.1 - before.1)));
    Cell {
        workload,
        subject,
        concurrency,
        round,
        requests,
        unexpected,
        throughput: requests as f64 / elapsed,
        p50_us: latencies.value_at_quantile(0.50),
        p95_us: latencies.value_at_quantile(0.95),
        p99_us: latencies.value_at_quantile(0.99),
        p999_us: latencies.value_at_quantile(0.999),
        postgres_per_request,
        redis_per_request,
        redis_fallbacks: after.2 - before.2,
    }
}

/// Postgres statements, Redis scripts and Redis fallbacks of the stores so far, as counted by the library.
fn store_calls(metrics: &PrometheusHandle) -> (f64, f64, f64) {
    let page = metrics.render();
    let total = |name: &str| -> f64 {
        page.lines()
            .filter(|line| line.starts_with(name))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    use idemstore::telemetry::{POSTGRES_STATEMENTS, REDIS_CALLS, REDIS_FALLBACKS};
    (total(POSTGRES_STATEMENTS), total(REDIS_CALLS), total(REDIS_FALLBACKS))
}
