//! Keys whose Redis copy may lag behind Postgres: a write that settles a key failed, or a claim marker
//! may have been written by a call that timed out. Such a copy could answer "in flight" for a key
//! Postgres already settled, to this process and to every other one, for up to a lease. So each key is
//! remembered and deleted as soon as Redis answers again: by a background task that tries every
//! cool-down (for the other processes' sake), and before this process's next script call on that key
//! (for its own: every script reads and writes its one key only). Deleting is always safe: Redis is a
//! cache, and a miss asks Postgres.
//!
//! Per key, not all at once: on a Redis Cluster one shard that is still down must not hold up calls
//! on the others, and a long list left by an outage is not sent again with every request.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Background;
use super::redis_connection::{RedisConnection, RedisSource};

/// How many keys are remembered (about 10 MB at most); beyond it the oldest are forgotten, and their
/// copies expire with their lease.
const CAPACITY: usize = 100_000;

/// How many deletions the background task sends at once.
const REPAIR_BATCH: usize = 1_000;

#[derive(Clone)]
pub(crate) struct LaggingKeys {
    keys: Arc<Mutex<Remembered>>,
    /// Whether a background task is deleting the keys.
    repairing: Arc<AtomicBool>,
    /// Where that task runs: it follows the store, and ends with its shutdown.
    background: Background,
}

/// The remembered keys: each with the number of its latest push (numbers never repeat), and the pushes
/// in order, for forgetting the oldest beyond the capacity.
#[derive(Default)]
struct Remembered {
    next: u64,
    latest: HashMap<String, u64>,
    order: VecDeque<(u64, String)>,
}

impl Remembered {
    /// Forgets `key` if it was not left behind again after push number `seen`.
    fn forget(&mut self, key: &str, seen: u64) {
        if self.latest.get(key).is_some_and(|latest| *latest <= seen) {
            self.latest.remove(key);
        }
    }
}

impl LaggingKeys {
    pub(crate) fn new(background: Background) -> Self {
        Self { keys: Arc::default(), repairing: Arc::default(), background }
    }

    /// Remembers `key`, and starts a task (one at a time) that deletes the remembered keys through
    /// `source` once Redis answers within `budget`, trying every `cooldown`.
    pub(crate) fn push(&self, key: &str, source: &RedisSource, cooldown: Duration, budget: Duration) {
        if let Ok(mut remembered) = self.keys.lock() {
            let number = remembered.next;
            remembered.next += 1;
            remembered.latest.insert(key.to_owned(), number);
            remembered.order.push_back((number, key.to_owned()));
            while remembered.order.len() > CAPACITY {
                if let Some((oldest, key)) = remembered.order.pop_front() {
                    remembered.forget(&key, oldest);
                }
            }
        }
        if !self.repairing.swap(true, Ordering::AcqRel)
            && self.background.follow(self.clone().repair(source.clone(), cooldown, budget)).is_none()
        {
            // No runtime, or the store is shut down: the copies expire with their lease.
            self.repairing.store(false, Ordering::Release);
        }
    }

    /// The number of `key`'s latest push, if its copy may lag.
    pub(crate) fn lagging(&self, key: &str) -> Option<u64> {
        self.keys.lock().ok()?.latest.get(key).copied()
    }

    /// Deletes `key` on `conn` and forgets it once Redis confirmed, unless it was left behind again
    /// after push `seen`. A call that fails or is cancelled (a timeout) keeps it for the next try.
    pub(crate) async fn delete(&self, conn: &RedisConnection, key: &str, seen: u64) -> Result<(), redis::RedisError> {
        redis::cmd("DEL").arg(key).query_async::<()>(&mut conn.clone()).await?;
        if let Ok(mut remembered) = self.keys.lock() {
            remembered.forget(key, seen);
        }
        Ok(())
    }

    /// Deletes every remembered key, one `DEL` each, [`REPAIR_BATCH`] at a time (a shared connection
    /// pipelines them; a cluster sends each to its key's node). Each is forgotten as soon as its own
    /// deletion is confirmed; one that fails (its shard still down) does not stop the others. Returns
    /// the first failure, after trying them all.
    async fn delete_remembered(&self, conn: &RedisConnection) -> Result<(), redis::RedisError> {
        let remembered: Vec<(String, u64)> = match self.keys.lock() {
            Ok(remembered) => remembered.latest.iter().map(|(key, seen)| (key.clone(), *seen)).collect(),
            Err(_) => return Ok(()),
        };
        let mut failed = None;
        for batch in remembered.chunks(REPAIR_BATCH) {
            let deletions = batch.iter().map(|(key, seen)| self.delete(conn, key, *seen));
            let first = futures_util::future::join_all(deletions).await.into_iter().find_map(Result::err);
            failed = failed.or(first);
        }
        if let Ok(mut remembered) = self.keys.lock() {
            let Remembered { latest, order, .. } = &mut *remembered;
            order.retain(|(number, key)| latest.get(key) == Some(number));
        }
        failed.map_or(Ok(()), Err)
    }

    fn is_empty(&self) -> bool {
        self.keys.lock().map_or(true, |remembered| remembered.latest.is_empty())
    }

    async fn repair(self, source: RedisSource, cooldown: Duration, budget: Duration) {
        loop {
            tokio::time::sleep(cooldown).await;
            let attempt = async {
                let conn =
                    source.connect(budget).await.map_err(|e| tracing::debug!(error = %e, "Redis still unavailable"))?;
                self.delete_remembered(&conn).await.map_err(|e| tracing::debug!(error = %e, "Redis still unavailable"))
            };
            // A long list takes several budgets; what is left waits for the next attempt.
            let _ = tokio::time::timeout(budget * 10, attempt).await;
            if self.is_empty() {
                self.repairing.store(false, Ordering::Release);
                // A key pushed between the check and the store found the task still running: go on.
                if self.is_empty() || self.repairing.swap(true, Ordering::AcqRel) {
                    return;
                }
            }
        }
    }
}
