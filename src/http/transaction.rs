//! The transactional path ([`IdempotencyLayer::with_claim_transaction`](super::IdempotencyLayer::with_claim_transaction)):
//! the claim, the handler's own writes and the stored response commit in one Postgres transaction, so
//! after any fault (a Postgres restart, a killed process, a lost connection) either all of them exist or
//! none does. The handler reaches the transaction through [`ClaimTx`] (an axum extractor) or, in any
//! tower service, through the [`ClaimTransaction`] request extension.
//!
//! | event | what happens |
//! |---|---|
//! | duplicate while the handler runs | 409 in flight at once: from the Redis marker, or from the key's lock in Postgres, which the owner's transaction holds (the duplicate writes nothing, answers from the record as committed, and holds no connection, no quota slot and no row lock while the owner works) |
//! | the handler answers a stored status | completion in the transaction, one commit, then the answer, then Redis |
//! | a released status (5xx, 401, 429...), an error | rollback (the handler's writes too), its answer (or the error) goes out, a retry executes once |
//! | a panic | rollback; the panic goes on to the server (add `CatchPanicLayer` inside this layer for a 500) |
//! | a statement of the handler failed and it answered anyway | rollback, 500: wrap statements that may fail in a nested transaction (a savepoint: `(&mut *tx).begin()`) |
//! | the handler and its body take longer than the lease | rollback, 503 with `Retry-After`: a retry executes once |
//! | the commit fails, or its outcome is unknown | 503 (never the handler's answer): the retry's claim finds the truth |
//! | the process dies before the commit | Postgres rolls back with the connection; a retry executes once |
//! | the response is larger than the capture limit | stored as completed but not replayable, in the same commit |
//!
//! The handler's statements run on the store's connection, so they inherit its server-side timeouts
//! (`statement_timeout` at 4/5 and `lock_timeout` at 1/2 of the store's Postgres timeout, when the store
//! opened its pool or the pool was built with [`crate::server_bounded`]). A tenant's live-key
//! [`Quota`](crate::Quota) bounds the claims open on this path with slots of their own (claims off it do
//! not see them); its new-key limit counts them once they commit.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::BodyExt;
use sqlx::postgres::{PgConnection, Postgres};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};
use tower::{BoxError, Service, ServiceExt};

use super::RequestBody;
use super::admission::Admitted;
use super::answer;
use super::boxed::{Boxed, resumed, with_trailers};
use super::capture::{self, Captured, Withheld};
use super::config::Config;
use crate::store::COMMIT;
use crate::store::{Attached, Begin, Owner};

type Transaction = sqlx::Transaction<'static, Postgres>;

/// The claim's open transaction, put in the request's extensions by a layer built
/// [`with_claim_transaction`](super::IdempotencyLayer::with_claim_transaction): write the handler's
/// effects through it and they commit together with the claim and the stored response, or not at all.
///
/// In axum take [`ClaimTx`] as an argument; in another tower service, take this extension and
/// [`lock`](ClaimTransaction::lock) it. Only the layer commits: a handler that commits or rolls back
/// on its own breaks the guarantee (sqlx's nested `begin` on it opens a savepoint, which is fine).
#[derive(Clone)]
pub struct ClaimTransaction(Arc<Mutex<Option<Transaction>>>);

impl std::fmt::Debug for ClaimTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTransaction").finish_non_exhaustive()
    }
}

impl ClaimTransaction {
    /// The transaction, for as long as the guard lives; `None` while another guard holds it, or once the
    /// layer took it back (a task the handler left running asks too late). Never waits: a second guard
    /// wanted while the first is alive is a bug in the handler, not a queue.
    pub fn lock(&self) -> Option<ClaimTx> {
        let guard = Arc::clone(&self.0).try_lock_owned().ok()?;
        OwnedMutexGuard::try_map(guard, Option::as_mut).ok().map(ClaimTx)
    }

    /// Takes the transaction back once the handler returned; `None` if the handler still holds it (a
    /// guard moved into a task or into the response body) or nothing is left to take.
    fn take_back(&self) -> Option<Transaction> {
        self.0.try_lock().ok()?.take()
    }
}

