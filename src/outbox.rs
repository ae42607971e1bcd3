//! The transactional outbox: effects that cannot join the database transaction (e-mails, calls to other
//! services, messages to a broker) are written as rows inside it, and a relay delivers them after the
//! commit. A transaction that rolls back leaves no row, so nothing is sent for work that did not happen;
//! a committed row is delivered at least once, with its id as the downstream's idempotency key, so a
//! downstream that honours the key applies it once.
//!
//! Delivery order is the row id within a topic. Ids are taken when a row is written, not when its
//! transaction commits: rows of one producer (or of one transaction) go out in the order they were
//! enqueued, while the order between transactions that commit concurrently is not defined.

use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, PoisonError};

use futures_util::FutureExt as _;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Row as _;
use sqlx::postgres::{PgConnection, PgRow};

use crate::error::{InputError, StoreError};
use crate::key::{IdempotencyKey, validate_name};
use crate::policy::millis;
use crate::store::{Statement, Store};
use crate::telemetry;

/// The nonce of the row's key ([`Message::idempotency_key`]) is the column's default (random, below 2^52).
const ENQUEUE: Statement = Statement::new(
    "outbox_enqueue",
    "INSERT INTO idempotency_outbox (topic, payload) VALUES ($1, $2::json) RETURNING id",
);

/// The newest row when a drain starts: it delivers nothing newer, so it ends even while producers write.
const HORIZON: Statement = Statement::new("outbox_horizon", "SELECT COALESCE(max(id), 0) FROM idempotency_outbox");

/// The next topic a worker may deliver, walking topics in name order from its cursor (`$1`, itself
/// included when `$2`): the first whose head (its oldest row, up to the drain's horizon `$4`) is due and
/// that no relay holds. A loose index scan, one probe per topic walked, which stops at the first
/// candidate: a drain walks each topic about once, however many there are (`$3`: the relay's topics;
/// `$5`: topics whose delivery failed earlier in this drain, left for the next one).
const NEXT_TOPIC: Statement = Statement::new(
    "outbox_next",
    "
    WITH RECURSIVE topics(topic) AS (
        (SELECT topic FROM idempotency_outbox
         WHERE (topic > $1 OR (topic = $1 AND $2)) AND ($3::text[] IS NULL OR topic = ANY($3))
         ORDER BY topic LIMIT 1)
        UNION ALL
        SELECT (SELECT o.topic FROM idempotency_outbox o
                WHERE o.topic > t.topic AND ($3::text[] IS NULL OR o.topic = ANY($3))
                ORDER BY o.topic LIMIT 1)
        FROM topics t WHERE t.topic IS NOT NULL
    )
    SELECT t.topic FROM topics t
    CROSS JOIN LATERAL (SELECT id, next_attempt_at FROM idempotency_outbox h
                        WHERE h.topic = t.topic ORDER BY h.id LIMIT 1) head
    WHERE t.topic IS NOT NULL AND head.id <= $4 AND head.next_attempt_at <= now() AND t.topic <> ALL($5)
      AND NOT EXISTS (SELECT 1 FROM idempotency_outbox_leases l WHERE l.topic = t.topic AND l.until > now())
    LIMIT 1",
);

/// Leases topic `$1` under token `$2` for `$3` ms, unless a live lease holds it (then no row). The lease
/// is the topic's lock: no two relays (or workers) deliver one topic at once, and nothing stays locked in
/// Postgres while the sink works. The batch is read by the next statement, whose snapshot includes the
/// settlement of the batch before (read in the same statement, a batch could be delivered twice).
const LEASE: Statement = Statement::new(
    "outbox_lease",
    "
    INSERT INTO idempotency_outbox_leases AS l (topic, token, until)
    VALUES ($1, $2, now() + $3::float8 * interval '1 millisecond')
    ON CONFLICT (topic) DO UPDATE SET token = EXCLUDED.token, until = EXCLUDED.until
    WHERE l.until <= now()
    RETURNING true",
);

