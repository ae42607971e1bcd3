//! The real side of the model test: the servers of one test, and each case run on them. Every step goes
//! to the store, its answer to the reference model, and after every step what Postgres holds is
//! compared with the model.
//!
//! Time moves only in steps, in the servers' data (the harness's `pass_lease`, `pass_retention` and
//! `pass_tombstone_horizon`): server time stays the only clock and no case waits for a lease. The stores'
//! leases and retentions are long enough that nothing runs out by itself during a case.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemstore::{
    Begin, Fingerprint, FingerprintOptions, IdempotencyKey, LeaseExpiry, Mode, Owner, Policy, Record, Resolution,
    Scope, State, Store, StoreError,
};
use serde_json::json;

use super::history::{Effect, History, Span};
use super::reference::{Answer, Call, Model, Order, Outcome, Payload, Rule, Seen, SeenRecord, Settle, Stage, Write};
use super::steps::{CLIENTS, Step};
use crate::support::{self, Harness, Servers};

const LEASE: Duration = Duration::from_secs(60);
const REDIS_TTL: Duration = Duration::from_secs(600);
const RETENTION: Duration = Duration::from_secs(3600);
/// A paused Redis costs a call this much before it degrades to Postgres, and is then skipped for the
/// cool-down: short, so that pauses keep cases fast.
const REDIS_BUDGET: Duration = Duration::from_millis(100);
const REDIS_COOLDOWN: Duration = Duration::from_millis(20);
/// Longer than the budget, so that the calls of the step during the pause degrade.
const REDIS_PAUSE_MS: u64 = 250;
/// After a pause ends, the commands Redis queued meanwhile run and the stores' cool-down ends; the next
/// step waits for both.
const AFTER_PAUSE: Duration = Duration::from_millis(50);
/// Purges and recoveries meet only the current case's key (each case removes its records at its end).
const BATCH: u32 = 100;

const FORGET_RECORDS: &str = "DELETE FROM idempotency_records WHERE tenant = $1";
const FORGET_TOMBSTONE: &str = "DELETE FROM idempotency_tombstones WHERE digest = idempotency_key_digest($1, $2, $3)";

/// The servers of one test and the stores on them. Cases run one after another, each under a tenant of
/// its own, so that they are independent and a shrunk case replays cleanly.
pub struct World {
    harness: Harness,
    /// One store per lease rule, as two services with different policies for the same operation have.
    take_over: Store,
    mark_indeterminate: Store,
    fingerprints: [(Payload, Fingerprint); 2],
    /// Cases run so far, shrinking included: the next case's tenant.
    cases: AtomicU64,
    /// Steps run so far, and how many of them were Redis faults, for the campaign's report.
    steps: AtomicU64,
    faults: AtomicU64,
}

impl World {
    /// Starts servers this test owns (it flushes, pauses and restarts Redis).
    pub async fn start(mode: Mode) -> Self {
        let harness = Harness::with(mode, policy(LeaseExpiry::TakeOver), Servers::Owned).await;
        let fingerprints = [Payload::A, Payload::B].map(|payload| {
            let body = json!({ "payload": format!("{payload:?}") });
            (payload, Fingerprint::of_serialize(&body, &FingerprintOptions::default()).expect("fingerprint"))
        });
        Self {
            take_over: store(&harness, LeaseExpiry::TakeOver),
            mark_indeterminate: store(&harness, LeaseExpiry::MarkIndeterminate),
            harness,
            fingerprints,
            cases: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            faults: AtomicU64::new(0),
        }
    }

    /// Cases, steps and Redis faults run so far.
    pub fn counts(&self) -> (u64, u64, u64) {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        (load(&self.cases), load(&self.steps), load(&self.faults))
    }

    pub fn mode(&self) -> Mode {
        self.harness.mode
    }

    /// Runs one case; `Err` says what the store did that the model does not allow, with the history.
    pub async fn run_case(&self, steps: &[Step]) -> Result<(), String> {
        let faults =
            steps.iter().filter(|step| matches!(step, Step::RedisFlush | Step::RedisRestart | Step::RedisPause));
        self.faults.fetch_add(faults.count() as u64, Ordering::Relaxed);
        self.steps.fetch_add(steps.len() as u64, Ordering::Relaxed);
        let mut case = Case::new(self, self.cases.fetch_add(1, Ordering::Relaxed));
        let verdict = case.run(steps).await;
        case.settle().await;
        case.forget().await;
        verdict
    }