/// The claim's transaction, as a connection to write the handler's effects through:
/// `sqlx::query(..).execute(&mut *tx)`. An axum extractor on routes behind a transactional layer; 500
/// where the request has none (a request without a key passed through, or the layer is not
/// transactional): take `Option<ClaimTx>` on routes where the key is optional.
///
/// Hold it only while the handler runs: the layer commits after the handler returned, and a guard still
/// held then (moved into a task or the response body) rolls everything back (500).
pub struct ClaimTx(OwnedMappedMutexGuard<Option<Transaction>, Transaction>);

impl std::fmt::Debug for ClaimTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimTx").finish_non_exhaustive()
    }
}

impl Deref for ClaimTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for ClaimTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

#[cfg(feature = "axum")]
const NOT_TRANSACTIONAL: (StatusCode, &str) = (
    StatusCode::INTERNAL_SERVER_ERROR,
    "no claim transaction for this request (no Idempotency-Key, a layer without with_claim_transaction, or the guard is already taken)",
);

#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ClaimTx {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut http::request::Parts, state: &S) -> Result<Self, Self::Rejection> {
        let optional = <Self as axum::extract::OptionalFromRequestParts<S>>::from_request_parts(parts, state).await;
        optional?.ok_or(NOT_TRANSACTIONAL)
    }
}

/// `Option<ClaimTx>`: `None` when the request has no claim transaction (a request without a key that
/// the layer passed through, or a route whose layer is not transactional), so one handler serves both.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for ClaimTx {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut http::request::Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        let Some(transaction) = parts.extensions.get::<ClaimTransaction>().cloned() else { return Ok(None) };
        transaction.lock().map(Some).ok_or(NOT_TRANSACTIONAL)
    }
}