/// The batch of leased topic `$1` (token `$2`): its rows in id order up to the horizon `$3`, at most `$4`,
/// if its head is due; with nothing to deliver, the lease is given back.
const READ: Statement = Statement::new(
    "outbox_read",
    "
    WITH batch AS (
        SELECT o.id, o.topic, o.payload::text AS payload, o.attempts, o.key_nonce
        FROM idempotency_outbox o
        WHERE o.topic = $1 AND o.id <= $3
          AND EXISTS (SELECT 1 FROM idempotency_outbox_leases l WHERE l.topic = $1 AND l.token = $2 AND l.until > now())
          AND (SELECT h.next_attempt_at FROM idempotency_outbox h WHERE h.topic = $1 ORDER BY h.id LIMIT 1) <= now()
        ORDER BY o.id
        LIMIT $4
    ), idle AS (
        DELETE FROM idempotency_outbox_leases
        WHERE topic = $1 AND token = $2 AND NOT EXISTS (SELECT 1 FROM batch)
    )
    SELECT * FROM batch ORDER BY id",
);

/// Gives a lease back unused.
const RELEASE: Statement =
    Statement::new("outbox_release", "DELETE FROM idempotency_outbox_leases WHERE topic = $1 AND token = $2");

/// Keeps a lease (topic `$1`, token `$2`) for `$3` more ms while the sink works through the batch.
const EXTEND: Statement = Statement::new(
    "outbox_extend",
    "UPDATE idempotency_outbox_leases SET until = now() + $3::float8 * interval '1 millisecond'
     WHERE topic = $1 AND token = $2",
);

/// The batch's outcome, and the lease given back, in one round trip; only while the lease (topic `$1`,
/// token `$2`) is still this relay's: one taken over after it ran out records nothing, and its rows are
/// the new holder's to deliver (again). Delivered rows are deleted, failed ones back off, counted from
/// now (`clock_timestamp`), not from the batch's start. Returns whether the lease was held.
const SETTLE: Statement = Statement::new(
    "outbox_settle",
    "
    WITH lease AS (DELETE FROM idempotency_outbox_leases WHERE topic = $1 AND token = $2 RETURNING 1),
    delivered AS (DELETE FROM idempotency_outbox WHERE id = ANY($3) AND topic = $1 AND EXISTS (SELECT 1 FROM lease)),
    failed AS (
        UPDATE idempotency_outbox o
        SET attempts = o.attempts + 1, last_error = f.error,
            next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond'
        FROM unnest($4::bigint[], $5::text[], $6::float8[]) AS f(id, error, delay_ms)
        WHERE o.id = f.id AND o.topic = $1 AND EXISTS (SELECT 1 FROM lease)
    )
    SELECT EXISTS (SELECT 1 FROM lease)",
);

/// Skips the rest of a topic's backoff: its head goes out at the next drain.
const RETRY: Statement = Statement::new(
    "outbox_retry",
    "UPDATE idempotency_outbox SET next_attempt_at = now() WHERE topic = $1 AND next_attempt_at > now()",
);

/// Deletes one undelivered row (a poison message holding its topic back), returning it for the record.
const DISCARD: Statement = Statement::new(
    "outbox_discard",
    "DELETE FROM idempotency_outbox WHERE id = $1 RETURNING id, topic, payload::text AS payload, attempts, key_nonce",
);

const GAUGES: Statement = Statement::new(
    "outbox_gauges",
    "
    SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(enqueued_at))::float8, 0) FROM idempotency_outbox",
);

/// Window functions run before `DISTINCT ON`, so each topic's row is its head with the topic's totals.
const BACKLOG: Statement = Statement::new(
    "outbox_backlog",
    "
    SELECT DISTINCT ON (topic) topic, id AS head_id,
           count(*) OVER (PARTITION BY topic) AS pending,
           EXTRACT(EPOCH FROM now() - min(enqueued_at) OVER (PARTITION BY topic))::float8 AS oldest_seconds,
           attempts, last_error,
           GREATEST(0, EXTRACT(EPOCH FROM next_attempt_at - now()))::float8 AS retry_in_seconds
    FROM idempotency_outbox
    ORDER BY topic, id",
);

