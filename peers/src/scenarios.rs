//! Correctness, counted in rows of `peer_charges`: each scenario runs against every subject with keys of
//! its own, and reports how often the handler ran and what the client was answered.

use std::collections::BTreeMap;
use std::time::Duration;

use idemstore_testkit::RedisServer;
use sqlx::PgPool;

use crate::Error;
use crate::client::{Answer, BODY, Client, TIMEOUT};
use crate::crash;
use crate::subjects::{App, LEASE, Subject};

/// How long a scenario waits for requests its client gave up on to end on the server.
const SETTLE: Duration = Duration::from_secs(30);
/// A little over idemstore's default Redis cool-down.
const REDIS_COOLDOWN: Duration = Duration::from_millis(1100);

/// One scenario's result for one subject.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    pub scenario: Scenario,
    pub subject: Subject,
    /// Rows the handler inserted for the scenario's key(s).
    pub executions: i64,
    /// What the client(s) got, in words.
    pub answer: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    Concurrent,
    OtherPayload,
    PausedRetry,
    PausedNewKey,
    Flushall,
    RestartedEmpty,
    OwnerCrash,
    Tenants,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::Concurrent,
        Scenario::OtherPayload,
        Scenario::PausedRetry,
        Scenario::PausedNewKey,
        Scenario::Flushall,
        Scenario::RestartedEmpty,
        Scenario::OwnerCrash,
        Scenario::Tenants,
    ];

    fn breaks_redis(self) -> bool {
        matches!(self, Scenario::PausedRetry | Scenario::PausedNewKey | Scenario::Flushall | Scenario::RestartedEmpty)
    }

    pub fn title(self) -> &'static str {
        match self {
            Scenario::Concurrent => "50 concurrent POSTs, one key, 200 ms handler",
            Scenario::OtherPayload => "same key, another payload, after completion",
            Scenario::Flushall => "retry after FLUSHALL (after completion)",
            Scenario::RestartedEmpty => "two retries after Redis restarted empty (after completion)",
            Scenario::PausedRetry => "retry while Redis is paused (SIGSTOP; after completion)",
            Scenario::PausedNewKey => "a new key while Redis is paused (SIGSTOP)",
            Scenario::OwnerCrash => "the owner's process dies mid-request; retry at once, then after the lease (2 s)",
            Scenario::Tenants => "tenant B sends tenant A's key and body (after A completed)",
        }
    }
}

/// What the scenarios share: the database to count in, the Redis to break, a tag for fresh keys.
pub struct Bench<'a> {
    pub pg: &'a PgPool,
    pub postgres_url: String,
    pub redis: &'a RedisServer,
    pub run: String,
}

