//! [`Outcome`]: the one vocabulary of answers. The run-once API ([`crate::RunOutcome`]), the claim
//! ([`crate::Begin`]), the inbox ([`crate::Received`]), the HTTP layer and the metrics' `outcome` label
//! all name an answer by one of these, and the HTTP status of each is decided here only.

/// What became of a request for a key, by the same name in every API.
///
/// | outcome | label | `Begin` | `RunOutcome` | `Received` | HTTP |
/// |---|---|---|---|---|---|
/// | [`Executed`](Outcome::Executed) | `executed` | `Acquired` | `Executed` | `Executed` | the handler's answer |
/// | [`Replayed`](Outcome::Replayed) | `replayed` | `Replayed` | `Replayed` | `Replayed` | the stored response |
/// | [`InFlight`](Outcome::InFlight) | `in_flight` | `InFlight` | `InFlight` | `InFlight` | 409 |
/// | [`Mismatch`](Outcome::Mismatch) | `mismatch` | `Mismatch` | `Mismatch` | `Mismatch` | 422 |
/// | [`Indeterminate`](Outcome::Indeterminate) | `indeterminate` | `Indeterminate` | `Indeterminate` | `Indeterminate` | 409 |
/// | [`Expired`](Outcome::Expired) | `expired` | `Expired` | `Expired` | `Expired` | 410 |
/// | [`NotReplayable`](Outcome::NotReplayable) | `not_replayable` | `Replayed` (its marker) | `NotReplayable` | `NotReplayable` | 409 |
/// | [`ReplayRefused`](Outcome::ReplayRefused) | `replay_refused` | `Replayed` (refused) | `ReplayRefused` | never | 403 |
/// | [`QuotaExceeded`](Outcome::QuotaExceeded) | `quota_exceeded` | `QuotaExceeded` | `QuotaExceeded` | `QuotaExceeded` | 429 |
/// | [`Error`](Outcome::Error) | `error` | `Err` | `Err` | `Err` | 503 (store unavailable) |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The caller owned the key and the work ran.
    Executed,
    /// The key completed before: its stored result is the answer.
    Replayed,
    /// Another caller owns the key and may be running the work: retry later.
    InFlight,
    /// The key was used with another payload: refused, nothing runs.
    Mismatch,
    /// An earlier owner's lease ran out under `MarkIndeterminate`: an operator decides.
    Indeterminate,
    /// The key completed so long ago that its result is gone: refused, nothing runs.
    Expired,
    /// The key completed, and its result was not stored for replay: nothing runs again.
    NotReplayable,
    /// The application's replay check (or the principal binding) refused to show the stored result.
    ReplayRefused,
    /// The tenant reached a limit of its quota: nothing runs, nothing is recorded.
    QuotaExceeded,
    /// The store could not answer: nothing runs. 503 (retry) when Postgres was unavailable; the HTTP
    /// layer answers 500 `unreadable-response` when a stored response cannot be opened (retrying does
    /// not help), and the error itself says which ([`crate::StoreError`]).
    Error,
}

impl Outcome {
    /// Every outcome, in the order of the table above.
    pub const ALL: &'static [Outcome] = &[
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::InFlight,
        Outcome::Mismatch,
        Outcome::Indeterminate,
        Outcome::Expired,
        Outcome::NotReplayable,
        Outcome::ReplayRefused,
        Outcome::QuotaExceeded,
        Outcome::Error,
    ];

    /// The value of the metrics' `outcome` label.
    pub const fn label(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::InFlight => "in_flight",
            Outcome::Mismatch => "mismatch",
            Outcome::Indeterminate => "indeterminate",
            Outcome::Expired => "expired",
            Outcome::NotReplayable => "not_replayable",
            Outcome::ReplayRefused => "replay_refused",
            Outcome::QuotaExceeded => "quota_exceeded",
            Outcome::Error => "error",
        }
    }

    /// The HTTP status the layer answers with when it answers itself: `None` for the outcomes whose
    /// answer is the handler's (executed) or the stored response (replayed). A mismatch is 422 unless the
    /// layer is configured otherwise (`http::MismatchStatus`). [`Outcome::Error`] is 503 for an
    /// unavailable store (see there).
    pub const fn http_status(self) -> Option<u16> {
        match self {
            Outcome::Executed | Outcome::Replayed => None,
            Outcome::InFlight | Outcome::Indeterminate | Outcome::NotReplayable => Some(409),
            Outcome::Mismatch => Some(422),
            Outcome::Expired => Some(410),
            Outcome::ReplayRefused => Some(403),
            Outcome::QuotaExceeded => Some(429),
            Outcome::Error => Some(503),
        }
    }
}

