//! The Postgres connections the store builds: how many, how long to wait for one, when to check one
//! is alive, and the server-side bounds of each statement. An application that passes its own pool to
//! [`StoreBuilder::postgres`](crate::StoreBuilder::postgres) builds it the same way.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::policy::millis;

/// A pooled connection idle at least this long is pinged before it is handed out; one in use a moment
/// ago is not: under load no connection is pinged (sqlx pings every one by default, a round trip per
/// statement), and after an outage longer than this every connection that lived through it is.
const PING_IF_IDLE_FOR: Duration = Duration::from_millis(100);

/// The pool a store builds from a URL ([`StoreBuilder::database_url`](crate::StoreBuilder::database_url)):
/// 16 connections, a 5 s acquire timeout, and a ping before use only for a connection idle for 100 ms
/// or more. Build your own pool from it when you pass one to
/// [`StoreBuilder::postgres`](crate::StoreBuilder::postgres), and raise or lower what suits you.
///
/// What the ping costs and buys: sqlx's default pings every connection it hands out, one round trip per
/// statement (a new key costs the store two: its claim and its completion). Without it, a connection that broke within the last
/// 100 ms (a Postgres restart, a cut connection) fails its next statement instead of being replaced
/// silently: the store fails that call closed ([`StoreError::StoreUnavailable`](crate::StoreError)),
/// which a client retries. sqlx 0.9 also pings every connection it takes back, whatever the options;
/// that round trip stays.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = idemstore::pool_options().max_connections(8).connect("postgres://localhost/app").await?;
/// let store = idemstore::Store::builder().postgres(pool).build()?;
/// # drop(store);
/// # Ok(())
/// # }
/// ```
pub fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// `options` with the server-side bounds of a store whose Postgres timeout is `timeout`: a
/// `statement_timeout` of four fifths of it and a `lock_timeout` of half of it, so the server cancels what
/// the store gave up on. For a pool you build yourself and pass to
/// [`StoreBuilder::postgres`](crate::StoreBuilder::postgres); the application's own queries on that pool
/// get the same bounds.
///
/// ```no_run
/// # use std::time::Duration;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let options: sqlx::postgres::PgConnectOptions = "postgres://localhost/app".parse()?;
/// let timeout = Duration::from_secs(5);
/// let pool = idemstore::pool_options()
///     .max_connections(8)
///     .connect_with(idemstore::server_bounded(options, timeout))
///     .await?;
/// let store = idemstore::Store::builder().postgres(pool).postgres_timeout(timeout).build()?;
/// # drop(store);
/// # Ok(())
/// # }
/// ```
pub fn server_bounded(options: PgConnectOptions, timeout: Duration) -> PgConnectOptions {
    // Postgres takes at most 2^31 - 1 ms here; `timeout - timeout / 5` never overflows as `4 / 5` would.
    let ms = |d: Duration| format!("{}ms", millis(d).clamp(1, i64::from(i32::MAX)));
    options.options([("statement_timeout", ms(timeout - timeout / 5)), ("lock_timeout", ms(timeout / 2))])
}
