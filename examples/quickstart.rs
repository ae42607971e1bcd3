//! A tour of the run-once API: one charge retried, raced and reused with another payload.
//!
//! ```text
//! cargo run --example quickstart
//! ```
//! Uses `DATABASE_URL` and `REDIS_URL` when set; otherwise starts throwaway servers on loopback and
//! stops them on exit. `IDEMSTORE_MODE=postgres-only` runs without Redis.

use std::error::Error;
use std::sync::atomic::{AtomicU32, Ordering};

use idemstore::{IdempotencyKey, RunOutcome, Scope};
use idemstore_testkit::LocalServers;
use metrics_exporter_prometheus::PrometheusBuilder;
use serde_json::{Value, json};

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let metrics = PrometheusBuilder::new().install_recorder()?;
    idemstore::telemetry::describe();

    let servers = LocalServers::from_env()?;
    let store = servers.store_builder().build()?;
    store.migrate().await?;
    println!("store ready in {:?} mode\n", store.mode());

    let executions = AtomicU32::new(0);
    let charge = || async {
        let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
        Ok::<_, std::io::Error>(json!({ "charge_id": format!("ch_{n}"), "amount": 1200 }))
    };
    let scope = Scope::new("tenant-42", "POST /payments")?;
    let key = IdempotencyKey::new(format!("order-{}", std::process::id()))?;
    let payload = json!({ "amount": 1200, "currency": "EUR" });

    let first: RunOutcome<Value> = store.run_once(&scope, &key, &payload, charge).await?;
    println!("first call:              {first:?}");
    let retry: RunOutcome<Value> = store.run_once(&scope, &key, &payload, charge).await?;
    println!("retry:                   {retry:?}");
    let other_payload = json!({ "amount": 9999, "currency": "EUR" });
    let reused: RunOutcome<Value> = store.run_once(&scope, &key, &other_payload, charge).await?;
    println!("key reused, new payload: {reused:?}");

    let race_key = IdempotencyKey::new(format!("race-{}", std::process::id()))?;
    let racers = (0..32).map(|_| store.run_once(&scope, &race_key, &payload, charge));
    let outcomes: Vec<Result<RunOutcome<Value>, _>> = futures::future::join_all(racers).await;
    let executed = outcomes.iter().filter(|o| matches!(o, Ok(RunOutcome::Executed(_)))).count();
    println!("32 concurrent duplicates: {executed} executed, {} answered without executing", outcomes.len() - executed);
    println!("\nthe work ran {} times in all\n", executions.load(Ordering::SeqCst));

    println!("metrics:");
    for line in metrics.render().lines().filter(|l| l.starts_with("idemstore_") && !l.contains("_seconds")) {
        println!("  {line}");
    }
    drop(servers);
    Ok(())
}
