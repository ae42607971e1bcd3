//! The reference model of one key: what the protocol says the key holds, and which answers it allows.
//! Plain Rust, no I/O. The driver hands it every real answer and, after every step, what Postgres
//! holds; the model says whether they are allowed, and follows them.
//!
//! It is exact where the protocol is. Where the protocol leaves a choice to the store (may another
//! payload reuse a key whose record expired before the purge came?), it allows each choice and follows
//! the one the answer shows. Time moves only in steps (a lease runs out, a retention or a tombstone's
//! horizon passes): the servers' leases and retentions are far longer than a case.
//!
//! The invariants, numbered as in the messages:
//! 1. at most one live owner: nobody acquires a key while a lease on it is live;
//! 2. a stored response answers only the payload that stored it, and it is the key's one completion;
//! 3. fences strictly increase over a key's whole life, purges included;
//! 4. a superseded owner's writes are refused (`LeaseLost`); a live owner's writes succeed;
//! 5. a completed key replays its response to the same payload until its retention ends, never "in
//!    flight"; another payload is refused;
//! 6. after the retention, the same payload is told `Expired` (it never runs again) until the
//!    tombstone's horizon; another payload is refused;
//! 7. once a lease ran out under `MarkIndeterminate`, nobody acquires the key until it is resolved;
//! 8. no "in flight" unless a lease is live; Postgres agrees with the model after every step, so
//!    "live" is what Postgres holds, not only what the model believes;
//! 9. a store hands out only a response it can open: never ciphertext to a store without the key, never
//!    clear bytes to one that seals; a work that ran is never run again, even when its result could
//!    not be stored for replay.
//! 10. a call that fails closed (Postgres did not answer in time, or its connection broke) changes at
//!     most what it asked for: what it sent may land late or never, and Postgres shows which. An
//!     owner's completion or release outlives a blip (it is asked again while the lease lasts), so it
//!     never fails closed.

use std::fmt;

/// A request payload. Two are enough: the same request retried, and a key reused by mistake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    A,
    B,
}

/// What a lease that runs out means, as the policy of the store a call goes to says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    TakeOver,
    MarkIndeterminate,
}

/// Whether a store seals the responses it writes (it has the deployment's key) or writes them in clear
/// (encryption turned off, a rollback, a second service): both kinds share one database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sealing {
    Sealed,
    Clear,
}

/// One `begin`: a payload, sent to the store whose policy has `rule` and that seals or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub payload: Payload,
    pub rule: Rule,
    pub sealing: Sealing,
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "begin {:?} ({:?}, {:?})", self.payload, self.rule, self.sealing)
    }
}

/// A `begin` answer, as far as the model reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Acquired {
        fence: i64,
    },
    InFlight,
    Completed(String),
    /// The HTTP layer replayed this body: the key's completion (the layer's stored form) holds it.
    ReplayedBody(String),
    Mismatch,
    Indeterminate,
    Expired,
    /// The key completed, and its stored response is one this store cannot open (a typed error).
    Unreadable,
    /// The store failed closed: Postgres did not answer in time, or the connection broke.
    Unavailable,
    /// The claim would have started the key, but the tenant holds its live-key quota elsewhere.
    QuotaExceeded,
}

/// An owner's fenced write. A completion is stored as its owner's store writes responses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Complete(String, Sealing),
    Release,
    Extend,
}

impl fmt::Display for Write {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Write::Complete(response, sealing) => write!(f, "complete {response:?} ({sealing:?})"),
            Write::Release => f.write_str("release"),
            Write::Extend => f.write_str("extend"),
        }
    }
}

/// How a fenced write ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    LeaseLost,
    /// The store failed closed: the write may land late, or never.
    Unavailable,
}

/// A call that failed closed: what it sent may have landed (late, after its caller gave up) or not.
/// The next look at Postgres says which.
#[derive(Clone, Debug)]
pub enum Pending {
    Begin(Call),
    Write {
        fence: i64,
        write: Write,
    },
    Purge,
    RecoverStale,
    Resolve(Settle, Sealing),
    /// A run whose work's commit landed (its effect row shows it), although its caller was told the
    /// store failed: its claim and its settlement landed with it. It must land.
    Run(Call, Write),
}

