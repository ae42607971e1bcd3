//! Group commit: the claims of new keys and the completions of concurrent calls, written together.
//!
//! Why: for a new key Postgres spends most of its time on each statement (its executor, its commit),
//! not on the row it writes; eight claims in one statement cost the server about a third of eight
//! statements (pgbench on the development machine: 29-37k new records a second in statements of eight,
//! 9-12k one at a time). But Postgres already commits concurrent statements together (one WAL flush for
//! all of them), so while the pool has a connection to spare a call writes at once, alone, on its own
//! task, as it does while fewer than two batches are under way: batches form under load. A batch is
//! whatever queued while the batches before it were under way.
//!
//! What stays as it was: each batch is one statement that commits before anyone hears of it, so a
//! claim is durable before its work runs, and a completion is stored before the client is answered. A
//! call the batch cannot answer for on its own (a row another transaction holds, a statement that failed
//! on some row's account) is told to ask alone, and sends its own statement as it would without group
//! commit. A claim whose caller stopped waiting (cancelled, or past the store's timeout) is taken back
//! at once, so nobody is told "in flight" for work that never started, and a call answered
//! "unavailable" leaves no record, as a statement the server cancelled does not. Claims inside the caller's
//! transaction never join a batch: they commit with the caller's work.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sqlx::Row as _;
use sqlx::postgres::{PgPool, PgRow};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use super::Background;
use super::awaiting::Awaiting;
use super::postgres_tier::{CLAIM_NEW_BATCH, COMPLETE_BATCH, Retained, decode_record, give_back, key_lock, retained};
use super::statement::{self, Statement};
use crate::error::StoreError;
use crate::key::KeyDigest;
use crate::policy::{LeaseExpiry, millis};
use crate::record::{Lease, Record};

/// A call's leave to write alone ([`Batcher::alone`]), held until its statement is done.
pub(crate) enum Alone {
    /// On its way to one of the pool's spare connections.
    ToSpareConnection(ToSpareConnection),
    /// A batch slot.
    InSlot { _slot: OwnedSemaphorePermit },
}

impl Alone {
    /// The call has its connection: it no longer counts against the pool's spare ones.
    pub(crate) fn took_connection(&mut self) {
        if let Alone::ToSpareConnection(counted) = self {
            drop(std::mem::replace(counted, ToSpareConnection(None)));
        }
    }
}

/// One lone call counted against the pool's spare connections, until it took one or was dropped.
pub(crate) struct ToSpareConnection(Option<Arc<AtomicUsize>>);

