//! A concurrent workload of retrying clients, and the checker that reads its real effects afterwards.
//!
//! Every client sends each key several times (a retry after a timeout looks the same), and from its
//! second pass on, mixes in requests that reuse a key with another payload. A request is retried on
//! "in flight" and on errors until it gets an answer or runs out of attempts. The work inserts a row into
//! `effects`, which has no unique constraint, so a double execution shows up as two rows.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemstore::{IdempotencyKey, RunOutcome, Store};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::Harness;

/// The shape of a workload.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub clients: usize,
    pub keys: usize,
    /// Passes each client makes over all keys.
    pub passes: usize,
    /// Attempts per request before the client gives up (each "in flight" or error costs one).
    pub attempts: usize,
}

impl Default for Load {
    fn default() -> Self {
        Self { clients: 8, keys: 24, passes: 3, attempts: 400 }
    }
}

/// What the checker found.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Report {
    pub requests: u64,
    pub keys: usize,
    pub executions: u64,
    /// Executions beyond the first, summed over keys.
    pub duplicate_executions: u64,
    /// Keys whose answer a client got but which Postgres does not hold as completed with that answer.
    pub lost_completions: u64,
    /// Keys for which clients got different answers.
    pub divergent_answers: u64,
    /// Errors clients saw (each was retried).
    pub errors_surfaced: u64,
    /// Reused-key requests refused as mismatches.
    pub mismatches_refused: u64,
    /// Requests that got an answer they should not have (a mismatch for the right payload, ...).
    pub wrong_answers: u64,
    /// Requests still without an answer after all attempts.
    pub unanswered: u64,
    /// The slowest single attempt, in milliseconds.
    pub slowest_attempt_ms: u64,
}

/// Counts answered requests, so a fault can be injected part-way through the load.
#[derive(Clone)]
pub struct Progress(watch::Sender<u64>);

impl Progress {
    pub fn new() -> Self {
        Self(watch::channel(0).0)
    }

    /// Resolves once `n` requests have been answered.
    pub async fn reached(&self, n: u64) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|done| *done >= n).await;
    }

    fn advance(&self) {
        self.0.send_modify(|done| *done += 1);
    }
}

#[derive(Default)]
struct Tally {
    report: Report,
    answers: BTreeMap<String, BTreeSet<String>>,
}

fn payload(key: usize) -> Value {
    json!({ "amount": 100 + key, "currency": "EUR" })
}

/// Runs the load on `store` under `tenant`, then checks the effects.
pub async fn run(h: &Harness, store: &Store, tenant: &str, load: Load, progress: &Progress) -> Report {
    run_until(h, store, tenant, load, progress, None).await
}

/// As [`run`]; with `fault_over`, each client goes on past `load.passes` until it has made one whole
/// pass that started after the flag was set.
async fn run_until(
    h: &Harness,
    store: &Store,
    tenant: &str,
    load: Load,
    progress: &Progress,
    fault_over: Option<&AtomicBool>,
) -> Report {
    let tally = Mutex::new(Tally::default());
    let clients = (0..load.clients).map(|client| {
        let tally = &tally;
        async move {
            let mut passes_after_fault = 0;
            for pass in 0.. {
                if pass >= load.passes && (fault_over.is_none() || passes_after_fault > 0) {
                    break;
                }
                let after_fault = fault_over.is_some_and(|over| over.load(Ordering::Acquire));
                for i in 0..load.keys {
                    let k = (i + client) % load.keys;
                    let key = IdempotencyKey::new(format!("chaos-{k}")).expect("key");
                    // From the second pass on, every fifth request reuses the key with another payload.
                    let reused = pass > 0 && (client + i) % 5 == 0;
                    let body = if reused { json!({ "amount": 1, "reused": true }) } else { payload(k) };
                    request(h, store, tenant, &key, &body, reused, load.attempts, tally).await;
                    progress.advance();
                }
                passes_after_fault += usize::from(after_fault);
            }
        }
    });
    futures::future::join_all(clients).await;

    let mut tally = tally.into_inner().expect("no poisoned tally");
    let report = &mut tally.report;
    report.keys = load.keys;
    for k in 0..load.keys {
        let key = IdempotencyKey::new(format!("chaos-{k}")).expect("key");
        let executions = h.effects(tenant, &key).await as u64;
        report.executions += executions;
        report.duplicate_executions += executions.saturating_sub(1);
        let seen = tally.answers.get(key.as_str()).cloned().unwrap_or_default();
        if seen.len() > 1 {
            report.divergent_answers += 1;
        }
        let stored = store.admin().lookup(&h.scope(tenant), &key).await.expect("lookup after the load");
        let stored = stored.and_then(|r| r.response).map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned());
        if seen.iter().any(|answer| Some(answer) != stored.as_ref()) {
            report.lost_completions += 1;
        }
    }
    tally.report
}

