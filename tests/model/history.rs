//! The history of one case: every call, its answer and when it ran, checked as a whole once the case
//! ends. The checks read only the answers, never the model, so they are a second opinion on the same
//! run (as Jepsen's checkers read a history): per life of the key, at most one completion, and every
//! replay repeats it.

use std::fmt;
use std::time::{Duration, Instant};

/// When a call ran, from the start of its case.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    started: Duration,
    ended: Duration,
}

impl Span {
    /// Whether this call was under way at the end of `other`: it began before `other` ended, and ended
    /// after.
    pub fn waited_for(self, other: Span) -> bool {
        self.started < other.ended && other.ended <= self.ended
    }
}

/// What an entry means to the end-of-case checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Nothing the checks read.
    None,
    /// A begin acquired a key that held nothing (no record, no standing tombstone): a new life of the
    /// key starts, in which nothing has completed yet.
    NewLife,
    /// A response was stored: an owner completed, or an operator resolved the record as completed.
    Completion(String),
    /// An operator replaced the life's completion, stored in a form the deployment cannot replay, with
    /// this response.
    Replacement(String),
    /// A begin replayed this response.
    Replay(String),
    /// The HTTP layer replayed this body, which the completion of its life holds.
    ReplayBody(String),
    /// A begin was told its response expired.
    Expired,
}

struct Entry {
    step: usize,
    key: usize,
    span: Span,
    call: String,
    answer: String,
    effect: Effect,
}

/// The entries of one case, in the order they took effect.
pub struct History {
    origin: Instant,
    entries: Vec<Entry>,
    /// The key the next entries are about.
    pub key: usize,
}

impl History {
    /// An empty history whose clock starts now.
    pub fn start() -> Self {
        Self { origin: Instant::now(), entries: Vec::new(), key: 0 }
    }

    /// Runs `call`, timing it.
    pub async fn timed<T>(&self, call: impl Future<Output = T>) -> (T, Span) {
        let started = self.origin.elapsed();
        let value = call.await;
        (value, Span { started, ended: self.origin.elapsed() })
    }

    /// Adds a call of step `step` and what it answered.
    pub fn record(
        &mut self,
        step: usize,
        span: Span,
        call: impl Into<String>,
        answer: impl Into<String>,
        effect: Effect,
    ) {
        let key = self.key;
        self.entries.push(Entry { step, key, span, call: call.into(), answer: answer.into(), effect });
    }

    /// Adds what the checker learnt of a call after it returned (a write that landed late).
    pub fn record_now(&mut self, step: usize, call: impl Into<String>, answer: impl Into<String>, effect: Effect) {
        let now = self.origin.elapsed();
        self.record(step, Span { started: now, ended: now }, call, answer, effect);
    }

    /// Adds a step that sent nothing to the store (a fault, time passing, a no-op).
    pub fn note(&mut self, step: usize, call: impl Into<String>, answer: impl Into<String>) {
        self.record_now(step, call, answer, Effect::None);
    }

    /// Per key: at most one completion per life of the key; every replay equals the completion of its
    /// life, and "expired" is only said of a life that completed.
    pub fn check(&self) -> Result<(), String> {
        let mut keys: Vec<usize> = self.entries.iter().map(|entry| entry.key).collect();
        keys.sort_unstable();
        keys.dedup();
        keys.into_iter().try_for_each(|key| self.check_key(key).map_err(|violation| format!("key {key}: {violation}")))
    }

    fn check_key(&self, key: usize) -> Result<(), String> {
        // The completion of the key's current life, and the step that stored it.
        let mut completion: Option<(usize, &str)> = None;
        for entry in self.entries.iter().filter(|entry| entry.key == key) {
            let step = entry.step;
            match (&entry.effect, completion) {
                (Effect::NewLife, _) => completion = None,
                (Effect::Completion(response), None) => completion = Some((step, response.as_str())),
                (Effect::Completion(response), Some((first, stored))) => {
                    return Err(format!(
                        "step {step} stored {response:?}, but step {first} stored {stored:?} in the same life of \
                         the key: the request ran twice"
                    ));
                }
                (Effect::Replacement(response), Some(_)) => completion = Some((step, response.as_str())),
                (Effect::Replacement(response), None) => {
                    return Err(format!("step {step} replaced the completion with {response:?}, but none was stored"));
                }
                (Effect::Replay(response), Some((_, stored))) if response == stored => {}
                (Effect::ReplayBody(body), Some((_, stored))) if stored.contains(body.as_str()) => {}
                (Effect::ReplayBody(body), _) => {
                    return Err(format!(
                        "step {step} replayed the body {body:?}, but this life of the key stored {completion:?}"
                    ));
                }
                (Effect::Replay(response), _) => {
                    return Err(format!(
                        "step {step} replayed {response:?}, but this life of the key stored {completion:?}"
                    ));
                }
                (Effect::Expired, None) => {
                    return Err(format!(
                        "step {step} was told \"expired\", but nothing completed in this life of the key"
                    ));
                }
                (Effect::Expired | Effect::None, _) => {}
            }
        }
        Ok(())
    }
}

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |at: Duration| at.as_secs_f64() * 1e3;
        for Entry { step, key, span, call, answer, .. } in &self.entries {
            let (started, ended) = (ms(span.started), ms(span.ended));
            writeln!(f, "  {step:>3}  k{key}  {started:>8.1}..{ended:<8.1}  {call:<40} -> {answer}")?;
        }
        Ok(())
    }
}