    fn store(&self, rule: Rule) -> &Store {
        match rule {
            Rule::TakeOver => &self.take_over,
            Rule::MarkIndeterminate => &self.mark_indeterminate,
        }
    }

    fn fingerprint(&self, payload: Payload) -> &Fingerprint {
        let (_, fingerprint) = self.fingerprints.iter().find(|(p, _)| *p == payload).expect("both payloads");
        fingerprint
    }

    /// The payload of a stored fingerprint (a tombstone keeps a prefix of it).
    fn payload_of(&self, stored: &[u8]) -> Option<Payload> {
        let known = self.fingerprints.iter().find(|(_, f)| !stored.is_empty() && f.as_bytes().starts_with(stored));
        known.map(|(payload, _)| *payload)
    }

    fn seen(&self, record: Record) -> Result<Seen, String> {
        let payload = self.payload_of(&record.fingerprint);
        let stage = match record.state {
            State::Expired => return Ok(Seen::Tombstone { payload, fence: record.fence }),
            State::InProgress => Stage::InProgress,
            State::Completed => Stage::Completed,
            State::Released => Stage::Released,
            State::Indeterminate => Stage::Indeterminate,
            other => return Err(format!("Postgres holds a state the model does not know: {other:?}")),
        };
        Ok(Seen::Record(SeenRecord {
            stage,
            payload,
            fence: record.fence,
            rule: record.lease_expiry.map(rule_of),
            lease_live: record.lease_remaining.is_some_and(|left| !left.is_zero()),
            retention_passed: record.expires_in == Some(Duration::ZERO),
            response: record.response.map(|response| text(response.as_bytes())),
        }))
    }
}

fn policy(expiry: LeaseExpiry) -> Policy {
    let builder = Policy::builder().lease(LEASE).redis_ttl(REDIS_TTL).retention(Some(RETENTION));
    builder.lease_expiry(expiry).build().expect("a valid policy")
}

/// A store on the harness's servers and Redis prefix, with a short Redis budget and cool-down.
fn store(h: &Harness, expiry: LeaseExpiry) -> Store {
    let mut builder = Store::builder()
        .database_url(&h.store_url)
        .key_prefix(&h.prefix)
        .redis_budget(REDIS_BUDGET)
        .redis_cooldown(REDIS_COOLDOWN)
        .postgres_timeout(Duration::from_secs(2))
        .policy(&h.operation, policy(expiry));
    if let Some(url) = &h.redis_url {
        builder = builder.redis_url(url);
    }
    support::sealed(builder).build().expect("build a store")
}

fn rule_of(expiry: LeaseExpiry) -> Rule {
    if expiry == LeaseExpiry::MarkIndeterminate { Rule::MarkIndeterminate } else { Rule::TakeOver }
}

/// Responses are UTF-8 by construction; text makes histories readable.
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A begin that returned, and what it returned.
struct Begun {
    client: usize,
    call: Call,
    span: Span,
    read: Result<(Answer, Option<Owner>), String>,
}

fn read(begun: Result<Begin, StoreError>) -> Result<(Answer, Option<Owner>), String> {
    let answer = match begun {
        Ok(Begin::Acquired(owner)) => return Ok((Answer::Acquired { fence: owner.fence() }, Some(owner))),
        Ok(Begin::InFlight { .. }) => Answer::InFlight,
        Ok(Begin::Completed(response)) => Answer::Completed(text(response.as_bytes())),
        Ok(Begin::Mismatch) => Answer::Mismatch,
        Ok(Begin::Indeterminate) => Answer::Indeterminate,
        Ok(Begin::Expired) => Answer::Expired,
        Ok(other) => return Err(format!("an answer the model does not know: {other:?}")),
        Err(error) => return Err(format!("begin failed, although Postgres is up: {error:?}")),
    };
    Ok((answer, None))
}

