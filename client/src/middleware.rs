//! The `reqwest_middleware::Middleware`: a key on every request of the configured methods, the same key
//! and body on every attempt, and retries only where the server says a retry can help.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Extensions, HeaderValue};
use reqwest::{Request, Response};
use reqwest_middleware::{Error, Middleware, Next, Result};

use crate::attempts::{Attempts, Wait};
use crate::budget::RetryBudget;
use crate::error::{ClientError, Problem, Retryable};
use crate::journal::{KeyJournal, MemoryJournal};
use crate::policy::{Judgment, RetryPolicy, judge_head, judge_with_body, replayed};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header an idempotency store sets on an answer it replayed.
pub const REPLAYED: &str = "idempotent-replayed";
/// The request header that asks the server to hold a request in flight for its answer (RFC 7240).
pub const PREFER: &str = "prefer";
/// What a poll of a request in flight leaves of its attempt's time for the answer to travel back.
const ANSWER_MARGIN: Duration = Duration::from_secs(1);

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
    replayed(response.headers())
}

/// Adds an `Idempotency-Key` (a UUIDv7, the journal's for a named [`Operation`], or the one the request
/// already carries) and retries by the server's answer. See the crate docs for the rules.
#[derive(Debug)]
pub struct IdempotencyMiddleware<J = MemoryJournal> {
    pub(crate) policy: RetryPolicy,
    pub(crate) budget: RetryBudget,
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
    pub(crate) async fn key(&self, operation: Option<Operation>) -> std::result::Result<HeaderValue, ClientError> {
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
        let judgment = match judge_head(status, response.headers()) {
            Some(judgment) => judgment,
            None => {
                let headers = response.headers().clone();
                let body = response.bytes().await.map(|body| body.to_vec()).unwrap_or_default();
                let problem = Problem::parse(&body);
                return match judge_with_body(status, &headers, problem.as_ref()) {
                    Judgment::Retry(last, wait) => Judged::Retry(last, wait),
                    Judgment::Answer | Judgment::Refused => {
                        Judged::Refused(ClientError::Refused { status, problem, body })
                    }
                };
            }
        };
        match judgment {
            Judgment::Retry(last, wait) => Judged::Retry(last, wait),
            Judgment::Answer | Judgment::Refused => Judged::Answer(response),
        }
    }
}

enum Judged {
    Answer(Response),
    Refused(ClientError),
    Retry(Retryable, Wait),
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
        let mut attempts = Attempts::start(&self.policy, &self.budget, host, Instant::now(), None);
        // Its own `Prefer` is the caller's: the middleware adds none then.
        let prefers = request.headers().contains_key(PREFER);
        let mut kept = Some(request);
        // After a `409 in-flight`: the next attempts ask the server to hold them for the first answer.
        let mut polling = false;
        loop {
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
            let left = attempts.send();
            let mut send = send;
            if polling && !prefers {
                let wait = left.saturating_sub(ANSWER_MARGIN).as_secs();
                let prefer = HeaderValue::try_from(format!("wait={wait}")).map_err(Error::middleware)?;
                send.headers_mut().insert(PREFER, prefer);
            }
            let Ok(sent) = tokio::time::timeout(left, next.clone().run(send, extensions)).await else {
                return Err(Error::middleware(attempts.timed_out()));
            };
            let (last, wait) = match sent {
                Ok(response) => match self.judge(response).await {
                    Judged::Answer(response) => {
                        attempts.answered(was_replayed(&response));
                        return Ok(response);
                    }
                    Judged::Refused(refusal) => {
                        attempts.answered(false);
                        return Err(Error::middleware(refusal));
                    }
                    Judged::Retry(last, wait) => (last, wait),
                },
                Err(Error::Reqwest(error)) if error.is_connect() || error.is_timeout() || error.is_request() => {
                    (Retryable::Transport(error.to_string()), Wait::Backoff)
                }
                Err(error) => return Err(error),
            };
            polling = matches!(last, Retryable::Status(http::StatusCode::CONFLICT));
            let wait = attempts.retry(last, wait, kept.is_some()).map_err(Error::middleware)?;
            tokio::time::sleep(wait).await;
        }
    }
}
