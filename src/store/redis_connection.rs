//! Where Redis calls go: one server (a deadpool pool handing out a multiplexed connection) or a Redis
//! Cluster (with feature `cluster`). Both answer the same [`ConnectionLike`] calls, so the protocol,
//! the scripts and the lagging-key repair do not know which one they talk to.

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// How connections to Redis are made.
#[derive(Clone)]
pub(crate) enum RedisSource {
    Single(deadpool_redis::Pool),
    /// Boxed: a cluster client's configuration is large, and cloned into each repair task.
    #[cfg(feature = "cluster")]
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// A connection to one server or to a whole cluster; cloning shares it (both pipeline concurrent
/// requests).
#[derive(Clone)]
pub(crate) enum RedisConnection {
    Single(MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

/// A connection could not be made within the budget.
pub(crate) type ConnectError = Box<dyn std::error::Error + Send + Sync>;

impl RedisSource {
    /// A cluster client whose own retries and timeouts fit in `budget`: the crate's defaults (16
    /// retries, waits from about a second, no response timeout) would hold a request far past the
    /// moment the store should have degraded to Postgres. Replicas are never read: the scripts write.
    #[cfg(feature = "cluster")]
    pub(crate) fn cluster(seeds: &[String], budget: Duration) -> Result<Self, redis::RedisError> {
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
        let client = redis::cluster::ClusterClientBuilder::new(seeds.iter().map(String::as_str))
            .retries(3)
            .min_retry_wait(millis(budget / 10))
            .max_retry_wait(millis(budget / 4))
            .connection_timeout(budget)
            .response_timeout(budget)
            .overall_response_timeout(Some(budget))
            .build()?;
        Ok(Self::Cluster(Box::new(client)))
    }

    /// Opens a connection, within `budget` (a cluster connection first asks a seed for the slot map,
    /// which can hang on a node that accepts and does not answer).
    pub(crate) async fn connect(&self, budget: Duration) -> Result<RedisConnection, ConnectError> {
        let connect = async {
            let connected: Result<RedisConnection, ConnectError> = match self {
                RedisSource::Single(pool) => {
                    let pooled = pool.get().await?;
                    Ok(RedisConnection::Single(deadpool_redis::Connection::take(pooled)))
                }
                #[cfg(feature = "cluster")]
                RedisSource::Cluster(client) => Ok(RedisConnection::Cluster(client.get_async_connection().await?)),
            };
            connected
        };
        tokio::time::timeout(budget, connect).await.map_err(|elapsed| Box::new(elapsed) as ConnectError)?
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Single(conn) => conn.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            RedisConnection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            RedisConnection::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Single(conn) => conn.get_db(),
            #[cfg(feature = "cluster")]
            RedisConnection::Cluster(conn) => conn.get_db(),
        }
    }
}
