//! Speed: every subject under `wrk` (its own process, the driver and script of `benches/http`), replays
//! and new keys, at each concurrency, subjects interleaved within a round (A..E, then E..A).

use std::net::SocketAddr;

use crate::Error;
use crate::client::{BODY, Client};
use crate::subjects::{App, Subject};
use crate::wrk::{self, Keys, Load, Summary};

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
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
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
        let (path, keys) = load_of(Workload::New, app.subject);
        let load = Load { path, keys, prefix: &format!("{run}-warm"), expect: 201, cookie: client.cookie() };
        wrk(app.address, &load, max, 1)?;
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
                    let (path, keys) = load_of(workload, app.subject);
                    if let Keys::Cycle(_) = keys {
                        for key in 0..REPLAY_KEYS {
                            let answer = client.charge(&format!("{prefix}-{key}"), BODY, &[]).await;
                            if answer.status != Some(201) {
                                return Err(format!("preparing replays of {:?}: {answer:?}", app.subject).into());
                            }
                        }
                    }
                    let load = Load { path, keys, prefix: &prefix, expect: 201, cookie: client.cookie() };
                    let summary = wrk(app.address, &load, concurrency, plan.seconds)?;
                    cells.push(Cell {
                        workload,
                        subject: app.subject,
                        concurrency,
                        round,
                        requests: summary.requests,
                        unexpected: summary.unexpected + summary.socket_errors,
                        throughput: summary.throughput(),
                        p50_us: summary.p50_us,
                        p99_us: summary.p99_us,
                        p999_us: summary.p999_us,
                    });
                }
            }
            eprintln!("speed: round {} at concurrency {concurrency} done", round + 1);
        }
    }
    Ok(cells)
}

/// Where a cell sends its requests and with which keys.
fn load_of(workload: Workload, subject: Subject) -> (&'static str, Keys) {
    match (workload, subject) {
        // The handler without any key: the cost of the work itself.
        (Workload::New, Subject::NoLayer) => ("/charges", Keys::None),
        (Workload::New, _) => ("/charges", Keys::Unique),
        // The same bytes as a replay, from a route that does nothing: what a replay costs at best.
        (Workload::Replay, Subject::NoLayer) => ("/static", Keys::None),
        (Workload::Replay, _) => ("/charges", Keys::Cycle(REPLAY_KEYS)),
    }
}

/// One wrk run. It blocks the thread of `main`'s future, which is not one of the runtime's workers: the
/// apps under test keep both.
fn wrk(address: SocketAddr, load: &Load, concurrency: usize, seconds: u32) -> Result<Summary, Error> {
    Ok(wrk::run(address, load, concurrency, seconds)?)
}
