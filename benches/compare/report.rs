//! Medians over rounds, ratios, and the JSON, Markdown and SVG outputs.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use crate::spread::Spread;
use crate::workload::{Subject, Workload};
use crate::{Cell, CostCell, Plan, RelayCell};

/// One row of the table: a workload (or floor) x subject x concurrency, summarized over rounds.
#[derive(Debug, serde::Serialize)]
struct Row {
    workload: Option<Workload>,
    subject: Subject,
    concurrency: usize,
    throughput: Spread,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    postgres_per_request: f64,
    redis_per_request: f64,
    unexpected: u64,
    redis_fallbacks: f64,
    /// Two-tier ÷ Postgres-only throughput, per round (two-tier rows only).
    vs_postgres_only: Option<Spread>,
    /// Throughput ÷ the floor's in the same round: EVALSHA for answers from Redis, SQL for new keys.
    vs_floor: Option<Spread>,
    /// A variant (Redis Cluster, encrypted responses, a quota, group commit off) ÷ its plain mode's
    /// throughput, per round.
    vs_plain: Option<Spread>,
}

type Group = (Option<Workload>, Subject, usize);

fn floor_for(workload: Option<Workload>, subject: Subject) -> Option<Subject> {
    match (workload?, subject) {
        (Workload::New | Workload::Mixed, _) => Some(Subject::SqlFloor),
        (
            _,
            Subject::TwoTier
            | Subject::TwoTierCluster
            | Subject::TwoTierEncrypted
            | Subject::TwoTierQuota
            | Subject::TwoTierAlone,
        ) => Some(Subject::EvalshaFloor),
        (_, _) => Some(Subject::SqlFloor),
    }
}

fn summarize(cells: &[Cell]) -> Vec<Row> {
    let mut groups: BTreeMap<String, (Group, Vec<&Cell>)> = BTreeMap::new();
    for cell in cells {
        let id = format!("{:?}|{}|{:05}", cell.workload, cell.subject.name(), cell.concurrency);
        groups.entry(id).or_insert(((cell.workload, cell.subject, cell.concurrency), Vec::new())).1.push(cell);
    }
    let throughput_in = |workload: Option<Workload>, subject: Subject, concurrency: usize, round: usize| {
        cells
            .iter()
            .find(|c| {
                c.workload == workload && c.subject == subject && c.concurrency == concurrency && c.round == round
            })
            .map(|c| c.throughput)
    };
    let ratios = |of: &[&Cell], workload: Option<Workload>, against: Subject, concurrency: usize| {
        let per_round =
            of.iter().filter_map(|c| Some(c.throughput / throughput_in(workload, against, concurrency, c.round)?));
        Spread::of(per_round.collect())
    };
    let median = |of: &[&Cell], pick: fn(&Cell) -> f64| {
        Spread::of(of.iter().map(|c| pick(c)).collect()).map_or(0.0, |s| s.median)
    };
    groups
        .into_values()
        .map(|((workload, subject, concurrency), of)| Row {
            workload,
            subject,
            concurrency,
            throughput: Spread::of(of.iter().map(|c| c.throughput).collect()).unwrap_or(Spread {
                median: 0.0,
                min: 0.0,
                max: 0.0,
            }),
            p50_ms: median(&of, |c| c.p50_us as f64 / 1000.0),
            p95_ms: median(&of, |c| c.p95_us as f64 / 1000.0),
            p99_ms: median(&of, |c| c.p99_us as f64 / 1000.0),
            p999_ms: median(&of, |c| c.p999_us as f64 / 1000.0),
            postgres_per_request: median(&of, |c| c.postgres_per_request),
            redis_per_request: median(&of, |c| c.redis_per_request),
            unexpected: of.iter().map(|c| c.unexpected).sum(),
            redis_fallbacks: of.iter().map(|c| c.redis_fallbacks).sum(),
            vs_postgres_only: subject
                .postgres_only_baseline()
                .and_then(|baseline| ratios(&of, workload, baseline, concurrency)),
            vs_floor: floor_for(workload, subject).and_then(|floor| ratios(&of, None, floor, concurrency)),
            vs_plain: subject.variant_of().and_then(|plain| ratios(&of, workload, plain, concurrency)),
        })
        .collect()
}

fn spread(s: &Spread, digits: usize) -> String {
    format!("{:.d$} ({:.d$}–{:.d$})", s.median, s.min, s.max, d = digits)
}

