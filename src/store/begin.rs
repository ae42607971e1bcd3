//! The store's answer to a claim: the key acquired (an [`Owner`]), or what the key already holds.
//! Above both the owner and the record, so that neither needs the other's module.

use std::time::Duration;

use super::owner::Owner;
use crate::outcome::Outcome;
use crate::record::StoredResponse;

/// The store's answer to [`crate::Store::begin`], named as in every API ([`Outcome`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Begin {
    /// The caller owns the key: run the work, then complete or release (see [`Owner`]).
    Acquired(Owner),
    /// Another owner is executing this request now; retry after roughly `retry_after`.
    InFlight {
        /// Time left on the owner's lease.
        retry_after: Duration,
    },
    /// The request already completed: replay this response.
    Replayed(StoredResponse),
    /// The key was used before with a different payload; nothing is executed.
    Mismatch,
    /// An owner's lease ran out without an answer, under [`crate::LeaseExpiry::MarkIndeterminate`];
    /// nothing is executed until the record is resolved.
    Indeterminate,
    /// The request completed long ago: its response was purged after the retention, and a tombstone
    /// remembers that it ran. Nothing is executed; the caller should treat it as done (or look the
    /// result up elsewhere).
    Expired,
    /// The key's tenant reached a limit of its policy's [`crate::Quota`]; nothing is executed, and
    /// nothing is recorded for the key.
    QuotaExceeded {
        /// The limit that was reached.
        limit: crate::QuotaLimit,
        /// When a place should free up if the tenant starts nothing else: the new-key estimate falls
        /// below the limit, or the soonest live lease ends (a completion frees one sooner, an extension
        /// later).
        retry_after: Duration,
    },
}

impl Begin {
    /// This answer in the vocabulary every API shares. `Acquired` is [`Outcome::Executed`]: the work
    /// runs now. A replay is [`Outcome::Replayed`] even when what was stored is a marker that the
    /// storing API reads as not replayable (`run_once`'s, the HTTP layer's): those APIs refine it.
    pub fn outcome(&self) -> Outcome {
        match self {
            Begin::Acquired(_) => Outcome::Executed,
            Begin::InFlight { .. } => Outcome::InFlight,
            Begin::Replayed(_) => Outcome::Replayed,
            Begin::Mismatch => Outcome::Mismatch,
            Begin::Indeterminate => Outcome::Indeterminate,
            Begin::Expired => Outcome::Expired,
            Begin::QuotaExceeded { .. } => Outcome::QuotaExceeded,
        }
    }
}
