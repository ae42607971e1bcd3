//! Metric names and descriptions. The library only emits through the `metrics` facade; the application
//! installs a recorder (for example `metrics-exporter-prometheus`) and may call [`describe`] once.
//!
//! Duplicate rate and conflict rate in PromQL:
//! ```text
//! sum(rate(idemstore_outcomes_total{outcome=~"replayed|in_flight"}[5m]))
//!   / sum(rate(idemstore_outcomes_total[5m]))
//! sum(rate(idemstore_outcomes_total{outcome="mismatch"}[5m])) / sum(rate(idemstore_outcomes_total[5m]))
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::outcome::Outcome;
use crate::quota::QuotaLimit;

/// Answers per operation, exactly one per claim (a `begin`, a `run_once`, an HTTP request, an inbox
/// delivery); label `outcome`: executed, replayed, in_flight, mismatch, indeterminate, expired,
/// quota_exceeded, error (the store could not answer). The duplicate and conflict ratios divide by its sum.
pub const OUTCOMES: &str = "idemstore_outcomes_total";
/// An owner's write that did not land, after its claim was counted; labels `operation`, `step`
/// (complete, release, extend) and `reason` (lease_lost: another owner took the key over; error:
/// Postgres failed).
pub const SETTLE_FAILURES: &str = "idemstore_settle_failures_total";
/// An owner's completion or release that Postgres refused for a while (a restart, a failover), asked
/// again while the lease lasts; label `operation`. Each one is a settlement that would otherwise have
/// been left to the lease's rule.
pub const SETTLE_RETRIES: &str = "idemstore_settle_retries_total";
/// Wake-ups of a claim that waits for an in-flight duplicate (`RunOptions::wait_in_flight`); labels
/// `operation` and `by`: notification (the owner settled), timer (the lease or wait ran out, or the
/// periodic re-check that covers a lost notification). The wait's answer is one outcome, however many
/// wake-ups it took.
pub const WAIT_WAKEUPS: &str = "idemstore_wait_wakeups_total";
/// Answers of `Store::attach` (a retry that attaches to its request instead of claiming); labels
/// `operation` and `answer`: replayed, in_flight (still running at the end of the wait), vacant (nothing
/// holds the key), mismatch, indeterminate, expired.
pub const ATTACHES: &str = "idemstore_attaches_total";
/// Requests without an `Idempotency-Key` whose key the HTTP layer derived (`with_derived_keys`), by
/// `operation`; their outcomes are counted in [`OUTCOMES`] as any other request's.
pub const DERIVED_KEYS: &str = "idemstore_derived_keys_total";
/// Redis hot-path answers; label `result`: hit (answered from Redis), miss (went on to Postgres), error.
pub const REDIS_LOOKUPS: &str = "idemstore_redis_lookups_total";
/// Redis calls that degraded to the Postgres path; label `reason`: error, timeout, circuit_open, cluster
/// (a Redis Cluster still redirecting: MOVED, ASK, TRYAGAIN, CLUSTERDOWN).
pub const REDIS_FALLBACKS: &str = "idemstore_redis_fallbacks_total";
/// Stored responses that did not open ([`crate::Encryption`]), by operation, tier (`redis`: the copy was
/// dropped and Postgres answered; `postgres`: the request was refused) and reason (`unknown_key`,
/// `tampered`, `unsealed`). Registered at 0 by stores with encryption. Any increase needs an operator.
pub const UNREADABLE_RESPONSES: &str = "idemstore_unreadable_responses_total";
/// Replays refused by the application's replay check (`with_replay_check`, `RunOptions::replay_check`) or
/// to another principal (`with_principal`), by operation; the store's answer was counted as `replayed`
/// in [`OUTCOMES`] before the refusal.
pub const REPLAYS_REFUSED: &str = "idemstore_replays_refused_total";
/// Claims refused by a tenant's quota ([`crate::Quota`]), by operation and `limit` (`new_keys`,
/// `live_keys`); each is also one `quota_exceeded` outcome in [`OUTCOMES`].
pub const QUOTA_REFUSALS: &str = "idemstore_quota_refusals_total";
/// Records found in Postgres that Redis had lost (eviction, flush, restart, expired TTL) and repaired.
pub const RECONCILIATIONS: &str = "idemstore_reconciliations_total";
/// Keys re-acquired from an owner whose lease ran out.
pub const LEASE_TAKEOVERS: &str = "idemstore_lease_takeovers_total";
/// Statements sent to Postgres; label `statement`: claim, complete, release, extend, mark_indeterminate,
/// renew_expired (a key of a policy without tombstones, freed once its retention ended), lookup, wait and notify (a claim waiting for an in-flight duplicate, its owner's announcement), the
/// jobs' purge, purge_tombstones, purge_quota_usage, count_expired, stale, release_stale, resolve, stats,
/// count_indeterminate, and outbox_enqueue, outbox_horizon, outbox_next, outbox_lease, outbox_read,
/// outbox_release, outbox_extend, outbox_settle, outbox_backlog, outbox_gauges, outbox_retry,
/// outbox_discard. The same name is the `step` of a `StoreError::StoreUnavailable` it caused.
/// With `idemstore_redis_calls_total`, the cost of each answer in round trips.
pub const POSTGRES_STATEMENTS: &str = "idemstore_postgres_statements_total";
/// Scripts run on Redis, answered or not; label `script`: begin, put, release, extend.
pub const REDIS_CALLS: &str = "idemstore_redis_calls_total";
/// Expired records deleted by `purge_expired`.
pub const PURGED: &str = "idemstore_purged_records_total";
/// Stale in-progress records recovered by `recover_stale`; label `action`: released, marked_indeterminate.
pub const RECOVERED: &str = "idemstore_recovered_records_total";
/// Records awaiting an operator: counted by `Admin::refresh_gauges` (and `recover_stale`, `resolve`), and
/// raised by the request path when it marks one.
pub const INDETERMINATE: &str = "idemstore_indeterminate_records";
/// Rows the outbox sink accepted; label `topic`. A row redelivered after a relay crash counts again.
pub const OUTBOX_DELIVERIES: &str = "idemstore_outbox_deliveries_total";
/// Outbox deliveries the sink refused or did not answer in time; label `topic`.
pub const OUTBOX_FAILURES: &str = "idemstore_outbox_failures_total";
/// `Outbox::drain` calls that failed (Postgres unavailable): with the enqueue-time gauge, what tells a
/// stuck relay apart from an idle one.
pub const OUTBOX_DRAIN_FAILURES: &str = "idemstore_outbox_drain_failures_total";
/// Undelivered outbox rows, as last counted by `Outbox::drain` or `Outbox::backlog`.
pub const OUTBOX_PENDING: &str = "idemstore_outbox_pending_rows";
/// Age of the oldest undelivered outbox row, as last counted; it grows while a topic is stuck.
pub const OUTBOX_OLDEST_AGE: &str = "idemstore_outbox_oldest_pending_age_seconds";
/// When the oldest undelivered outbox row was enqueued (Unix time; 0 when none is pending), as last
/// counted: unlike the age, `time() - it` keeps growing between refreshes.
pub const OUTBOX_OLDEST_ENQUEUED: &str = "idemstore_outbox_oldest_pending_enqueued_timestamp_seconds";
/// Time of one claim call; label `tier`: redis or postgres.
pub const CLAIM_DURATION: &str = "idemstore_claim_duration_seconds";