/// How an operator settles an indeterminate record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    Completed(String),
    Released,
}

/// What Postgres holds for the key after a step (`Admin::lookup`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    Nothing,
    Record(SeenRecord),
    /// A tombstone within its horizon; `payload` is `None` for a fingerprint of neither payload.
    Tombstone {
        payload: Option<Payload>,
        fence: i64,
    },
}

/// A record as Postgres holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeenRecord {
    pub stage: Stage,
    /// `None` for a fingerprint of neither payload.
    pub payload: Option<Payload>,
    pub fence: i64,
    /// The rule stored with the record (`None`: none the store knows, a disagreement).
    pub rule: Option<Rule>,
    pub lease_live: bool,
    pub retention_passed: bool,
    pub response: Option<String>,
    /// How the response is stored (`None` without a response).
    pub sealing: Option<Sealing>,
}

/// A record's state, without its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    InProgress,
    Completed,
    Released,
    Indeterminate,
}

/// What a check found wrong, in words that name the invariant.
pub type Verdict = Result<(), String>;

/// The key as the protocol says it should be.
#[derive(Clone, Debug, Default)]
pub struct Model {
    record: Option<Record>,
    /// What a purged completion left; kept past its horizon until a purge or a new owner removes it.
    tombstone: Option<Tombstone>,
    /// The highest fence any begin was given for this key.
    highest_fence: Option<i64>,
    /// Calls of the current step that failed closed, in the order they were made.
    pending: Vec<Pending>,
    /// The operation's live-key quota is held by the case's other keys: a claim that would start this
    /// key is refused instead (the driver says before each step: [`Model::set_quota_full`]).
    quota_full: bool,
    /// The operation has a live-key quota of one.
    under_quota: bool,
}

#[derive(Clone, Debug)]
struct Record {
    payload: Payload,
    fence: i64,
    /// The rule of the call that first claimed the record: it stays with the record whoever claims it
    /// again, until the record is purged.
    rule: Rule,
    phase: Phase,
    retention_passed: bool,
    /// How the completion's response is stored.
    sealing: Sealing,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    InProgress { live: bool },
    Completed(String),
    Released,
    Indeterminate,
}

impl Phase {
    fn stage(&self) -> Stage {
        match self {
            Phase::InProgress { .. } => Stage::InProgress,
            Phase::Completed(_) => Stage::Completed,
            Phase::Released => Stage::Released,
            Phase::Indeterminate => Stage::Indeterminate,
        }
    }
}

#[derive(Clone, Debug)]
struct Tombstone {
    payload: Payload,
    /// The last fence of the purged record.
    fence: i64,
    horizon_passed: bool,
}

/// The kinds of answer a begin may get now, and why only those.
struct Allowed {
    kinds: &'static [Kind],
    why: &'static str,
}

fn answers(kinds: &'static [Kind], why: &'static str) -> Allowed {
    Allowed { kinds, why }
}

const HORIZON_PASSED: &str = "the tombstone's horizon passed: the key is new, though it may be refused until the purge";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Acquired,
    InFlight,
    Completed,
    Mismatch,
    Indeterminate,
    Expired,
    Unreadable,
    Unavailable,
    QuotaExceeded,
}

impl Answer {
    fn kind(&self) -> Kind {
        match self {
            Answer::Acquired { .. } => Kind::Acquired,
            Answer::InFlight => Kind::InFlight,
            Answer::Completed(_) | Answer::ReplayedBody(_) => Kind::Completed,
            Answer::Mismatch => Kind::Mismatch,
            Answer::Indeterminate => Kind::Indeterminate,
            Answer::Expired => Kind::Expired,
            Answer::Unreadable => Kind::Unreadable,
            Answer::Unavailable => Kind::Unavailable,
            Answer::QuotaExceeded => Kind::QuotaExceeded,
        }
    }
}