/// Claims the key inside a transaction; as its owner, runs the inner service with the transaction in
/// the request's extensions, writes the completion into it and commits once, then answers.
pub(crate) async fn execute<S, T, ReqBody, ResBody>(
    inner: S,
    config: &Config<T>,
    admitted: Admitted,
) -> Result<Response<Boxed>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Admitted { scope, principal, .. } = &admitted;
    let store = &config.store;
    let (owner, tx) = match claim(config, &admitted).await {
        Ok(claimed) => claimed,
        Err(answer) => return Ok(answer),
    };
    // Redis's marker lives one lease from the claim: the transaction should end before it does, so that
    // a duplicate meets the marker rather than queueing on the row lock (and holding a connection).
    let options = admitted.options(config);
    let policy = options.policy.as_deref().unwrap_or_else(|| store.policy(scope.operation()));
    let lease = policy.lease();
    // The completion and the commit after the deadline take up to a Postgres timeout each.
    let margin = (lease / 10).max(store.postgres_timeout() * 2).min(lease / 2);
    let deadline = tokio::time::Instant::now() + lease - margin;
    let principal = *principal;
    let transaction = ClaimTransaction(Arc::new(Mutex::new(Some(tx))));
    let mut request = admitted.into_request();
    request.extensions_mut().insert(transaction.clone());
    let handled = tokio::time::timeout_at(deadline, inner.oneshot(request)).await;
    let taken = transaction.take_back();
    // Rolled back below unless committed (before the answer, so that a retry sent at once does not meet
    // the key's lock); the owner then takes back Redis's marker.
    let (response, tx) = match (handled, taken) {
        (Ok(Ok(response)), Some(tx)) => (response, tx),
        (handled, taken) => {
            if let Some(tx) = taken {
                store.roll_back(tx).await;
            }
            let _ = owner.release().await;
            return match handled {
                Ok(Err(error)) => Err(error),
                Err(_) => Ok(too_slow()),
                Ok(Ok(_)) => {
                    let detail =
                        "the handler kept the claim's transaction after it returned; its writes were rolled back";
                    tracing::error!("{detail}");
                    Ok(answer::rolled_back(StatusCode::INTERNAL_SERVER_ERROR, detail, None))
                }
            };
        }
    };
    let (head, body) = response.into_parts();
    let headers = capture::replayed(&head.headers, &config.replayed_headers);
    if !(config.stored.stores(head.status) && config.stored.stores_grpc(&head.headers)) {
        store.roll_back(tx).await;
        let _ = owner.release().await;
        return Ok(Response::from_parts(head, body.map_err(Into::into).boxed_unsync()));
    }
    let Ok(read) = tokio::time::timeout_at(deadline, read(body, config.max_response_body)).await else {
        store.roll_back(tx).await;
        let _ = owner.release().await;
        return Ok(too_slow());
    };
    let (stored, answer_body) = match read {
        BodyRead::Whole(bytes, trailers) if trailers.as_ref().is_none_or(|t| config.stored.stores_grpc(t)) => {
            let kept = trailers.as_ref().map(|trailers| capture::replayed(trailers, &config.replayed_headers));
            let captured = Captured::new(head.status, &headers, bytes.to_vec(), kept.as_ref(), principal);
            (captured.encode(), with_trailers(bytes, trailers))
        }
        // A gRPC status in the trailers that is not stored: as a released status.
        BodyRead::Whole(bytes, trailers) => {
            store.roll_back(tx).await;
            let _ = owner.release().await;
            return Ok(Response::from_parts(head, with_trailers(bytes, trailers)));
        }
        BodyRead::Larger { seen, body } => (Withheld::new(head.status, seen, principal).encode(), body),
        BodyRead::Failed => {
            store.roll_back(tx).await;
            let _ = owner.release().await;
            let detail = "the handler's response body failed; its writes were rolled back";
            return Ok(answer::rolled_back(StatusCode::INTERNAL_SERVER_ERROR, detail, None));
        }
    };
    match owner.complete_in(tx, &stored).await {
        Ok(()) => Ok(Response::from_parts(head, answer_body)),
        // A statement of the handler failed, so Postgres refuses every later one: the same would happen
        // again, so this is no store outage to retry (a savepoint around the statement avoids it).
        Err(error) if error.sqlstate().is_some_and(|code| repeats(&code)) => {
            let detail = "a statement of the handler failed and the handler answered anyway; everything was rolled \
                          back (wrap statements that may fail in a savepoint: a nested transaction)";
            Ok(answer::rolled_back(StatusCode::INTERNAL_SERVER_ERROR, detail, None))
        }
        // Not committed, or not known to be: never the handler's answer (its effects may not exist).
        Err(_) => Ok(answer::not_committed()),
    }
}