/// Histogram buckets (seconds) that resolve claim latency from a Redis round trip to a slow commit.
pub const CLAIM_DURATION_BUCKETS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Registers the description and unit of every metric with the installed recorder.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(OUTCOMES, "Idempotency answers by operation and outcome.");
    describe_counter!(REDIS_LOOKUPS, "Redis hot-path answers by result.");
    describe_counter!(REDIS_FALLBACKS, "Redis calls that degraded to the Postgres path, by reason.");
    describe_counter!(RECONCILIATIONS, "Records Redis had lost, served from Postgres and repaired.");
    describe_counter!(UNREADABLE_RESPONSES, "Stored responses that did not open (key gone, changed), by reason.");
    describe_counter!(REPLAYS_REFUSED, "Replays the application's replay check refused.");
    describe_counter!(QUOTA_REFUSALS, "Claims refused by a tenant's quota, by limit.");
    describe_counter!(LEASE_TAKEOVERS, "Keys re-acquired after their owner's lease ran out.");
    describe_counter!(SETTLE_FAILURES, "Owner writes (complete, release, extend) that did not land, by reason.");
    describe_counter!(SETTLE_RETRIES, "Owner completions and releases asked again while Postgres was unavailable.");
    describe_counter!(WAIT_WAKEUPS, "Wake-ups of claims waiting for an in-flight duplicate, by cause.");
    describe_counter!(ATTACHES, "Answers of attaches to a request by key, by answer.");
    describe_counter!(DERIVED_KEYS, "Requests without a key whose key the HTTP layer derived from their payload.");
    describe_counter!(POSTGRES_STATEMENTS, "Statements sent to Postgres, by statement.");
    describe_counter!(REDIS_CALLS, "Scripts run on Redis, by script.");
    describe_counter!(PURGED, "Expired records deleted by purge_expired.");
    describe_counter!(RECOVERED, "Stale in-progress records recovered, by action.");
    metrics::describe_gauge!(INDETERMINATE, "Records awaiting an operator (indeterminate), as last counted.");
    describe_counter!(OUTBOX_DELIVERIES, "Outbox rows the sink accepted, by topic.");
    describe_counter!(OUTBOX_FAILURES, "Outbox deliveries refused or timed out, by topic.");
    describe_counter!(OUTBOX_DRAIN_FAILURES, "Outbox drains that failed (Postgres unavailable).");
    metrics::describe_gauge!(OUTBOX_PENDING, "Undelivered outbox rows, as last counted.");
    metrics::describe_gauge!(OUTBOX_OLDEST_AGE, Unit::Seconds, "Age of the oldest undelivered outbox row.");
    metrics::describe_gauge!(
        OUTBOX_OLDEST_ENQUEUED,
        Unit::Seconds,
        "Unix time the oldest undelivered row was enqueued."
    );
    describe_histogram!(CLAIM_DURATION, Unit::Seconds, "Duration of one claim call, by tier.");
}

