//! The payments demo: `POST /payments` behind the Idempotency-Key middleware, its receipts sent through
//! the transactional outbox by a relay running in the background.
//!
//! ```text
//! cargo run --example payments
//! ```
//! Environment: `DATABASE_URL`, `REDIS_URL` (throwaway local servers when unset), `BIND` (default
//! 127.0.0.1:8080), `IDEMSTORE_MODE` (`two-tier`, the default, or `postgres-only`), `IDEMSTORE_REDIS_CLUSTER`
//! (comma-separated seed URLs of a Redis Cluster, used instead of `REDIS_URL`),
//! `IDEMSTORE_DEMO_WEBHOOK_SECRETS` (`provider=secret` pairs, comma-separated: the senders
//! `/webhooks/{provider}` accepts, each verified with its own secret, `whsec_` and base64; public demo
//! secrets for `stripe`, `partner` and `carrier` when unset), `IDEMSTORE_ENCRYPTION_KEY` (base64 of 32 bytes, newest first,
//! comma-separated: stored responses are encrypted in both tiers), `IDEMSTORE_DEMO_PATH` (how `POST
//! /payments` settles: `transactional`, the default, writes the charge in the claim's transaction;
//! `takeover` and `indeterminate` write it apart and settle the record after it, under that lease rule).

mod app;

use std::error::Error;
use std::time::Duration;

use idemstore_testkit::LocalServers;
use metrics_exporter_prometheus::PrometheusBuilder;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // Served on /metrics; histograms as real buckets.
    let metrics =
        PrometheusBuilder::new().set_buckets(idemstore::telemetry::CLAIM_DURATION_BUCKETS)?.install_recorder()?;
    idemstore::telemetry::describe();

    let servers = LocalServers::from_env()?;
    let mut builder = servers.store_builder();
    if let Some(keys) = std::env::var("IDEMSTORE_ENCRYPTION_KEY").ok().filter(|keys| !keys.is_empty()) {
        builder = builder.encryption(idemstore::Encryption::from_base64(&keys)?);
        println!("stored responses are encrypted (IDEMSTORE_ENCRYPTION_KEY)");
    }
    let store = builder.build()?;
    app::migrate(&store).await?;

    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let addr = listener.local_addr()?;
    println!("payments demo on http://{addr} ({:?} mode)\n", store.mode());
    println!("try:");
    let post = format!(
        "curl -si http://{addr}/payments -H 'Authorization: Bearer acme' -H 'Content-Type: application/json' \
         -H 'Idempotency-Key: order-1'"
    );
    println!(
        "  {post} -d '{{\"amount\": 1200, \"currency\": \"EUR\", \"customer\": \"cus_1\"}}'   # run twice: replayed"
    );
    println!(
        "  {post} -d '{{\"amount\": 9900, \"currency\": \"EUR\", \"customer\": \"cus_1\"}}'   # same key, new payload: 422"
    );
    println!("  curl -s http://{addr}/metrics | grep idemstore_");
    let tenant = app::tenant_of("acme");
    println!("  # records name the token's tenant, never the token: acme is {tenant} (idemctl inspect {tenant} ...)\n");

    // A bad secret is refused at start, not on the first delivery.
    if std::env::var_os("IDEMSTORE_DEMO_WEBHOOK_SECRET").is_some() {
        return Err(
            "IDEMSTORE_DEMO_WEBHOOK_SECRET is gone: set IDEMSTORE_DEMO_WEBHOOK_SECRETS=provider=secret,...".into()
        );
    }
    let webhook_senders = match std::env::var("IDEMSTORE_DEMO_WEBHOOK_SECRETS") {
        Ok(list) => app::WebhookSenders::parse(&list)?,
        Err(_) => {
            println!("webhooks are verified with the demo's secrets (set IDEMSTORE_DEMO_WEBHOOK_SECRETS):");
            for pair in app::DEMO_WEBHOOK_SECRETS.split(',') {
                let (provider, secret) = pair.trim().split_once('=').expect("provider=secret");
                println!("  POST http://{addr}/webhooks/{provider} signed with {secret}");
            }
            println!();
            app::WebhookSenders::demo()
        }
    };

    let relay = store.clone();
    tokio::spawn(async move {
        loop {
            if let Err(e) = app::send_receipts(&relay).await {
                eprintln!("receipt relay: {e}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });

    // Gauges follow the database, whoever changed it (an operator's idemctl included).
    let observer = store.admin();
    tokio::spawn(async move {
        loop {
            if let Err(e) = observer.refresh_gauges().await {
                eprintln!("gauges: {e}");
            }
            tokio::time::sleep(Duration::from_secs(15)).await;
        }
    });

    let path = match std::env::var("IDEMSTORE_DEMO_PATH").as_deref() {
        Ok("takeover") => app::PaymentsPath::Plain(idemstore::LeaseExpiry::TakeOver),
        Ok("indeterminate") => app::PaymentsPath::Plain(idemstore::LeaseExpiry::MarkIndeterminate),
        Ok("transactional") | Err(_) => app::PaymentsPath::Transactional,
        Ok(other) => {
            return Err(format!("IDEMSTORE_DEMO_PATH={other}: transactional, takeover or indeterminate").into());
        }
    };
    let app = app::App { store, metrics, webhook_senders };
    let app = match path {
        app::PaymentsPath::Transactional => app::router(app),
        plain => app::router_with(app, plain),
    };
    axum::serve(listener, app).with_graceful_shutdown(shutdown()).await?;
    drop(servers);
    Ok(())
}

/// Ctrl-C or SIGTERM: stop serving, then stop the throwaway servers (dropped at the end of `main`).
async fn shutdown() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let terminated = async {
        match terminate.as_mut() {
            Some(signal) => drop(signal.recv().await),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminated => {}
    }
}