impl Allowed {
    /// Whether an answer of `kind` is allowed, with the live-key quota full or not: a claim that would
    /// start the key is then refused, and nothing else changes (replays, duplicates in flight and
    /// mismatches are answered as before).
    fn permits(&self, kind: Kind, quota_full: bool) -> bool {
        match kind {
            Kind::Acquired => !quota_full && self.kinds.contains(&Kind::Acquired),
            Kind::QuotaExceeded => quota_full && self.kinds.contains(&Kind::Acquired),
            kind => self.kinds.contains(&kind),
        }
    }

    fn refusal(&self, subject: impl fmt::Display, answer: impl fmt::Debug, quota_full: bool) -> String {
        let quota =
            if quota_full { " (the live-key quota is full: a claim that would start it is refused)" } else { "" };
        format!("{subject} was answered {answer:?}, but {}{quota}: only {:?} may be answered", self.why, self.kinds)
    }
}

impl Model {
    /// A key that holds nothing yet, of an operation with a live-key quota of one or without.
    pub fn new(under_quota: bool) -> Self {
        Self { under_quota, ..Self::default() }
    }

    /// Whether the case's other keys hold the operation's live-key quota.
    pub fn set_quota_full(&mut self, full: bool) {
        self.quota_full = self.under_quota && full;
    }

    /// Checks a begin's answer and follows it.
    pub fn begin(&mut self, call: Call, answer: &Answer) -> Verdict {
        if *answer == Answer::Unavailable {
            self.pending.push(Pending::Begin(call));
            return Ok(());
        }
        let allowed = self.allowed(call);
        if !allowed.permits(answer.kind(), self.quota_full) {
            return Err(allowed.refusal(call, answer, self.quota_full));
        }
        match answer {
            Answer::Acquired { fence } => self.acquired(call, *fence),
            Answer::Completed(response) => self.replayed(response),
            Answer::ReplayedBody(body) => self.replayed_body(body),
            Answer::Indeterminate => {
                if let Some(record) = &mut self.record {
                    record.phase = Phase::Indeterminate;
                }
                Ok(())
            }
            Answer::InFlight
            | Answer::Mismatch
            | Answer::Expired
            | Answer::Unreadable
            | Answer::Unavailable
            | Answer::QuotaExceeded => Ok(()),
        }
    }

    /// A run in a transaction answered "indeterminate": allowed now, and its mark of the record lands
    /// with the transaction's commit, or not (decided at the next [`Model::observe`]).
    pub fn indeterminate_in_tx(&mut self, call: Call) -> Verdict {
        let allowed = self.allowed(call);
        if !allowed.permits(Kind::Indeterminate, self.quota_full) {
            return Err(allowed.refusal(call, Answer::Indeterminate, self.quota_full));
        }
        self.pending.push(Pending::Begin(call));
        Ok(())
    }

    /// A call that failed closed: decided at the next [`Model::observe`].
    pub fn failed_closed(&mut self, pending: Pending) {
        self.pending.push(pending);
    }

    /// The run of `call` that failed closed committed its work after all: its claim, recorded as a
    /// begin that failed closed, landed with `settle`.
    pub fn ran_after_all(&mut self, call: Call, settle: Write) {
        let begun = self.pending.iter().rposition(|pending| matches!(pending, Pending::Begin(c) if *c == call));
        if let Some(index) = begun {
            self.pending.remove(index);
        }
        self.pending.push(Pending::Run(call, settle));
    }

    /// Checks that `call` may acquire the key now, without following it: a claim made in a transaction
    /// that rolled back (its work failed) left nothing, but it must still have been allowed.
    pub fn may_acquire(&self, call: Call) -> Verdict {
        let allowed = self.allowed(call);
        if allowed.permits(Kind::Acquired, self.quota_full) {
            return Ok(());
        }
        Err(allowed.refusal(format!("{call} (its work ran, then rolled back)"), Kind::Acquired, self.quota_full))
    }

