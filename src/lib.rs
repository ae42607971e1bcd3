//! # idemstore
//!
//! A two-tier idempotency store: it makes API mutations and message handlers safe to retry, so that a
//! payment, an order or a webhook is applied once however often the network, a load balancer, an SDK
//! or an agent resends it.
//!
//! ## Guarantees
//! - Work runs only after its claim is durable in Postgres; Redis alone never decides "execute".
//! - Concurrent requests with the same (tenant, operation, key) execute the work at most once while the
//!   owner's lease is live. An owner whose lease ran out and was taken over cannot store its result:
//!   completions are fenced by a token that increases on every takeover.
//! - The same key with a different payload is refused ([`Begin::Mismatch`]), never applied.
//! - A tenant never sees another tenant's records.
//! - Postgres unavailable: the store fails closed. Redis unavailable: the Postgres path answers, and
//!   `idemstore_redis_fallbacks_total` says so.
//!
//! "Once" has a limit: if an owner crashes mid-work, the store cannot know whether the work's side
//! effects happened. After its lease runs out, the operation's [`LeaseExpiry`] policy either lets the
//! next request execute again (the work must then be safe to repeat, e.g. by passing a downstream
//! idempotency key) or marks the record [`State::Indeterminate`] for an operator.
//!
//! ## Two tiers
//! 1. Redis: one EVALSHA answers duplicates (completed, in flight, mismatch) or writes an in-progress
//!    marker.
//! 2. Postgres: one `INSERT ... ON CONFLICT ... RETURNING` claims the key durably, or returns what it
//!    holds; if Redis had lost it (eviction, flush, restart), Redis is repaired.
//! 3. The work runs; completion is a fenced `UPDATE` in Postgres, then the result is cached in Redis.
//!
//! Without Redis ([`Mode::PostgresOnly`]) the same protocol runs on Postgres alone.
//!
//! ## Quick start
//! ```no_run
//! use idemstore::{IdempotencyKey, RunOutcome, Scope, Store};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Store::builder()
//!     .database_url("postgres://postgres@127.0.0.1/app")
//!     .redis_url("redis://127.0.0.1/")
//!     .build()?;
//! store.migrate().await?;
//!
//! let scope = Scope::new("tenant-42", "charge")?;
//! let key = IdempotencyKey::new("order-1001-attempt")?;
//! let payload = serde_json::json!({"amount": 1200, "currency": "EUR"});
//! let outcome = store
//!     .run_once(&scope, &key, &payload, || async {
//!         // The side effect, executed once.
//!         Ok::<_, std::io::Error>(serde_json::json!({"charge_id": "ch_1"}))
//!     })
//!     .await?;
//! match outcome {
//!     RunOutcome::Executed(charge) | RunOutcome::Replayed(charge) => println!("{charge}"),
//!     RunOutcome::InFlight { retry_after } => println!("busy, retry in {retry_after:?}"),
//!     RunOutcome::Mismatch => println!("key reused with another payload"),
//!     other => println!("{other:?}"),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## Layout
//! - [`key`](IdempotencyKey), [`Scope`], [`Fingerprint`]: what identifies a request, validated.
//! - [`Policy`]: lease, Redis TTL, Postgres retention and lease-expiry rule, per operation; [`config`]
//!   loads tiers and operation patterns from TOML.
//! - [`Store`]: the request path (`begin`, `run_once`, the inbox and outbox) on both tiers;
//!   [`Store::admin`] the operator's and scheduler's [`Admin`](admin::Admin) (`lookup`, `inspect`, `evict`,
//!   `purge_expired`, `recover_stale`, `resolve`, `stats`, `refresh_gauges`, `partition_by_tenant`).
//! - [`Owner`]: the one owner lifecycle every entry point shares: `begin` -> [`Begin::Acquired`] ->
//!   `owner.run(work)` (heartbeat) -> `owner.complete(bytes)` or `owner.release()`; a dropped owner is
//!   settled by its rule. [`RunOptions`] is the one way to change a claim (policy, wait, heartbeat).
//! - [`Store::run_once`] and [`Store::run_once_in_tx`]: the generic APIs on top; derived downstream keys
//!   with [`Owner::derive_key`].
//! - [`Inbox`] (`Store::inbox`): webhook and message consumers handle each event once; deliveries
//!   signed the Stripe or Standard Webhooks way are verified first ([`WebhookVerifier`]).
//! - [`Outbox`] (`Store::outbox`): rows written in the application's transaction, delivered after the
//!   commit by a relay the application schedules.
//! - [`http`] (feature `http`): the `Idempotency-Key` middleware for any tower service (axum routes,
//!   tonic servers), built on the public API like any user's middleware would be.
//! - [`telemetry`]: metric names (every series registered at 0 when an operation is first seen) and the
//!   `tracing` spans; the library never installs a recorder, and never logs a key or a payload.
//!
//! Throwaway Redis and Postgres servers for tests, examples and benchmarks are the `idemstore-testkit`
//! crate (testkit/), apart from the library: nothing in the library installs or starts software.

#![forbid(unsafe_code)]
// docs.rs (nightly, `--cfg docsrs`) badges each feature-gated item with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![warn(missing_debug_implementations, unreachable_pub)]

pub mod config;
mod derived_key;
mod encryption;
mod error;
mod fingerprint;
#[cfg(feature = "http")]
pub mod http;
pub mod inbox;
mod key;
mod options;
pub mod outbox;
mod outcome;
mod policy;
mod quota;
mod record;
mod run_once;
mod store;
mod target;

/// The operator's and the scheduler's side of a store ([`Store::admin`]): what its jobs and tools
/// take and return.
pub mod admin {
    pub use crate::store::{Admin, Inspection, Purging, Recovery, RedisView, Resolution, StatsRow};
}
pub mod telemetry;

pub use derived_key::DerivedKeys;
pub use encryption::{Encryption, SEALING_OVERHEAD};
pub use error::{ConfigError, EncryptionError, InputError, SignatureError, StoreError};
pub use fingerprint::{Fingerprint, FingerprintOptions};
pub use inbox::{Inbox, Received, SignatureScheme, WebhookVerifier};
pub use key::{IdempotencyKey, Scope};
pub use options::{Heartbeat, RunOptions};
pub use outbox::{Message, Outbox};
pub use outcome::Outcome;
pub use policy::{LeaseExpiry, Policy, PolicyBuilder, Tier};
pub use quota::{Quota, QuotaLimit};
pub use record::{Record, State, StoredResponse};
pub use run_once::{RunError, RunOutcome, TxFuture};
pub use store::{
    Attached, BatchBegin, Begin, KeepAlive, MAX_BATCH_ITEMS, MIGRATOR, Mode, Owner, Store, StoreBuilder, pool_options,
    server_bounded,
};

/// Compiles the README's examples as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// Compiles the guide's examples as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide.md")]
pub struct GuideDoctests;

/// Compiles the HTTP page's examples as doc tests.
#[cfg(all(doctest, feature = "axum"))]
#[doc = include_str!("../docs/http.md")]
pub struct HttpDoctests;

/// Compiles the scale-out guide's examples as doc tests.
#[cfg(all(doctest, feature = "cluster"))]
#[doc = include_str!("../docs/scale-out.md")]
pub struct ScaleOutDoctests;
