//! A real Prometheus (Debian's `prometheus`, which `.ci/run` installs) scrapes the demo every second with
//! the rules of `ops/` loaded: after a known sequence the PromQL of docs/metrics.md and every rule evaluate through
//! Prometheus's HTTP API to the right, non-zero values, and the Redis fallback alert goes pending on the
//! first Redis outage after start. Skipped, with a message, where `prometheus` is not installed.

use crate::support;
use support::payments::app;
// Only the demo's router is used here.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idemstore::{IdempotencyKey, Mode, Policy, Scope, State};
use serde_json::{Value, json};
use support::{Harness, Servers};

suite!(prometheus_sees_the_first_burst_and_the_first_outage);

/// The duplicate-rate and conflict-rate queries of docs/metrics.md.
const DUPLICATE_RATE: &str = r#"sum(rate(idemstore_outcomes_total{outcome=~"replayed|in_flight"}[5m])) / sum(rate(idemstore_outcomes_total[5m]))"#;
const CONFLICT_RATE: &str =
    r#"sum(rate(idemstore_outcomes_total{outcome="mismatch"}[5m])) / sum(rate(idemstore_outcomes_total[5m]))"#;

/// A Prometheus server of this test's own, stopped when dropped.
struct Prometheus {
    child: Child,
    base: String,
    _data: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes `target` (host:port) every second, rules from ops/ evaluated every second.
    fn start(target: &str) -> Option<Self> {
        let data = tempfile::tempdir().expect("a data directory");
        let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/idemstore.rules.yml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  \
             - job_name: demo\n    static_configs:\n      - targets: ['{target}']\n",
            rules.display()
        );
        let config_file = data.path().join("prometheus.yml");
        std::fs::write(&config_file, config).expect("write the configuration");
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("port").port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!("--storage.tsdb.path={}", data.path().join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        Some(Self { child, base: format!("http://127.0.0.1:{port}"), _data: data })
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> Option<Value> {
        let response = reqwest::Client::new().get(format!("{}{path}", self.base)).query(query).send().await.ok()?;
        response.json::<Value>().await.ok()
    }

    /// The value of an instant query, if it has exactly one series.
    async fn value(&self, promql: &str) -> Option<f64> {
        let answer = self.get("/api/v1/query", &[("query", promql)]).await?;
        match answer["data"]["result"].as_array()?.as_slice() {
            [series] => series["value"][1].as_str()?.parse().ok(),
            _ => None,
        }
    }

    /// Polls `check` every 250 ms until it holds, for at most 60 s.
    async fn until(&self, what: &str, mut check: impl AsyncFnMut(&Self) -> bool) {
        for _ in 0..240 {
            if check(self).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!("Prometheus never saw: {what}");
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn post(client: &reqwest::Client, base: &str, key: &str, amount: i64, delay_ms: u64) -> reqwest::StatusCode {
    let body = json!({"amount": amount, "currency": "EUR", "customer": "cus_1"});
    let request = client.post(format!("{base}/payments")).bearer_auth("acme").header("idempotency-key", key);
    let request = request.header("x-demo-delay-ms", delay_ms.to_string()).json(&body);
    request.send().await.expect("HTTP request").status()
}

/// One new key, then 5 in-flight duplicates, 120 replays and 10 mismatches: Prometheus, which scraped
/// the outcome series at 0 before the burst, reads both ratios above 0 (before: both 0.0, since every
/// series appeared with its first increment), every rule evaluates, and in two-tier mode the fallback
/// alert is pending on the first Redis outage (before: only on the second).
async fn prometheus_sees_the_first_burst_and_the_first_outage(mode: Mode) {
    if support::rerun_alone(mode, module_path!(), "prometheus_sees_the_first_burst_and_the_first_outage") {
        return;
    }
    let h = Harness::with(mode, Policy::default(), Servers::Owned).await;
    app::migrate(&h.store).await.expect("migrations");
    // The plain path: its in-progress record is visible while the slow request runs, and duplicates
    // get 409 at once in both modes (on the transactional path a Postgres-only duplicate waits on the
    // claim's row lock first).
    let app = app::App {
        store: h.store.clone(),
        metrics: support::recorder().clone(),
        webhook_senders: app::WebhookSenders::demo(),
    };
    let router = app::router_with(app, app::PaymentsPath::Plain(idemstore::LeaseExpiry::TakeOver));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let target = listener.local_addr().expect("address").to_string();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let base = format!("http://{target}");
    let Some(prometheus) = Prometheus::start(&target) else {
        // CI installs it (.ci/run): there, a missing binary is a failure, not a pass.
        assert!(std::env::var_os("CI").is_none(), "`prometheus` is not installed (apt-get install prometheus)");
        eprintln!("SKIPPED: `prometheus` is not installed (apt-get install prometheus)");
        return;
    };
    prometheus.until("ready", async |p| p.get("/-/ready", &[]).await.is_some() || p.value("up").await.is_some()).await;

    let client = reqwest::Client::new();
    assert_eq!(post(&client, &base, "p-1", 1, 0).await, reqwest::StatusCode::CREATED);
    // A scrape after the first request holds the series the burst will increment, at 0.
    let zero = r#"idemstore_outcomes_total{operation="POST /payments",outcome="mismatch"}"#;
    prometheus.until("the mismatch series at 0", async |p| p.value(zero).await == Some(0.0)).await;

    let slow = tokio::spawn({
        let (client, base) = (client.clone(), base.clone());
        async move { post(&client, &base, "p-slow", 1, 1500).await }
    });
    let (scope, slow_key) =
        (Scope::new(app::tenant_of("acme"), "POST /payments").expect("scope"), IdempotencyKey::new("p-slow"));
    let slow_key = slow_key.expect("key");
    while h.store.admin().lookup(&scope, &slow_key).await.expect("lookup").is_none_or(|r| r.state != State::InProgress)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..5 {
        assert_eq!(post(&client, &base, "p-slow", 1, 0).await, reqwest::StatusCode::CONFLICT);
    }
    assert_eq!(slow.await.expect("the slow request"), reqwest::StatusCode::CREATED);
    for _ in 0..120 {
        assert_eq!(post(&client, &base, "p-1", 1, 0).await, reqwest::StatusCode::CREATED);
    }
    for _ in 0..10 {
        assert_eq!(post(&client, &base, "p-1", 2, 0).await, reqwest::StatusCode::UNPROCESSABLE_ENTITY);
    }
    let replayed = r#"idemstore_outcomes_total{operation="POST /payments",outcome="replayed"}"#;
    prometheus.until("the 120 replays", async |p| p.value(replayed).await == Some(120.0)).await;
    // The mismatches came last: a scrape that saw every replay may not have seen them all yet.
    let mismatched = r#"idemstore_outcomes_total{operation="POST /payments",outcome="mismatch"}"#;
    prometheus.until("the 10 mismatches", async |p| p.value(mismatched).await == Some(10.0)).await;

    let duplicate_rate = prometheus.value(DUPLICATE_RATE).await.expect("the duplicate rate");
    let conflict_rate = prometheus.value(CONFLICT_RATE).await.expect("the conflict rate");
    println!("REPORT prometheus {mode:?} duplicate_rate={duplicate_rate:.3} conflict_rate={conflict_rate:.3}");
    // 125 of 137 answers were duplicates, 10 of 137 mismatches; rate() extrapolates, so with margin.
    assert!((0.5..=1.0).contains(&duplicate_rate), "{duplicate_rate}");
    assert!((0.02..=0.2).contains(&conflict_rate), "{conflict_rate}");
    let recorded = r#"operation:idemstore_duplicate_ratio:rate5m{operation="POST /payments"}"#;
    prometheus.until("the recording rules", async |p| p.value(recorded).await.is_some_and(|v| v > 0.0)).await;
    let rules = prometheus.get("/api/v1/rules", &[]).await.expect("the rules");
    let groups = rules["data"]["groups"].as_array().expect("rule groups");
    let all: Vec<&Value> = groups.iter().flat_map(|g| g["rules"].as_array().into_iter().flatten()).collect();
    assert!(all.len() >= 8, "the rules of ops/ are loaded: {rules}");
    assert!(all.iter().all(|rule| rule["health"] == "ok"), "every rule evaluates: {rules}");

    if mode == Mode::TwoTier {
        h.redis.as_ref().expect("owned Redis").kill();
        for n in 0..5 {
            assert_eq!(post(&client, &base, &format!("p-down-{n}"), 1, 0).await, reqwest::StatusCode::CREATED);
        }
        prometheus
            .until("the fallback alert pending", async |p| {
                let alerts = p.get("/api/v1/alerts", &[]).await.unwrap_or_default();
                alerts["data"]["alerts"].as_array().into_iter().flatten().any(|alert| {
                    alert["labels"]["alertname"] == "IdemstoreRedisFallbackActive"
                        && (alert["state"] == "pending" || alert["state"] == "firing")
                })
            })
            .await;
        println!("REPORT prometheus {mode:?} IdemstoreRedisFallbackActive pending on the first outage");
    }
}
