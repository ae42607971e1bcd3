//! The layer's own answers, which the inner service never sees: replays of stored responses and
//! `application/problem+json` refusals, one per way a request can be turned away.

use std::fmt;
use std::time::Duration;

use http::request::Parts;
use http::{Response, StatusCode};

use super::boxed::Boxed;
use super::capture::{Principal, Stored, StoredForm};
use super::config::{Config, MismatchStatus};
use super::problem::{Problem, problem_types as types};
use crate::error::{EncryptionError, StoreError};
use crate::key::{IdempotencyKey, Scope};
use crate::outcome::Outcome;
use crate::quota::QuotaLimit;
use crate::record::StoredResponse;
use crate::store::Begin;

/// The status of an answer the layer gives itself: the vocabulary's ([`Outcome::http_status`]), the one
/// mapping of answers to statuses.
fn status(outcome: Outcome) -> StatusCode {
    let code = outcome.http_status().expect("the layer answers itself only for outcomes with a status");
    StatusCode::from_u16(code).expect("the vocabulary's statuses are valid")
}

/// The answer to a claim that did not acquire the key (of `scope`, asked by `principal`): refused with
/// 403 when it would show a stored response the application's replay check does not let this request
/// see, or that answered another principal.
pub(crate) async fn refusal<T>(
    answer: Begin,
    config: &Config<T>,
    parts: &Parts,
    (scope, key, principal): (&Scope, &IdempotencyKey, Principal),
) -> Response<Boxed> {
    if config.reveals(&answer) && !config.allows_replay(parts, scope).await {
        return replay_refused();
    }
    match answer {
        Begin::Replayed(stored) => replay(stored, scope, principal),
        Begin::InFlight { retry_after } => {
            let detail = "a request with this Idempotency-Key is being processed; retry later";
            Problem::new(status(Outcome::InFlight), types::IN_FLIGHT, "Request in flight", detail)
                .retry_after(retry_after)
                .into_response()
        }
        Begin::Mismatch => mismatch(config, scope, key, principal).await,
        Begin::Indeterminate => {
            let detail = "an earlier attempt with this key ended without an answer; it must be resolved first";
            Problem::new(status(Outcome::Indeterminate), types::INDETERMINATE, "Outcome unknown", detail)
                .into_response()
        }
        Begin::Expired => {
            let detail =
                "a request with this key completed, and its response is no longer kept; it is not executed again";
            Problem::new(status(Outcome::Expired), types::EXPIRED, "Response expired", detail).into_response()
        }
        Begin::QuotaExceeded { limit, retry_after } => {
            let detail = match limit {
                QuotaLimit::NewKeys => "this tenant started as many new requests as its quota allows for now",
                QuotaLimit::LiveKeys => "this tenant has as many requests in progress as its quota allows",
            };
            Problem::new(status(Outcome::QuotaExceeded), types::QUOTA_EXCEEDED, "Quota exceeded", detail)
                .retry_after(retry_after)
                .into_response()
        }
        Begin::Acquired(_) => unreachable!("an acquired key is executed, not refused"),
    }
}

fn replay(stored: StoredResponse, scope: &Scope, principal: Principal) -> Response<Boxed> {
    let stored = StoredForm::new(stored.into_bytes());
    match stored.read() {
        Some(stored) if !stored.answers(principal) => {
            crate::telemetry::replay_refused(scope.operation());
            replay_refused()
        }
        Some(Stored::Response(captured)) => captured.replay(None),
        Some(Stored::Withheld(withheld)) => not_replayable(format!(
            "a request with this key completed with status {}, but its response ({} bytes when settled) was \
             not stored for replay (larger than the capture limit, cut short, or streamed past the bound); \
             it is not executed again",
            withheld.status, withheld.bytes
        )),
        // Completed by another writer of the key (an operator's raw bytes): done, but not replayable here.
        None => not_replayable(
            "a request with this key completed; its stored result is not an HTTP response this \
             layer can replay; it is not executed again"
                .into(),
        ),
    }
}

fn not_replayable(detail: String) -> Response<Boxed> {
    Problem::new(status(Outcome::NotReplayable), types::NOT_REPLAYABLE, "Response not replayable", detail)
        .into_response()
}

async fn mismatch<T>(config: &Config<T>, scope: &Scope, key: &IdempotencyKey, principal: Principal) -> Response<Boxed> {
    let status = config.mismatch.status();
    if config.mismatch == MismatchStatus::ConflictWithOriginal
        && let Ok(Some(record)) = config.store.lookup(scope, key).await
        && let Some(stored) = record.response.map(|r| StoredForm::new(r.into_bytes()))
        && let Some(stored) = stored.read()
        && stored.answers(principal)
        && let Stored::Response(original) = stored
    {
        return original.replay(Some(status));
    }
    let detail = "this Idempotency-Key was used with a different request payload";
    Problem::new(status, types::KEY_REUSED, "Idempotency-Key reused", detail).into_response()
}

