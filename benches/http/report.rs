//! The HTTP run's table: medians over rounds with min-max, and the ratios the targets are stated in.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use crate::footprint::Footprint;
use crate::spread::Spread;
use crate::{Cell, CostCell, Plan, Subject, Workload};

#[derive(Debug, serde::Serialize)]
struct Row {
    workload: Workload,
    concurrency: usize,
    subject: Subject,
    throughput: Spread,
    p99_us: Spread,
    unexpected: u64,
    socket_errors: u64,
}

fn summarize(cells: &[Cell]) -> Vec<Row> {
    let mut groups: BTreeMap<(String, usize, String), Vec<&Cell>> = BTreeMap::new();
    for cell in cells {
        let key = (format!("{:?}", cell.workload), cell.concurrency, format!("{:?}", cell.subject));
        groups.entry(key).or_default().push(cell);
    }
    let mut rows: Vec<Row> = groups
        .into_values()
        .filter_map(|group| {
            let first = group[0];
            Some(Row {
                workload: first.workload,
                concurrency: first.concurrency,
                subject: first.subject,
                throughput: Spread::of(group.iter().map(|c| c.throughput).collect())?,
                p99_us: Spread::of(group.iter().map(|c| c.p99_us as f64).collect())?,
                unexpected: group.iter().map(|c| c.unexpected).sum(),
                socket_errors: group.iter().map(|c| c.socket_errors).sum(),
            })
        })
        .collect();
    rows.sort_by_key(|row| (row.workload as u8, row.concurrency, row.subject as u8));
    rows
}

fn markdown(plan: &Plan, rows: &[Row]) -> String {
    let mut out = format!(
        "HTTP through wrk (2 threads), {} round(s) x {} s per cell, subjects changing places between rounds; medians [min-max].\n\n\
         | workload | conns | subject | req/s | p99 ms | ÷ bare | two-tier ÷ postgres-only | unexpected |\n\
         |---|---|---|---|---|---|---|---|\n",
        plan.rounds, plan.seconds
    );
    let median_of = |workload, concurrency, subject| {
        rows.iter()
            .find(|r| r.workload == workload && r.concurrency == concurrency && r.subject == subject)
            .map(|r| r.throughput.median)
    };
    for row in rows {
        let ratio =
            |other: Option<f64>| other.map_or(String::new(), |other| format!("{:.2}x", row.throughput.median / other));
        let over_bare = match row.subject {
            Subject::Bare => String::new(),
            _ => ratio(median_of(row.workload, row.concurrency, Subject::Bare)),
        };
        let over_postgres = match row.subject {
            Subject::TwoTier => ratio(median_of(row.workload, row.concurrency, Subject::PostgresOnly)),
            Subject::TwoTierTx => ratio(median_of(row.workload, row.concurrency, Subject::PostgresOnlyTx)),
            _ => String::new(),
        };
        let t = row.throughput;
        let p = row.p99_us;
        let _ = writeln!(
            out,
            "| {:?} | {} | {:?} | {:.0} [{:.0}-{:.0}] | {:.2} [{:.2}-{:.2}] | {over_bare} | {over_postgres} | {} |",
            row.workload,
            row.concurrency,
            row.subject,
            t.median,
            t.min,
            t.max,
            p.median / 1e3,
            p.min / 1e3,
            p.max / 1e3,
            row.unexpected + row.socket_errors,
        );
    }
    out.push_str(
        "\nBare: the same app without the layer; its replay row is a route that answers the same bytes without \
         the insert. In-flight answers are 409 (no bare row). The Tx subjects run the handler's insert in the \
         claim's transaction (one commit per new key).\n",
    );
    out
}

/// The speed targets this bench measures, each against this run: new keys through the plain path at
/// least 0.35x the bare handler, through the transactional path at least 0.6x, at each concurrency.
fn targets_markdown(rows: &[Row]) -> String {
    let median_of = |subject, concurrency| {
        rows.iter()
            .find(|r| r.workload == Workload::New && r.concurrency == concurrency && r.subject == subject)
            .map(|r| r.throughput.median)
    };
    let mut md = String::from(
        "\nSpeed targets, against this run (new keys, medians ÷ the bare handler's):\n\n\
         | target | conns | subject | measured | verdict |\n|---|---|---|---|---|\n",
    );
    let mut concurrencies: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    let targets = [
        ("plain path ≥ 0.35x bare", 0.35, [Subject::TwoTier, Subject::PostgresOnly]),
        ("transactional path ≥ 0.6x bare", 0.6, [Subject::TwoTierTx, Subject::PostgresOnlyTx]),
    ];
    for (target, at_least, subjects) in targets {
        for &c in &concurrencies {
            for subject in subjects {
                let (Some(of), Some(bare)) = (median_of(subject, c), median_of(Subject::Bare, c)) else { continue };
                if bare <= 0.0 {
                    continue;
                }
                // Judged as printed, to two decimals.
                let ratio = (of / bare * 100.0).round() / 100.0;
                let verdict = if ratio >= at_least {
                    "met".to_owned()
                } else {
                    format!("**missed** ({:.0}% of it)", 100.0 * ratio / at_least)
                };
                let _ = writeln!(md, "| {target} | {c} | {subject:?} | {ratio:.2}x | {verdict} |");
            }
        }
    }
    md
}

/// The counted pass's table.
fn cost_markdown(costs: &[CostCell]) -> String {
    let intro = "What a request pays, counted in a pass of its own (wrk, one second per row at 16 connections \
                 after a warm-up, not timed; per request answered). The handler's insert is in every row, in the \
                 claim's transaction on the transactional paths.";
    let rows: Vec<_> = costs
        .iter()
        .map(|c| (format!("{:?}", c.workload).to_lowercase(), format!("{:?}", c.subject), c.cost))
        .collect();
    if rows.is_empty() { String::new() } else { crate::cost::markdown(intro, &rows) }
}

pub fn write(
    plan: &Plan,
    cells: &[Cell],
    footprint: &Footprint,
    costs: &[CostCell],
) -> Result<(), Box<dyn std::error::Error>> {
    let rows = summarize(cells);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let json =
        serde_json::json!({ "plan": plan, "cells": cells, "summary": rows, "footprint": footprint, "costs": costs });
    std::fs::write(dir.join("http.json"), serde_json::to_vec_pretty(&json)?)?;
    let table = markdown(plan, &rows) + &cost_markdown(costs) + &footprint.markdown() + &targets_markdown(&rows);
    std::fs::write(dir.join("http.md"), &table)?;
    println!("{table}");
    println!("written: target/bench/http.json, http.md");
    Ok(())
}