    /// Checks the answers of begins that ran at the same time: some order of them must explain every
    /// answer. Returns that order (positions in `begun`).
    ///
    /// With the same payload, a later one may be told "in flight" and change nothing: it met an earlier
    /// one's Redis marker (`redis_in_front`: Redis had no settled copy of the key, so the earlier one
    /// wrote a marker before asking Postgres), waited on an earlier one's fresh claim, or lost the race to
    /// mark the record indeterminate. That is the one round trip of "in flight" the protocol allows
    /// without a lease.
    pub fn begin_together(&mut self, begun: &[(Call, &Answer)], redis_in_front: bool) -> Result<Vec<usize>, String> {
        let mut refusals = Vec::new();
        for order in orders(begun.len()) {
            match self.in_order(begun, &order, redis_in_front) {
                Ok(model) => {
                    *self = model;
                    return Ok(order);
                }
                Err(refusal) => refusals.push(format!("in the order {order:?}: {refusal}")),
            }
        }
        Err(format!("no order of the concurrent begins explains their answers.\n  {}", refusals.join("\n  ")))
    }

    fn in_order(&self, begun: &[(Call, &Answer)], order: &[usize], redis_in_front: bool) -> Result<Model, String> {
        let mut model = self.clone();
        for (position, &index) in order.iter().enumerate() {
            let (call, answer) = begun[index];
            // One that failed closed may have written, too.
            let wrote = |answer: &Answer| {
                matches!(answer, Answer::Acquired { .. } | Answer::Indeterminate | Answer::Unavailable)
            };
            let met_an_earlier = *answer == Answer::InFlight
                && order[..position].iter().any(|&earlier| {
                    let (earlier_call, earlier_answer) = begun[earlier];
                    earlier_call.payload == call.payload && (redis_in_front || wrote(earlier_answer))
                });
            if !met_an_earlier {
                model.begin(call, answer)?;
            }
        }
        Ok(model)
    }

    /// Checks how an owner's write under `fence` ended, and follows it.
    pub fn write(&mut self, fence: i64, write: &Write, outcome: Outcome) -> Verdict {
        use Outcome::{Done, LeaseLost, Unavailable};
        match (outcome, write) {
            (Unavailable, Write::Extend) => {
                self.pending.push(Pending::Write { fence, write: write.clone() });
                return Ok(());
            }
            (Unavailable, _) => {
                return Err(format!(
                    "{write} under fence {fence} failed closed, but a settlement is asked again while the lease \
                     lasts: a blip of Postgres costs it time, not its write (invariant 10)"
                ));
            }
            _ => {}
        }
        let owned = self.record.as_mut().filter(|record| record.fence == fence);
        let (allowed, why): (&[Outcome], &str) = match (owned.as_ref().map(|record| &record.phase), write) {
            (Some(Phase::InProgress { live: true }), _) => {
                (&[Done], "its lease is live and nobody took over, so it must succeed (invariant 4)")
            }
            (Some(Phase::InProgress { live: false }), _) => {
                (&[Done, LeaseLost], "its lease ran out, but nobody took over")
            }
            (Some(Phase::Indeterminate), Write::Extend) => {
                (&[LeaseLost], "an indeterminate record has no lease to extend")
            }
            (Some(Phase::Indeterminate), _) => (&[Done], "the owner of an indeterminate record may still settle it"),
            (Some(Phase::Completed(_) | Phase::Released), _) => (&[LeaseLost], "its owner already finished"),
            (None, _) => (&[LeaseLost], "a later owner took the key over, or its record was purged (invariant 4)"),
        };
        if !allowed.contains(&outcome) {
            return Err(format!("{write} under fence {fence} ended {outcome:?}, but {why}"));
        }
        if let (Done, Some(record)) = (outcome, owned) {
            record.phase = match write {
                Write::Complete(response, sealing) => {
                    record.retention_passed = false;
                    record.sealing = *sealing;
                    Phase::Completed(response.clone())
                }
                Write::Release => Phase::Released,
                Write::Extend => Phase::InProgress { live: true },
            };
        }
        Ok(())
    }

