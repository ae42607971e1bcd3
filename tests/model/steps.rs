//! The operations a case is made of, and the strategy that draws them. proptest shrinks a failing
//! sequence by dropping steps and simplifying the rest; every step is valid on its own (a write by a
//! client that holds no lease does nothing), so any shrunk sequence is a valid case.

use idemstore::Mode;
use proptest::prelude::*;

use super::reference::{Call, Payload, Rule, Sealing};

/// How many clients share each key.
pub const CLIENTS: usize = 3;

/// How many keys a case has, under one tenant and operation.
pub const KEYS: usize = 2;

/// A case: its steps, each naming the key it is about (a fault, a purge and a recovery meet every key),
/// and whether the operation has a live-key quota of one (the keys then compete for it).
#[derive(Clone, Debug)]
pub struct Script {
    pub quota: bool,
    pub steps: Vec<(usize, Step)>,
}

/// One step of a case: a call to the store, time passing in the servers' data, or a fault of Redis or
/// of the stores' connections to Postgres.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// A client begins; a lease it already held stays held unless this begin acquires a new one.
    Begin {
        client: usize,
        call: Call,
    },
    /// Two different clients begin at the same time.
    BeginTogether {
        first: (usize, Call),
        second: (usize, Call),
    },
    /// Every client begins at the same time (client `i` with `calls[i]`).
    EveryoneBegins {
        calls: [Call; CLIENTS],
    },
    /// A client begins and waits for the key's owner (`wait_in_flight`), while the client that owns the
    /// record completes (or releases) it: the waiter is answered as a begin after the settlement.
    Wait {
        client: usize,
        call: Call,
        complete: bool,
    },
    /// A client runs a work through the run-once API: claim, work (which writes an effect row), and
    /// settlement in one call.
    Run {
        client: usize,
        call: Call,
        path: Path,
        work: Work,
    },
    /// A client sends the request through the HTTP layer, plain or with the handler's effect row in the
    /// claim's transaction. The handler answers 201 (`Replayable`), 400 (`Unencodable`: a client error,
    /// stored and replayed as a 201 is) or 500 (`Fails`: released, or rolled back).
    Http {
        client: usize,
        call: Call,
        path: Path,
        work: Work,
    },
    /// The client completes its lease with a response of its own.
    Complete {
        client: usize,
    },
    Release {
        client: usize,
    },
    Extend {
        client: usize,
    },
    /// The client forgets its lease, as an owner that crashed does; the record stays as it was.
    Drop {
        client: usize,
    },
    /// The live owner's lease runs out (it stopped extending).
    ExpireLease,
    /// The record's retention passes (for a live lease: its owner kept extending past it).
    PassRetention,
    /// The tombstone's horizon passes.
    PassTombstoneHorizon,
    Purge,
    RecoverStale,
    /// An operator settles the record as completed (with a response of its own) or released, with a
    /// store that seals or not.
    Resolve {
        completed: bool,
        sealing: Sealing,
    },
    /// Redis loses every key (two-tier only).
    RedisFlush,
    /// Redis restarts empty, scripts and connections gone (two-tier only).
    RedisRestart,
    /// Redis stops answering for longer than the stores' budget; the next step runs during the pause
    /// (two-tier only).
    RedisPause,
    /// The stores' connections to Postgres hold every byte for longer than the stores' Postgres timeout
    /// (a partition that heals); the next step runs during it. What was sent meanwhile arrives after.
    PostgresStall,
    /// Every connection of the stores to Postgres breaks at once (a restart, a failover), unseen until
    /// the next statement.
    PostgresCut,
}

impl Step {
    /// A fault of the servers, not a call or time passing.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            Step::RedisFlush | Step::RedisRestart | Step::RedisPause | Step::PostgresStall | Step::PostgresCut
        )
    }
}

/// Where a run's work writes its effect row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// `run_once`: on a connection of its own, committed before the result is stored.
    Plain,
    /// `run_once_in_tx`: in the claim's transaction, committed with the stored result.
    InTx,
}

/// How a run's work ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// With a result that is stored for replay.
    Replayable,
    /// With a result that cannot be serialized: stored as "completed, not replayable".
    Unencodable,
    /// With an error: the key is released.
    Fails,
}