impl Drop for ToSpareConnection {
    fn drop(&mut self) {
        if let Some(on_the_way) = self.0.take() {
            on_the_way.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The most calls in one statement.
const MAX_BATCH: usize = 64;
/// Batches of one kind under way at once: while they are, the next calls queue and go together.
const BATCHES_UNDER_WAY: usize = 2;
/// A completion that stores more than this goes alone: a batch is one message to Postgres, and one
/// large response would hold up the small ones.
const MAX_BATCHED_RESPONSE: usize = 64 * 1024;

/// What a batch answered a call.
#[derive(Debug)]
pub(crate) enum Batched<A> {
    Answered(A),
    /// The batch could not answer for this call on its own: the caller sends its own statement.
    AskAlone,
}

/// The two kinds of write that go in batches.
pub(crate) struct GroupCommit {
    pub(crate) claims: Batcher<NewClaim>,
    pub(crate) completions: Batcher<Completion>,
}

impl GroupCommit {
    pub(crate) fn new(pool: &PgPool, timeout: Duration, background: &Background) -> Self {
        Self { claims: Batcher::new(pool, timeout, background), completions: Batcher::new(pool, timeout, background) }
    }
}

/// A write that can go in a batch.
pub(crate) trait Job: Send + Sync + Sized + 'static {
    type Answer: Send + 'static;
    const STATEMENT: Statement;

    /// The lease the job writes for; every batch writes its rows in the order of their keys.
    fn lease(&self) -> &Lease;

    /// The batch as one statement: an answer per job, in order; `None` where the job must ask alone.
    fn send(
        pool: &PgPool,
        jobs: &[&Self],
    ) -> impl Future<Output = Result<Vec<Option<Self::Answer>>, sqlx::Error>> + Send;

    /// The caller stopped waiting before `answer` reached it.
    fn unheard(&self, answer: Self::Answer, pool: &PgPool, timeout: Duration) -> impl Future<Output = ()> + Send;
}

struct Queued<J: Job> {
    job: Arc<J>,
    reply: oneshot::Sender<Result<Batched<J::Answer>, StoreError>>,
}

/// The queue of one kind of write, and the task that sends its batches.
pub(crate) struct Batcher<J: Job> {
    /// The running task's queue; started on first use, and again if its runtime ended.
    queue: Mutex<Option<mpsc::UnboundedSender<Queued<J>>>>,
    /// The batches under way, and the calls that write alone in a batch's slot (see [`Batcher::alone`]).
    under_way: Arc<Semaphore>,
    /// The lone calls on their way to a spare connection of the pool (see [`Batcher::alone`]).
    on_the_way: Arc<AtomicUsize>,
    pool: PgPool,
    timeout: Duration,
    background: Background,
}

impl<J: Job> Batcher<J> {
    fn new(pool: &PgPool, timeout: Duration, background: &Background) -> Self {
        Self {
            queue: Mutex::new(None),
            under_way: Arc::new(Semaphore::new(BATCHES_UNDER_WAY)),
            on_the_way: Arc::new(AtomicUsize::new(0)),
            pool: pool.clone(),
            timeout,
            background: background.clone(),
        }
    }

    /// A place for a call to write alone, on its own task: a connection the pool has spare (idle, or
    /// not opened yet) that no other lone call is on its way to take, or else a batch slot, when fewer
    /// than [`BATCHES_UNDER_WAY`] writes are under way (nothing would join its batch). Batching a call
    /// that has a spare connection would only add the hop to the batch task and back (about a
    /// millisecond) and hold it to two statements at a time, where Postgres runs as many as the pool
    /// has and flushes their commits together: with slots alone, new keys at 16 in flight on a pool of
    /// 16 ran at 0.7-0.9x of writing alone (the compare bench). A slot is held while the call writes and
    /// counts as a batch: calls that come meanwhile queue and go together.
    pub(crate) fn alone(&self) -> Option<Alone> {
        let on_the_way = self.on_the_way.fetch_add(1, Ordering::AcqRel);
        let counted = ToSpareConnection(Some(Arc::clone(&self.on_the_way)));
        let options = self.pool.options();
        let unopened = (options.get_max_connections() as usize).saturating_sub(self.pool.size() as usize);
        if on_the_way < self.pool.num_idle() + unopened {
            return Some(Alone::ToSpareConnection(counted));
        }
        drop(counted);
        let slot = Arc::clone(&self.under_way).try_acquire_owned().ok()?;
        Some(Alone::InSlot { _slot: slot })
    }

    /// Sends `job` in the next batch and waits, at most the store's Postgres timeout, for its answer.
    pub(crate) async fn submit(&self, job: J) -> Result<Batched<J::Answer>, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job = Arc::new(job);
        if !self.enqueue(Queued { job: Arc::clone(&job), reply }) {
            return Ok(Batched::AskAlone);
        }
        // Dropped before it took the answer (the caller was cancelled), the caller's end undoes an answer
        // sent just before; the batch undoes those it sends from then on ([`Job::unheard`]).
        let mut awaiting = Awaiting::new(answer, |answered| self.undo_unheard(job, answered));
        let answer = &mut awaiting.answer;
        match tokio::time::timeout(self.timeout, &mut *answer).await {
            Ok(Ok(answered)) => answered,
            // The batch was dropped (its runtime ended), perhaps after it was sent: a claim it wrote is
            // this call's own, which the full claim recognises by its owner.
            Ok(Err(_)) => Ok(Batched::AskAlone),
            Err(_) => {
                // Closed first: an answer sent before the close is taken, and after it the batch knows
                // nobody hears it (and releases a claim).
                answer.close();
                answer.try_recv().unwrap_or_else(|_| Err(J::STATEMENT.failed(statement::timed_out())))
            }
        }
    }

    /// Undoes, in a settlement, an answer that reached a caller's end after the caller had left.
    fn undo_unheard(&self, job: Arc<J>, answered: Result<Batched<J::Answer>, StoreError>) {
        let Ok(Batched::Answered(answer)) = answered else { return };
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        self.background.settle(async move { job.unheard(answer, &pool, timeout).await });
    }

    /// Queues `queued`, starting the task if none runs; false when no task can run (no runtime, or the
    /// store was shut down).
    fn enqueue(&self, queued: Queued<J>) -> bool {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let queued = match queue.as_ref() {
            Some(sender) => match sender.send(queued) {
                Ok(()) => return true,
                Err(mpsc::error::SendError(queued)) => queued,
            },
            None => queued,
        };
        let (sender, receiver) = mpsc::unbounded_channel();
        let task =
            drive(receiver, Arc::clone(&self.under_way), self.pool.clone(), self.timeout, self.background.clone());
        if self.background.follow(task).is_none() {
            return false;
        }
        let sent = sender.send(queued).is_ok();
        *queue = Some(sender);
        sent
    }
}

/// Takes what queued into batches, with at most [`BATCHES_UNDER_WAY`] of them (or lone writes) under way.
async fn drive<J: Job>(
    mut queue: mpsc::UnboundedReceiver<Queued<J>>,
    under_way: Arc<Semaphore>,
    pool: PgPool,
    timeout: Duration,
    background: Background,
) {
    while let Some(first) = queue.recv().await {
        let Ok(permit) = Arc::clone(&under_way).acquire_owned().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH
            && let Ok(next) = queue.try_recv()
        {
            batch.push(next);
        }
        // A settlement: a shutdown waits for the batch, whose claims and completions may have landed.
        let pool = pool.clone();
        background.settle(async move {
            flush(batch, &pool, timeout).await;
            drop(permit);
        });
    }
}

/// Sends one batch and answers its callers.
async fn flush<J: Job>(mut batch: Vec<Queued<J>>, pool: &PgPool, timeout: Duration) {
    // A caller that stopped waiting is not written for.
    batch.retain(|queued| !queued.reply.is_closed());
    if batch.is_empty() {
        return;
    }
    batch.sort_by(|a, b| order(a.job.lease()).cmp(&order(b.job.lease())));
    let jobs: Vec<&J> = batch.iter().map(|queued| &*queued.job).collect();
    let sent = statement::bounded(timeout, &J::STATEMENT, J::send(pool, &jobs)).await;
    let answers = match sent {
        Ok(answers) => answers,
        Err(error) => {
            let out_of_reach = out_of_reach(&error);
            for queued in batch {
                let _ = queued.reply.send(match &out_of_reach {
                    // Each call would fail the same way alone.
                    Some(copy) => Err(J::STATEMENT.failed(copy())),
                    // The statement failed on some row's account (a lock waited out, a deadlock, a
                    // constraint, a row it could not read): each call asks alone, and only its own row
                    // can fail it.
                    None => Ok(Batched::AskAlone),
                });
            }
            return;
        }
    };
    // Fault tests: the statement committed, and its callers hear of it only after `return(ms)`.
    #[cfg(feature = "failpoints")]
    statement::pause_at("group-commit-before-answers").await;
    // Everyone is answered first; then what nobody heard is undone.
    let mut unheard = Vec::new();
    for (queued, answer) in batch.into_iter().zip(answers) {
        let reply = answer.map_or(Batched::AskAlone, Batched::Answered);
        if let Err(Ok(Batched::Answered(answer))) = queued.reply.send(Ok(reply)) {
            unheard.push((queued.job, answer));
        }
    }
    for (job, answer) in unheard {
        job.unheard(answer, pool, timeout).await;
    }
}

/// Where a lease's row comes in a batch.
pub(crate) fn order(lease: &Lease) -> (&str, &str, &str) {
    (lease.scope.tenant(), lease.scope.operation(), lease.key.as_str())
}

/// When a batch failed because Postgres is out of reach (a connection lost or refused, no connection
/// in time, the server shutting down or out of resources, the store's timeout): the error each of its
/// callers gets, as each would alone, and as retryable. `None` when the failure is some row's, or the
/// store's own (its pool closed): asked alone, each call meets it again, with its cause.
pub(crate) fn out_of_reach(error: &StoreError) -> Option<impl Fn() -> sqlx::Error + use<>> {
    let StoreError::StoreUnavailable { source, .. } = error else { return None };
    let kind = match source {
        sqlx::Error::Io(io) => io.kind(),
        sqlx::Error::PoolTimedOut => std::io::ErrorKind::TimedOut,
        sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => std::io::ErrorKind::Other,
        // Connection exceptions, insufficient resources, operator intervention (a shutdown, a cancel).
        sqlx::Error::Database(db) if db.code().is_some_and(|code| ["08", "53", "57"].contains(&&code[..2])) => {
            std::io::ErrorKind::Other
        }
        _ => return None,
    };
    let text = source.to_string();
    Some(move || sqlx::Error::Io(std::io::Error::new(kind, text.clone())))
}

/// The claim of a key that is most likely new; answered with its new record, or `None` when the key has
/// a record or a live tombstone (the full claim answers then).
pub(crate) struct NewClaim {
    pub(crate) lease: Lease,
    pub(crate) digest: KeyDigest,
}

impl Job for NewClaim {
    type Answer = Option<Record>;
    const STATEMENT: Statement = CLAIM_NEW_BATCH;