    /// A begin of `waiter` that waited for the key's owner while the owner's `write` under `fence` ended
    /// `outcome`: some order of the two explains both answers. A waiter answers "in flight" only at the
    /// end of its wait, so the settlement, which came before, must have left a live lease. Returns
    /// whether the settlement came first.
    pub fn wait_for(
        &mut self,
        waiter: Call,
        answer: &Answer,
        fence: i64,
        write: &Write,
        outcome: Outcome,
    ) -> Result<bool, String> {
        let mut settled_first = self.clone();
        let first = settled_first.write(fence, write, outcome).and_then(|()| settled_first.begin(waiter, answer));
        let Err(first) = first else {
            *self = settled_first;
            return Ok(true);
        };
        let mut waiter_first = self.clone();
        let second = if *answer == Answer::InFlight {
            Err(format!("{waiter} waited, and was told \"in flight\" although the owner settled within its wait"))
        } else {
            waiter_first.begin(waiter, answer).and_then(|()| waiter_first.write(fence, write, outcome))
        };
        match second {
            Ok(()) => {
                *self = waiter_first;
                Ok(false)
            }
            Err(second) => Err(format!(
                "no order of a waiting begin and the owner's settlement explains their answers.\n  the settlement \
                 first: {first}\n  the waiter first: {second}"
            )),
        }
    }

    /// Checks whether `resolve`, by a store that seals or not, acted, and follows it.
    pub fn resolve(&mut self, settle: &Settle, sealing: Sealing, resolved: bool) -> Verdict {
        let indeterminate = self.record.as_ref().is_some_and(|record| record.phase == Phase::Indeterminate);
        // A store that seals replaces a response written in clear, which it cannot replay.
        let unsealed = self
            .record
            .as_ref()
            .is_some_and(|record| matches!(record.phase, Phase::Completed(_)) && record.sealing == Sealing::Clear)
            && sealing == Sealing::Sealed
            && matches!(settle, Settle::Completed(_));
        if resolved != (indeterminate || unsealed) {
            return Err(format!(
                "resolve ({sealing:?}) answered {resolved}, but the model holds {:?}: resolve settles indeterminate \
                 records, and a store that seals also replaces a completion stored in clear; nothing else",
                self.record
            ));
        }
        if let Some(record) = self.record.as_mut().filter(|_| resolved) {
            record.sealing = sealing;
            record.phase = match settle {
                // A replaced response keeps the retention it had.
                Settle::Completed(response) if unsealed => Phase::Completed(response.clone()),
                Settle::Completed(response) => {
                    record.retention_passed = false;
                    Phase::Completed(response.clone())
                }
                Settle::Released => Phase::Released,
            };
        }
        Ok(())
    }

    /// Whether the key holds a live lease (which counts towards the live-key quota).
    pub fn holds_a_live_lease(&self) -> bool {
        matches!(self.record, Some(Record { phase: Phase::InProgress { live: true }, .. }))
    }

    /// The owner's lease ran out (it stopped extending).
    pub fn expire_lease(&mut self) {
        if let Some(Record { phase: Phase::InProgress { live }, .. }) = &mut self.record {
            *live = false;
        }
    }

    /// The record's retention passed (for a live lease: its owner kept extending past it).
    pub fn pass_retention(&mut self) {
        if let Some(record) = &mut self.record {
            record.retention_passed = true;
        }
    }

    /// The tombstone's horizon passed: the key may be new again.
    pub fn pass_horizon(&mut self) {
        if let Some(tombstone) = &mut self.tombstone {
            tombstone.horizon_passed = true;
        }
    }