/// Anything a sound, healthy run should not show, after the row.
fn notes(r: &Row) -> String {
    let mut notes = String::new();
    if r.unexpected > 0 {
        let _ = write!(notes, " {} unexpected answers", r.unexpected);
    }
    if r.redis_fallbacks > 0.0 {
        let _ = write!(notes, " {} Redis fallbacks", r.redis_fallbacks);
    }
    notes
}

fn markdown(plan: &Plan, rows: &[Row]) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Rounds: {}, {} s per cell, subjects changing places between rounds. Medians over rounds (min–max). \
         PG and Redis columns count the store's own statements and scripts per request (the work's insert \
         is one more statement in both modes).\n",
        plan.rounds, plan.seconds
    );
    md.push_str("| workload | c | subject | req/s | p50 ms | p95 ms | p99 ms | p99.9 ms | PG/req | Redis/req | ÷ PG-only | ÷ floor |\n");
    md.push_str("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        let workload = r.workload.map_or("—".to_owned(), |w| format!("{w:?}").to_lowercase());
        let _ = writeln!(
            md,
            "| {workload} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} |{}",
            r.concurrency,
            r.subject.name(),
            spread(&r.throughput, 0),
            r.p50_ms,
            r.p95_ms,
            r.p99_ms,
            r.p999_ms,
            r.postgres_per_request,
            r.redis_per_request,
            r.vs_postgres_only.map_or(String::new(), |s| spread(&s, 2)),
            r.vs_floor.map_or(String::new(), |s| spread(&s, 2)),
            notes(r),
        );
    }
    let variants: Vec<&Row> = rows.iter().filter(|r| r.vs_plain.is_some()).collect();
    if !variants.is_empty() {
        md.push_str(
            "
Variants ÷ their plain mode (two-tier: one Redis, responses in clear; both: group commit on), throughput
per round: Redis Cluster (three masters, three replicas), every response encrypted
(`StoreBuilder::encryption`), a per-tenant quota the load never reaches (`Policy::quota`: 10^9 new keys a
minute, 10^5 live keys; new keys only), and each claim and completion sent alone
(`StoreBuilder::group_commit(false)`; new keys only):

",
        );
        md.push_str(
            "| workload | c | subject | req/s | ÷ plain | p99 ms |
|---|---:|---|---:|---:|---:|
",
        );
        for r in variants {
            let workload = r.workload.map_or("—".to_owned(), |w| format!("{w:?}").to_lowercase());
            let ratio = r.vs_plain.map_or(String::new(), |s| spread(&s, 2));
            let _ = writeln!(
                md,
                "| {workload} | {} | {} | {} | {ratio} | {:.2} |",
                r.concurrency,
                r.subject.name(),
                spread(&r.throughput, 0),
                r.p99_ms
            );
        }
    }
    md
}

/// The speed targets this bench measures, each against this run: new keys two-tier ÷ Postgres-only
/// (at least 0.95x at every concurrency) and the replay p99 ÷ the EVALSHA floor's (at most 2x, at the
/// highest concurrency).
fn targets_markdown(rows: &[Row]) -> String {
    let find = |workload: Option<Workload>, subject: Subject, concurrency: usize| {
        rows.iter().find(|r| r.workload == workload && r.subject == subject && r.concurrency == concurrency)
    };
    let verdict = |met: bool| if met { "met" } else { "**missed**" };
    let mut md = String::from(
        "\nSpeed targets, against this run (medians; a ratio's per-round range in brackets):\n\n\
         | target | c | measured | verdict |\n|---|---:|---:|---|\n",
    );
    let mut concurrencies: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    for &c in &concurrencies {
        let Some(ratio) = find(Some(Workload::New), Subject::TwoTier, c).and_then(|r| r.vs_postgres_only) else {
            continue;
        };
        let _ = writeln!(
            md,
            "| new keys, two-tier ÷ Postgres-only ≥ 0.95x | {c} | {:.2}x [{:.2}–{:.2}] | {} |",
            ratio.median,
            ratio.min,
            ratio.max,
            verdict((ratio.median * 100.0).round() >= 95.0)
        );
    }
    if let Some(&c) = concurrencies.iter().max()
        && let (Some(replay), Some(floor)) =
            (find(Some(Workload::Replay), Subject::TwoTier, c), find(None, Subject::EvalshaFloor, c))
    {
        // Judged as printed, to two decimals.
        let ratio = (replay.p99_ms / floor.p99_ms.max(f64::MIN_POSITIVE) * 100.0).round() / 100.0;
        let _ = writeln!(
            md,
            "| replay p99 ÷ the EVALSHA floor's ≤ 2x | {c} | {:.2}x ({:.2} ms ÷ {:.2} ms) | {} |",
            ratio,
            replay.p99_ms,
            floor.p99_ms,
            verdict(ratio <= 2.0)
        );
    }
    md
}

