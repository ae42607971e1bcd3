//! `idemctl`: the operator's view of an idemstore deployment.
//!
//! ```text
//! idemctl migrate [--partitions N]
//! idemctl inspect <tenant> <operation> <key> [--target PATH] [--response]
//! idemctl purge [--dry-run] [--batch N]
//! idemctl recover [--dry-run] [--batch N]
//! idemctl resolve <tenant> <operation> <key> [--target PATH] (--complete-with FILE | --release)
//! idemctl stats [--window 1h]
//! idemctl evict <tenant> <operation> <key> [--target PATH]
//! idemctl outbox status
//! idemctl outbox drain --exec '<shell command>' [--topic T]... [--batch N] [--concurrency N] [--timeout 30s]
//! idemctl outbox retry <topic>
//! idemctl outbox discard <id>
//! ```
//! Reads `DATABASE_URL` and `REDIS_URL` (or `--database-url`, `--redis-url`; for a Redis Cluster,
//! `--redis-cluster` / `IDEMSTORE_REDIS_CLUSTER` with comma-separated seed URLs); `--json` prints one JSON
//! document for scripts; `IDEMSTORE_ENCRYPTION_KEY` (environment only) opens and seals encrypted responses.
//! Exit status 0 on success, 1 when the store failed, 2 on bad usage.