    /// A purge: a completed record past its retention becomes a tombstone, a released one goes, and a
    /// tombstone past its horizon goes. In-progress records (a live lease outlives any retention; a lease
    /// that ran out awaits its rule) and indeterminate ones (they await their resolution) stay.
    pub fn purge(&mut self) {
        if self.tombstone.as_ref().is_some_and(|tombstone| tombstone.horizon_passed) {
            self.tombstone = None;
        }
        let purgeable = self.record.as_ref().is_some_and(|record| {
            record.retention_passed && matches!(record.phase, Phase::Completed(_) | Phase::Released)
        });
        if !purgeable {
            return;
        }
        if let Some(record) = self.record.take()
            && matches!(record.phase, Phase::Completed(_))
        {
            self.tombstone = Some(Tombstone { payload: record.payload, fence: record.fence, horizon_passed: false });
        }
    }

    /// A recovery of stale leases: the rule stored with the record decides.
    pub fn recover_stale(&mut self) {
        if let Some(record) = &mut self.record
            && record.phase == (Phase::InProgress { live: false })
        {
            record.phase = match record.rule {
                Rule::TakeOver => Phase::Released,
                Rule::MarkIndeterminate => Phase::Indeterminate,
            };
        }
    }

    /// Compares what Postgres holds after a step with the model. The calls of the step that failed
    /// closed landed or not, in the order they were made: some choice of them must explain what
    /// Postgres holds, and the model follows the first that does (none landed, first). Returns the
    /// calls that landed, each with the fence it acquired under, if it acquired the key.
    pub fn observe(&mut self, seen: &Seen) -> Result<Vec<(Pending, Option<i64>)>, String> {
        let pending = std::mem::take(&mut self.pending);
        let mut refusals = Vec::new();
        for chosen in 0..1u32 << pending.len() {
            let skips_a_run =
                |(index, call): (usize, &Pending)| matches!(call, Pending::Run(..)) && chosen & (1 << index) == 0;
            if pending.iter().enumerate().any(skips_a_run) {
                continue;
            }
            let mut model = self.clone();
            let landed: Result<Vec<_>, String> = (pending.iter().enumerate())
                .filter(|(index, _)| chosen & (1 << index) != 0)
                .map(|(_, call)| model.land(call, seen).map(|fence| (call.clone(), fence)))
                .collect();
            match landed.and_then(|landed| model.agree_with(seen).map(|()| landed)) {
                Ok(landed) => {
                    *self = model;
                    return Ok(landed);
                }
                Err(refusal) => refusals.push(refusal),
            }
        }
        Err(refusals.swap_remove(0))
    }

    /// Follows a call that failed closed as if it had landed; `Err` if it cannot have, given what
    /// Postgres holds. A begin that acquired returns its fence.
    fn land(&mut self, pending: &Pending, seen: &Seen) -> Result<Option<i64>, String> {
        match pending {
            Pending::Begin(call) => {
                let allowed = self.allowed(*call);
                let new_fence = match seen {
                    Seen::Record(record) if record.stage == Stage::InProgress => {
                        Some(record.fence).filter(|fence| self.highest_fence.is_none_or(|highest| *fence > highest))
                    }
                    _ => None,
                };
                if let Some(fence) = new_fence.filter(|_| allowed.permits(Kind::Acquired, self.quota_full)) {
                    self.acquired(*call, fence)?;
                    return Ok(Some(fence));
                }
                if allowed.permits(Kind::Indeterminate, self.quota_full) {
                    return self.begin(*call, &Answer::Indeterminate).map(|()| None);
                }
                Err(format!("{call} failed closed, and nothing it may have done explains what Postgres holds"))
            }
            Pending::Write { fence, write } => self.write(*fence, write, Outcome::Done).map(|()| None),
            Pending::Purge => {
                self.purge();
                Ok(None)
            }
            Pending::RecoverStale => {
                self.recover_stale();
                Ok(None)
            }
            Pending::Resolve(settle, sealing) => self.resolve(settle, *sealing, true).map(|()| None),
            Pending::Run(call, settle) => {
                let Seen::Record(record) = seen else {
                    return Err(format!("{call} ran its work and committed, but Postgres holds {seen:?}"));
                };
                let allowed = self.allowed(*call);
                if !allowed.permits(Kind::Acquired, self.quota_full) {
                    return Err(allowed.refusal(
                        format!("{call} (its work ran and committed)"),
                        Kind::Acquired,
                        self.quota_full,
                    ));
                }
                self.acquired(*call, record.fence)?;
                self.write(record.fence, settle, Outcome::Done)?;
                Ok(Some(record.fence))
            }
        }
    }

