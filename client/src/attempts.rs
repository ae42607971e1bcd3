//! One request's attempts, whatever carries them (a reqwest client, a tonic channel): how many were sent
//! and failed, how long they took, and whether another may go and when.

use std::time::{Duration, Instant};

use crate::budget::RetryBudget;
use crate::error::{ClientError, Retryable, Stop};
use crate::policy::RetryPolicy;
use crate::telemetry;

/// How long to wait before the next attempt.
pub(crate) enum Wait {
    /// The policy's backoff.
    Backoff,
    /// What the server asked for (`Retry-After` on a 429 or 503, gRPC's `RetryInfo`): it wants no attempt
    /// sooner. Up to a tenth more, drawn at random, so that the clients it told the same do not come back
    /// in the same instant.
    Asked(Duration),
    /// A request in flight: the backoff, never past the bound the server gave (when the first
    /// attempt's lease ends). Not a failure.
    Poll(Option<Duration>),
}

/// The shortest wait between two polls of a request in flight, whatever the jitter drew or the server's
/// bound says: a poll is free of attempts and budget, so it must not be free of time.
const MIN_POLL: Duration = Duration::from_millis(10);

impl Wait {
    fn duration(&self, policy: &RetryPolicy, attempt: u32) -> Duration {
        match *self {
            Self::Backoff => policy.backoff_after(attempt),
            Self::Asked(asked) => asked + asked.mul_f64(rand::random::<f64>() / 10.0),
            Self::Poll(bound) => policy.backoff_after(attempt).min(bound.unwrap_or(Duration::MAX)).max(MIN_POLL),
        }
    }
}

/// The attempts of one request to one host.
pub(crate) struct Attempts<'a> {
    policy: &'a RetryPolicy,
    budget: &'a RetryBudget,
    host: String,
    started: Instant,
    /// The policy's deadline, or the caller's own if that is sooner.
    deadline: Duration,
    /// Sends so far; those that failed (no answer, 5xx, 429...); those that met the first in flight.
    sent: u32,
    failures: u32,
    polls: u32,
}

impl<'a> Attempts<'a> {
    /// The attempts of a request that started at `started`, within the policy's deadline or `caller`'s
    /// (the request's own timeout) if sooner.
    pub(crate) fn start(
        policy: &'a RetryPolicy,
        budget: &'a RetryBudget,
        host: String,
        started: Instant,
        caller: Option<Duration>,
    ) -> Self {
        let deadline = caller.map_or(policy.deadline, |caller| caller.min(policy.deadline));
        Self { policy, budget, host, started, deadline, sent: 0, failures: 0, polls: 0 }
    }

    /// Counts a send. Returns how long it may take: no attempt outlives the deadline, even against a
    /// server that never answers.
    pub(crate) fn send(&mut self) -> Duration {
        self.sent += 1;
        telemetry::attempt();
        self.left()
    }

    /// The time left before the deadline.
    pub(crate) fn left(&self) -> Duration {
        self.deadline.saturating_sub(self.started.elapsed())
    }

    /// The attempt in progress was still unanswered at the deadline.
    pub(crate) fn timed_out(&self) -> ClientError {
        self.stop(Retryable::Transport("no answer before the deadline".to_owned()), Stop::Deadline)
    }

    /// A final answer came (a success, or a refusal: either way the server works).
    pub(crate) fn answered(&self, replayed: bool) {
        self.budget.answered(&self.host);
        if replayed {
            telemetry::replayed();
        }
    }

    /// The attempt failed in a way worth repeating (`last`): how long to wait before the next one, or
    /// why there is none. `repeatable`: the request can be sent again (a streamed body cannot).
    pub(crate) fn retry(&mut self, last: Retryable, wait: Wait, repeatable: bool) -> Result<Duration, ClientError> {
        // A request in flight is the server at work, not failing: polling it spends neither attempts
        // nor budget, only time.
        let (wait, stop) = if let Wait::Poll(_) = wait {
            self.polls += 1;
            (wait.duration(self.policy, self.polls), None)
        } else {
            self.failures += 1;
            let budget_left = self.budget.failed(&self.host);
            let stop = if self.failures >= self.policy.max_attempts {
                Some(Stop::Attempts)
            } else if !budget_left {
                Some(Stop::Budget)
            } else {
                None
            };
            (wait.duration(self.policy, self.failures), stop)
        };
        let stop = if repeatable {
            stop.or_else(|| (self.started.elapsed().saturating_add(wait) > self.deadline).then_some(Stop::Deadline))
        } else {
            Some(Stop::BodyNotReplayable)
        };
        if let Some(because) = stop {
            return Err(self.stop(last, because));
        }
        telemetry::retry(&last);
        Ok(wait)
    }

    fn stop(&self, last: Retryable, because: Stop) -> ClientError {
        telemetry::gave_up(because);
        ClientError::GaveUp { attempts: self.sent, last, because }
    }
}
