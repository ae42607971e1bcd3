//! The client half of "applied once": a [`reqwest_middleware`] middleware that mints an
//! `Idempotency-Key` per logical operation, keeps it across the client's own crash, sends the same key and
//! the same body bytes on every attempt, and retries only where the server says a retry can help.
//!
//! ```no_run
//! use std::time::Duration;
//! use idemstore_client::{ClientError, FileJournal, IdempotencyMiddleware, Operation, was_replayed};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Keys of named operations survive a restart for a week.
//! let journal = FileJournal::open("payments-keys.jsonl", Duration::from_secs(7 * 24 * 3600))?;
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::with_journal(journal))
//!     .build();
//! let sent = client
//!     .post("http://127.0.0.1:8080/payments")
//!     .header("content-type", "application/json")
//!     .body(r#"{"amount": 1200, "currency": "EUR"}"#)
//!     .with_extension(Operation::new("order-1001/charge"))
//!     .send()
//!     .await;
//! match sent {
//!     Ok(response) => println!("{} (replayed: {})", response.status(), was_replayed(&response)),
//!     Err(error) => match ClientError::of(&error) {
//!         Some(ClientError::Refused { status, problem, .. }) => println!("refused: {status} {problem:?}"),
//!         Some(ClientError::GaveUp { .. }) => println!("unknown outcome: send again later, same key"),
//!         _ => return Err(error.into()),
//!     },
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # The rules
//! - **Which requests**: POST and PATCH by default ([`RetryPolicy::methods`]). Others pass untouched.
//! - **The key**: the one the request already carries; else, for a request tagged with an [`Operation`],
//!   the journal's key for that operation, written durably before the first send ([`FileJournal`]); else
//!   a fresh UUIDv7. Every attempt sends the same key and the same body bytes (a streamed body, which
//!   cannot be copied, is sent once).
//! - **Retried**: no answer (connection refused or reset, timeout); 5xx (an idempotent server releases the
//!   key when the work failed, and answers 503 while its store is down); 408, 425, 429; 409 with problem
//!   type `in-flight` (the first attempt still runs: its answer comes to a retry). The wait is the
//!   exponential backoff with full jitter, except that a `Retry-After` (seconds or an HTTP-date) on a
//!   429 or 5xx is waited out in full, and one on a `409 in-flight` (when the first attempt's lease ends)
//!   bounds the backoff: that answer may come any moment. Each poll after a `409 in-flight` carries
//!   `Prefer: wait=N` (RFC 7240; `N`: the attempt's time left, less a second), so that a server whose
//!   route waits for in-flight duplicates (idemstore's `with_wait_in_flight`) holds it and answers the
//!   first attempt's response as soon as it is stored; a server that does not wait answers as before. A
//!   request that carries its own `Prefer` is sent as it is.
//! - **Never retried**: 400, 410 (the stored answer expired), 422 (the key was used with another body),
//!   409 `indeterminate` (an operator must resolve it), every other 4xx, and a 5xx that is final (replayed
//!   from the server's record, or `unreadable-response`): [`ClientError::Refused`], with the body and its
//!   problem document.
//! - **Bounded**: at most [`RetryPolicy::max_attempts`] failed sends (polling a request in flight is no
//!   failure), nothing past [`RetryPolicy::deadline`] (no wait that would end after it, and an attempt
//!   still unanswered at it is abandoned), and a retry budget per host ([`RetryPolicy::budget`], gRPC's retry
//!   throttling), so that clients never multiply the load on a server that is down. When retries stop,
//!   [`ClientError::GaveUp`] says why; the outcome is then unknown, and the same operation sent later
//!   carries the same key.
//! - **Replays**: [`was_replayed`] tells an answer the server stored earlier from one it just made.
//!
//! **gRPC** (feature `tonic`): [`IdempotencyGrpcLayer`] puts the same rules around a tonic channel for
//! the unary methods it names, the key in the `idempotency-key` metadata, retries by gRPC status
//! (`UNAVAILABLE`, `ABORTED`, `RESOURCE_EXHAUSTED` with a `RetryInfo`) within the call's `grpc-timeout`.
//!
//! Metrics (the `metrics` facade): [`telemetry::ATTEMPTS`], [`telemetry::RETRIES`] by reason,
//! [`telemetry::REPLAYS`], [`telemetry::GAVE_UP`] by cause.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod attempts;
mod budget;
mod error;
#[cfg(feature = "tonic")]
mod grpc;
mod journal;
mod middleware;
mod policy;
pub mod telemetry;

pub use error::{ClientError, Problem, Retryable, Stop};
#[cfg(feature = "tonic")]
pub use grpc::{IdempotencyGrpc, IdempotencyGrpcLayer};
pub use journal::{FileJournal, KeyJournal, MemoryJournal};
pub use middleware::{IDEMPOTENCY_KEY, IdempotencyMiddleware, Operation, REPLAYED, was_replayed};
pub use policy::RetryPolicy;
