//! The two tables (correctness, speed) as Markdown for docs/peers.md, and everything as JSON.

use std::fmt::Write as _;
use std::path::Path;

use crate::Error;
use crate::scenarios::{Outcome, Scenario};
use crate::speed::{Cell, Plan, Workload};
use crate::spread::Spread;
use crate::subjects::Subject;

pub fn write(versions: &str, outcomes: &[Outcome], plan: &Plan, cells: &[Cell]) -> Result<(), Error> {
    let mut out = format!("{versions}\n\n### Correctness (rows of `peer_charges` per key, and the answers)\n\n");
    out.push_str(&correctness(outcomes));
    out.push_str(&format!(
        "\n### Speed ({} round(s) x {} s per cell, interleaved; median [min-max] over rounds)\n\n",
        plan.rounds, plan.seconds
    ));
    out.push_str(&speed(cells));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/peers");
    std::fs::create_dir_all(&dir)?;
    let json = serde_json::json!({ "versions": versions, "plan": plan, "correctness": outcomes, "cells": cells });
    std::fs::write(dir.join("peers.json"), serde_json::to_vec_pretty(&json)?)?;
    std::fs::write(dir.join("peers.md"), &out)?;
    println!("{out}");
    println!("written: target/peers/peers.json, peers.md");
    Ok(())
}

fn correctness(outcomes: &[Outcome]) -> String {
    let subjects: Vec<Subject> =
        Subject::ALL.into_iter().filter(|s| outcomes.iter().any(|o| o.subject == *s)).collect();
    let mut out = String::from("| scenario |");
    for subject in &subjects {
        let _ = write!(out, " {} |", subject.name());
    }
    out.push_str(&format!("\n|---|{}\n", "---|".repeat(subjects.len())));
    for scenario in Scenario::ALL {
        let _ = write!(out, "| {} |", scenario.title());
        for subject in &subjects {
            match outcomes.iter().find(|o| o.scenario == scenario && o.subject == *subject) {
                Some(o) => {
                    let _ = write!(
                        out,
                        " **{}** run{}: {} |",
                        o.executions,
                        if o.executions == 1 { "" } else { "s" },
                        o.answer
                    );
                }
                None => out.push_str(" |"),
            }
        }
        out.push('\n');
    }
    out
}

fn speed(cells: &[Cell]) -> String {
    let mut out = String::from(
        "| workload | concurrency | subject | requests/s | p50 ms | p99 ms | ÷ no layer | unexpected |\n|---|---|---|---|---|---|---|---|\n",
    );
    let mut concurrencies: Vec<usize> = cells.iter().map(|c| c.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    for workload in [Workload::Replay, Workload::New] {
        for &concurrency in &concurrencies {
            let cells_of = |subject: Subject| {
                cells
                    .iter()
                    .filter(move |c| c.workload == workload && c.concurrency == concurrency && c.subject == subject)
            };
            for subject in Subject::ALL {
                let Some(throughput) = Spread::of(cells_of(subject).map(|c| c.throughput).collect()) else { continue };
                let ms = |us: fn(&Cell) -> u64| Spread::of(cells_of(subject).map(|c| us(c) as f64 / 1e3).collect());
                let (Some(p50), Some(p99)) = (ms(|c| c.p50_us), ms(|c| c.p99_us)) else { continue };
                // Per round, against the no-layer route of the same round.
                let ratios = cells_of(subject)
                    .filter_map(|c| {
                        let bare = cells_of(Subject::NoLayer).find(|b| b.round == c.round)?;
                        Some(c.throughput / bare.throughput)
                    })
                    .collect();
                let ratio = match (subject, Spread::of(ratios)) {
                    (Subject::NoLayer, _) | (_, None) => String::new(),
                    (_, Some(r)) => format!("{:.2} [{:.2}-{:.2}]", r.median, r.min, r.max),
                };
                let unexpected: u64 = cells_of(subject).map(|c| c.unexpected).sum();
                let _ = writeln!(
                    out,
                    "| {workload:?} | {concurrency} | {} | {:.0} [{:.0}-{:.0}] | {:.2} | {:.2} [{:.2}-{:.2}] | {ratio} | {unexpected} |",
                    subject.name(),
                    throughput.median,
                    throughput.min,
                    throughput.max,
                    p50.median,
                    p99.median,
                    p99.min,
                    p99.max,
                );
            }
        }
    }
    out.push_str(
        "\nNo layer: the handler alone; its replay row is a route answering the same bytes without the insert \
         (what a replay costs at best). Unexpected: answers other than 201, and socket errors.\n",
    );
    out
}
