//! Wakes claims that wait for an in-flight duplicate ([`RunOptions::wait_in_flight`]) when its owner
//! settles, instead of polling.
//!
//! A waiting claim registers here first, then flags the record it waits for: in Redis (begin.lua writes
//! the key's digest into the marker) when this store follows Redis, else in Postgres (the `waited`
//! column). Only a flagged record costs its owner a notification when it completes or releases: Redis
//! publishes the digest (put.lua, release.lua) and Postgres sends it with `pg_notify` after the commit.
//! One subscription per store and tier, opened by the first wait and kept for the store's life, carries
//! them to every waiter of the digest in this process. A notification is a hint: the waiter asks again,
//! and a lost one (a subscription reconnecting, a Redis write that failed) costs at most
//! [`RECHECK_EVERY`].
//!
//! [`RunOptions::wait_in_flight`]: crate::RunOptions::wait_in_flight

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use futures_util::StreamExt as _;
use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::watch;

use super::Background;
use crate::key::{IdempotencyKey, Scope, key_digest};

/// The Postgres channel settlements are announced on (the payload is the key's digest).
pub(crate) const POSTGRES_CHANNEL: &str = "idemstore_settled";

/// Longest a waiter goes without asking again, should its notification be lost.
pub(crate) const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// Pause before a lost subscription is opened again.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// Longest attempt to open a subscription.
const CONNECT_WITHIN: Duration = Duration::from_secs(2);

/// The waiters of this process, by key digest.
#[derive(Default)]
struct Waiters(Mutex<HashMap<String, watch::Sender<()>>>);

impl Waiters {
    fn wake(&self, digest: &str) {
        if let Some(sender) = self.0.lock().expect("waiters lock").get(digest) {
            sender.send_replace(());
        }
    }

    /// Wakes everyone: a subscription came back, and what it carried meanwhile is lost.
    fn wake_all(&self) {
        self.0.lock().expect("waiters lock").values().for_each(|sender| {
            sender.send_replace(());
        });
    }
}

/// One waiting claim's registration; dropping it unregisters.
pub(crate) struct Watch {
    waiters: Arc<Waiters>,
    digest: String,
    woken: watch::Receiver<()>,
}

impl Watch {
    pub(crate) fn digest(&self) -> &str {
        &self.digest
    }

    /// Waits for a notification of the key until `until`; whether one came.
    pub(crate) async fn notified_before(&mut self, until: tokio::time::Instant) -> bool {
        tokio::time::timeout_at(until, self.woken.changed()).await.is_ok()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut waiters = self.waiters.0.lock().expect("waiters lock");
        if waiters.get(&self.digest).is_some_and(|sender| sender.receiver_count() <= 1) {
            waiters.remove(&self.digest);
        }
    }
}

/// Where settlements come from.
enum Source {
    // Boxed: with TLS features that another crate in the build may turn on, a client is large.
    Redis { client: Box<redis::Client>, channel: String },
    Postgres(PgPool),
}

/// A subscription, opened by the first waiter that needs it and followed by a task until the store is
/// dropped or shut down.
struct Feed {
    source: Source,
    /// Whether the subscription is open now.
    open: watch::Sender<bool>,
    task: OnceLock<AbortOnDrop>,
    background: Background,
}

impl Feed {
    fn new(source: Source, background: Background) -> Self {
        Self { source, open: watch::Sender::new(false), task: OnceLock::new(), background }
    }

    /// Starts following the source (once), and waits up to `within` for the subscription to open;
    /// whether it is.
    async fn opened(&self, waiters: &Arc<Waiters>, within: Duration) -> bool {
        self.task.get_or_init(|| {
            let (open, waiters) = (self.open.clone(), Arc::downgrade(waiters));
            // However the task ends (stopped by a shutdown too), waiters stop counting on it.
            let closed = Closed(open.clone());
            AbortOnDrop(match &self.source {
                Source::Redis { client, channel } => {
                    let (client, channel) = (redis::Client::clone(client), channel.clone());
                    self.background.follow(async move {
                        let _closed = closed;
                        follow_redis(client, channel, open, waiters).await;
                    })
                }
                Source::Postgres(pool) => {
                    let pool = pool.clone();
                    self.background.follow(async move {
                        let _closed = closed;
                        follow_postgres(pool, open, waiters).await;
                    })
                }
            })
        });
        // A follower that could not start, or was stopped with the store, never opens the subscription.
        if self.background.is_stopped() || self.task.get().is_some_and(|task| task.0.is_none()) {
            return false;
        }
        let mut open = self.open.subscribe();
        tokio::time::timeout(within, open.wait_for(|open| *open)).await.is_ok_and(|opened| opened.is_ok())
    }
}