/// One case: a key under a tenant of its own, the clients' leases, the model, and the history.
struct Case<'w> {
    world: &'w World,
    tenant: String,
    scope: Scope,
    key: IdempotencyKey,
    model: Model,
    /// The owner each client is, with the payload it acquired the key for.
    leases: [Option<(Owner, Payload)>; CLIENTS],
    history: History,
    /// Whether Postgres held anything for the key (a record or a standing tombstone) after the last step.
    key_held: bool,
    /// When the current Redis pause ends.
    paused_until: Option<Instant>,
}

impl<'w> Case<'w> {
    fn new(world: &'w World, number: u64) -> Self {
        let tenant = format!("m{number}");
        Self {
            world,
            scope: world.harness.scope(&tenant),
            tenant,
            key: support::key("k"),
            model: Model::default(),
            leases: Default::default(),
            history: History::start(),
            key_held: false,
            paused_until: None,
        }
    }

    async fn run(&mut self, steps: &[Step]) -> Result<(), String> {
        for (index, step) in steps.iter().enumerate() {
            self.step(index, *step).await.map_err(|violation| self.report(index, &violation))?;
            let seen = self.look().await.map_err(|violation| self.report(index, &violation))?;
            let agreed = self.model.observe(&seen).map_err(|violation| format!("after the step, {violation}"));
            agreed.map_err(|violation| self.report(index, &violation))?;
            // The step after a pause runs during it.
            if !matches!(step, Step::RedisPause) {
                self.settle().await;
            }
        }
        self.history.check().map_err(|violation| self.report(steps.len(), &format!("the history: {violation}")))
    }

    async fn step(&mut self, index: usize, step: Step) -> Result<(), String> {
        let world: &'w World = self.world;
        let h = &world.harness;
        match step {
            Step::Begin { client, call } => return self.begin(index, client, call).await,
            Step::BeginTogether { first, second } => return self.begin_together(index, first, second).await,
            Step::Complete { client } => return self.complete(index, client).await,
            Step::Release { client } => return self.fenced(index, client, Write::Release).await,
            Step::Extend { client } => return self.fenced(index, client, Write::Extend).await,
            Step::Purge => return self.purge(index).await,
            Step::RecoverStale => return self.recover_stale(index).await,
            Step::Resolve { completed } => return self.resolve(index, completed).await,
            Step::Drop { client } => {
                let dropped = self.abandon(client);
                self.history.note(index, format!("c{client} forgets its lease"), format!("{dropped:?}"));
            }
            Step::ExpireLease => {
                h.pass_lease(&self.scope, &self.key).await;
                self.model.expire_lease();
                self.history.note(index, "the lease runs out", "");
            }
            Step::PassRetention => {
                h.pass_retention(&self.scope, &self.key).await;
                self.model.pass_retention();
                self.history.note(index, "the retention passes", "");
            }
            Step::PassTombstoneHorizon => {
                h.pass_tombstone_horizon(&self.scope, &self.key).await;
                self.model.pass_horizon();
                self.history.note(index, "the tombstone's horizon passes", "");
            }
            Step::RedisFlush => self.flush_redis(index).await,
            Step::RedisRestart => self.restart_redis(index),
            Step::RedisPause => self.pause_redis(index).await,
        }
        Ok(())
    }

    async fn begin(&mut self, index: usize, client: usize, call: Call) -> Result<(), String> {
        let begun = self.send_begin(client, call).await;
        let verdict = match &begun.read {
            Ok((answer, _)) => self.model.begin(call, answer),
            Err(error) => Err(error.clone()),
        };
        self.log(index, &begun);
        verdict?;
        self.keep(begun);
        Ok(())
    }

    async fn begin_together(
        &mut self,
        index: usize,
        first: (usize, Call),
        second: (usize, Call),
    ) -> Result<(), String> {
        let (a, b) = tokio::join!(self.send_begin(first.0, first.1), self.send_begin(second.0, second.1));
        let verdict = match (&a.read, &b.read) {
            (Ok((x, _)), Ok((y, _))) => {
                let redis_in_front = self.world.mode() == Mode::TwoTier;
                self.model.begin_together((a.call, x), (b.call, y), redis_in_front)
            }
            (Err(error), _) | (_, Err(error)) => Err(error.clone()),
        };
        // In the order the model found, which is the order the history's checks must read them in.
        let in_effect = if matches!(verdict, Ok(Order::Reversed)) { [&b, &a] } else { [&a, &b] };
        for begun in in_effect {
            self.log(index, begun);
        }
        verdict?;
        self.keep(a);
        self.keep(b);
        Ok(())
    }

