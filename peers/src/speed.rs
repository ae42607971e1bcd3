//! Speed: every subject under `wrk` (its own process, the same Lua script as `benches/http`), replays
//! and new keys, at each concurrency, subjects interleaved within a round (A..E, then E..A).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use crate::client::{BODY, Client, Error};
use crate::subjects::{App, Subject};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Every request a fresh key: the handler's insert runs each time.
    New,
    /// Retries of 256 keys that completed before the cell.
    Replay,
}

const REPLAY_KEYS: usize = 256;

/// One timed cell, as wrk reported it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    pub workload: Workload,
    pub subject: Subject,
    pub concurrency: usize,
    pub round: usize,
    pub requests: u64,
    /// Answers with another status than 201, plus socket errors (0 in a sound run).
    pub unexpected: u64,
    pub throughput: f64,
    pub p99_us: u64,
}

#[derive(serde::Deserialize)]
struct WrkSummary {
    requests: u64,
    duration_us: u64,
    unexpected: u64,
    socket_errors: u64,
    p99_us: u64,
}

/// What a timed run does.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    pub concurrency: Vec<usize>,
    pub rounds: usize,
    pub seconds: u32,
}

pub async fn run(plan: &Plan, apps: &[App], run: &str) -> Result<Vec<Cell>, Error> {
    let mut clients = Vec::new();
    for app in apps {
        clients.push(Client::new(app.address, app.subject, "bench").await?);
    }
    // Warm-up, not recorded: connections opened and statements prepared everywhere.
    for (app, client) in apps.iter().zip(&clients) {
        let max = plan.concurrency.iter().copied().max().unwrap_or(16);
        wrk(1, app.address, route(Workload::New, app.subject), max, &format!("{run}-warm"), client.cookie())?;
    }
    let mut cells = Vec::new();
    for round in 0..plan.rounds {
        for &concurrency in &plan.concurrency {
            for workload in [Workload::Replay, Workload::New] {
                let mut order: Vec<_> = apps.iter().zip(&clients).collect();
                if round % 2 == 1 {
                    order.reverse();
                }
                for (app, client) in order {
                    let prefix = format!("{run}-{round}-{concurrency}-{workload:?}-{:?}", app.subject);
                    let route = route(workload, app.subject);
                    if route.keys != "none" && workload == Workload::Replay {
                        for key in 0..REPLAY_KEYS {
                            let answer = client.charge(&format!("{prefix}-{key}"), BODY, &[]).await;
                            if answer.status != Some(201) {
                                return Err(format!("preparing replays of {:?}: {answer:?}", app.subject).into());
                            }
                        }
                    }
                    let summary = wrk(plan.seconds, app.address, route, concurrency, &prefix, client.cookie())?;
                    cells.push(Cell {
                        workload,
                        subject: app.subject,
                        concurrency,
                        round,
                        requests: summary.requests,
                        unexpected: summary.unexpected + summary.socket_errors,
                        throughput: summary.requests as f64 / (summary.duration_us as f64 / 1e6),
                        p99_us: summary.p99_us,
                    });
                }
            }
            eprintln!("speed: round {} at concurrency {concurrency} done", round + 1);
        }
    }
    Ok(cells)
}

/// Where a cell sends its requests and with which keys.
#[derive(Clone, Copy)]
struct Route {
    path: &'static str,
    keys: &'static str,
}

fn route(workload: Workload, subject: Subject) -> Route {
    match (workload, subject) {
        // The handler without any key: the cost of the work itself.
        (Workload::New, Subject::NoLayer) => Route { path: "/charges", keys: "none" },
        (Workload::New, _) => Route { path: "/charges", keys: "unique" },
        // The same bytes as a replay, from a route that does nothing: what a replay costs at best.
        (Workload::Replay, Subject::NoLayer) => Route { path: "/static", keys: "none" },
        (Workload::Replay, _) => Route { path: "/charges", keys: "256" },
    }
}

fn wrk(
    seconds: u32,
    address: SocketAddr,
    route: Route,
    concurrency: usize,
    prefix: &str,
    cookie: Option<&str>,
) -> Result<WrkSummary, Error> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/http/wrk.lua");
    let mut command = Command::new("wrk");
    command
        .args(["-t2", &format!("-c{concurrency}"), &format!("-d{seconds}s"), "-s"])
        .arg(&script)
        .arg(format!("http://{address}"))
        .env("HTTP_BENCH_PATH", route.path)
        .env("HTTP_BENCH_KEYS", route.keys)
        .env("HTTP_BENCH_PREFIX", prefix)
        .env("HTTP_BENCH_EXPECT", "201");
    if let Some(cookie) = cookie {
        command.env("HTTP_BENCH_COOKIE", cookie);
    }
    let output = command.output().map_err(|error| format!("running wrk (apt install wrk): {error}"))?;
    if !output.status.success() {
        return Err(format!("wrk failed: {}", String::from_utf8_lossy(&output.stderr)).into());
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|error| format!("wrk printed {stdout:?}: {error}").into())
}
