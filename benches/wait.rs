//! How soon a claim waiting for an in-flight duplicate learns of the owner's completion: woken by the
//! store's notification (`RunOptions::wait_in_flight`) against polling `begin` with a backoff (5 ms,
//! doubling to 200 ms: what the store did before notifications, and what a caller without them does).
//!
//! ```text
//! cargo bench --bench wait                 # 40 rounds per cell
//! cargo bench --bench wait -- --quick      # 6 rounds per cell (CI)
//! ```
//! Durable throwaway servers, as in `compare`. The owner and the waiter use two stores (two processes'
//! worth of connections). Each round the owner completes 20-400 ms after the waiter started waiting; the
//! latency runs from the owner's `complete` call to the waiter's answer. The mechanisms alternate within
//! each mode (A B, then B A). Results go to `target/bench/wait.{json,md}`; the table is printed too.

use std::time::{Duration, Instant};

use clap::Parser;
use idemstore::{Begin, Fingerprint, FingerprintOptions, IdempotencyKey, Mode, Policy, RunOptions, Scope, Store};
use idemstore_testkit::{PostgresServer, RedisServer};

#[path = "common/repeat.rs"]
mod repeat;

#[derive(Parser, Debug)]
struct Args {
    /// `--quick`: 6 rounds per cell; else 40.
    #[command(flatten)]
    repeat: repeat::Repeat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
enum Mechanism {
    Notification,
    Polling,
}

#[derive(Debug, serde::Serialize)]
struct Cell {
    mode: &'static str,
    mechanism: Mechanism,
    /// Milliseconds from the owner's completion call to the waiter's answer, sorted.
    latencies_ms: Vec<f64>,
}

impl Cell {
    fn quantile(&self, q: f64) -> f64 {
        let index = ((self.latencies_ms.len() - 1) as f64 * q).round() as usize;
        self.latencies_ms[index]
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let rounds = args.repeat.rounds(6, 40);
    let postgres = PostgresServer::start_durable()?;
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"])?;
    let policy = Policy::builder().lease(Duration::from_secs(30)).build()?;
    let store = |redis_url: Option<&str>| {
        let builder = Store::builder().database_url(postgres.url()).key_prefix("wait").default_policy(policy.clone());
        match redis_url {
            Some(url) => builder.redis_url(url),
            None => builder,
        }
        .build()
    };
    let mut cells = Vec::new();
    for (mode, redis_url) in [(Mode::TwoTier, Some(redis.url())), (Mode::PostgresOnly, None)] {
        let (owner, waiter) = (store(redis_url.as_deref())?, store(redis_url.as_deref())?);
        owner.migrate().await?;
        let name = if mode == Mode::TwoTier { "two-tier" } else { "postgres-only" };
        let mut measured = [Vec::new(), Vec::new()];
        for round in 0..rounds {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for which in order {
                let mechanism = [Mechanism::Notification, Mechanism::Polling][which];
                let delay = Duration::from_millis(rand::random_range(20..400));
                measured[which]
                    .push(one_round(&owner, &waiter, mechanism, delay, &format!("{name}-{round}-{which}")).await?);
            }
        }
        for (which, mut latencies_ms) in measured.into_iter().enumerate() {
            latencies_ms.sort_by(f64::total_cmp);
            cells.push(Cell {
                mode: name,
                mechanism: [Mechanism::Notification, Mechanism::Polling][which],
                latencies_ms,
            });
        }
    }
    report(rounds, &cells)
}

/// The owner claims a key, the waiter starts waiting, and after `delay` the owner completes; the
/// waiter's latency in milliseconds.
async fn one_round(
    owner: &Store,
    waiter: &Store,
    mechanism: Mechanism,
    delay: Duration,
    name: &str,
) -> Result<f64, Box<dyn std::error::Error>> {
    let scope = Scope::new("bench", "wait")?;
    let key = IdempotencyKey::new(name)?;
    let fingerprint = Fingerprint::of_json(b"{}", &FingerprintOptions::default())?;
    let Begin::Acquired(lease) = owner.begin(&scope, &key, &fingerprint).await? else {
        return Err("not acquired".into());
    };
    let waiting = {
        let (waiter, scope, key, fingerprint) = (waiter.clone(), scope.clone(), key.clone(), fingerprint.clone());
        tokio::spawn(async move {
            let answer = match mechanism {
                Mechanism::Notification => {
                    let options = RunOptions::default().wait_in_flight(Duration::from_secs(10));
                    waiter.begin_with(&scope, &key, &fingerprint, &options).await
                }
                Mechanism::Polling => poll(&waiter, &scope, &key, &fingerprint).await,
            };
            (answer, Instant::now())
        })
    };
    tokio::time::sleep(delay).await;
    let completing = Instant::now();
    lease.complete(b"done").await?;
    let (answer, answered) = waiting.await?;
    if !matches!(answer?, Begin::Replayed(_)) {
        return Err("the waiter did not replay".into());
    }
    Ok(answered.duration_since(completing).as_secs_f64() * 1000.0)
}

/// Asks again with a backoff of 5 ms doubling to 200 ms while the key is in flight.
async fn poll(
    store: &Store,
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: &Fingerprint,
) -> Result<Begin, idemstore::StoreError> {
    let mut backoff = Duration::from_millis(5);
    loop {
        match store.begin(scope, key, fingerprint).await? {
            Begin::InFlight { .. } => tokio::time::sleep(backoff).await,
            answer => return Ok(answer),
        }
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}

fn report(rounds: usize, cells: &[Cell]) -> Result<(), Box<dyn std::error::Error>> {
    let mut table = format!(
        "Wake-up latency: owner's `complete` call to the waiter's answer, ms ({rounds} rounds per cell)\n\n\
         | mode | mechanism | median | p90 | max | polling ÷ notification (median) |\n|---|---|---|---|---|---|\n"
    );
    for pair in cells.chunks(2) {
        let ratio = pair[1].quantile(0.5) / pair[0].quantile(0.5);
        for (i, cell) in pair.iter().enumerate() {
            let ratio = if i == 1 { format!("{ratio:.1}x") } else { String::new() };
            let (p50, p90, max) = (cell.quantile(0.5), cell.quantile(0.9), cell.quantile(1.0));
            table += &format!("| {} | {:?} | {p50:.1} | {p90:.1} | {max:.1} | {ratio} |\n", cell.mode, cell.mechanism);
        }
    }
    print!("{table}");
    std::fs::create_dir_all("target/bench")?;
    std::fs::write("target/bench/wait.md", &table)?;
    std::fs::write(
        "target/bench/wait.json",
        serde_json::to_vec_pretty(&serde_json::json!({ "rounds": rounds, "cells": cells }))?,
    )?;
    Ok(())
}