/// The values of each label, registered at 0 ahead of their first increment: a series that appears with
/// its first increment has no earlier sample, so Prometheus's `rate()` and `increase()` never count it.
const LOOKUP_RESULTS: [&str; 3] = ["hit", "miss", "error"];
const UNREADABLE_REASONS: [&str; 3] = ["unknown_key", "tampered", "unsealed"];
const FALLBACK_REASONS: [&str; 4] = ["error", "timeout", "circuit_open", "cluster"];
/// Beyond this many operations a store stops registering new ones ahead (their series still appear at
/// their first increment): a bound on what a caller that names operations freely can cost.
const MAX_REGISTERED_OPERATIONS: usize = 10_000;

/// The operations whose series a store registered at 0, with the counters every claim of each touches.
#[derive(Debug, Default)]
pub(crate) struct Registered(RwLock<HashMap<String, Arc<OperationCounters>>>);

/// The counters every claim of one operation touches (its answer, and Redis's lookup), taken from the
/// recorder once, when the operation's series are registered at 0: a claim increments a handle instead
/// of building the series' labels and looking it up in the recorder. They belong to the recorder
/// installed before the operation's first claim: with none installed then, they count nowhere, for the
/// life of the store (install it at start-up; docs/metrics.md).
pub(crate) struct OperationCounters {
    /// By outcome label.
    outcomes: Vec<(&'static str, metrics::Counter)>,
    /// In the order of [`LOOKUP_RESULTS`]; none without Redis.
    redis_lookups: Vec<metrics::Counter>,
}

impl fmt::Debug for OperationCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationCounters").finish_non_exhaustive()
    }
}