    async fn send_begin(&self, client: usize, call: Call) -> Begun {
        let store = self.world.store(call.rule);
        let begin = store.begin(&self.scope, &self.key, self.world.fingerprint(call.payload));
        let (begun, span) = self.history.timed(begin).await;
        Begun { client, call, span, read: read(begun) }
    }

    fn log(&mut self, index: usize, begun: &Begun) {
        let (answer, effect) = match &begun.read {
            Ok((answer, _)) => {
                let effect = match answer {
                    Answer::Acquired { .. } if !self.key_held => Effect::NewLife,
                    Answer::Completed(response) => Effect::Replay(response.clone()),
                    Answer::Expired => Effect::Expired,
                    _ => Effect::None,
                };
                (format!("{answer:?}"), effect)
            }
            Err(error) => (error.clone(), Effect::None),
        };
        self.history.record(index, begun.span, format!("c{} {}", begun.client, begun.call), answer, effect);
    }

    /// The client forgets its owner, as a crashed process would: the lease is left to run out.
    fn abandon(&mut self, client: usize) -> Option<i64> {
        self.leases[client].take().map(|(owner, _)| {
            let fence = owner.fence();
            owner.abandon();
            fence
        })
    }

    fn keep(&mut self, begun: Begun) {
        if let Ok((_, Some(owner))) = begun.read {
            self.abandon(begun.client);
            self.leases[begun.client] = Some((owner, begun.call.payload));
        }
    }

    /// Completes with a response that names who stored it, so that every completion's bytes differ.
    async fn complete(&mut self, index: usize, client: usize) -> Result<(), String> {
        let response = match &self.leases[client] {
            Some((lease, payload)) => format!("{payload:?}:c{client}:f{}:s{index}", lease.fence()),
            None => String::new(),
        };
        self.fenced(index, client, Write::Complete(response)).await
    }

    async fn fenced(&mut self, index: usize, client: usize, write: Write) -> Result<(), String> {
        // Completing or releasing spends the owner (a second try is not expressible); extending keeps it.
        let owner = match write {
            Write::Extend => None,
            _ => self.leases[client].take().map(|(owner, _)| owner),
        };
        let Some(fence) = owner.as_ref().or(self.leases[client].as_ref().map(|(owner, _)| owner)).map(Owner::fence)
        else {
            self.history.note(index, format!("c{client} {write}"), "holds no lease: nothing sent");
            return Ok(());
        };
        let (written, span) = self
            .history
            .timed(async {
                match (&write, owner) {
                    (Write::Complete(response), Some(owner)) => owner.complete(response.as_bytes()).await,
                    (Write::Release, Some(owner)) => owner.release().await,
                    _ => self.leases[client].as_ref().map(|(owner, _)| owner).expect("held").extend().await,
                }
            })
            .await;
        let outcome = match written {
            Ok(()) => Ok(Outcome::Done),
            Err(StoreError::LeaseLost { .. }) => Ok(Outcome::LeaseLost),
            Err(error) => Err(format!("{write} failed, although Postgres is up: {error:?}")),
        };
        let (answer, effect) = match (&outcome, &write) {
            (Ok(Outcome::Done), Write::Complete(response)) => ("Done".to_owned(), Effect::Completion(response.clone())),
            (Ok(outcome), _) => (format!("{outcome:?}"), Effect::None),
            (Err(error), _) => (error.clone(), Effect::None),
        };
        let call = format!("c{client} {write} (fence {fence})");
        self.history.record(index, span, call, answer, effect);
        self.model.write(fence, &write, outcome?)
    }

    async fn purge(&mut self, index: usize) -> Result<(), String> {
        let (purged, span) = self.history.timed(self.world.take_over.purge_expired(BATCH)).await;
        let purged = purged.map_err(|error| format!("purge failed: {error:?}"))?;
        self.history.record(index, span, "purge", format!("{purged} purged"), Effect::None);
        self.model.purge();
        Ok(())
    }

    async fn recover_stale(&mut self, index: usize) -> Result<(), String> {
        let (recovered, span) = self.history.timed(self.world.take_over.recover_stale(BATCH)).await;
        let recovered = recovered.map_err(|error| format!("recover_stale failed: {error:?}"))?;
        self.history.record(index, span, "recover stale leases", format!("{recovered:?}"), Effect::None);
        self.model.recover_stale();
        Ok(())
    }

