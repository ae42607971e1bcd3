//! The client's metrics, through the `metrics` facade (the application installs the recorder).

use crate::error::{Retryable, Stop};

/// Requests sent, retries included.
pub const ATTEMPTS: &str = "idemstore_client_attempts_total";
/// Attempts followed by another, by `reason`: `transport`, `in_flight` (409 `in-flight`), `throttled`
/// (408, 425, 429, gRPC `RESOURCE_EXHAUSTED`), `unavailable` (503, gRPC `UNAVAILABLE`), `aborted` (gRPC
/// `ABORTED`) or `server_error` (other 5xx).
pub const RETRIES: &str = "idemstore_client_retries_total";
/// Answers the server replayed from an earlier attempt (`Idempotent-Replayed: true`).
pub const REPLAYS: &str = "idemstore_client_replays_total";
/// Requests given up on, by `because`: `attempts`, `deadline`, `budget` or `body_not_replayable`.
pub const GAVE_UP: &str = "idemstore_client_gave_up_total";

/// Registers the metrics' descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(ATTEMPTS, "Requests sent by the idempotency middleware, retries included.");
    metrics::describe_counter!(RETRIES, "Attempts followed by a retry, by reason.");
    metrics::describe_counter!(REPLAYS, "Answers replayed by the server from an earlier attempt.");
    metrics::describe_counter!(GAVE_UP, "Requests the middleware stopped retrying, by reason.");
}

pub(crate) fn attempt() {
    metrics::counter!(ATTEMPTS).increment(1);
}

pub(crate) fn replayed() {
    metrics::counter!(REPLAYS).increment(1);
}

pub(crate) fn retry(last: &Retryable) {
    let reason = match last {
        Retryable::Transport(_) => "transport",
        Retryable::Status(status) => match status.as_u16() {
            409 => "in_flight",
            408 | 425 | 429 => "throttled",
            503 => "unavailable",
            _ => "server_error",
        },
        #[cfg(feature = "tonic")]
        Retryable::Grpc(code) => match code {
            tonic::Code::Aborted => "aborted",
            tonic::Code::ResourceExhausted => "throttled",
            _ => "unavailable",
        },
    };
    metrics::counter!(RETRIES, "reason" => reason).increment(1);
}

pub(crate) fn gave_up(because: Stop) {
    let because = match because {
        Stop::Attempts => "attempts",
        Stop::Deadline => "deadline",
        Stop::Budget => "budget",
        Stop::BodyNotReplayable => "body_not_replayable",
    };
    metrics::counter!(GAVE_UP, "because" => because).increment(1);
}