pub(crate) fn replay_refused() -> Response<Boxed> {
    let detail = "this request may not see the stored response of its Idempotency-Key";
    Problem::new(status(Outcome::ReplayRefused), types::REPLAY_REFUSED, "Replay not authorized", detail).into_response()
}

pub(crate) fn missing_key() -> Response<Boxed> {
    let detail = "this route requires an Idempotency-Key header";
    Problem::new(StatusCode::BAD_REQUEST, types::MISSING_KEY, "Idempotency-Key missing", detail).into_response()
}

pub(crate) fn invalid_key(detail: String) -> Response<Boxed> {
    Problem::new(StatusCode::BAD_REQUEST, types::INVALID_KEY, "Invalid Idempotency-Key", detail).into_response()
}

pub(crate) fn missing_tenant() -> Response<Boxed> {
    let detail = "the request has no tenant; authenticate first";
    Problem::new(StatusCode::UNAUTHORIZED, types::MISSING_TENANT, "Tenant unknown", detail).into_response()
}

pub(crate) fn too_large(limit: usize) -> Response<Boxed> {
    let detail = format!("the request body is larger than {limit} bytes");
    Problem::new(StatusCode::PAYLOAD_TOO_LARGE, types::BODY_TOO_LARGE, "Request body too large", detail).into_response()
}

pub(crate) fn too_many_parts(limit: usize) -> Response<Boxed> {
    let detail = format!("the multipart body has more than {limit} parts");
    Problem::new(StatusCode::PAYLOAD_TOO_LARGE, types::BODY_TOO_LARGE, "Request body too large", detail).into_response()
}

pub(crate) fn unsupported_encoding(detail: String) -> Response<Boxed> {
    let (status, title) = (StatusCode::UNSUPPORTED_MEDIA_TYPE, "Unsupported Content-Encoding");
    Problem::new(status, types::UNSUPPORTED_ENCODING, title, detail).into_response()
}

pub(crate) fn invalid_body(detail: impl fmt::Display) -> Response<Boxed> {
    Problem::new(StatusCode::BAD_REQUEST, types::INVALID_BODY, "Invalid request", detail.to_string()).into_response()
}

/// The answer to a claim the store could not make: a response it cannot open (500), or the store
/// unavailable (503; nothing ran).
pub(crate) fn store_failed(error: &StoreError) -> Response<Boxed> {
    match error {
        // A store without the key where responses are sealed: nothing was claimed or run.
        StoreError::Encryption(EncryptionError::WouldWriteClear) => unavailable_because(
            "this server has no encryption key and the stored responses are encrypted, so it cannot store an \
             answer; nothing was executed",
        ),
        StoreError::Encryption(_) => unreadable(),
        _ => unavailable(),
    }
}

pub(crate) fn unavailable() -> Response<Boxed> {
    unavailable_because("the idempotency store is unavailable; nothing was executed")
}

/// 503 `unavailable`, retried after a second, saying why.
fn unavailable_because(detail: &'static str) -> Response<Boxed> {
    Problem::new(status(Outcome::Error), types::UNAVAILABLE, "Store unavailable", detail)
        .retry_after(Duration::from_secs(1))
        .into_response()
}

/// A request that completed before, whose stored response does not open (its encryption key is gone, or
/// it was changed): not replayed, not run again, and a retry would get the same.
pub(crate) fn unreadable() -> Response<Boxed> {
    let detail = "a request with this key completed, but its stored response cannot be read; it is not \
                  executed again";
    Problem::new(StatusCode::INTERNAL_SERVER_ERROR, types::UNREADABLE, "Stored response unreadable", detail)
        .into_response()
}

/// The handler's body failed before the record could be settled with it.
/// The transactional path could not commit, or does not know whether its commit landed: the handler's
/// answer is not sent (its effects may not exist). A retry replays what was committed, or runs once.
pub(crate) fn not_committed() -> Response<Boxed> {
    let detail = "the idempotency store could not confirm the commit; retry with the same key";
    Problem::new(status(Outcome::Error), types::UNAVAILABLE, "Store unavailable", detail)
        .retry_after(Duration::from_secs(1))
        .into_response()
}

/// The transactional path rolled the handler's writes back (the handler outlived its lease, its body
/// failed, or it kept the transaction): nothing of it stands, and a retry runs it again.
pub(crate) fn rolled_back(status: StatusCode, detail: &str, retry_after: Option<Duration>) -> Response<Boxed> {
    let problem = Problem::new(status, types::RESPONSE_FAILED, "Rolled back", detail);
    match retry_after {
        Some(retry_after) => problem.retry_after(retry_after),
        None => problem,
    }
    .into_response()
}

pub(crate) fn response_failed() -> Response<Boxed> {
    let detail = "the handler ran, and its response body failed; a retry is told it cannot be replayed";
    Problem::new(StatusCode::INTERNAL_SERVER_ERROR, types::RESPONSE_FAILED, "Response failed", detail).into_response()
}
