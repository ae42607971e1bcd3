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
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Row as _;
use sqlx::postgres::{PgConnection, PgRow};

use crate::error::{InputError, StoreError};
use crate::key::{IdempotencyKey, validate_name};
use crate::policy::millis;
use crate::store::{BEGIN, COMMIT, Statement, Store};
use crate::telemetry;

const ENQUEUE: Statement = Statement::new(
    "outbox_enqueue",
    "INSERT INTO idempotency_outbox (topic, payload) VALUES ($1, $2::json) RETURNING id",
);

/// The newest row when a drain starts: it delivers nothing newer, so it ends even while producers write.
const HORIZON: Statement = Statement::new("outbox_horizon", "SELECT COALESCE(max(id), 0) FROM idempotency_outbox");

/// One topic's batch, locked for this relay's transaction: the oldest due head (a topic's oldest row, up
/// to the drain's horizon `$3`) that no other relay holds, and the rows behind it in id order, at most
/// `$1`. The head is the topic's lock: no two relays (or workers of one drain) deliver one topic at once,
/// and its rows go out in id order. One topic per batch, so a slow topic holds back only itself, never
/// the commit of other topics' deliveries. Topics are found by a loose index scan (one probe per topic),
/// so a long backlog in one topic costs no scan. A head that is backing off holds its whole topic back:
/// order before progress. The rows behind the head are locked waiting, never skipped: a row another
/// relay holds (it saw an older head, before a producer's earlier row committed) is that relay's to
/// deliver first. `$4`: topics that failed earlier in this drain, left for the next one.
const LOCK_BATCH: Statement = Statement::new(
    "outbox_lock",
    "
    WITH RECURSIVE topics(topic) AS (
        (SELECT topic FROM idempotency_outbox
         WHERE $2::text[] IS NULL OR topic = ANY($2) ORDER BY topic LIMIT 1)
        UNION ALL
        SELECT (SELECT o.topic FROM idempotency_outbox o
                WHERE o.topic > t.topic AND ($2::text[] IS NULL OR o.topic = ANY($2))
                ORDER BY o.topic LIMIT 1)
        FROM topics t WHERE t.topic IS NOT NULL
    ), heads AS (
        SELECT o.topic FROM idempotency_outbox o
        WHERE o.id IN (SELECT (SELECT h.id FROM idempotency_outbox h WHERE h.topic = t.topic ORDER BY h.id LIMIT 1)
                       FROM topics t WHERE t.topic IS NOT NULL)
          AND o.next_attempt_at <= now() AND o.id <= $3 AND o.topic <> ALL($4)
        ORDER BY o.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    )
    SELECT o.id, o.topic, o.payload::text AS payload, o.attempts
    FROM idempotency_outbox o JOIN heads USING (topic)
    WHERE o.id <= $3
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o",
);

/// The batch's outcome in one round trip: delivered rows are deleted, failed ones back off. The backoff
/// counts from now (`clock_timestamp`), not from the batch's start (`now()`), which may be long past.
const SETTLE: Statement = Statement::new(
    "outbox_settle",
    "
    WITH delivered AS (DELETE FROM idempotency_outbox WHERE id = ANY($1))
    UPDATE idempotency_outbox o
    SET attempts = o.attempts + 1, last_error = f.error,
        next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond'
    FROM unnest($2::bigint[], $3::text[], $4::float8[]) AS f(id, error, delay_ms)
    WHERE o.id = f.id",
);

/// Skips the rest of a topic's backoff: its head goes out at the next drain.
const RETRY: Statement = Statement::new(
    "outbox_retry",
    "UPDATE idempotency_outbox SET next_attempt_at = now() WHERE topic = $1 AND next_attempt_at > now()",
);

/// Deletes one undelivered row (a poison message holding its topic back), returning it for the record.
const DISCARD: Statement = Statement::new(
    "outbox_discard",
    "DELETE FROM idempotency_outbox WHERE id = $1 RETURNING id, topic, payload::text AS payload, attempts",
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
}

impl Message {
    /// `outbox-<id>`: the same on every delivery of this row. Pass it as the downstream's idempotency
    /// key. Row ids are unique within one database; prefix the key when several databases feed one
    /// downstream account.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::outbox(self.id)
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

    /// Most rows locked and delivered in one transaction (default 100, at least 1). A relay that dies
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

    /// Longest a sink call may take before it counts as failed (default 30 s). The batch's rows stay
    /// locked meanwhile.
    pub fn with_delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// Most topics whose rows are with the sink at once (default 4, at least 1): each is a worker of the
    /// drain taking one topic's batch at a time in its own transaction, so a slow downstream holds back
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
    /// not serialize, [`InputError::PayloadTooLarge`]; [`StoreError::StoreUnavailable`] if Postgres
    /// failed (the caller's transaction is then unusable).
    pub async fn enqueue<P: Serialize + ?Sized>(
        &self,
        conn: &mut PgConnection,
        topic: &str,
        payload: &P,
    ) -> Result<i64, StoreError> {
        validate_name("topic", topic)?;
        let json = serde_json::to_string(payload).map_err(InputError::InvalidJson)?;
        if json.len() > self.max_payload {
            return Err(InputError::PayloadTooLarge { len: json.len(), limit: self.max_payload }.into());
        }
        let insert = sqlx::query_scalar(ENQUEUE.sql).bind(topic).bind(json).fetch_one(conn);
        self.store.bounded(&ENQUEUE, insert).await
    }