    fn agree_with(&mut self, seen: &Seen) -> Verdict {
        let Some(record) = &mut self.record else {
            return self.agree_without_record(seen);
        };
        match seen {
            Seen::Record(seen) => record.agree(seen),
            _ => Err(format!("Postgres holds {seen:?}, but the model holds the record {record:?}")),
        }
    }

    fn agree_without_record(&self, seen: &Seen) -> Verdict {
        // Postgres shows a tombstone only within its horizon.
        let standing = self.tombstone.as_ref().filter(|tombstone| !tombstone.horizon_passed);
        match (standing, seen) {
            (_, Seen::Record(_)) => Err(format!("Postgres holds {seen:?}, but the model holds no record")),
            (None, Seen::Nothing) => Ok(()),
            (Some(tombstone), Seen::Tombstone { payload, fence })
                if *payload == Some(tombstone.payload) && *fence == tombstone.fence =>
            {
                Ok(())
            }
            (Some(tombstone), _) => Err(format!(
                "Postgres holds {seen:?}, but the model holds the tombstone {tombstone:?}: a purged completion \
                 leaves a tombstone with its payload and last fence until its horizon (invariant 6)"
            )),
            (None, _) => Err(format!("Postgres holds {seen:?}, but the model holds nothing for the key")),
        }
    }

    /// The answers `call` may get now.
    fn allowed(&self, call: Call) -> Allowed {
        use Kind::{Acquired, Completed, Expired, InFlight, Indeterminate, Mismatch, Unreadable};
        let payload = call.payload;
        let Some(record) = &self.record else {
            return self.allowed_without_record(payload);
        };
        if record.payload != payload {
            let spent = match record.phase {
                Phase::Released => true,
                Phase::InProgress { live: false } => record.rule == Rule::TakeOver,
                _ => false,
            };
            return if record.retention_passed && spent {
                answers(&[Mismatch, Acquired], "the key's record, of another payload, expired without a result")
            } else {
                answers(&[Mismatch], "the key belongs to another payload (invariant 2)")
            };
        }
        match (&record.phase, record.rule) {
            (Phase::Completed(_), _) if record.retention_passed => answers(
                &[Expired],
                "the key completed and its retention passed: the request never runs again (invariant 6)",
            ),
            (Phase::Completed(_), _) if record.sealing != call.sealing => answers(
                &[Unreadable],
                "the key completed, and its response is stored in a form this store cannot open: neither \
                 ciphertext nor clear bytes are handed out as the response (invariant 9)",
            ),
            (Phase::Completed(_), _) => {
                answers(&[Completed], "the key completed: its response is replayed, never \"in flight\" (invariant 5)")
            }
            (Phase::Released, _) => answers(&[Acquired], "the key was released: the next request executes"),
            (Phase::Indeterminate, _) => {
                answers(&[Indeterminate], "the key is indeterminate: nothing runs until it is resolved (invariant 7)")
            }
            (Phase::InProgress { live: true }, _) => answers(
                &[InFlight],
                "a live lease holds the key, retention or not: nobody else acquires it (invariant 1)",
            ),
            (Phase::InProgress { live: false }, Rule::TakeOver) => answers(
                &[Acquired],
                "the lease ran out under the record's TakeOver rule: the next request takes over, and \"in \
                 flight\" needs a live lease (invariant 8)",
            ),
            (Phase::InProgress { live: false }, Rule::MarkIndeterminate) => answers(
                &[Indeterminate],
                "the lease ran out under the record's MarkIndeterminate rule, whatever the caller's rule: the \
                 record turns indeterminate and nobody acquires it (invariant 7)",
            ),
        }
    }