    fn lease(&self) -> &Lease {
        &self.lease
    }

    async fn send(pool: &PgPool, jobs: &[&Self]) -> Result<Vec<Option<Option<Record>>>, sqlx::Error> {
        let leases = || jobs.iter().map(|job| &job.lease);
        let rows = sqlx::query(CLAIM_NEW_BATCH.sql)
            .bind(leases().map(|lease| lease.scope.tenant()).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.scope.operation()).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.key.as_str()).collect::<Vec<_>>())
            .bind(leases().map(|lease| &lease.fingerprint.as_bytes()[..]).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.owner.as_str()).collect::<Vec<_>>())
            .bind(leases().map(|lease| millis(lease.policy.lease) as f64).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.policy.retention.map(|r| millis(r) as f64)).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.policy.lease_expiry == LeaseExpiry::TakeOver).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.policy.name()).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.policy.tombstone.map(|t| millis(t) as f64)).collect::<Vec<_>>())
            .bind(jobs.iter().map(|job| job.digest.as_str()).collect::<Vec<_>>())
            .bind(jobs.iter().map(|job| key_lock(&job.digest)).collect::<Vec<_>>())
            .fetch_all(pool)
            .await?;
        let mut answers: Vec<Option<Record>> = jobs.iter().map(|_| None).collect();
        for row in rows {
            let owner: &str = row.try_get("owner")?;
            let place = jobs.iter().position(|job| job.lease.owner == owner);
            let place =
                place.ok_or_else(|| sqlx::Error::Decode("a batch claimed for an owner it was not sent".into()))?;
            answers[place] = Some(decode_record(&row)?);
        }
        Ok(answers.into_iter().map(Some).collect())
    }

    /// Nobody runs the work of a claim its caller never heard of: the claim is taken back at once, as
    /// if it had never been written (the caller was told so, or nothing), and claims that wait for it
    /// hear so.
    async fn unheard(&self, answer: Option<Record>, pool: &PgPool, timeout: Duration) {
        let Some(record) = answer else { return };
        let lease = Lease { fence: record.fence, ..self.lease.clone() };
        give_back(pool, timeout, &lease, false, self.digest.as_str()).await;
    }
}