/// The outbox of a store's database. Cheap to clone; configure a relay with the `with_*` setters.
#[derive(Clone, Debug)]
pub struct Outbox {
    store: Store,
    topics: Option<Vec<String>>,
    batch_size: u32,
    backoff: (Duration, Duration),
    delivery_timeout: Duration,
    concurrency: usize,
    max_payload: usize,
}

/// A relay's hold on one topic for one batch.
struct Lease<'t> {
    topic: &'t str,
    token: i64,
    length: Duration,
    /// Before the statement that took it: the lease may have started since, never before.
    taken: tokio::time::Instant,
}

/// Lease time beyond two delivery timeouts: round trips to Postgres and clock reading, so a lease never
/// runs out under a delivery that keeps to its timeout.
const LEASE_MARGIN: Duration = Duration::from_secs(1);

/// One delivery: `None` if the sink accepted the message, else why not. A sink that panics (in the call
/// or in its future) has failed this delivery, like one that answers `Err`.
async fn deliver_one<F, Fut, E>(sink: &Mutex<F>, message: Message, timeout: Duration) -> Option<String>
where
    F: FnMut(Message) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    let panicked = || "the sink panicked".to_owned();
    let call =
        std::panic::catch_unwind(AssertUnwindSafe(|| (sink.lock().unwrap_or_else(PoisonError::into_inner))(message)));
    let Ok(delivery) = call else { return Some(panicked()) };
    match tokio::time::timeout(timeout, AssertUnwindSafe(delivery).catch_unwind()).await {
        Ok(Ok(Ok(()))) => None,
        Ok(Ok(Err(error))) => Some(error.to_string()),
        Ok(Err(_)) => Some(panicked()),
        Err(_) => Some(format!("no answer within {timeout:?}")),
    }
}

/// What a batch's deliveries came to, shaped as `SETTLE`'s arguments.
#[derive(Default)]
struct Settlement {
    delivered: Vec<i64>,
    failed: Vec<i64>,
    errors: Vec<String>,
    delays_ms: Vec<f64>,
}

/// One row handed to the sink.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message {
    /// The row id: increasing within a topic.
    pub id: i64,
    /// The topic it was enqueued to.
    pub topic: String,
    /// 1 for the first delivery, then 2, 3, ... after failures. A row redelivered after a relay crashed
    /// mid-batch keeps its number, since the crash recorded nothing.
    pub attempt: u32,
    payload: String,
    key_nonce: i64,
}

impl Message {
    /// `outbox-<id>-<nonce>`: the same on every delivery of this row, and never another row's, even if
    /// ids repeat (a sequence restarted, a restored backup). Pass it as the downstream's idempotency key.
    /// Prefix the key when several databases feed one downstream account.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::outbox(self.id, self.key_nonce)
    }

    /// The payload, as the JSON text that was enqueued.
    pub fn payload(&self) -> &str {
        &self.payload
    }

    /// The payload as a `T`.
    ///
    /// # Errors
    /// The payload does not deserialize as a `T`.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.payload)
    }

    fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
        Ok(Message {
            id: row.try_get("id")?,
            topic: row.try_get("topic")?,
            attempt: u32::try_from(row.try_get::<i32, _>("attempts")?).unwrap_or(0) + 1,
            payload: row.try_get("payload")?,
            key_nonce: row.try_get("key_nonce")?,
        })
    }
}

/// What one [`Outbox::drain`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Drained {
    /// Rows the sink accepted (and that were then deleted).
    pub delivered: u64,
    /// Deliveries the sink refused or that timed out; those rows back off.
    pub failed: u64,
}

/// The undelivered rows of one topic ([`Outbox::backlog`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicBacklog {
    /// The topic.
    pub topic: String,
    /// Rows not delivered yet.
    pub pending: u64,
    /// Age of the oldest of them.
    pub oldest: Duration,
    /// The topic's head: its next row to go out.
    pub head_id: i64,
    /// Failed deliveries of the head.
    pub head_attempts: u32,
    /// Why the head's last delivery failed.
    pub head_error: Option<String>,
    /// Time until the head may be tried again.
    pub retry_in: Duration,
}

