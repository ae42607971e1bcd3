//! Keys whose Redis copy may lag behind Postgres: a write that settles a key failed, or a claim marker
//! may have been written by a call that timed out. Such a copy could answer "in flight" for a key
//! Postgres already settled, to this process and to every other one, for up to a lease. So each key is
//! remembered and deleted as soon as Redis answers again: by a background task that tries every
//! cool-down (for the other processes' sake), and before this process's next script call (for its own).
//! Deleting is always safe: Redis is a cache, and a miss asks Postgres.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::redis_connection::{RedisConnection, RedisSource};

/// How many keys are remembered (about 10 MB at most); beyond it the oldest are forgotten, and their
/// copies expire with their lease.
const CAPACITY: usize = 100_000;

#[derive(Clone, Default)]
pub(crate) struct LaggingKeys {
    keys: Arc<Mutex<Remembered>>,
    /// Whether a background task is deleting the keys.
    repairing: Arc<AtomicBool>,
}

/// The remembered keys, numbered in the order they were left behind (numbers never repeat).
#[derive(Default)]
struct Remembered {
    next: u64,
    keys: VecDeque<(u64, String)>,
}

impl LaggingKeys {
    /// Remembers `key`, and starts a task (one at a time) that deletes the remembered keys through
    /// `source` once Redis answers within `budget`, trying every `cooldown`.
    pub(crate) fn push(&self, key: &str, source: &RedisSource, cooldown: Duration, budget: Duration) {
        if let Ok(mut remembered) = self.keys.lock() {
            if remembered.keys.len() == CAPACITY {
                remembered.keys.pop_front();
            }
            let number = remembered.next;
            remembered.next += 1;
            remembered.keys.push_back((number, key.to_owned()));
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        if !self.repairing.swap(true, Ordering::AcqRel) {
            runtime.spawn(self.clone().repair(source.clone(), cooldown, budget));
        }
    }

    /// Deletes every remembered key on `conn`, one `DEL` each, all sent at once (a shared connection
    /// pipelines them; a cluster sends each to its key's node, where one pipeline would be refused as
    /// crossing slots). Keys are forgotten only once Redis confirmed every deletion: a call that fails
    /// or is cancelled (a timeout) leaves them for the next try, and a concurrent call deletes them too
    /// rather than answering before they are gone.
    pub(crate) async fn delete_all(&self, conn: &RedisConnection) -> Result<(), redis::RedisError> {
        let (keys, next): (Vec<String>, u64) = match self.keys.lock() {
            Ok(remembered) if !remembered.keys.is_empty() => {
                (remembered.keys.iter().map(|(_, key)| key.clone()).collect(), remembered.next)
            }
            _ => return Ok(()),
        };
        let deletions = keys.iter().map(|key| {
            let mut conn = conn.clone();
            async move { redis::cmd("DEL").arg(key).query_async::<()>(&mut conn).await }
        });
        futures_util::future::try_join_all(deletions).await?;
        // Keys remembered after the snapshot (even the same key, left behind again) stay.
        if let Ok(mut remembered) = self.keys.lock() {
            remembered.keys.retain(|(number, _)| *number >= next);
        }
        Ok(())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.keys.lock().map_or(true, |remembered| remembered.keys.is_empty())
    }

    async fn repair(self, source: RedisSource, cooldown: Duration, budget: Duration) {
        loop {
            tokio::time::sleep(cooldown).await;
            let attempt = async {
                let conn =
                    source.connect(budget).await.map_err(|e| tracing::debug!(error = %e, "Redis still unavailable"))?;
                self.delete_all(&conn).await.map_err(|e| tracing::debug!(error = %e, "Redis still unavailable"))
            };
            let _ = tokio::time::timeout(budget, attempt).await;
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
