//! Model-based checking of the store. Random sequences of begins (up to three at once, or waiting for the
//! key's owner while it settles), runs of a work that writes an effect row (`run_once`,
//! `run_once_in_tx`, and requests through the HTTP layer, plain and transactional; results that
//! serialize, that do not, and errors), completions, releases, extensions, crashed owners, leases running
//! out, retentions and tombstone horizons passing, purges, recoveries, resolutions, (two-tier) Redis
//! flushes, restarts and pauses, and stalls and cuts of the stores' connections to Postgres run against
//! real Redis and Postgres, through stores that seal and stores without the key on one database, on two
//! keys per case, some cases under a live-key quota of one. Every answer is checked against a reference
//! model of its key (`model/reference.rs`), what Postgres holds (and Redis's copy) is compared with the
//! model after every step, and each case's history is checked as a whole at its end
//! (`model/history.rs`).
//!
//! Each test starts its servers once; each case uses a tenant of its own (`model/driver.rs`). Time moves
//! in the servers' data, so no case waits for a lease. proptest shrinks a failing sequence and the
//! failure names the seed that replays it:
//!
//! ```text
//! MODEL_SEED=<seed> MODEL_CASES=<cases> MODEL_STEPS=<steps> cargo nextest run -E 'test(/^model::/)'
//! ```
//!
//! `tests/model/run` runs a long campaign.

#[path = "model/driver.rs"]
mod driver;
#[path = "model/history.rs"]
mod history;
#[path = "model/reference.rs"]
mod reference;
#[path = "model/steps.rs"]
mod steps;

use std::fmt;
use std::str::FromStr;

use idemstore::Mode;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use tokio::runtime::Handle;

use driver::World;

suite!(every_answer_is_one_the_model_allows);

/// Random step sequences on two keys: every answer is one the reference model allows, Postgres holds
/// what the model holds after every step, and per life of the key at most one completion is stored and
/// every replay repeats it.
async fn every_answer_is_one_the_model_allows(mode: Mode) {
    let world = World::start(mode).await;
    let campaign = Campaign::from_env(mode);
    eprintln!("model check, {mode:?}: {campaign}");
    let runtime = Handle::current();
    // proptest runs cases one at a time, synchronously; each runs to its end on this test's runtime.
    let verdict = tokio::task::block_in_place(|| campaign.run(&world, &runtime));
    if let Err(report) = verdict {
        panic!("{report}");
    }
    let counts = world.counts();
    eprintln!(
        "model check, {mode:?}: {} cases, {} steps ({} HTTP requests, {} of them handled; {} claims refused by the \
         quota; {} waiters answered with the owner's result), {} faults, {} calls failed closed ({} of them \
         landed late), 0 violations",
        counts.cases,
        counts.steps,
        counts.requests,
        counts.handled,
        counts.refused_by_quota,
        counts.woken,
        counts.faults,
        counts.failed_closed,
        counts.landed_late
    );
}

/// How many cases of how many steps, drawn from which seed.
struct Campaign {
    seed: u64,
    cases: u32,
    max_steps: usize,
}

impl Campaign {
    /// `MODEL_CASES` (default 400 Postgres-only, 300 two-tier, whose Redis faults take longer: each
    /// mode about a minute and a half of CI), `MODEL_STEPS` (the most steps per case, default 20) and
    /// `MODEL_SEED` (default: a random one, printed).
    fn from_env(mode: Mode) -> Self {
        let cases = if mode == Mode::TwoTier { 300 } else { 400 };
        Self {
            seed: env("MODEL_SEED").unwrap_or_else(rand::random),
            cases: env("MODEL_CASES").unwrap_or(cases),
            max_steps: env("MODEL_STEPS").unwrap_or(20),
        }
    }

    fn run(&self, world: &World, runtime: &Handle) -> Result<(), String> {
        let config = Config {
            cases: self.cases,
            rng_seed: RngSeed::Fixed(self.seed),
            // A failure is replayed from its seed: the servers, not a file, hold a case's state.
            failure_persistence: None,
            // Each shrinking attempt runs a whole case against the servers.
            max_shrink_iters: 500,
            max_shrink_time: 180_000,
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        let scripts = steps::scripts(world.mode(), self.max_steps);
        let found =
            runner.run(&scripts, |script| runtime.block_on(world.run_case(&script)).map_err(TestCaseError::fail));
        match found {
            Ok(()) => Ok(()),
            Err(TestError::Fail(reason, script)) => Err(format!(
                "the store did what the model does not allow (replay: {self} cargo nextest run -E 'test(/^model::/)')\n\
                 shortest failing case found: {script:#?}\n\n{reason}"
            )),
            Err(TestError::Abort(reason)) => Err(format!("proptest gave up ({self}): {reason}")),
        }
    }
}

impl fmt::Display for Campaign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MODEL_SEED={} MODEL_CASES={} MODEL_STEPS={}", self.seed, self.cases, self.max_steps)
    }
}

fn env<T: FromStr>(name: &str) -> Option<T> {
    let value = std::env::var(name).ok()?;
    Some(value.parse().unwrap_or_else(|_| panic!("{name}={value} is not a number")))
}