/// The follower's task, if it could start (not without a runtime, nor after a shutdown).
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// Marks a subscription closed when dropped.
struct Closed(watch::Sender<bool>);

impl Drop for Closed {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// A store's waiters and the subscriptions that wake them.
pub(crate) struct Wakeups {
    waiters: Arc<Waiters>,
    redis: Option<Feed>,
    postgres: Feed,
}

impl Wakeups {
    /// `redis`: the client and channel of this store's Redis, when it has one it can subscribe with.
    pub(crate) fn new(redis: Option<(redis::Client, String)>, pool: PgPool, background: Background) -> Self {
        let redis = redis.map(|(client, channel)| {
            Feed::new(Source::Redis { client: Box::new(client), channel }, background.clone())
        });
        Self { waiters: Arc::default(), redis, postgres: Feed::new(Source::Postgres(pool), background) }
    }

    /// Registers a waiter of `key`, before it flags the record: a settlement after the flag wakes it.
    pub(crate) fn watch(&self, scope: &Scope, key: &IdempotencyKey) -> Watch {
        let digest = key_digest(scope, key).to_string();
        let mut waiters = self.waiters.0.lock().expect("waiters lock");
        let woken = waiters.entry(digest.clone()).or_insert_with(|| watch::Sender::new(())).subscribe();
        Watch { waiters: Arc::clone(&self.waiters), digest, woken }
    }

    /// Whether Redis settlements reach this store (its subscription opened within `within`).
    pub(crate) async fn follows_redis(&self, within: Duration) -> bool {
        match &self.redis {
            Some(feed) => feed.opened(&self.waiters, within).await,
            None => false,
        }
    }

    /// Whether Postgres settlements reach this store (its subscription opened within `within`).
    pub(crate) async fn follows_postgres(&self, within: Duration) -> bool {
        self.postgres.opened(&self.waiters, within).await
    }
}

async fn follow_redis(client: redis::Client, channel: String, open: watch::Sender<bool>, waiters: Weak<Waiters>) {
    let mut lost = false;
    loop {
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        if let Ok(Ok(pubsub)) = tokio::time::timeout(CONNECT_WITHIN, subscribed).await {
            if !reopened(&open, &waiters, lost) {
                return;
            }
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                let Some(waiters) = waiters.upgrade() else { return };
                if let Ok(digest) = std::str::from_utf8(message.get_payload_bytes()) {
                    waiters.wake(digest);
                }
            }
            open.send_replace(false);
            lost = true;
        }
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}

async fn follow_postgres(pool: PgPool, open: watch::Sender<bool>, waiters: Weak<Waiters>) {
    let mut lost = false;
    loop {
        let listening = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(POSTGRES_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        if let Ok(Ok(mut listener)) = tokio::time::timeout(CONNECT_WITHIN, listening).await {
            if !reopened(&open, &waiters, lost) {
                return;
            }
            // `None`: the connection was lost; the listener is dropped and a new one listens again.
            while let Ok(Some(notification)) = listener.try_recv().await {
                let Some(waiters) = waiters.upgrade() else { return };
                waiters.wake(notification.payload());
            }
            open.send_replace(false);
            lost = true;
        }
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}

/// Marks a subscription open; after a loss, wakes every waiter, since what it carried meanwhile is
/// lost. False once the store is gone.
fn reopened(open: &watch::Sender<bool>, waiters: &Weak<Waiters>, lost: bool) -> bool {
    let Some(waiters) = waiters.upgrade() else { return false };
    open.send_replace(true);
    if lost {
        waiters.wake_all();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lengths keep tenant and operation apart: "ab"/"c" and "a"/"bc" name different keys.
    #[test]
    fn digests_name_tenant_operation_and_key_unambiguously() {
        let key = IdempotencyKey::new("k").expect("key");
        let a = key_digest(&Scope::new("ab", "c").expect("scope"), &key);
        let b = key_digest(&Scope::new("a", "bc").expect("scope"), &key);
        assert_eq!(a.as_str().len(), 32);
        assert_ne!(a, b);
    }
}