impl OperationCounters {
    /// The counters of `operation`, each registered at 0.
    fn register(operation: &str, redis: bool) -> Self {
        let outcomes = Outcome::ALL.iter().filter(|o| o.answers_a_claim()).map(|o| {
            let counter = metrics::counter!(OUTCOMES, "operation" => operation.to_owned(), "outcome" => o.label());
            counter.increment(0);
            (o.label(), counter)
        });
        let lookups = LOOKUP_RESULTS.iter().filter(|_| redis).map(|&result| {
            let counter = metrics::counter!(REDIS_LOOKUPS, "operation" => operation.to_owned(), "result" => result);
            counter.increment(0);
            counter
        });
        Self { outcomes: outcomes.collect(), redis_lookups: lookups.collect() }
    }
}

impl Registered {
    /// Registers every series of `operation` at 0 the first time it is seen (the Redis ones when
    /// `redis`, the unreadable responses when `encrypted`), and its claims' counters; a read lock on
    /// every later call. `None` past [`MAX_REGISTERED_OPERATIONS`].
    pub(crate) fn operation(&self, operation: &str, redis: bool, encrypted: bool) -> Option<Arc<OperationCounters>> {
        // Past the cap, nothing is registered: a read lock, never the write lock, on every later call.
        {
            let seen = self.0.read().ok()?;
            if let Some(counters) = seen.get(operation) {
                return Some(Arc::clone(counters));
            }
            if seen.len() >= MAX_REGISTERED_OPERATIONS {
                return None;
            }
        }
        let Ok(mut seen) = self.0.write() else { return None };
        if seen.is_empty() {
            register_jobs();
        }
        if let Some(counters) = seen.get(operation) {
            return Some(Arc::clone(counters));
        }
        if seen.len() >= MAX_REGISTERED_OPERATIONS {
            return None;
        }
        let counters = Arc::new(OperationCounters::register(operation, redis));
        seen.insert(operation.to_owned(), Arc::clone(&counters));
        metrics::counter!(LEASE_TAKEOVERS, "operation" => operation.to_owned()).increment(0);
        metrics::counter!(SETTLE_RETRIES, "operation" => operation.to_owned()).increment(0);
        for limit in [QuotaLimit::NewKeys, QuotaLimit::LiveKeys] {
            quota_refusal_counter(operation, limit).increment(0);
        }
        for answer in ["replayed", "in_flight", "vacant", "mismatch", "indeterminate", "expired"] {
            metrics::counter!(ATTACHES, "operation" => operation.to_owned(), "answer" => answer).increment(0);
        }
        for by in ["notification", "timer"] {
            metrics::counter!(WAIT_WAKEUPS, "operation" => operation.to_owned(), "by" => by).increment(0);
        }
        for step in ["complete", "release", "extend"] {
            for reason in ["lease_lost", "error"] {
                settle_failure_counter(operation, step, reason).increment(0);
            }
        }
        let tiers: &[&str] = match (encrypted, redis) {
            (false, _) => &[],
            (true, false) => &["postgres"],
            (true, true) => &["postgres", "redis"],
        };
        for tier in tiers {
            for reason in UNREADABLE_REASONS {
                metrics::counter!(UNREADABLE_RESPONSES, "operation" => operation.to_owned(), "tier" => *tier, "reason" => reason)
                    .increment(0);
            }
        }
        if redis {
            for reason in FALLBACK_REASONS {
                metrics::counter!(REDIS_FALLBACKS, "operation" => operation.to_owned(), "reason" => reason)
                    .increment(0);
            }
            metrics::counter!(RECONCILIATIONS, "operation" => operation.to_owned()).increment(0);
        }
        Some(counters)
    }
}

/// The series without an operation label, at 0.
fn register_jobs() {
    metrics::counter!(PURGED).increment(0);
    for action in ["released", "marked_indeterminate"] {
        metrics::counter!(RECOVERED, "action" => action).increment(0);
    }
}

/// A key as logs and traces show it: 8 hex digits of a SHA-256 keyed with a random per-process salt,
/// never the key. Stable within a process (one key's claim, writes and retries share a tag), and not
/// reversible by hashing candidate keys (order numbers, sequential ids); computed only when a subscriber
/// records it.
pub(crate) struct KeyTag<'a>(pub(crate) &'a str);

impl fmt::Display for KeyTag<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use sha2::Digest;
        static SALT: std::sync::LazyLock<[u8; 16]> = std::sync::LazyLock::new(rand::random);
        let digest = sha2::Sha256::new().chain_update(*SALT).chain_update(self.0.as_bytes()).finalize();
        digest[..4].iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}