/// Claims the key in a transaction of its own, or answers the request from what the key holds. A retry
/// that meets its request in flight, on a route that waits ([`Config::wait_in_flight`]), ends its
/// transaction (it holds no connection while it waits), attaches to the request ([`Store::attach`]) and
/// answers what it finds; where the key is vacant by then (the first request failed and gave the key
/// up), it claims again, with a backoff should the key stay contended.
async fn claim<T>(
    config: &Config<T>,
    admitted: &Admitted,
) -> Result<(Owner, sqlx::Transaction<'static, Postgres>), Response<Boxed>> {
    let Admitted { parts, scope, key, fingerprint, principal, .. } = admitted;
    let store = &config.store;
    let options = admitted.options(config);
    let until = options.wait.map(|wait| tokio::time::Instant::now() + wait);
    let mut backoff: Option<Duration> = None;
    loop {
        let mut tx = None;
        let refused = match store.begin_in(scope, key, fingerprint, &options, &mut tx).await {
            Ok(Begin::Acquired(owner)) => return tx.map(|tx| (owner, tx)).ok_or_else(answer::unavailable),
            Ok(refused) => {
                // The answer may have marked the record indeterminate, in this transaction: keep it.
                if let Some(tx) = tx
                    && let Err(error) = store.bounded(&COMMIT, tx.commit()).await
                {
                    tracing::warn!(%error, "could not commit the answer's writes; the next request repeats them");
                }
                refused
            }
            Err(error) => {
                if let Some(tx) = tx {
                    store.roll_back(tx).await;
                }
                return Err(answer::store_failed(&error));
            }
        };
        let left = |until: tokio::time::Instant| until.saturating_duration_since(tokio::time::Instant::now());
        let answer = match (refused, until) {
            (Begin::InFlight { retry_after }, Some(until)) if !left(until).is_zero() => {
                match store.attach(scope, key, fingerprint, left(until)).await {
                    Ok(Attached::Vacant) if !left(until).is_zero() => {
                        // Claimed again at once the first time; then the key is contended (a claim's Redis
                        // marker ahead of its record): ask less often, never past the wait.
                        if let Some(pause) = backoff {
                            tokio::time::sleep(pause.min(left(until))).await;
                        }
                        backoff = Some(backoff.map_or(FIRST_PAUSE, |pause| (pause * 2).min(RECHECK_EVERY)));
                        continue;
                    }
                    // Vacant at the bound: what the claim found stands.
                    Ok(Attached::Vacant) => Begin::InFlight { retry_after },
                    Ok(Attached::Replayed(stored)) => Begin::Replayed(stored),
                    Ok(Attached::InFlight { retry_after }) => Begin::InFlight { retry_after },
                    Ok(Attached::Mismatch) => Begin::Mismatch,
                    Ok(Attached::Indeterminate) => Begin::Indeterminate,
                    Ok(Attached::Expired) => Begin::Expired,
                    // The wait could not be had (a pool with no connection to spare): the claim's answer
                    // stands, as on a route that does not wait.
                    Err(error) => {
                        tracing::debug!(%error, "a retry could not attach to its request in flight");
                        Begin::InFlight { retry_after }
                    }
                }
            }
            (refused, _) => refused,
        };
        return Err(answer::refusal(answer, config, parts, (scope, key, *principal)).await);
    }
}

/// First and longest pause between the claims of a transactional retry that waits for a key kept
/// contended.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const RECHECK_EVERY: Duration = Duration::from_secs(1);

/// Whether a refusal of the completion or the commit would come again on a retry of the request: the
/// transaction is aborted or in a state the handler set (class 25, e.g. 25P02 after a failed statement,
/// 25006 after `SET TRANSACTION READ ONLY`), or a deferred constraint failed at the commit (class 23).
fn repeats(sqlstate: &str) -> bool {
    sqlstate.starts_with("25") || sqlstate.starts_with("23")
}

/// The handler and its body outlived the claim's deadline: rolled back, and a retry runs it again.
fn too_slow() -> Response<Boxed> {
    let detail = "the handler did not finish within its lease; its writes were rolled back";
    answer::rolled_back(StatusCode::SERVICE_UNAVAILABLE, detail, Some(Duration::from_secs(1)))
}

/// What the transactional path read of the handler's body before its commit.
enum BodyRead {
    /// All of it (within the capture limit), and its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// More than the capture limit: the body to send (what was read, then the rest), and how many bytes
    /// were read.
    Larger { seen: u64, body: Boxed },
    /// The body failed before its end: nothing was sent, so nothing is stored.
    Failed,
}

/// Reads `body` up to `limit` bytes: the whole body is stored and replayed; past the limit, the body
/// streams on after the commit.
async fn read<B>(body: B, limit: usize) -> BodyRead
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let length = http_body::Body::size_hint(&body).exact();
    let mut body = body.map_err(Into::into).boxed_unsync();
    let mut frames: Vec<Frame<Bytes>> = Vec::new();
    let mut seen = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { return BodyRead::Failed };
        seen += frame.data_ref().map_or(0, |data| data.len() as u64);
        frames.push(frame);
        if seen > limit as u64 {
            let left = length.map(|length| length.saturating_sub(seen));
            return BodyRead::Larger { seen, body: resumed(frames, body, left) };
        }
    }
    let mut bytes = Vec::with_capacity(usize::try_from(seen).unwrap_or(0));
    let mut trailers = None;
    for frame in frames {
        match frame.into_data() {
            Ok(data) => bytes.extend_from_slice(&data),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    BodyRead::Whole(Bytes::from(bytes), trailers)
}