use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use idemstore::admin::{Inspection, Resolution};
use idemstore::outbox::TopicBacklog;
use idemstore::{Encryption, IdempotencyKey, Message, Scope, Store, StoreError};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(name = "idemctl", version, about = "Inspect and maintain an idemstore idempotency store")]
struct Cli {
    /// Postgres URL of the store.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Redis URL of the store (omit for a Postgres-only deployment).
    #[arg(long, env = "REDIS_URL", global = true, hide_env_values = true)]
    redis_url: Option<String>,
    /// Seed URLs of the store's Redis Cluster, comma-separated (used instead of `--redis-url` when both
    /// are given).
    #[arg(long, env = "IDEMSTORE_REDIS_CLUSTER", global = true, hide_env_values = true, value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// Prefix of the store's Redis keys.
    #[arg(long, default_value = "idem", global = true)]
    key_prefix: String,
    /// Print one JSON document instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug)]
struct RecordId {
    tenant: String,
    operation: String,
    key: String,
    /// The request path the key was sent to, on a route with path parameters (`/accounts/A/transfers`):
    /// the HTTP layer keeps such keys per path, and this names the record as it does.
    #[arg(long, value_name = "PATH")]
    target: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Apply the store's migrations.
    Migrate {
        /// Then hash-partition the records table by tenant into N partitions (once; the same N again
        /// does nothing). See docs/scale-out.md.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
        partitions: Option<u16>,
    },
    /// Show a key as Postgres and Redis hold it.
    Inspect {
        #[command(flatten)]
        id: RecordId,
        /// Also print the stored response (opened with `IDEMSTORE_ENCRYPTION_KEY` when it is encrypted).
        #[arg(long)]
        response: bool,
    },
    /// Delete expired records in batches.
    Purge {
        /// Only count what would be deleted.
        #[arg(long)]
        dry_run: bool,
        /// Records per batch (one short statement each).
        #[arg(long, default_value_t = 1000)]
        batch: u32,
    },
    /// Release or mark indeterminate the in-progress records whose lease ran out.
    Recover {
        /// Only count the stale records.
        #[arg(long)]
        dry_run: bool,
        /// Most records handled in one run.
        #[arg(long, default_value_t = 1000)]
        batch: u32,
    },
    /// Settle an indeterminate record.
    Resolve {
        #[command(flatten)]
        id: RecordId,
        /// The work happened: store this file's bytes as the result to replay (records of `run_once`
        /// and the inbox, which store JSON).
        #[arg(long, conflicts_with_all = ["release", "status"], required_unless_present_any = ["release", "status"])]
        complete_with: Option<PathBuf>,
        /// The work happened: store an HTTP response with this status for the layer to replay (records
        /// of the HTTP layer), with `--header` and `--body`.
        #[arg(long, conflicts_with = "release")]
        status: Option<u16>,
        /// A header of that response, `Name: value` (repeatable).
        #[arg(long = "header", requires = "status")]
        headers: Vec<String>,
        /// The file holding that response's body (default: empty).
        #[arg(long, requires = "status")]
        body: Option<PathBuf>,
        /// The work did not happen: let the next request execute it.
        #[arg(long)]
        release: bool,
        /// Store the response in clear although the deployment's responses are encrypted (one that turned
        /// encryption off for good); without it, that is refused unless IDEMSTORE_ENCRYPTION_KEY is set.
        #[arg(long)]
        allow_clear: bool,
    },
    /// Count records by operation, state and tier, and those expiring soon.
    Stats {
        /// What "expiring soon" means (e.g. 30m, 1h, 2d).
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        window: Duration,
    },
    /// Delete a key's Redis copy; Postgres keeps the record.
    Evict(RecordId),
    /// The transactional outbox.
    #[command(subcommand)]
    Outbox(OutboxCommand),
}

#[derive(Subcommand, Debug)]
enum OutboxCommand {
    /// Undelivered rows per topic, and why each topic's head last failed.
    Status,
    /// Deliver the due rows once, each through a shell command (exit status 0 = delivered).
    ///
    /// The command reads the payload (JSON) on stdin and gets IDEMPOTENCY_KEY, OUTBOX_ID, OUTBOX_TOPIC
    /// and OUTBOX_ATTEMPT in its environment; its output goes to stderr.
    Drain {
        /// The delivery command, run with `sh -c`.
        #[arg(long)]
        exec: String,
        /// Only these topics (repeat the option); default all.
        #[arg(long)]
        topic: Vec<String>,
        /// Rows per transaction.
        #[arg(long, default_value_t = 100)]
        batch: u32,
        /// Topics delivered side by side (each topic's rows stay in order).
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// Longest a delivery may take before it counts as failed (e.g. 30s, 2m).
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Deliver a topic's head at the next drain, without waiting out its backoff.
    Retry { topic: String },
    /// Delete an undelivered row without delivering it (a message no downstream accepts); prints it.
    Discard { id: i64 },
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    idemstore::config::parse_duration(text).map_err(|e| e.to_string())
}

/// What went wrong, with the step, for a clear message and exit status.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("DATABASE_URL is not set (or pass --database-url)")]
    NoDatabase,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Input(String),
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
}

/// Whether an operation is named the way the HTTP layer names them (`"POST /payments"`, `"POST unmatched"`).
fn is_http_operation(operation: &str) -> bool {
    let method = operation.split_once(' ').map_or("", |(method, _)| method);
    !method.is_empty() && method.bytes().all(|b| b.is_ascii_uppercase())
}

/// The layer's stored form of a response given on the command line.
fn http_response(status: u16, headers: &[String], body: Vec<u8>) -> Result<Vec<u8>, CliError> {
    let status = http::StatusCode::from_u16(status)
        .ok()
        .filter(|status| (100..600).contains(&status.as_u16()))
        .ok_or_else(|| CliError::Input(format!("--status {status}: not an HTTP status (100 to 599)")))?;
    let mut map = http::HeaderMap::new();
    for header in headers {
        let invalid = |why: &str| CliError::Input(format!("--header {header:?}: {why}"));
        let (name, value) = header.split_once(':').ok_or_else(|| invalid("not `Name: value`"))?;
        let name = http::HeaderName::try_from(name.trim()).map_err(|_| invalid("not a header name"))?;
        let value = http::HeaderValue::try_from(value.trim()).map_err(|_| invalid("not a header value"))?;
        map.append(name, value);
    }
    Ok(idemstore::http::stored_response(status, &map, body))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    warn_of_passwords_in_arguments(&cli, &matches);
    match run(&cli).await {
        Ok(output) => {
            print(&cli, &output);
            ExitCode::SUCCESS
        }
        Err(error) => {
            let mut message = error.to_string();
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            if cli.json {
                println!("{}", json!({ "error": message }));
            } else {
                eprintln!("idemctl: {message}");
            }
            // Bad usage (a missing URL included) is 2, a store that failed is 1.
            if matches!(error, CliError::Input(_) | CliError::NoDatabase) {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// A URL typed on the command line is visible to every user of the machine (`ps`, shell history): say so
/// when one carries a password, and where to put it instead.
fn warn_of_passwords_in_arguments(cli: &Cli, matches: &clap::ArgMatches) {
    let typed = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    let urls = [
        ("database-url", "DATABASE_URL", cli.database_url.iter().collect::<Vec<_>>()),
        ("redis-url", "REDIS_URL", cli.redis_url.iter().collect()),
        ("redis-cluster", "IDEMSTORE_REDIS_CLUSTER", cli.redis_cluster.iter().collect()),
    ];
    for (flag, variable, values) in urls {
        if typed(&flag.replace('-', "_")) && values.iter().any(|url| has_password(url)) {
            eprintln!(
                "idemctl: warning: --{flag} carries a password, which other users can read in the process list; \
                 set {variable} in the environment instead"
            );
        }
    }
}

/// Whether a URL's authority holds a password (`scheme://user:password@host`).
fn has_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else { return false };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    authority.rsplit_once('@').is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

/// A command's result: JSON for `--json`, and the text shown otherwise.
struct Output {
    json: Value,
    text: String,
}

fn print(cli: &Cli, output: &Output) {
    if cli.json {
        println!("{}", output.json);
    } else {
        println!("{}", output.text);
    }
}

async fn run(cli: &Cli) -> Result<Output, CliError> {
    let database_url = cli.database_url.clone().ok_or(CliError::NoDatabase)?;
    let mut builder = Store::builder().database_url(database_url).key_prefix(cli.key_prefix.clone());
    let seeds: Vec<String> = cli.redis_cluster.iter().filter(|seed| !seed.is_empty()).cloned().collect();
    if !seeds.is_empty() {
        builder = builder.redis_cluster(seeds);
    } else if let Some(url) = &cli.redis_url {
        builder = builder.redis_url(url.clone());
    }
    // From the environment only: a key on the command line would show in `ps` and shell history.
    let keys = std::env::var("IDEMSTORE_ENCRYPTION_KEY").ok();
    let encrypted = keys.as_deref().is_some_and(|keys| !keys.is_empty());
    if let Some(keys) = keys.as_deref().filter(|keys| !keys.is_empty()) {
        builder = builder.encryption(Encryption::from_base64(keys).map_err(StoreError::from)?);
    }
    if matches!(cli.command, Command::Resolve { allow_clear: true, .. }) {
        builder = builder.clear_responses_allowed();
    }
    let store = builder.build().map_err(idemstore::StoreError::from)?;
    let record = |id: &RecordId| -> Result<(Scope, IdempotencyKey), CliError> {
        let scope = Scope::new(id.tenant.clone(), id.operation.clone()).map_err(|e| CliError::Input(e.to_string()))?;
        let key = IdempotencyKey::new(id.key.clone()).map_err(|e| CliError::Input(e.to_string()))?;
        let key = match &id.target {
            Some(target) => key.for_target(target),
            None => key,
        };
        Ok((scope, key))
    };
    Ok(match &cli.command {
        Command::Migrate { partitions } => {
            store.migrate().await?;
            if let Some(partitions) = *partitions {
                store.admin().partition_by_tenant(partitions).await?;
            }
            match partitions {
                Some(n) => Output {
                    json: json!({ "migrated": true, "partitions": n }),
                    text: format!("migrations applied; records partitioned by tenant into {n}"),
                },
                None => Output { json: json!({ "migrated": true }), text: "migrations applied".into() },
            }
        }
        Command::Inspect { id, response } => {
            let (scope, key) = record(id)?;
            inspection(&store.admin().inspect(&scope, &key).await?, *response, encrypted)
        }
        Command::Purge { dry_run: true, .. } => {
            let expired = store.admin().count_expired().await?;
            Output {
                json: json!({ "expired": expired, "purged": 0 }),
                text: format!("{expired} expired records (dry run)"),
            }
        }
        Command::Purge { batch, .. } => {
            let expired = store.admin().count_expired().await?;
            let progress = indicatif::ProgressBar::new(expired);
            if cli.json {
                progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
            }
            let (mut purged, mut purging) = (0, store.admin().purge_expired(*batch));
            while let Some(deleted) = purging.next_batch().await? {
                purged += deleted;
                progress.inc(deleted);
            }
            progress.finish_and_clear();
            Output {
                json: json!({ "expired": expired, "purged": purged }),
                text: format!("purged {purged} expired records"),
            }
        }
        Command::Recover { dry_run: true, .. } => {
            let found = store.admin().count_stale().await?;
            let text = format!("{found} stale records (dry run)");
            Output { json: json!({ "found": found, "released": 0, "marked_indeterminate": 0, "unreadable": 0 }), text }
        }
        Command::Recover { batch, .. } => {
            let recovery = store.admin().recover_stale(*batch).await?;
            let text = format!(
                "{} stale records: {} released, {} marked indeterminate, {} unreadable (left for an operator)",
                recovery.found, recovery.released, recovery.marked_indeterminate, recovery.unreadable
            );
            Output { json: serde_json::to_value(&recovery).unwrap_or_default(), text }
        }
        Command::Resolve { id, complete_with, status, headers, body, .. } => {
            let (scope, key) = record(id)?;
            let read =
                |path: &PathBuf| std::fs::read(path).map_err(|source| CliError::Read { path: path.clone(), source });
            let resolution = match (complete_with, status) {
                (Some(_), _) if is_http_operation(scope.operation()) => {
                    return Err(CliError::Input(format!(
                        "{:?} is an operation of the HTTP layer, which replays only its own stored form: \
                         resolve it with --status, --header and --body",
                        scope.operation()
                    )));
                }
                (Some(path), _) => {
                    let bytes = read(path)?;
                    // run_once and the inbox store JSON: anything else would fail every retry's decode.
                    serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).map_err(|e| {
                        CliError::Input(format!(
                            "{}: not JSON ({e}); records of run_once and the inbox hold JSON",
                            path.display()
                        ))
                    })?;
                    Resolution::Completed(bytes)
                }
                (None, Some(status)) => {
                    let body = body.as_ref().map(read).transpose()?.unwrap_or_default();
                    Resolution::Completed(http_response(*status, headers, body)?)
                }
                (None, None) => Resolution::Released,
            };
            let resolved = store.admin().resolve(&scope, &key, resolution).await.map_err(|error| match error {
                StoreError::Encryption(idemstore::EncryptionError::WouldWriteClear) => CliError::Input(format!(
                    "{error}: set IDEMSTORE_ENCRYPTION_KEY to the deployment's key (or --allow-clear)"
                )),
                error => error.into(),
            })?;
            let text = if resolved { "resolved" } else { "not resolved: the record is not indeterminate" };
            Output { json: json!({ "resolved": resolved }), text: text.into() }
        }
        Command::Stats { window } => {
            let rows = store.admin().stats(*window).await?;
            let mut text =
                format!("{:<32} {:<14} {:<10} {:>10} {:>10}\n", "operation", "state", "tier", "records", "expiring");
            for row in &rows {
                let state = serde_json::to_value(row.state)
                    .ok()
                    .and_then(|s| s.as_str().map(str::to_owned))
                    .unwrap_or_default();
                text.push_str(&format!(
                    "{:<32} {:<14} {:<10} {:>10} {:>10}\n",
                    row.operation, state, row.tier, row.records, row.expiring
                ));
            }
            Output { json: json!({ "window_seconds": window.as_secs(), "rows": rows }), text: text.trim_end().into() }
        }
        Command::Evict(id) => {
            let (scope, key) = record(id)?;
            let evicted = store.admin().evict(&scope, &key).await?;
            let text = if evicted { "evicted from Redis" } else { "Redis held no copy" };
            Output { json: json!({ "evicted": evicted }), text: text.into() }
        }
        Command::Outbox(OutboxCommand::Status) => outbox_status(&store.outbox().backlog().await?),
        Command::Outbox(OutboxCommand::Retry { topic }) => {
            let waiting = store.outbox().retry(topic).await?;
            Output { json: json!({ "retried": waiting }), text: format!("{waiting} rows of {topic} retried now") }
        }
        Command::Outbox(OutboxCommand::Discard { id }) => match store.outbox().discard(*id).await? {
            Some(message) => {
                let payload: Value = message.decode().unwrap_or_else(|_| Value::String(message.payload().into()));
                let document =
                    json!({ "discarded": true, "id": message.id, "topic": message.topic, "payload": payload });
                Output { text: format!("discarded {document}"), json: document }
            }
            None => Output { json: json!({ "discarded": false }), text: format!("no undelivered row {id}") },
        },
        Command::Outbox(OutboxCommand::Drain { exec, topic, batch, concurrency, timeout }) => {
            let outbox = store.outbox().with_batch_size(*batch).with_concurrency(*concurrency);
            let mut outbox = outbox.with_delivery_timeout(*timeout);
            if !topic.is_empty() {
                outbox = outbox.with_topics(topic.clone());
            }
            let drained = outbox.drain(|message| deliver(exec, message)).await?;
            Output {
                json: serde_json::to_value(drained).unwrap_or_default(),
                text: format!("{} delivered, {} failed", drained.delivered, drained.failed),
            }
        }
    })
}

/// Runs the delivery command for one outbox row.
async fn deliver(command: &str, message: Message) -> Result<(), String> {
    use tokio::io::AsyncWriteExt as _;
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", command])
        .env("IDEMPOTENCY_KEY", message.idempotency_key().as_str())
        .env("OUTBOX_ID", message.id.to_string())
        .env("OUTBOX_TOPIC", &message.topic)
        .env("OUTBOX_ATTEMPT", message.attempt.to_string())
        .stdin(Stdio::piped())
        .stdout(std::io::stderr())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot run the delivery command: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A command that does not read its input is fine: ignore a closed pipe.
        let _ = stdin.write_all(message.payload().as_bytes()).await;
    }
    let status = child.wait().await.map_err(|e| format!("waiting for the delivery command: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("the delivery command failed ({status})")) }
}

fn outbox_status(backlog: &[TopicBacklog]) -> Output {
    let mut text =
        format!("{:<32} {:>8} {:>10} {:>8} {:>10}  last error\n", "topic", "pending", "oldest", "attempts", "retry in");
    for topic in backlog {
        text.push_str(&format!(
            "{:<32} {:>8} {:>9}s {:>8} {:>9}s  {}\n",
            topic.topic,
            topic.pending,
            topic.oldest.as_secs(),
            topic.head_attempts,
            topic.retry_in.as_secs(),
            topic.head_error.as_deref().unwrap_or("")
        ));
    }
    let topics: Vec<Value> = backlog
        .iter()
        .map(|t| {
            json!({
                "topic": t.topic,
                "pending": t.pending,
                "oldest_seconds": t.oldest.as_secs_f64(),
                "head_id": t.head_id,
                "head_attempts": t.head_attempts,
                "head_error": t.head_error,
                "retry_in_seconds": t.retry_in.as_secs_f64(),
            })
        })
        .collect();
    Output { json: json!({ "topics": topics }), text: text.trim_end().into() }
}

/// Stored bytes (a fingerprint) as lowercase hex digits.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// A record side by side in both tiers; its response only when asked (it may hold personal data).
fn inspection(inspection: &Inspection, show_response: bool, encrypted: bool) -> Output {
    let millis = |d: Option<Duration>| d.map(|d| d.as_millis() as u64);
    let postgres = inspection.postgres.as_ref().map(|r| {
        json!({
            "state": r.state,
            "fence": r.fence,
            "fingerprint": hex(&r.fingerprint),
            "tier": r.tier,
            "lease_remaining_ms": millis(r.lease_remaining),
            "expires_in_ms": millis(r.expires_in),
            "response_bytes": r.response.as_ref().map(|r| r.as_bytes().len()),
            "response": r.response.as_ref().filter(|_| show_response).map(|r| String::from_utf8_lossy(r.as_bytes()).into_owned()),
            // Without the key, a sealed response does not open (`UnknownKey`): say what to set.
            "response_error": inspection.unreadable.as_ref().map(|error| match error {
                idemstore::EncryptionError::UnknownKey { .. } if !encrypted => {
                    format!("{error}: the response is encrypted; set IDEMSTORE_ENCRYPTION_KEY")
                }
                _ => error.to_string(),
            }),
        })
    });
    let redis = inspection.redis.as_ref().map(|r| {
        json!({
            "state": r.state,
            "fingerprint": hex(&r.fingerprint),
            "owner": r.owner,
            "ttl_ms": millis(r.ttl),
            "response_bytes": r.response_bytes,
        })
    });
    let document = json!({ "redis_key": inspection.redis_key, "postgres": postgres, "redis": redis });
    let side = |v: &Option<Value>| {
        v.as_ref().map_or("(none)".to_owned(), |v| serde_json::to_string_pretty(v).unwrap_or_default())
    };
    let text = format!("postgres: {}\nredis:    {}", side(&postgres), side(&redis));
    Output { json: document, text }
}
