//! A bulk request's new keys claimed and completed as a batch (`Store::begin_many` and
//! `Store::complete_many`: two statements) against the same keys one by one (`begin` then `complete`
//! per key, in turn, as a handler looping over its items does), and against all single claims at once
//! (every item's `begin`/`complete` concurrently, which group commit shares where it can).
//!
//! ```text
//! cargo bench --bench batch                 # 20 rounds of 100 keys per cell
//! cargo bench --bench batch -- --quick      # 3 rounds (CI)
//! ```
//! Durable throwaway servers (fsync on), as in `compare`. The three ways alternate within each round, and
//! each round uses keys of its own. Items per second are claims and completions of new keys; results go to
//! `target/bench/batch.{json,md}`, and the table is printed too.

use std::time::Instant;

use clap::Parser;
use futures::future::join_all;
use idemstore::{BatchBegin, Begin, Fingerprint, FingerprintOptions, IdempotencyKey, Mode, Scope, Store};
use idemstore_testkit::{PostgresServer, RedisServer};

#[path = "common/repeat.rs"]
mod repeat;

#[derive(Parser, Debug)]
struct Args {
    /// `--quick`: 3 rounds per cell; else 20.
    #[command(flatten)]
    repeat: repeat::Repeat,
    /// Items per batch.
    #[arg(long, default_value_t = 100)]
    items: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
enum Way {
    /// `begin_many` + `complete_many`.
    Batch,
    /// `begin` + `complete` per item, one item after the other.
    OneByOne,
    /// `begin` + `complete` per item, every item at once.
    AllAtOnce,
}

const WAYS: [Way; 3] = [Way::Batch, Way::OneByOne, Way::AllAtOnce];

#[derive(Debug, serde::Serialize)]
struct Cell {
    mode: &'static str,
    way: Way,
    /// Items claimed and completed per second, each round's, sorted.
    items_per_s: Vec<f64>,
}

impl Cell {
    fn median(&self) -> f64 {
        self.items_per_s[self.items_per_s.len() / 2]
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let rounds = args.repeat.rounds(3, 20);
    let postgres = PostgresServer::start_durable()?;
    let redis = RedisServer::start_with(&["--maxmemory-policy", "noeviction"])?;
    let mut cells = Vec::new();
    for (mode, redis_url) in [(Mode::TwoTier, Some(redis.url())), (Mode::PostgresOnly, None)] {
        let builder = Store::builder().database_url(postgres.url()).key_prefix("batch");
        let store = match redis_url.as_deref() {
            Some(url) => builder.redis_url(url),
            None => builder,
        }
        .build()?;
        store.migrate().await?;
        let name = if mode == Mode::TwoTier { "two-tier" } else { "postgres-only" };
        let mut measured = [Vec::new(), Vec::new(), Vec::new()];
        for round in 0..rounds {
            // Each way first in turn, so that none always runs on the warmest server.
            for turn in 0..WAYS.len() {
                let which = (round + turn) % WAYS.len();
                let keys: Vec<IdempotencyKey> = (0..args.items)
                    .map(|i| IdempotencyKey::new(format!("{name}-{round}-{which}-{i}")))
                    .collect::<Result<_, _>>()?;
                let started = Instant::now();
                run(&store, WAYS[which], &keys).await?;
                measured[which].push(args.items as f64 / started.elapsed().as_secs_f64());
            }
        }
        for (way, mut items_per_s) in WAYS.into_iter().zip(measured) {
            items_per_s.sort_by(f64::total_cmp);
            cells.push(Cell { mode: name, way, items_per_s });
        }
        store.shutdown().await;
    }
    report(rounds, args.items, &cells)
}

/// Claims and completes `keys` (all new) the `way` given; an error if any item was not acquired.
async fn run(store: &Store, way: Way, keys: &[IdempotencyKey]) -> Result<(), Box<dyn std::error::Error>> {
    let scope = Scope::new("bench", "bulk")?;
    let fingerprint = Fingerprint::of_json(br#"{"amount":1}"#, &FingerprintOptions::default())?;
    let single = |key: &IdempotencyKey| {
        let (scope, fingerprint) = (&scope, &fingerprint);
        let key = key.clone();
        async move {
            let Begin::Acquired(owner) = store.begin(scope, &key, fingerprint).await? else {
                return Err::<(), Box<dyn std::error::Error>>("a new key was not acquired".into());
            };
            Ok(owner.complete(b"done").await?)
        }
    };
    match way {
        Way::Batch => {
            let items: Vec<_> = keys.iter().map(|key| (key.clone(), fingerprint.clone())).collect();
            let mut owners = Vec::with_capacity(keys.len());
            for verdict in store.begin_many(&scope, &items).await? {
                let BatchBegin::Begun(Begin::Acquired(owner)) = verdict else {
                    return Err(format!("a new key was not acquired: {verdict:?}").into());
                };
                owners.push((owner, b"done".to_vec()));
            }
            for stored in store.complete_many(owners).await {
                stored?;
            }
        }
        Way::OneByOne => {
            for key in keys {
                single(key).await?;
            }
        }
        Way::AllAtOnce => {
            for done in join_all(keys.iter().map(single)).await {
                done?;
            }
        }
    }
    Ok(())
}

fn report(rounds: usize, items: usize, cells: &[Cell]) -> Result<(), Box<dyn std::error::Error>> {
    let mut table = format!(
        "New keys claimed and completed, items/s: batches of {items}, {rounds} rounds per cell (medians)\n\n\
         | mode | way | items/s | batch ÷ this way |\n|---|---|---|---|\n"
    );
    for per_mode in cells.chunks(WAYS.len()) {
        let batch = per_mode[0].median();
        for cell in per_mode {
            let ratio = if cell.way == Way::Batch { String::new() } else { format!("{:.1}x", batch / cell.median()) };
            table += &format!("| {} | {:?} | {:.0} | {ratio} |\n", cell.mode, cell.way, cell.median());
        }
    }
    print!("{table}");
    std::fs::create_dir_all("target/bench")?;
    std::fs::write("target/bench/batch.md", &table)?;
    let json = serde_json::json!({ "rounds": rounds, "items": items, "cells": cells });
    std::fs::write("target/bench/batch.json", serde_json::to_vec_pretty(&json)?)?;
    Ok(())
}
