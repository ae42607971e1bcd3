//! One bounded path to Postgres. Every statement the store sends is a named [`Statement`]; one function
//! ([`Store::bounded`]) sends it under the store's timeout, counts it in
//! `idemstore_postgres_statements_total{statement}` and names it as the failed step of
//! [`StoreError::StoreUnavailable`]: a metric label and an error always say the same thing.

use std::future::Future;
use std::io;

use super::Store;
use super::postgres_tier::begin_statement;
use crate::error::StoreError;
use crate::record::Lease;
use crate::telemetry;

/// A statement (or a round trip without SQL of its own, such as a commit) and its name.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Statement {
    pub(crate) name: &'static str,
    pub(crate) sql: &'static str,
}

impl Statement {
    pub(crate) const fn new(name: &'static str, sql: &'static str) -> Self {
        Self { name, sql }
    }

    /// A round trip that is not a query of ours: a connection taken from the pool, a transaction begun
    /// or committed.
    pub(crate) const fn step(name: &'static str) -> Self {
        Self { name, sql: "" }
    }

    /// `source` (of this statement, or of decoding its rows) as the store's error: fail closed.
    pub(crate) fn failed(&self, source: sqlx::Error) -> StoreError {
        StoreError::StoreUnavailable { step: self.name, source }
    }
}

/// A connection taken from the pool.
pub(crate) const ACQUIRE: Statement = Statement::step("acquire");
/// A transaction begun on a pooled connection.
pub(crate) const BEGIN: Statement = Statement::step("begin_transaction");
/// A transaction committed.
pub(crate) const COMMIT: Statement = Statement::step("commit");
/// A transaction rolled back.
pub(crate) const ROLLBACK: Statement = Statement::step("rollback");

impl Store {
    /// Sends `statement` (`call` runs it) under the store's Postgres timeout, counted and named.
    pub(crate) async fn bounded<T>(
        &self,
        statement: &Statement,
        call: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        self.inner.postgres.bounded(statement, call).await
    }

    /// The bound on each Postgres step.
    pub(crate) fn postgres_timeout(&self) -> std::time::Duration {
        self.inner.postgres.timeout()
    }

    /// A key acquired by [`Store::begin_in`] is always acquired inside the transaction it began (only
    /// Postgres acquires): this is the error should that ever not hold, failing closed.
    pub(crate) fn no_transaction() -> StoreError {
        BEGIN.failed(sqlx::Error::Protocol("a key acquired without its claim's transaction".into()))
    }

    /// A transaction on a pooled connection, for a claim that commits with the caller's work.
    ///
    /// `BEGIN` runs in a task of its own: sqlx counts a transaction only once the server confirmed its
    /// `BEGIN`, so a caller cancelled in between (a client gone, this call's deadline) would hand the
    /// pool a connection inside a transaction that nobody rolls back, and later statements on it (a
    /// claim) would never commit. The task finishes the `BEGIN`, and a transaction nobody awaits any
    /// more is dropped, which rolls it back. It begins with the key's lock of `lease` where the claim
    /// reads ([`begin_statement`]).
    pub(crate) async fn begin_transaction(
        &self,
        lease: &Lease,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let (pool, begin) = (self.pg_pool().clone(), begin_statement(lease));
        // A settlement: a shutdown waits for the BEGIN (a transaction nobody awaits is dropped, and sqlx
        // rolls it back when its connection goes back to the pool).
        let begun = self.background().settle(async move {
            match begin {
                Some(statement) => pool.begin_with(statement).await,
                None => pool.begin().await,
            }
        });
        let joined = async {
            let Some(begun) = begun else { return Err(sqlx::Error::WorkerCrashed) };
            begun.await.unwrap_or_else(|join| Err(sqlx::Error::Io(std::io::Error::other(join))))
        };
        self.bounded(&BEGIN, joined).await
    }

    /// Rolls back a claim's transaction before its caller answers: dropped, it would roll back a moment
    /// later, in the task that returns its connection to the pool, and until then it holds the key's lock
    /// (and the claim's row), so a retry sent at once could be told the key is in flight. A failure is the
    /// connection's: Postgres rolls the transaction back when it ends.
    pub(crate) async fn roll_back(&self, tx: sqlx::Transaction<'static, sqlx::Postgres>) {
        if let Err(error) = self.bounded(&ROLLBACK, tx.rollback()).await {
            tracing::debug!(%error, "could not roll back a claim's transaction; its connection ends it");
        }
    }
}

/// `call` under `timeout`, counted as `statement`; a timeout is an I/O error like a lost connection.
/// Steps without SQL of ours (a pooled connection's ping, BEGIN, COMMIT) are bounded and named, not
/// counted: the counter is the store's own statements per answer, comparable across modes.
pub(crate) async fn bounded<T>(
    timeout: std::time::Duration,
    statement: &Statement,
    call: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    if !statement.sql.is_empty() {
        telemetry::postgres_statement(statement.name);
    }
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(|source| statement.failed(source)),
        Err(_) => Err(statement.failed(timed_out())),
    }
}

/// A statement past the store's timeout: an I/O error, like a lost connection.
pub(crate) fn timed_out() -> sqlx::Error {
    sqlx::Error::Io(io::Error::new(io::ErrorKind::TimedOut, "Postgres did not answer in time"))
}

/// Fault tests: holds the caller for as many milliseconds as the failpoint `name` returns (`return(ms)`),
/// while it is configured; at once otherwise.
#[cfg(feature = "failpoints")]
pub(crate) async fn pause_at(name: &str) {
    let pause = || -> Option<u64> {
        fail::fail_point!(name, |ms: Option<String>| ms.and_then(|ms| ms.parse().ok()));
        None
    };
    if let Some(ms) = pause() {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}