/// A fenced completion; answered with how long the record is kept, or told to ask alone when the
/// record is held by another transaction or its fence moved on.
pub(crate) struct Completion {
    pub(crate) lease: Lease,
    pub(crate) response: Vec<u8>,
}

impl Completion {
    /// Whether `response` may go in a batch ([`MAX_BATCHED_RESPONSE`]).
    pub(crate) fn fits(response: &[u8]) -> bool {
        response.len() <= MAX_BATCHED_RESPONSE
    }
}

impl Job for Completion {
    type Answer = Retained;
    const STATEMENT: Statement = COMPLETE_BATCH;

    fn lease(&self) -> &Lease {
        &self.lease
    }

    async fn send(pool: &PgPool, jobs: &[&Self]) -> Result<Vec<Option<Retained>>, sqlx::Error> {
        let leases = || jobs.iter().map(|job| &job.lease);
        let rows: Vec<PgRow> = sqlx::query(COMPLETE_BATCH.sql)
            .bind(leases().map(|lease| lease.digest().as_str().to_owned()).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.scope.tenant()).collect::<Vec<_>>())
            .bind(leases().map(|lease| lease.fence).collect::<Vec<_>>())
            .bind(jobs.iter().map(|job| &job.response[..]).collect::<Vec<_>>())
            .fetch_all(pool)
            .await?;
        let mut answers: Vec<Option<Retained>> = jobs.iter().map(|_| None).collect();
        for row in rows {
            let n: i64 = row.try_get("n")?;
            let place = usize::try_from(n - 1).ok().filter(|&place| place < answers.len());
            let place = place
                .ok_or_else(|| sqlx::Error::Decode(format!("a batch completed row {n} it was not sent").into()))?;
            answers[place] = Some(retained(&row)?);
        }
        Ok(answers)
    }

    /// A completion stands whether or not its caller heard of it: the work ran.
    async fn unheard(&self, _: Retained, _: &PgPool, _: Duration) {}
}