#[allow(clippy::too_many_arguments)]
async fn request(
    h: &Harness,
    store: &Store,
    tenant: &str,
    key: &IdempotencyKey,
    body: &Value,
    reused: bool,
    attempts: usize,
    tally: &Mutex<Tally>,
) {
    let scope = h.scope(tenant);
    let record = |f: &dyn Fn(&mut Tally)| f(&mut tally.lock().expect("tally"));
    record(&|t| t.report.requests += 1);
    for _ in 0..attempts {
        let started = Instant::now();
        let outcome = store.run_once(&scope, key, body, || h.charge(tenant, key)).await;
        let elapsed = started.elapsed().as_millis() as u64;
        record(&|t| t.report.slowest_attempt_ms = t.report.slowest_attempt_ms.max(elapsed));
        match outcome {
            Ok(RunOutcome::Executed(value) | RunOutcome::Replayed(value)) if !reused => {
                let answer = value.to_string();
                record(&|t| {
                    t.answers.entry(key.as_str().to_owned()).or_default().insert(answer.clone());
                });
                return;
            }
            Ok(RunOutcome::Mismatch) if reused => return record(&|t| t.report.mismatches_refused += 1),
            Ok(RunOutcome::InFlight { retry_after }) => {
                tokio::time::sleep(retry_after.clamp(Duration::from_millis(2), Duration::from_millis(25))).await;
            }
            Ok(_) => return record(&|t| t.report.wrong_answers += 1),
            Err(_) => {
                record(&|t| t.report.errors_surfaced += 1);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    record(&|t| t.report.unanswered += 1);
}

/// Runs the default load across `fault`, injected once a third of the requests are answered.
pub async fn load_with_fault<F: std::future::Future<Output = ()>>(h: &Harness, fault: impl FnOnce() -> F) -> Report {
    load_with_fault_at(h, 3, fault).await
}

/// Runs the default load across `fault`, injected once 1/`fraction` of the requests are answered.
pub async fn load_with_fault_at<F: std::future::Future<Output = ()>>(
    h: &Harness,
    fraction: u64,
    fault: impl FnOnce() -> F,
) -> Report {
    load_across(h, Load::default(), fraction, fault).await
}

/// Runs `load` across `fault`, injected once a quarter of its requests are answered.
pub async fn load_across_fault<F: std::future::Future<Output = ()>>(
    h: &Harness,
    load: Load,
    fault: impl FnOnce() -> F,
) -> Report {
    load_across(h, load, 4, fault).await
}

/// Runs `load`, injecting `fault` once 1/`fraction` of its requests are answered, and goes on until
/// every client made one whole pass that started after the fault's last step (a load that ended before
/// the fault did would prove nothing about it); checks that those requests were answered.
async fn load_across<F: std::future::Future<Output = ()>>(
    h: &Harness,
    load: Load,
    fraction: u64,
    fault: impl FnOnce() -> F,
) -> Report {
    let (progress, fault_over) = (Progress::new(), AtomicBool::new(false));
    let total = (load.clients * load.keys * load.passes) as u64;
    let injected = async {
        progress.reached(total / fraction).await;
        fault().await;
        fault_over.store(true, Ordering::Release);
        *progress.0.borrow()
    };
    let (report, answered_by_then) =
        tokio::join!(run_until(h, &h.store, "acme", load, &progress, Some(&fault_over)), injected);
    let after = report.requests - answered_by_then;
    assert!(after >= (load.clients * load.keys) as u64, "only {after} requests after the fault: {report:#?}");
    report
}

/// Prints the report with what the store counted meanwhile, for `docs/reliability.md`.
pub fn print(fault: &str, h: &Harness, report: &Report) {
    let mut line = serde_json::to_value(report).expect("json");
    line["redis_fallbacks"] = json!(fallbacks(h));
    line["reconciliations"] = json!(h.counter("idemstore_reconciliations_total", &[]));
    line["takeovers"] = json!(h.counter("idemstore_lease_takeovers_total", &[]));
    println!("REPORT {fault} {:?} {line}", h.mode);
}

/// The invariants every fault must keep: nothing ran twice, every answer is what Postgres holds, and
/// every request was answered.
pub fn assert_once(report: &Report) {
    assert_eq!(report.duplicate_executions, 0, "{report:#?}");
    assert_clean(report);
}

/// Answers are consistent and complete (duplicates are checked by the caller).
pub fn assert_clean(report: &Report) {
    assert_eq!(report.lost_completions, 0, "{report:#?}");
    assert_eq!(report.divergent_answers, 0, "{report:#?}");
    assert_eq!(report.wrong_answers, 0, "{report:#?}");
    assert_eq!(report.unanswered, 0, "{report:#?}");
    assert_eq!(report.executions, report.keys as u64 + report.duplicate_executions, "{report:#?}");
    assert!(report.mismatches_refused > 0, "the load reuses keys: {report:#?}");
}

pub fn fallbacks(h: &Harness) -> f64 {
    h.counter("idemstore_redis_fallbacks_total", &[])
}