impl Outcome {
    /// Whether a claim ([`crate::Begin`]) answers it, and so the metrics count it per claim: not the
    /// refinements of a replay that `run_once` and the HTTP layer make (not replayable, replay refused),
    /// which have counters of their own.
    pub(crate) const fn answers_a_claim(self) -> bool {
        !matches!(self, Outcome::NotReplayable | Outcome::ReplayRefused)
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/protocol.md's table of answers is this vocabulary: each row names an outcome's label, the
    /// variants of `RunOutcome` and `Received` whose `outcome()` it is (the code's mapping), `Begin`'s,
    /// and the HTTP status, as the code has them.
    #[test]
    fn the_protocol_table_is_the_vocabulary() {
        use crate::{Received, RunOutcome};
        use std::time::Duration;
        let wait = Duration::ZERO;
        let limit = crate::QuotaLimit::NewKeys;
        let runs: Vec<RunOutcome<()>> = vec![
            RunOutcome::Executed(()),
            RunOutcome::Replayed(()),
            RunOutcome::InFlight { retry_after: wait },
            RunOutcome::Mismatch,
            RunOutcome::Indeterminate,
            RunOutcome::Expired,
            RunOutcome::NotReplayable,
            RunOutcome::ReplayRefused,
            RunOutcome::QuotaExceeded { limit, retry_after: wait },
        ];
        let received: Vec<Received<()>> = vec![
            Received::Executed(()),
            Received::Replayed { result: (), sequence: None },
            Received::InFlight { retry_after: wait },
            Received::Mismatch,
            Received::Indeterminate,
            Received::Expired,
            Received::NotReplayable,
            Received::QuotaExceeded { limit, retry_after: wait },
        ];
        let begins: Vec<crate::Begin> = vec![
            crate::Begin::Replayed(crate::StoredResponse::new(Vec::new())),
            crate::Begin::InFlight { retry_after: wait },
            crate::Begin::Mismatch,
            crate::Begin::Indeterminate,
            crate::Begin::Expired,
            crate::Begin::QuotaExceeded { limit, retry_after: wait },
        ];
        // A variant's name as the code spells it (its Debug form up to its fields).
        let name = |debug: String| debug.split(['(', ' ', '{']).next().unwrap_or_default().to_owned();
        let named = |names: Vec<(Outcome, String)>, outcome: Outcome| {
            names.into_iter().find(|(o, _)| *o == outcome).map(|(_, name)| format!("`{name}`"))
        };
        let doc = include_str!("../docs/protocol.md");
        let start = doc.find("| outcome | label |").expect("docs/protocol.md has the table of answers");
        let rows: Vec<Vec<&str>> = doc[start..]
            .lines()
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|line| line.trim_matches('|').split('|').map(str::trim).collect())
            .collect();
        assert_eq!(rows.len(), Outcome::ALL.len(), "one row per outcome");
        for (row, &outcome) in rows.iter().zip(Outcome::ALL) {
            assert_eq!(row[0], format!("`{outcome:?}`"), "{row:?}");
            assert_eq!(row[1], format!("`{}`", outcome.label()), "{row:?}");
            let begin = named(begins.iter().map(|b| (b.outcome(), name(format!("{b:?}")))).collect(), outcome);
            let run = named(runs.iter().map(|r| (r.outcome(), name(format!("{r:?}")))).collect(), outcome);
            let inbox = named(received.iter().map(|r| (r.outcome(), name(format!("{r:?}")))).collect(), outcome);
            for (column, name) in [(2, begin), (3, run), (4, inbox)] {
                if let Some(name) = name {
                    assert!(row[column].starts_with(&name), "{outcome:?}: {:?} is not {name}", row[column]);
                }
            }
            let status = outcome.http_status().map_or(String::new(), |status| status.to_string());
            assert!(row[5].starts_with(&status), "{outcome:?}: {:?} against {status}", row[5]);
        }
    }

    #[test]
    fn labels_are_distinct() {
        let mut labels: Vec<_> = Outcome::ALL.iter().map(|o| o.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Outcome::ALL.len());
    }
}