    /// Delivers the rows that are due to `sink`, topic by topic in id order, one batch per transaction,
    /// until it has caught up with the rows that existed when it started; returns the counts. Rows the
    /// sink refuses (an `Err`, or no answer within the delivery timeout) back off and hold their topic
    /// back. Several relays may drain at once, in one process or many. The application schedules it (a
    /// loop with a pause, a cron job, or `idemctl outbox drain`).
    ///
    /// Delivery is at least once: a relay that dies, or whose commit fails, after the sink accepted a
    /// row delivers that row again, with the same [`Message::idempotency_key`].
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed; the current batch is delivered again later.
    pub async fn drain<F, Fut, E>(&self, sink: F) -> Result<Drained, StoreError>
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
        // The rows are settled by now: a failed gauge refresh must not report the drain as failed.
        if let Err(error) = self.refresh_gauges().await {
            tracing::warn!(%error, "could not count the outbox backlog after a drain");
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

    /// One worker of a drain: one topic's batch after another, until no due topic is left to it. A topic
    /// whose delivery failed is not taken again in this drain (whatever its backoff), so a drain ends:
    /// each batch delivers a row up to the horizon, or retires a topic.
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
        while let Some(batch) = self.drain_batch(sink, horizon, failed).await? {
            drained.delivered += batch.delivered;
            drained.failed += batch.failed;
        }
        Ok(drained)
    }

    /// One topic's batch, delivered and settled in one transaction; `None` when no due topic was free.
    async fn drain_batch<F, Fut, E>(
        &self,
        sink: &Mutex<F>,
        horizon: i64,
        failed: &Mutex<Vec<String>>,
    ) -> Result<Option<Drained>, StoreError>
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let store = &self.store;
        let mut tx = store.bounded(&BEGIN, store.pg_pool().begin()).await?;
        let retired = failed.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let lock = sqlx::query(LOCK_BATCH.sql)
            .bind(i64::from(self.batch_size))
            .bind(self.topics.as_deref())
            .bind(horizon)
            .bind(retired);
        let rows = store.bounded(&LOCK_BATCH, lock.fetch_all(&mut *tx)).await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let messages = rows.iter().map(Message::from_row).collect::<Result<Vec<_>, _>>();
        let messages = messages.map_err(|source| LOCK_BATCH.failed(source))?;
        let topic = messages[0].topic.clone();
        let settlement = self.deliver(sink, messages).await;
        if !settlement.failed.is_empty() {
            failed.lock().unwrap_or_else(PoisonError::into_inner).push(topic);
        }
        let drained = Drained { delivered: settlement.delivered.len() as u64, failed: settlement.failed.len() as u64 };
        let settle = sqlx::query(SETTLE.sql)
            .bind(settlement.delivered)
            .bind(settlement.failed)
            .bind(settlement.errors)
            .bind(settlement.delays_ms);
        store.bounded(&SETTLE, settle.execute(&mut *tx)).await?;
        store.bounded(&COMMIT, tx.commit()).await?;
        Ok(Some(drained))
    }

    /// Hands one topic's rows to the sink, one after the other in id order; a failed row backs off and
    /// holds the rest back.
    async fn deliver<F, Fut, E>(&self, sink: &Mutex<F>, messages: Vec<Message>) -> Settlement
    where
        F: FnMut(Message) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Display,
    {
        let timeout = self.delivery_timeout;
        let mut settlement = Settlement::default();
        for message in messages {
            let (id, attempt, topic) = (message.id, message.attempt, message.topic.clone());
            let delivery =
                tokio::time::timeout(timeout, (sink.lock().unwrap_or_else(PoisonError::into_inner))(message));
            let error = match delivery.await {
                Ok(Ok(())) => None,
                Ok(Err(error)) => Some(error.to_string()),
                Err(_) => Some(format!("no answer within {timeout:?}")),
            };
            let Some(error) = error else {
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
        settlement
    }

    /// The wait before the next delivery of a row whose `attempt`-th delivery failed.
    fn backoff_after(&self, attempt: u32) -> Duration {
        let (first, max) = self.backoff;
        first.saturating_mul(1 << attempt.saturating_sub(1).min(20)).min(max)
    }

    /// Lets `topic`'s head be delivered at the next drain instead of after its backoff (once the
    /// downstream is fixed); returns how many rows were waiting. If a relay holds the topic, this waits for
    /// its batch to end, up to the store's statement timeout.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed, or a relay held the topic past the timeout.
    pub async fn retry(&self, topic: &str) -> Result<u64, StoreError> {
        let query = sqlx::query(RETRY.sql).bind(topic).execute(self.store.pg_pool());
        Ok(self.store.bounded(&RETRY, query).await?.rows_affected())
    }

    /// Deletes the undelivered row `id` without delivering it, and returns it (to keep, or to replay by
    /// hand): the way out for a row no downstream will ever accept, which otherwise holds its topic back.
    /// `None` if there is no such row (delivered, or discarded already). If a relay holds the row, this
    /// waits for its batch to end, up to the store's statement timeout.
    ///
    /// # Errors
    /// [`StoreError::StoreUnavailable`] if Postgres failed, or a relay held the row past the timeout.
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