/// Cases of 1 to `max_steps` steps; Redis faults only in two-tier mode, Postgres faults in both. One
/// case in four goes through the HTTP layer: a key is used through one interface (the layer's stored
/// form and fingerprints are its own), so those cases send no begins of the store's. One case of the
/// store's in three runs under a live-key quota.
pub fn scripts(mode: Mode, max_steps: usize) -> impl Strategy<Value = Script> {
    let keyed = |step: BoxedStrategy<Step>| proptest::collection::vec((key(), step), 1..=max_steps);
    let quota = prop_oneof![2 => Just(false), 1 => Just(true)];
    prop_oneof![
        3 => (quota, keyed(step(mode))).prop_map(|(quota, steps)| Script { quota, steps }),
        1 => keyed(http_step(mode)).prop_map(|steps| Script { quota: false, steps }),
    ]
}

/// Most steps go to the first key; shrinking moves them there.
fn key() -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(0), 1 => 1..KEYS]
}

/// A step of a case through the HTTP layer: requests, time passing, the operator's calls and faults.
fn http_step(mode: Mode) -> BoxedStrategy<Step> {
    let requests = (0..CLIENTS, call(), path(), work()).prop_map(|(client, call, path, work)| Step::Http {
        client,
        call,
        path,
        work,
    });
    let protocol = prop_oneof![
        10 => requests,
        9 => time_and_operator(),
    ];
    with_faults(mode, protocol.boxed())
}

/// Begins and completions dominate, so that most cases reach the interesting states (a completion, a
/// takeover, a tombstone) within a few steps.
fn step(mode: Mode) -> BoxedStrategy<Step> {
    let client = 0..CLIENTS;
    let protocol = prop_oneof![
        6 => (client.clone(), call()).prop_map(|(client, call)| Step::Begin { client, call }),
        2 => (client.clone(), 1..CLIENTS, call(), call()).prop_map(|(client, offset, first, second)| {
            Step::BeginTogether { first: (client, first), second: ((client + offset) % CLIENTS, second) }
        }),
        1 => [call(), call(), call()].prop_map(|calls| Step::EveryoneBegins { calls }),
        1 => (client.clone(), call(), any::<bool>())
            .prop_map(|(client, call, complete)| Step::Wait { client, call, complete }),
        3 => (client.clone(), call(), path(), work())
            .prop_map(|(client, call, path, work)| Step::Run { client, call, path, work }),
        4 => client.clone().prop_map(|client| Step::Complete { client }),
        1 => client.clone().prop_map(|client| Step::Release { client }),
        1 => client.clone().prop_map(|client| Step::Extend { client }),
        1 => client.prop_map(|client| Step::Drop { client }),
        9 => time_and_operator(),
    ];
    with_faults(mode, protocol.boxed())
}

/// Time passing in the servers' data and the operator's calls, in both kinds of case.
fn time_and_operator() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => Just(Step::ExpireLease),
        2 => Just(Step::PassRetention),
        1 => Just(Step::PassTombstoneHorizon),
        2 => Just(Step::Purge),
        1 => Just(Step::RecoverStale),
        1 => (any::<bool>(), sealing()).prop_map(|(completed, sealing)| Step::Resolve { completed, sealing }),
    ]
}

/// `protocol`, with the faults of `mode` among its steps.
fn with_faults(mode: Mode, protocol: BoxedStrategy<Step>) -> BoxedStrategy<Step> {
    let postgres_faults = prop_oneof![Just(Step::PostgresStall), Just(Step::PostgresCut)];
    if mode != Mode::TwoTier {
        return prop_oneof![24 => protocol, 1 => postgres_faults].boxed();
    }
    prop_oneof![
        24 => protocol,
        1 => Just(Step::RedisFlush),
        1 => Just(Step::RedisRestart),
        1 => Just(Step::RedisPause),
        1 => postgres_faults,
    ]
    .boxed()
}

fn call() -> impl Strategy<Value = Call> {
    let payload = prop_oneof![Just(Payload::A), Just(Payload::B)];
    let rule = prop_oneof![Just(Rule::TakeOver), Just(Rule::MarkIndeterminate)];
    (payload, rule, sealing()).prop_map(|(payload, rule, sealing)| Call { payload, rule, sealing })
}

/// Stores that seal are the common case; one call in four goes to a store without the key.
fn sealing() -> impl Strategy<Value = Sealing> {
    prop_oneof![3 => Just(Sealing::Sealed), 1 => Just(Sealing::Clear)]
}

fn path() -> impl Strategy<Value = Path> {
    prop_oneof![Just(Path::Plain), Just(Path::InTx)]
}

fn work() -> impl Strategy<Value = Work> {
    prop_oneof![3 => Just(Work::Replayable), 1 => Just(Work::Unencodable), 1 => Just(Work::Fails)]
}