impl Bench<'_> {
    pub async fn run(&self, scenario: Scenario, app: &App) -> Result<Outcome, Error> {
        let key = format!("{}-{:?}-{:?}", self.run, scenario, app.subject);
        let client = Client::new(app.address, app.subject, "tenant-a").await?;
        client.ready(&format!("{key}-ready")).await?;
        if scenario.breaks_redis() {
            // idemstore skips a Redis it saw fail for a cool-down (1 s by default): let any earlier
            // fault's pass, so that every subject meets this one as a fresh outage. Nothing signals it.
            tokio::time::sleep(REDIS_COOLDOWN).await;
        }
        let answer = match scenario {
            Scenario::Concurrent => {
                let requests = (0..50).map(|_| client.charge(&key, BODY, &[("x-delay-ms", "200")]));
                let answers = futures_util::future::join_all(requests).await;
                let mut statuses = BTreeMap::new();
                for answer in &answers {
                    *statuses.entry(status_text(answer)).or_insert(0) += 1;
                }
                statuses.iter().map(|(status, n)| format!("{n} × {status}")).collect::<Vec<_>>().join(", ")
            }
            Scenario::OtherPayload => {
                let first = client.charge(&key, BODY, &[]).await;
                let other = BODY.replace("1250", "9999");
                describe(&first, &client.charge(&key, &other, &[]).await, "new answer")
            }
            Scenario::Flushall | Scenario::RestartedEmpty => {
                let first = client.charge(&key, BODY, &[]).await;
                if scenario == Scenario::Flushall {
                    let mut redis = redis::Client::open(self.redis.url())?.get_multiplexed_async_connection().await?;
                    redis::cmd("FLUSHALL").query_async::<()>(&mut redis).await?;
                    describe(&first, &client.charge(&key, BODY, &[]).await, "new answer")
                } else {
                    self.redis.restart_empty()?;
                    // A client may lose its first command to the restart (a dropped connection) and
                    // reconnect after it: the second retry shows what the lost data means.
                    let retry = client.charge(&key, BODY, &[]).await;
                    let second = client.charge(&key, BODY, &[]).await;
                    // The second retry against the last answer the client got: a replay of a re-run is one.
                    let last = if retry.status.is_some_and(|s| (200..300).contains(&s)) { &retry } else { &first };
                    format!(
                        "{}, then {}",
                        describe(&first, &retry, "new answer"),
                        describe(last, &second, "new answer")
                    )
                }
            }
            Scenario::PausedRetry | Scenario::PausedNewKey => {
                let first =
                    if scenario == Scenario::PausedRetry { Some(client.charge(&key, BODY, &[]).await) } else { None };
                self.redis.pause()?;
                let answer = client.charge(&key, BODY, &[]).await;
                self.redis.resume()?;
                // A request the client gave up on may still be in the server: count what it did.
                let settled = tokio::time::timeout(SETTLE, app.inflight.wait_idle()).await.is_ok();
                let what = match &first {
                    Some(first) => describe(first, &answer, "new answer"),
                    None => status_text(&answer),
                };
                let unsettled = match settled {
                    true => String::new(),
                    false => format!("; still in the server {} s after Redis resumed", SETTLE.as_secs()),
                };
                match answer.status {
                    Some(_) => format!("{what} in {} ms{unsettled}", answer.elapsed.as_millis()),
                    None => format!("{what}{unsettled}"),
                }
            }
            Scenario::OwnerCrash => {
                crash::kill_owner_mid_request(&client, app.subject, &self.postgres_url, &self.redis.url(), &key)
                    .await?;
                let at_once = client.charge(&key, BODY, &[]).await;
                // Waiting out the lease is the scenario: there is nothing to be signalled by.
                tokio::time::sleep(LEASE + LEASE / 4).await;
                let later = client.charge(&key, BODY, &[]).await;
                let later_text = match (at_once.status, later.status) {
                    (Some(200..=299), Some(200..=299)) if later.body == at_once.body => {
                        format!("{} replay", status_text(&later))
                    }
                    _ => status_text(&later),
                };
                format!("at once {}; after the lease {later_text}", status_text(&at_once))
            }
            Scenario::Tenants => {
                let first = client.charge(&key, BODY, &[]).await;
                let other = Client::new(app.address, app.subject, "tenant-b").await?.charge(&key, BODY, &[]).await;
                match other.status {
                    Some(200..=299) if other.body == first.body => {
                        format!("{}, tenant A's answer", status_text(&other))
                    }
                    _ => describe(&first, &other, "its own answer"),
                }
            }
        };
        let executions =
            sqlx::query_scalar("SELECT count(*) FROM peer_charges WHERE subject = $1 AND idempotency_key = $2")
                .bind(app.subject.name())
                .bind(&key)
                .fetch_one(self.pg)
                .await?;
        Ok(Outcome { scenario, subject: app.subject, executions, answer })
    }
}

fn status_text(answer: &Answer) -> String {
    answer.status.map_or_else(|| format!("no answer in {} s", TIMEOUT.as_secs()), |status| status.to_string())
}

/// A retry's answer next to the first one: replayed, answered anew (`fresh`), or refused. A first request
/// that did not succeed is named too (the retry was then no retry of a completed request).
fn describe(first: &Answer, retry: &Answer, fresh: &str) -> String {
    let retry_text = match retry.status {
        Some(200..=299) if retry.body == first.body => format!("{} replay", status_text(retry)),
        Some(200..=299) => format!("{} {fresh}", status_text(retry)),
        _ => status_text(retry),
    };
    match first.status {
        Some(201) => retry_text,
        _ => format!("first request {}, then {retry_text}", status_text(first)),
    }
}