    async fn resolve(&mut self, index: usize, completed: bool) -> Result<(), String> {
        let (settle, resolution) = if completed {
            let response = format!("resolved:s{index}");
            (Settle::Completed(response.clone()), Resolution::Completed(response.into_bytes()))
        } else {
            (Settle::Released, Resolution::Released)
        };
        let resolve = self.world.take_over.resolve(&self.scope, &self.key, resolution);
        let (resolved, span) = self.history.timed(resolve).await;
        let resolved = resolved.map_err(|error| format!("resolve failed: {error:?}"))?;
        let effect = match &settle {
            Settle::Completed(response) if resolved => Effect::Completion(response.clone()),
            _ => Effect::None,
        };
        self.history.record(index, span, format!("resolve {settle:?}"), resolved.to_string(), effect);
        self.model.resolve(&settle, resolved)
    }

    async fn flush_redis(&mut self, index: usize) {
        if self.world.harness.redis.is_some() {
            let mut conn = self.world.harness.redis_connection().await;
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
        }
        self.history.note(index, "Redis loses every key", "");
    }

    /// A real restart: the stores' connections break and Redis forgets its scripts.
    fn restart_redis(&mut self, index: usize) {
        if let Some(redis) = &self.world.harness.redis {
            redis.restart().expect("restart Redis");
            self.paused_until = None;
        }
        self.history.note(index, "Redis restarts empty", "");
    }

    async fn pause_redis(&mut self, index: usize) {
        if self.world.harness.redis.is_some() {
            let mut conn = self.world.harness.redis_connection().await;
            let _: () = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(REDIS_PAUSE_MS)
                .arg("ALL")
                .query_async(&mut conn)
                .await
                .expect("CLIENT PAUSE");
            let until = Instant::now() + Duration::from_millis(REDIS_PAUSE_MS);
            self.paused_until = Some(self.paused_until.map_or(until, |earlier| earlier.max(until)));
        }
        self.history.note(index, format!("Redis pauses for {REDIS_PAUSE_MS} ms"), "");
    }

    /// Waits for a Redis pause to end and for what it queued to run.
    async fn settle(&mut self) {
        if let Some(until) = self.paused_until.take() {
            tokio::time::sleep_until((until + AFTER_PAUSE).into()).await;
        }
    }

    /// What Postgres holds for the key, as it is stored (not as `lookup` presents a record past its
    /// retention).
    async fn look(&mut self) -> Result<Seen, String> {
        let found = self.world.take_over.inspect(&self.scope, &self.key).await;
        let found = found.map_err(|error| format!("inspect failed: {error:?}"))?.postgres;
        let seen = match found {
            Some(record) => self.world.seen(record)?,
            None => Seen::Nothing,
        };
        self.key_held = seen != Seen::Nothing;
        Ok(seen)
    }

    /// Removes what the case left in both tiers, so that later cases' purges and recoveries meet only
    /// their own key.
    async fn forget(&mut self) {
        for client in 0..CLIENTS {
            self.abandon(client);
        }
        let h = &self.world.harness;
        let records = sqlx::query(FORGET_RECORDS).bind(&self.tenant).execute(&h.pool);
        records.await.expect("delete the case's records");
        let tombstone = sqlx::query(FORGET_TOMBSTONE).bind(&self.tenant).bind(&h.operation).bind(self.key.as_str());
        tombstone.execute(&h.pool).await.expect("delete the case's tombstone");
        if h.redis.is_some() {
            let mut conn = h.redis_connection().await;
            let record_key = h.redis_key(&self.scope, &self.key);
            let _: i64 = redis::cmd("DEL").arg(record_key).query_async(&mut conn).await.expect("delete its Redis copy");
        }
    }

    fn report(&self, step: usize, violation: &str) -> String {
        format!(
            "{mode:?}, case {tenant}, step {step}: {violation}\n\nhistory (step, ms into the case, call -> answer):\n\
             {history}model after the last step it accepted: {model:?}",
            mode = self.world.mode(),
            tenant = self.tenant,
            history = self.history,
            model = self.model,
        )
    }
}