/// The span of one claim (`idemstore.claim`): operation and key tag; its outcome and, when acquired,
/// the fence are recorded when it is answered.
pub(crate) fn claim_span(operation: &str, key: &str) -> tracing::Span {
    let (outcome, fence) = (tracing::field::Empty, tracing::field::Empty);
    tracing::debug_span!("idemstore.claim", operation, key = %KeyTag(key), outcome, fence)
}

/// The span of an owner's write (`idemstore.complete`, `idemstore.release`, `idemstore.extend`).
pub(crate) fn write_span(step: &'static str, operation: &str, key: &str, fence: i64) -> tracing::Span {
    match step {
        "complete" => tracing::debug_span!("idemstore.complete", operation, key = %KeyTag(key), fence),
        "release" => tracing::debug_span!("idemstore.release", operation, key = %KeyTag(key), fence),
        _ => tracing::trace_span!("idemstore.extend", operation, key = %KeyTag(key), fence),
    }
}

/// A claim's answer, on the operation's registered counter when there is one.
pub(crate) fn outcome(counters: Option<&OperationCounters>, operation: &str, outcome: &'static str) {
    match counters.and_then(|counters| counters.outcomes.iter().find(|(label, _)| *label == outcome)) {
        Some((_, counter)) => counter.increment(1),
        None => metrics::counter!(OUTCOMES, "operation" => operation.to_owned(), "outcome" => outcome).increment(1),
    }
}

pub(crate) fn settle_failure(operation: &str, step: &'static str, reason: &'static str) {
    settle_failure_counter(operation, step, reason).increment(1);
}

fn settle_failure_counter(operation: &str, step: &'static str, reason: &'static str) -> metrics::Counter {
    metrics::counter!(SETTLE_FAILURES, "operation" => operation.to_owned(), "step" => step, "reason" => reason)
}

/// A waiting claim woke up, by a notification or its timer.
pub(crate) fn wait_wakeup(operation: &str, notified: bool) {
    let by = if notified { "notification" } else { "timer" };
    metrics::counter!(WAIT_WAKEUPS, "operation" => operation.to_owned(), "by" => by).increment(1);
}

/// The HTTP layer derived a request's key ([`DERIVED_KEYS`]).
#[cfg(feature = "http")]
pub(crate) fn derived_key(operation: &str) {
    metrics::counter!(DERIVED_KEYS, "operation" => operation.to_owned()).increment(1);
}

/// An attach answered ([`ATTACHES`]).
pub(crate) fn attached(operation: &str, answer: &'static str) {
    metrics::counter!(ATTACHES, "operation" => operation.to_owned(), "answer" => answer).increment(1);
}

/// Redis's answer to a claim, on the operation's registered counter when there is one.
pub(crate) fn redis_lookup(counters: Option<&OperationCounters>, operation: &str, result: &'static str) {
    let registered = counters.and_then(|counters| {
        let at = LOOKUP_RESULTS.iter().position(|known| *known == result)?;
        counters.redis_lookups.get(at)
    });
    match registered {
        Some(counter) => counter.increment(1),
        None => metrics::counter!(REDIS_LOOKUPS, "operation" => operation.to_owned(), "result" => result).increment(1),
    }
}

pub(crate) fn redis_fallback(operation: &str, reason: &'static str) {
    metrics::counter!(REDIS_FALLBACKS, "operation" => operation.to_owned(), "reason" => reason).increment(1);
}

pub(crate) fn unreadable_response(operation: &str, tier: &'static str, reason: &'static str) {
    metrics::counter!(UNREADABLE_RESPONSES, "operation" => operation.to_owned(), "tier" => tier, "reason" => reason)
        .increment(1);
}

/// A claim a tenant's quota refused.
pub(crate) fn quota_refusal(operation: &str, limit: QuotaLimit) {
    quota_refusal_counter(operation, limit).increment(1);
}

fn quota_refusal_counter(operation: &str, limit: QuotaLimit) -> metrics::Counter {
    metrics::counter!(QUOTA_REFUSALS, "operation" => operation.to_owned(), "limit" => limit.as_str())
}

