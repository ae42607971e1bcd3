//! The `reqwest_middleware::Middleware`: a key on every request of the configured methods, the same key
//! and body on every attempt, and retries only where the server says a retry can help.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::{Extensions, HeaderValue, StatusCode};
use reqwest::{Request, Response};
use reqwest_middleware::{Error, Middleware, Next, Result};

use crate::budget::RetryBudget;
use crate::error::{ClientError, Problem, Retryable, Stop, retry_after};
use crate::journal::{KeyJournal, MemoryJournal};
use crate::policy::{RetryPolicy, Verdict, verdict};
use crate::telemetry;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header an idempotency store sets on an answer it replayed.
pub const REPLAYED: &str = "idempotent-replayed";

/// The logical operation a request performs, named by the caller (`"order-1001/charge"`): its key comes
/// from the journal, so a client that crashed and runs the operation again sends the same key. Attach it
/// with `RequestBuilder::with_extension`. Without it, each request gets a fresh key that only its own
/// retries reuse.
#[derive(Debug, Clone)]
pub struct Operation(Arc<str>);

impl Operation {
    /// Names an operation. The name is the journal's key: one name, one logical operation.
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into().into())
    }
}

/// Whether the server answered from its record of an earlier attempt (`Idempotent-Replayed: true`)
/// rather than running the request now.
pub fn was_replayed(response: &Response) -> bool {
    response.headers().get(REPLAYED).is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// Adds an `Idempotency-Key` (a UUIDv7, the journal's for a named [`Operation`], or the one the request
/// already carries) and retries by the server's answer. See the crate docs for the rules.
#[derive(Debug)]
pub struct IdempotencyMiddleware<J = MemoryJournal> {
    policy: RetryPolicy,
    budget: RetryBudget,
    journal: Arc<J>,
}

impl Default for IdempotencyMiddleware<MemoryJournal> {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyMiddleware<MemoryJournal> {
    /// The default [`RetryPolicy`], operations' keys kept in memory for a day.
    pub fn new() -> Self {
        Self::with_journal(MemoryJournal::new(Duration::from_secs(24 * 3600)))
    }
}

impl<J: KeyJournal> IdempotencyMiddleware<J> {
    /// The default [`RetryPolicy`], operations' keys kept in `journal` (e.g. a
    /// [`FileJournal`](crate::FileJournal), to outlive the process).
    pub fn with_journal(journal: J) -> Self {
        let policy = RetryPolicy::default();
        Self { budget: RetryBudget::new(policy.budget), policy, journal: Arc::new(journal) }
    }

    /// Replaces the retry policy (and starts its budgets afresh).
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.budget = RetryBudget::new(policy.budget);
        self.policy = policy;
        self
    }

    /// The key for a request: the journal's for a named operation, else a fresh UUIDv7.
    async fn key(&self, operation: Option<Operation>) -> std::result::Result<HeaderValue, ClientError> {
        let mut mint = || uuid::Uuid::now_v7().to_string();
        let key = match operation {
            None => mint(),
            Some(Operation(name)) => {
                let journal = Arc::clone(&self.journal);
                let recorded = tokio::task::spawn_blocking(move || journal.key(&name, &mut mint)).await;
                recorded.map_err(std::io::Error::other).and_then(|key| key).map_err(ClientError::Journal)?
            }
        };
        HeaderValue::from_str(&key).map_err(|error| ClientError::Journal(std::io::Error::other(error)))
    }

    /// What one attempt's response means: handed back, refused for good, or worth a retry (and how long
    /// to wait before it).
    async fn judge(&self, response: Response) -> Judged {
        let status = response.status();
        let asked = retry_after(response.headers(), SystemTime::now());
        let replayed = was_replayed(&response);
        let verdict = verdict(status);
        // A retryable status without a body worth reading goes straight back out.
        if verdict == Verdict::Answer {
            return Judged::Answer(response);
        }
        if verdict == Verdict::Retry && !status.is_server_error() {
            return Judged::Retry(Retryable::Status(status), asked.map_or(Wait::Backoff, Wait::Asked));
        }
        let body = response.bytes().await.map(|body| body.to_vec()).unwrap_or_default();
        let problem = Problem::parse(&body);
        let is = |kind: &str| problem.as_ref().is_some_and(|p| p.is(kind));
        if status == StatusCode::CONFLICT && is("in-flight") {
            // The first attempt's answer may come at any moment; a `Retry-After` is when its lease ends
            // at the latest. Polled with the backoff, never waiting past that.
            return Judged::Retry(Retryable::Status(status), Wait::Poll(asked));
        }
        // A 5xx is worth a retry unless it is final: the server's stored answer, or one it cannot read.
        if verdict == Verdict::Retry && !replayed && !is("unreadable-response") {
            return Judged::Retry(Retryable::Status(status), asked.map_or(Wait::Backoff, Wait::Asked));
        }
        Judged::Refused(ClientError::Refused { status, problem, body })
    }
}

enum Judged {
    Answer(Response),
    Refused(ClientError),
    Retry(Retryable, Wait),
}

/// How long to wait before the next attempt.
enum Wait {
    /// The policy's backoff.
    Backoff,
    /// What `Retry-After` asked for (429, 503): the server wants no attempt sooner. Up to a tenth more,
    /// drawn at random, so that the clients it told the same do not come back in the same instant.
    Asked(Duration),
    /// A request in flight: the backoff, never past its `Retry-After`. Not a failure.
    Poll(Option<Duration>),
}

impl Wait {
    fn duration(&self, policy: &RetryPolicy, attempt: u32) -> Duration {
        match *self {
            Self::Backoff | Self::Poll(None) => policy.backoff_after(attempt),
            Self::Asked(asked) => asked + asked.mul_f64(rand::random::<f64>() / 10.0),
            Self::Poll(Some(bound)) => policy.backoff_after(attempt).min(bound),
        }
    }
}

#[async_trait::async_trait]
impl<J: KeyJournal> Middleware for IdempotencyMiddleware<J> {
    async fn handle(&self, mut request: Request, extensions: &mut Extensions, next: Next<'_>) -> Result<Response> {
        let operation = extensions.get::<Operation>().cloned();
        if !self.policy.applies_to(request.method()) {
            if let Some(Operation(name)) = &operation {
                let method = request.method();
                tracing::warn!(operation = %name, %method, "the retry policy does not cover this method: no key");
            }
            return next.run(request, extensions).await;
        }
        match (request.headers().contains_key(IDEMPOTENCY_KEY), operation) {
            (true, Some(Operation(name))) => {
                tracing::warn!(operation = %name, "the request carries its own Idempotency-Key: the journal's is not used");
            }
            (true, None) => {}
            (false, operation) => {
                let key = self.key(operation).await.map_err(Error::middleware)?;
                request.headers_mut().insert(IDEMPOTENCY_KEY, key);
            }
        }
        let url = request.url();
        let host = format!("{}:{}", url.host_str().unwrap_or_default(), url.port_or_known_default().unwrap_or(0));
        let started = Instant::now();
        let mut kept = Some(request);
        // Sends so far; those that failed (no answer, 5xx, 429...); those that met the first attempt in flight.
        let (mut attempts, mut failures, mut polls) = (0, 0, 0);
        loop {
            attempts += 1;
            let original = kept.take().expect("a request is kept for every attempt but the last");
            // The copy goes out; the original stays for the next attempt. A streamed body cannot be
            // copied: it is sent once.
            let send = match original.try_clone() {
                Some(copy) => {
                    kept = Some(original);
                    copy
                }
                None => original,
            };
            telemetry::attempt();
            // No attempt outlives the deadline, even against a server that never answers.
            let left = self.policy.deadline.saturating_sub(started.elapsed());
            let sent = tokio::time::timeout(left, next.clone().run(send, extensions)).await;
            let Ok(sent) = sent else {
                let last = Retryable::Transport("no answer before the deadline".to_owned());
                telemetry::gave_up(Stop::Deadline);
                return Err(Error::middleware(ClientError::GaveUp { attempts, last, because: Stop::Deadline }));
            };
            let (last, wait) = match sent {
                Ok(response) => match self.judge(response).await {
                    Judged::Answer(response) => {
                        self.budget.answered(&host);
                        if was_replayed(&response) {
                            telemetry::replayed();
                        }
                        return Ok(response);
                    }
                    Judged::Refused(refusal) => {
                        self.budget.answered(&host);
                        return Err(Error::middleware(refusal));
                    }
                    Judged::Retry(last, wait) => (last, wait),
                },
                Err(Error::Reqwest(error)) if error.is_connect() || error.is_timeout() || error.is_request() => {
                    (Retryable::Transport(error.to_string()), Wait::Backoff)
                }
                Err(error) => return Err(error),
            };
            // A request in flight is the server at work, not failing: polling it spends neither
            // attempts nor budget, only time.
            let (wait, stop) = if let Wait::Poll(_) = wait {
                polls += 1;
                (wait.duration(&self.policy, polls), None)
            } else {
                failures += 1;
                let budget_left = self.budget.failed(&host);
                let stop = if failures >= self.policy.max_attempts {
                    Some(Stop::Attempts)
                } else if !budget_left {
                    Some(Stop::Budget)
                } else {
                    None
                };
                (wait.duration(&self.policy, failures), stop)
            };
            let stop = if kept.is_none() {
                Some(Stop::BodyNotReplayable)
            } else {
                stop.or_else(|| {
                    (started.elapsed().saturating_add(wait) > self.policy.deadline).then_some(Stop::Deadline)
                })
            };
            if let Some(because) = stop {
                telemetry::gave_up(because);
                return Err(Error::middleware(ClientError::GaveUp { attempts, last, because }));
            }
            telemetry::retry(&last);
            tokio::time::sleep(wait).await;
        }
    }
}