    fn allowed_without_record(&self, payload: Payload) -> Allowed {
        use Kind::{Acquired, Expired, Mismatch};
        match &self.tombstone {
            None => answers(&[Acquired], "the key is new"),
            Some(tombstone) if tombstone.horizon_passed && tombstone.payload == payload => {
                answers(&[Acquired, Expired], HORIZON_PASSED)
            }
            Some(tombstone) if tombstone.horizon_passed => answers(&[Acquired, Mismatch], HORIZON_PASSED),
            Some(tombstone) if tombstone.payload == payload => answers(
                &[Expired],
                "the response was purged after its retention and the tombstone stands: the request never runs \
                 again (invariant 6)",
            ),
            Some(_) => answers(&[Mismatch], "the tombstone of another payload stands (invariant 6)"),
        }
    }

    fn acquired(&mut self, call: Call, fence: i64) -> Verdict {
        if let Some(highest) = self.highest_fence
            && fence <= highest
        {
            return Err(format!(
                "{call} acquired under fence {fence}, but fence {highest} was given before: fences only increase \
                 over a key's whole life, purges included (invariant 3)"
            ));
        }
        self.highest_fence = Some(fence);
        let rule = self.record.as_ref().map_or(call.rule, |record| record.rule);
        let phase = Phase::InProgress { live: true };
        let sealing = call.sealing;
        self.record = Some(Record { payload: call.payload, fence, rule, phase, retention_passed: false, sealing });
        // A tombstone past its horizon belongs to an earlier life of the key, which this owner ended.
        self.tombstone = None;
        Ok(())
    }

    fn replayed_body(&self, body: &str) -> Verdict {
        match self.record.as_ref().map(|record| &record.phase) {
            Some(Phase::Completed(stored)) if stored.contains(body) => Ok(()),
            stored => Err(format!(
                "the layer replayed the body {body:?}, but the key's one completion stored {stored:?} (invariant 2)"
            )),
        }
    }

    fn replayed(&self, response: &str) -> Verdict {
        match self.record.as_ref().map(|record| &record.phase) {
            Some(Phase::Completed(stored)) if stored == response => Ok(()),
            stored => {
                Err(format!("replayed {response:?}, but the key's one completion stored {stored:?} (invariant 2)"))
            }
        }
    }
}

impl Record {
    /// Compares what Postgres holds with the record. When a record's retention restarts outside a
    /// completion (a claim, an extension past it) is the store's choice: the model follows it.
    fn agree(&mut self, seen: &SeenRecord) -> Verdict {
        let disagree = |what: &str| Err(format!("Postgres holds {seen:?}, but the model holds {self:?}: {what}"));
        if (seen.stage, seen.payload, seen.fence) != (self.phase.stage(), Some(self.payload), self.fence) {
            return disagree("state, payload or fence differ");
        }
        if seen.rule != Some(self.rule) {
            return disagree("the rule a record was first claimed under stays with it");
        }
        match &self.phase {
            Phase::InProgress { live } if *live != seen.lease_live => disagree("the lease differs"),
            Phase::Completed(response) if seen.response.as_ref() != Some(response) => {
                disagree("the stored response is not the one completion's (invariant 2)")
            }
            Phase::Completed(_) if seen.sealing != Some(self.sealing) => {
                disagree("a response is stored as the store that wrote it writes: sealed, or in clear")
            }
            Phase::Completed(_) if seen.retention_passed != self.retention_passed => {
                disagree("a completion keeps its response for the whole retention")
            }
            Phase::Completed(_) => Ok(()),
            Phase::InProgress { .. } | Phase::Released | Phase::Indeterminate => {
                self.retention_passed = seen.retention_passed;
                Ok(())
            }
        }
    }
}

/// Every order of `n` things, the identity first.
fn orders(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut all = Vec::new();
    for shorter in orders(n - 1) {
        for at in (0..n).rev() {
            let mut order = shorter.clone();
            order.insert(at, n - 1);
            all.push(order);
        }
    }
    all
}
