//! The operations a case is made of, and the strategy that draws them. proptest shrinks a failing
//! sequence by dropping steps and simplifying the rest; every step is valid on its own (a write by a
//! client that holds no lease does nothing), so any shrunk sequence is a valid case.

use idemstore::Mode;
use proptest::prelude::*;

use super::reference::{Call, Payload, Rule};

/// How many clients share the key.
pub const CLIENTS: usize = 3;

/// One step of a case: a call to the store, time passing in the servers' data, or a Redis fault.
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
    /// An operator settles the record as completed (with a response of its own) or released.
    Resolve {
        completed: bool,
    },
    /// Redis loses every key (two-tier only).
    RedisFlush,
    /// Redis restarts empty, scripts and connections gone (two-tier only).
    RedisRestart,
    /// Redis stops answering for longer than the stores' budget; the next step runs during the pause
    /// (two-tier only).
    RedisPause,
}

/// Sequences of 1 to `max_steps` steps; Redis faults only in two-tier mode.
pub fn sequences(mode: Mode, max_steps: usize) -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(step(mode), 1..=max_steps)
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
        4 => client.clone().prop_map(|client| Step::Complete { client }),
        1 => client.clone().prop_map(|client| Step::Release { client }),
        1 => client.clone().prop_map(|client| Step::Extend { client }),
        1 => client.prop_map(|client| Step::Drop { client }),
        2 => Just(Step::ExpireLease),
        2 => Just(Step::PassRetention),
        1 => Just(Step::PassTombstoneHorizon),
        2 => Just(Step::Purge),
        1 => Just(Step::RecoverStale),
        1 => any::<bool>().prop_map(|completed| Step::Resolve { completed }),
    ];
    if mode != Mode::TwoTier {
        return protocol.boxed();
    }
    prop_oneof![
        24 => protocol,
        1 => Just(Step::RedisFlush),
        1 => Just(Step::RedisRestart),
        1 => Just(Step::RedisPause),
    ]
    .boxed()
}

fn call() -> impl Strategy<Value = Call> {
    let payload = prop_oneof![Just(Payload::A), Just(Payload::B)];
    let rule = prop_oneof![Just(Rule::TakeOver), Just(Rule::MarkIndeterminate)];
    (payload, rule).prop_map(|(payload, rule)| Call { payload, rule })
}