impl Store {
    /// The outbox in this store's database (migrated with the store).
    pub fn outbox(&self) -> Outbox {
        Outbox {
            store: self.clone(),
            topics: None,
            batch_size: 100,
            backoff: (Duration::from_secs(1), Duration::from_secs(300)),
            delivery_timeout: Duration::from_secs(30),
            concurrency: 4,
            max_payload: 1 << 20,
        }
    }
}

impl Outbox {
    /// Drains only these topics (default: all), so that each relay can have its own sink.
    pub fn with_topics<I: IntoIterator<Item = S>, S: Into<String>>(mut self, topics: I) -> Self {
        self.topics = Some(topics.into_iter().map(Into::into).collect());
        self
    }

    /// Most rows leased and delivered in one batch (default 100, at least 1). A relay that dies
    /// mid-batch has the whole batch delivered again.
    pub fn with_batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// Wait after the first failed delivery of a row, doubled on each further failure up to `max`
    /// (default 1 s, 5 min).
    pub fn with_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = (first, max.max(first));
        self
    }

    /// Longest a sink call may take before it counts as failed (default 30 s). A topic's lease lasts
    /// twice this and a second (extended while the sink works), so a relay that dies holds its topic
    /// back for at most that long. At most an hour (a longer `timeout` is an hour: the lease's deadline
    /// must stay within the clock's range).
    pub fn with_delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout.min(Duration::from_secs(3600));
        self
    }

    /// Most topics whose rows are with the sink at once (default 4, at least 1): each is a worker of the
    /// drain taking one topic's batch at a time under its own lease, so a slow downstream holds back
    /// its own topic and one worker, never the others. The rows of one topic are always delivered one
    /// after the other, in order.
    pub fn with_concurrency(mut self, topics: usize) -> Self {
        self.concurrency = topics.max(1);
        self
    }

    /// Largest payload [`Outbox::enqueue`] accepts, as JSON bytes (default 1 MiB).
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Writes `payload` to `topic` on `conn`, inside the caller's transaction: the row exists if and
    /// only if that transaction commits. Returns the row id.
    ///
    /// # Errors
    /// [`InputError::InvalidScope`] for a bad topic, [`InputError::InvalidJson`] when the payload does
    /// not serialize, [`InputError::NonFiniteNumber`] when it holds NaN or an infinity, [`InputError::PayloadTooLarge`]; [`StoreError::StoreUnavailable`] if Postgres
    /// failed (the caller's transaction is then unusable).
    pub async fn enqueue<P: Serialize + ?Sized>(
        &self,
        conn: &mut PgConnection,
        topic: &str,
        payload: &P,
    ) -> Result<i64, StoreError> {
        validate_name("topic", topic)?;
        // serde_json writes NaN and infinities as `null`: the downstream would get another message.
        if !crate::fingerprint::is_finite(payload) {
            return Err(InputError::NonFiniteNumber.into());
        }
        let json = serde_json::to_string(payload).map_err(InputError::InvalidJson)?;
        if json.len() > self.max_payload {
            return Err(InputError::PayloadTooLarge { len: json.len(), limit: self.max_payload }.into());
        }
        let insert = sqlx::query_scalar(ENQUEUE.sql).bind(topic).bind(json).fetch_one(conn);
        self.store.bounded(&ENQUEUE, insert).await
    }

    /// Delivers the rows that are due to `sink`, topic by topic in id order, one batch at a time per
    /// topic, until it has caught up with the rows that existed when it started; returns the counts. Rows
    /// the sink refuses (an `Err`, a panic, or no answer within the delivery timeout) back off and hold
    /// their topic back. Several relays may drain at once, in one process or many. The application
    /// schedules it (a loop with a pause, a cron job, or `idemctl outbox drain`).
    ///
    /// No transaction stays open while the sink works: a batch is read under a lease on its topic (twice
    /// the delivery timeout, extended while the sink works through the batch), and settled in a statement
    /// of its own. Delivery is at least once: a relay that dies, or whose settlement fails, after the sink
    /// accepted a row has that row delivered again (once its lease ran out), with the same
    /// [`Message::idempotency_key`].
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed; the current batch is delivered again later.
    /// Counted in `idemstore_outbox_drain_failures_total`.
    pub async fn drain<F, Fut, E>(&self, sink: F) -> Result<Drained, StoreError>
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let drained = self.drain_all(sink).await;
        telemetry::outbox_drain(drained.is_ok());
        // Counted whatever the drain came to, so the gauges keep telling the truth while drains fail.
        if let Err(error) = self.refresh_gauges().await {
            tracing::warn!(%error, "could not count the outbox backlog after a drain");
        }
        drained
    }

    async fn drain_all<F, Fut, E>(&self, sink: F) -> Result<Drained, StoreError>
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let horizon = sqlx::query_scalar(HORIZON.sql).fetch_one(self.store.pg_pool());
        let horizon: i64 = self.store.bounded(&HORIZON, horizon).await?;
        // The workers share the sink: each call only makes a delivery's future, so the lock is held for
        // no await (a Mutex, not a RefCell, keeps the drain's future Send).
        let sink = Mutex::new(sink);
        let failed = Mutex::new(Vec::new());
        let workers = (0..self.concurrency).map(|_| self.drain_topics(&sink, horizon, &failed));
        let mut drained = Drained::default();
        for worker in futures_util::future::join_all(workers).await {
            let worker = worker?;
            drained.delivered += worker.delivered;
            drained.failed += worker.failed;
        }
        Ok(drained)
    }

    /// The pending-rows and oldest-row gauges, from one aggregate (cheaper than [`Outbox::backlog`]).
    pub(crate) async fn refresh_gauges(&self) -> Result<(), StoreError> {
        let gauges = sqlx::query_as::<_, (i64, f64)>(GAUGES.sql).fetch_one(self.store.pg_pool());
        let (pending, oldest) = self.store.bounded(&GAUGES, gauges).await?;
        telemetry::outbox_backlog(
            u64::try_from(pending).unwrap_or(0),
            Duration::try_from_secs_f64(oldest).unwrap_or_default(),
        );
        Ok(())
    }

    /// One worker of a drain: topic after topic in name order, a batch at a time, until no due topic is
    /// left after its cursor. A topic is taken again only while its batches come back full and
    /// delivered, and one whose delivery failed is not taken again in this drain by any worker (whatever
    /// its backoff), so a drain ends: every batch delivers a row up to the horizon, or moves on.
    async fn drain_topics<F, Fut, E>(
        &self,
        sink: &Mutex<F>,
        horizon: i64,
        failed: &Mutex<Vec<String>>,
    ) -> Result<Drained, StoreError>
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let mut drained = Drained::default();
        let (mut cursor, mut again) = (String::new(), true);
        loop {
            let retired = failed.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let next = sqlx::query_scalar(NEXT_TOPIC.sql)
                .bind(&cursor)
                .bind(again)
                .bind(self.topics.as_deref())
                .bind(horizon)
                .bind(retired)
                .fetch_optional(self.store.pg_pool());
            let Some(topic): Option<String> = self.store.bounded(&NEXT_TOPIC, next).await? else { return Ok(drained) };
            let batch = self.drain_batch(sink, &topic, horizon, failed).await?.unwrap_or_default();
            drained.delivered += batch.delivered;
            drained.failed += batch.failed;
            again = batch.failed == 0 && batch.delivered == u64::from(self.batch_size);
            cursor = topic;
        }
    }

    /// One batch of `topic`, delivered under a lease and settled; `None` when the topic was not free
    /// (another relay leased it first), not due, or failed earlier in this drain (`failed`, where a
    /// failure is recorded before its settlement frees the topic).
    async fn drain_batch<F, Fut, E>(
        &self,
        sink: &Mutex<F>,
        topic: &str,
        horizon: i64,
        failed: &Mutex<Vec<String>>,
    ) -> Result<Option<Drained>, StoreError>
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let retired = |failed: &Mutex<Vec<String>>| {
            failed.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|t| t == topic)
        };
        let lease = Lease {
            topic,
            token: rand::random(),
            length: self.delivery_timeout.saturating_mul(2) + LEASE_MARGIN,
            taken: tokio::time::Instant::now(),
        };
        let take = sqlx::query_scalar::<_, bool>(LEASE.sql)
            .bind(topic)
            .bind(lease.token)
            .bind(millis(lease.length) as f64)
            .fetch_optional(self.store.pg_pool());
        if self.store.bounded(&LEASE, take).await?.is_none() {
            return Ok(None);
        }
        // Checked under the lease: a worker whose batch failed records it before its settlement gives
        // the lease up, so no other worker takes that topic again in this drain.
        if retired(failed) {
            let release = sqlx::query(RELEASE.sql).bind(topic).bind(lease.token);
            self.store.bounded(&RELEASE, release.execute(self.store.pg_pool())).await?;
            return Ok(None);
        }
        let read = sqlx::query(READ.sql)
            .bind(topic)
            .bind(lease.token)
            .bind(horizon)
            .bind(i64::from(self.batch_size))
            .fetch_all(self.store.pg_pool());
        let rows = self.store.bounded(&READ, read).await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let messages = rows.iter().map(Message::from_row).collect::<Result<Vec<_>, _>>();
        let messages = messages.map_err(|source| READ.failed(source))?;
        let settlement = self.deliver(sink, messages, &lease).await?;
        if !settlement.failed.is_empty() {
            failed.lock().unwrap_or_else(PoisonError::into_inner).push(topic.to_owned());
        }
        let drained = Drained { delivered: settlement.delivered.len() as u64, failed: settlement.failed.len() as u64 };
        let settle = sqlx::query_scalar(SETTLE.sql)
            .bind(topic)
            .bind(lease.token)
            .bind(settlement.delivered)
            .bind(settlement.failed)
            .bind(settlement.errors)
            .bind(settlement.delays_ms);
        let held: bool = self.store.bounded(&SETTLE, settle.fetch_one(self.store.pg_pool())).await?;
        if !held {
            // Nothing was recorded: the rows are the new holder's to deliver (again), not this drain's.
            tracing::warn!(topic, "outbox lease ran out and was taken over mid-batch; its rows are delivered again");
            return Ok(Some(Drained::default()));
        }
        Ok(Some(drained))
    }

    /// Hands one topic's rows to the sink, one after the other in id order, extending the lease while
    /// it works; a failed row backs off and holds the rest back.
    async fn deliver<F, Fut, E>(
        &self,
        sink: &Mutex<F>,
        messages: Vec<Message>,
        lease: &Lease<'_>,
    ) -> Result<Settlement, StoreError>
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let timeout = self.delivery_timeout;
        let mut settlement = Settlement::default();
        let mut leased_at = lease.taken;
        for message in messages {
            // A delivery may take the whole timeout: the lease must outlast it by the margin.
            if leased_at.elapsed() + timeout + LEASE_MARGIN > lease.length {
                let extending = tokio::time::Instant::now();
                if !self.extend(lease).await? {
                    // Taken over after it ran out: the new holder delivers the rest (and these) again.
                    tracing::warn!(topic = lease.topic, "outbox lease lost mid-batch; leaving the topic");
                    break;
                }
                leased_at = extending;
            }
            let (id, attempt, topic) = (message.id, message.attempt, message.topic.clone());
            let Some(error) = deliver_one(sink, message, timeout).await else {
                telemetry::outbox_delivery(&topic);
                settlement.delivered.push(id);
                continue;
            };
            tracing::warn!(id, topic, attempt, error, "outbox delivery failed");
            telemetry::outbox_failure(&topic);
            settlement.failed.push(id);
            settlement.errors.push(error);
            settlement.delays_ms.push(millis(self.backoff_after(attempt)) as f64);
            break;
        }
        Ok(settlement)
    }

    /// Extends the lease; false if it is no longer this relay's.
    async fn extend(&self, lease: &Lease<'_>) -> Result<bool, StoreError> {
        let extend = sqlx::query(EXTEND.sql).bind(lease.topic).bind(lease.token).bind(millis(lease.length) as f64);
        let extended = self.store.bounded(&EXTEND, extend.execute(self.store.pg_pool())).await?;
        Ok(extended.rows_affected() == 1)
    }

    /// The wait before the next delivery of a row whose `attempt`-th delivery failed.
    fn backoff_after(&self, attempt: u32) -> Duration {
        let (first, max) = self.backoff;
        first.saturating_mul(1 << attempt.saturating_sub(1).min(20)).min(max)
    }

    /// Lets `topic`'s head be delivered at the next drain instead of after its backoff (once the
    /// downstream is fixed); returns how many rows were waiting.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn retry(&self, topic: &str) -> Result<u64, StoreError> {
        let query = sqlx::query(RETRY.sql).bind(topic).execute(self.store.pg_pool());
        Ok(self.store.bounded(&RETRY, query).await?.rows_affected())
    }

    /// Deletes the undelivered row `id` without delivering it, and returns it (to keep, or to replay by
    /// hand): the way out for a row no downstream will ever accept, which otherwise holds its topic back.
    /// `None` if there is no such row (delivered, or discarded already). A relay delivering the row's
    /// topic right now may still hand it to its sink once.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn discard(&self, id: i64) -> Result<Option<Message>, StoreError> {
        let query = sqlx::query(DISCARD.sql).bind(id).fetch_optional(self.store.pg_pool());
        let row = self.store.bounded(&DISCARD, query).await?;
        let message = row.as_ref().map(Message::from_row).transpose().map_err(|source| DISCARD.failed(source))?;
        if let Some(message) = &message {
            // The payload is returned to the caller, never logged: it may carry personal data.
            tracing::warn!(id, topic = message.topic, payload_bytes = message.payload.len(), "outbox row discarded");
        }
        Ok(message)
    }

    /// The undelivered rows, per topic, and updates the pending-rows and oldest-age gauges.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed.
    pub async fn backlog(&self) -> Result<Vec<TopicBacklog>, StoreError> {
        let rows = self.store.bounded(&BACKLOG, sqlx::query(BACKLOG.sql).fetch_all(self.store.pg_pool())).await?;
        let backlog =
            rows.iter().map(topic_backlog).collect::<Result<Vec<_>, _>>().map_err(|source| BACKLOG.failed(source))?;
        let oldest = backlog.iter().map(|t| t.oldest).max().unwrap_or_default();
        telemetry::outbox_backlog(backlog.iter().map(|t| t.pending).sum(), oldest);
        Ok(backlog)
    }
}

fn topic_backlog(row: &PgRow) -> Result<TopicBacklog, sqlx::Error> {
    let seconds = |column: &str| -> Result<Duration, sqlx::Error> {
        Ok(Duration::try_from_secs_f64(row.try_get::<f64, _>(column)?).unwrap_or_default())
    };
    Ok(TopicBacklog {
        topic: row.try_get("topic")?,
        pending: u64::try_from(row.try_get::<i64, _>("pending")?).unwrap_or(0),
        oldest: seconds("oldest_seconds")?,
        head_id: row.try_get("head_id")?,
        head_attempts: u32::try_from(row.try_get::<i32, _>("attempts")?).unwrap_or(0),
        head_error: row.try_get("last_error")?,
        retry_in: seconds("retry_in_seconds")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn backoff_doubles_up_to_the_cap() {
        let store = Store::builder().database_url("postgres://localhost/unused").build().expect("lazy store");
        let outbox = store.outbox().with_backoff(Duration::from_millis(100), Duration::from_secs(1));
        let waits: Vec<_> = (1..=6).map(|attempt| outbox.backoff_after(attempt).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(outbox.backoff_after(u32::MAX), Duration::from_secs(1), "no overflow");
    }
}