/// Replay and new keys in both modes, with both floors: the comparisons docs/performance.md reads.
fn plot(rows: &[Row], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let shown = |r: &&Row| matches!(r.workload, None | Some(Workload::Replay | Workload::New));
    let rows: Vec<&Row> = rows.iter().filter(shown).collect();
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    let max_c = rows.iter().map(|r| r.concurrency).max().unwrap_or(1).max(2) as f64;
    let throughput: fn(&Row) -> f64 = |r| r.throughput.median;
    let p99: fn(&Row) -> f64 = |r| r.p99_ms;
    let panels = [
        (&left, "throughput (req/s, log)", throughput, SeriesLabelPosition::LowerRight),
        (&right, "p99 latency (ms, log)", p99, SeriesLabelPosition::UpperLeft),
    ];
    for (area, title, value, legend) in panels {
        let values: Vec<f64> = rows.iter().map(|r| value(r)).filter(|v| *v > 0.0).collect();
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min).max(1e-3) / 2.0;
        let hi = values.iter().copied().fold(0.0, f64::max) * 2.0;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((0.8..max_c * 1.25).log_scale(), (lo..hi.max(lo * 2.0)).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("requests in flight")
            .x_labels(4)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v}"))
            .light_line_style(WHITE)
            .draw()?;
        let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for r in &rows {
            let name = match r.workload {
                Some(w) => format!("{} {}", format!("{w:?}").to_lowercase(), r.subject.name()),
                None => r.subject.name().to_owned(),
            };
            series.entry(name).or_default().push((r.concurrency as f64, value(r)));
        }
        for (i, (name, mut points)) in series.into_iter().enumerate() {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = Palette99::pick(i).to_rgba();
            let floor = name.contains("floor");
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(if floor { 1 } else { 2 })))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// The relay's rows per second by batch size, over rounds.
fn relay_summary(relay: &[RelayCell]) -> BTreeMap<u32, Spread> {
    let mut by_batch: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for cell in relay {
        by_batch.entry(cell.batch).or_default().push(cell.rows_per_second);
    }
    by_batch.into_iter().filter_map(|(batch, values)| Some((batch, Spread::of(values)?))).collect()
}

fn relay_markdown(relay: &[RelayCell]) -> String {
    let Some(backlog) = relay.first().map(|c| c.rows) else { return String::new() };
    let mut md = format!(
        "\nOutbox relay: one `Outbox::drain` over a backlog of {backlog} rows in 10 topics, a sink that accepts at \
         once (medians over rounds, min–max).\n\n| batch | rows/s |\n|---:|---:|\n"
    );
    for (batch, rows_per_second) in relay_summary(relay) {
        let _ = writeln!(md, "| {batch} | {} |", spread(&rows_per_second, 0));
    }
    md
}

/// The counted pass's table: what one request paid, by workload and subject.
fn cost_markdown(costs: &[CostCell]) -> String {
    let Some(first) = costs.first() else { return String::new() };
    let intro = format!(
        "What a request pays, counted in a pass of its own ({} requests per row after a warm-up, {} in flight, \
         not timed). The work's own insert is in every library row (one round trip and one write transaction \
         in `run_once`; inside the claim's transaction in-tx).",
        first.requests, first.concurrency
    );
    let rows: Vec<_> = costs
        .iter()
        .map(|c| {
            (
                c.workload.map_or("—".to_owned(), |w| format!("{w:?}").to_lowercase()),
                c.subject.name().to_owned(),
                c.cost,
            )
        })
        .collect();
    crate::cost::markdown(&intro, &rows)
}

pub fn write(
    plan: &Plan,
    cells: &[Cell],
    relay: &[RelayCell],
    costs: &[CostCell],
) -> Result<(), Box<dyn std::error::Error>> {
    let rows = summarize(cells);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let relay_summary = relay_summary(relay);
    let json = serde_json::json!({
        "plan": plan, "cells": cells, "summary": rows, "relay": relay, "relay_summary": relay_summary,
        "costs": costs,
    });
    std::fs::write(dir.join("compare.json"), serde_json::to_vec_pretty(&json)?)?;
    let table = markdown(plan, &rows) + &cost_markdown(costs) + &relay_markdown(relay) + &targets_markdown(&rows);
    std::fs::write(dir.join("compare.md"), &table)?;
    plot(&rows, &dir.join("compare.svg"))?;
    println!("{table}");
    println!("written: target/bench/compare.json, compare.md, compare.svg");
    Ok(())
}