/// A replay the application's check refused.
pub(crate) fn replay_refused(operation: &str) {
    metrics::counter!(REPLAYS_REFUSED, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn reconciliation(operation: &str) {
    metrics::counter!(RECONCILIATIONS, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn settlement_retry(operation: &str) {
    metrics::counter!(SETTLE_RETRIES, "operation" => operation.to_owned()).increment(1);
}

pub(crate) fn lease_takeover(operation: &str) {
    metrics::counter!(LEASE_TAKEOVERS, "operation" => operation.to_owned()).increment(1);
}

/// The metric `$macro!($name, $label => value)`, for a label value known when it is one of `$known`
/// (literals): then its key is a static, and the call builds no label vector (the request path counts
/// a few series on every request). Any other value builds its labels per call.
macro_rules! with_static_label {
    ($macro:ident!($name:expr, $label:literal => $value:expr), [$($known:literal),* $(,)?]) => {
        match $value {
            $($known => metrics::$macro!($name, $label => $known),)*
            other => metrics::$macro!($name, $label => other),
        }
    };
}

pub(crate) fn postgres_statement(statement: &'static str) {
    let counter = with_static_label!(
        counter!(POSTGRES_STATEMENTS, "statement" => statement),
        [
            "claim",
            "complete",
            "lookup",
            "attach",
            "release",
            "extend",
            "wait",
            "notify",
            "mark_indeterminate",
            "hold_key"
        ]
    );
    counter.increment(1);
}

pub(crate) fn redis_call(script: &'static str) {
    let counter = with_static_label!(counter!(REDIS_CALLS, "script" => script), ["begin", "put", "release", "extend"]);
    counter.increment(1);
}

pub(crate) fn purged(records: u64) {
    metrics::counter!(PURGED).increment(records);
}

pub(crate) fn recovered(action: &'static str) {
    metrics::counter!(RECOVERED, "action" => action).increment(1);
}

/// The request path marked a record indeterminate: the gauge goes up before the next count.
pub(crate) fn indeterminate_marked() {
    metrics::gauge!(INDETERMINATE).increment(1.0);
}

pub(crate) fn indeterminate(records: u64) {
    metrics::gauge!(INDETERMINATE).set(records as f64);
}

/// Counts a delivery, and registers the topic's failures at 0 (and the other way round), so that the
/// first failure after deliveries is a change `rate()` sees.
pub(crate) fn outbox_delivery(topic: &str) {
    metrics::counter!(OUTBOX_DELIVERIES, "topic" => topic.to_owned()).increment(1);
    metrics::counter!(OUTBOX_FAILURES, "topic" => topic.to_owned()).increment(0);
}

/// A drain ended; its failures count (the series exists from the first drain on).
pub(crate) fn outbox_drain(succeeded: bool) {
    metrics::counter!(OUTBOX_DRAIN_FAILURES).increment(u64::from(!succeeded));
}

pub(crate) fn outbox_failure(topic: &str) {
    metrics::counter!(OUTBOX_FAILURES, "topic" => topic.to_owned()).increment(1);
    metrics::counter!(OUTBOX_DELIVERIES, "topic" => topic.to_owned()).increment(0);
}

pub(crate) fn outbox_backlog(pending: u64, oldest: Duration) {
    // Registered wherever the backlog is reported, so the first failed drain is a rate() can see.
    metrics::counter!(OUTBOX_DRAIN_FAILURES).increment(0);
    metrics::gauge!(OUTBOX_PENDING).set(pending as f64);
    metrics::gauge!(OUTBOX_OLDEST_AGE).set(oldest.as_secs_f64());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let enqueued = if pending == 0 { 0.0 } else { now.saturating_sub(oldest).as_secs_f64() };
    metrics::gauge!(OUTBOX_OLDEST_ENQUEUED).set(enqueued);
}

pub(crate) fn claim_duration(tier: &'static str, elapsed: Duration) {
    let histogram = with_static_label!(histogram!(CLAIM_DURATION, "tier" => tier), ["redis", "postgres"]);
    histogram.record(elapsed.as_secs_f64());
}
