//! When to retry, and how long to wait: the rules an idempotent server expects of its clients.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, StatusCode};

use crate::attempts::Wait;
use crate::error::{Problem, Retryable, retry_after};
use crate::middleware::REPLAYED;

/// Which requests carry a key and are retried, how often and for how long.
///
/// The defaults suit a payments-style API: POST and PATCH, at most 8 attempts within 60 s, backoff from
/// 100 ms doubling to 10 s with full jitter, and a retry budget per host of one retry for every ten
/// requests that succeeded (at least ten retries' worth of credit).
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(crate) methods: Vec<Method>,
    pub(crate) max_attempts: u32,
    pub(crate) deadline: Duration,
    pub(crate) base_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) budget: BudgetConfig,
}

/// The retry budget's settings: gRPC's retry throttling (a bucket per host that each failure drains by
/// one token and each success refills by `ratio`; retries stop while it is at most half full).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BudgetConfig {
    pub(crate) tokens: f64,
    pub(crate) ratio: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            max_attempts: 8,
            deadline: Duration::from_secs(60),
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
            budget: BudgetConfig { tokens: 20.0, ratio: 0.1 },
        }
    }
}

impl RetryPolicy {
    /// The methods that get a key and retries (default POST and PATCH). Others pass through untouched:
    /// GET, PUT and DELETE are idempotent by their definition and need no key.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// At most this many failed sends of one request, the first included (default 8; at least 1). A
    /// `409 in-flight` is no failure (the server is at work): polling it is bounded by the deadline only.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// No attempt starts later than this after the first (default 60 s). A server that asks to wait
    /// past it (`Retry-After`) ends the retries at once rather than after a wait that cannot succeed.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The backoff: the first wait is at most `base`, each next one at most twice the last, never more
    /// than `max` (defaults 100 ms and 10 s). The wait is drawn uniformly below that ("full jitter"), so
    /// clients that failed together do not come back together.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_delay = base;
        self.max_delay = max.max(base);
        self
    }

    /// The retry budget per host: each failed attempt spends a token, each success earns `ratio` of one,
    /// and retries stop while at most half of `tokens` are left (defaults 20 and 0.1). It keeps a
    /// retry storm from tripling the load on a server that is already failing.
    pub fn budget(mut self, tokens: u32, ratio: f64) -> Self {
        self.budget = BudgetConfig { tokens: f64::from(tokens.max(1)), ratio: ratio.clamp(0.0, 1.0) };
        self
    }

    pub(crate) fn applies_to(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// The wait before attempt `attempt + 1`: full jitter below the capped exponential.
    pub(crate) fn backoff_after(&self, attempt: u32) -> Duration {
        let ceiling = self.base_delay.saturating_mul(1 << attempt.saturating_sub(1).min(20)).min(self.max_delay);
        ceiling.mul_f64(rand::random::<f64>())
    }
}

/// What an answer means for the request, and the wait before the next attempt when there is one.
pub(crate) enum Judgment {
    /// A success (or another answer to hand back as it is).
    Answer,
    /// Final, and not a success: sending again cannot change it.
    Refused,
    /// Worth sending again with the same key.
    Retry(Retryable, Wait),
}

/// The judgment on an HTTP answer from its head alone, or `None` when its body must be read
/// ([`judge_with_body`]): a 409 may be a request in flight, and a 5xx may be final.
pub(crate) fn judge_head(status: StatusCode, headers: &HeaderMap) -> Option<Judgment> {
    match verdict(status) {
        Verdict::Answer => Some(Judgment::Answer),
        Verdict::Retry if !status.is_server_error() => Some(retry_as_asked(status, headers)),
        _ => None,
    }
}

/// The judgment on an HTTP answer whose head did not settle it, with its body's problem document.
pub(crate) fn judge_with_body(status: StatusCode, headers: &HeaderMap, problem: Option<&Problem>) -> Judgment {
    let is = |kind: &str| problem.is_some_and(|p| p.is(kind));
    if status == StatusCode::CONFLICT && is("in-flight") {
        // The first attempt's answer may come at any moment; a `Retry-After` is when its lease ends at
        // the latest. Polled with the backoff, never waiting past that.
        let asked = retry_after(headers, SystemTime::now());
        return Judgment::Retry(Retryable::Status(status), Wait::Poll(asked));
    }
    // A 5xx is worth a retry unless it is final: the server's stored answer, or one it cannot read.
    if verdict(status) == Verdict::Retry && !replayed(headers) && !is("unreadable-response") {
        return retry_as_asked(status, headers);
    }
    Judgment::Refused
}

fn retry_as_asked(status: StatusCode, headers: &HeaderMap) -> Judgment {
    let asked = retry_after(headers, SystemTime::now());
    Judgment::Retry(Retryable::Status(status), asked.map_or(Wait::Backoff, Wait::Asked))
}

/// Whether the server answered from its record of an earlier attempt (`Idempotent-Replayed: true`).
pub(crate) fn replayed(headers: &HeaderMap) -> bool {
    headers.get(REPLAYED).is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// What one status means for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A success (or a redirect reqwest did not follow): hand it to the caller.
    Answer,
    /// Worth sending again with the same key.
    Retry,
    /// Final: sending again cannot change it.
    Refused,
}

/// The verdict on a status. A 409 is refused here; the one exception, problem type `in-flight` (the first
/// attempt still runs and its answer is worth the wait), is read from the body ([`judge_with_body`]). Any
/// other 409 (indeterminate, not replayable) needs an operator, not a retry.
fn verdict(status: StatusCode) -> Verdict {
    match status.as_u16() {
        100..=399 => Verdict::Answer,
        // Request timeout, too early, too many requests: the server asks to come back.
        408 | 425 | 429 => Verdict::Retry,
        400..=499 => Verdict::Refused,
        // An idempotent server releases the key on a 5xx (the work did not complete), or answers 503
        // while its store is down: the same key is safe to send again. (A 5xx it replays from its record
        // is final; the middleware reads that from the response.)
        _ => Verdict::Retry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_get_the_verdicts_an_idempotent_server_expects() {
        for (status, expected) in [
            (201, Verdict::Answer),
            (409, Verdict::Refused),
            (429, Verdict::Retry),
            (503, Verdict::Retry),
            (500, Verdict::Retry),
            (400, Verdict::Refused),
            (410, Verdict::Refused),
            (422, Verdict::Refused),
            (404, Verdict::Refused),
        ] {
            let status = StatusCode::from_u16(status).expect("a status");
            assert_eq!(verdict(status), expected, "{status}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_below_full_jitter() {
        let policy = RetryPolicy::default().backoff(Duration::from_millis(100), Duration::from_millis(1_000));
        for attempt in 1..40 {
            let ceiling = Duration::from_millis((100u64 << (attempt - 1).min(20)).min(1_000));
            assert!(policy.backoff_after(attempt) <= ceiling, "attempt {attempt}");
        }
        assert_eq!(RetryPolicy::default().max_attempts(0).max_attempts, 1);
    }
}
