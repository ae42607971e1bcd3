//! One `wrk` run over loopback with `benches/http/wrk.lua`: the load generator in a process of its own,
//! shared by the HTTP benchmark and the peers comparison (peers/).

use std::net::SocketAddr;
use std::process::Command;

/// The script, compiled in so that every crate that includes this file finds it.
const SCRIPT: &str = include_str!("../http/wrk.lua");

/// What a run sends.
pub struct Load<'a> {
    /// The route every request POSTs to.
    pub path: &'a str,
    pub keys: Keys,
    /// The keys' prefix: one per run, so that runs never share keys.
    pub prefix: &'a str,
    /// The status every answer should have; others are counted as unexpected.
    pub expect: u16,
    /// A `Cookie` header for every request (a session).
    pub cookie: Option<&'a str>,
}

/// The `Idempotency-Key` of each request.
#[derive(Clone, Copy, Debug)]
pub enum Keys {
    /// No key header.
    None,
    /// A fresh key per request.
    Unique,
    /// Cycling through this many keys.
    Cycle(usize),
}

/// What the script prints at the end of a run.
#[derive(Debug, serde::Deserialize)]
pub struct Summary {
    pub requests: u64,
    pub duration_us: u64,
    pub unexpected: u64,
    pub socket_errors: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
}

impl Summary {
    /// Requests per second.
    pub fn throughput(&self) -> f64 {
        self.requests as f64 / (self.duration_us as f64 / 1e6)
    }
}

/// Runs wrk with two threads and `concurrency` connections for `seconds` against `address`. Blocks.
pub fn run(address: SocketAddr, load: &Load, concurrency: usize, seconds: u32) -> Result<Summary, String> {
    let script = std::env::temp_dir().join(format!("idemstore-wrk-{}.lua", std::process::id()));
    std::fs::write(&script, SCRIPT).map_err(|error| format!("writing the wrk script: {error}"))?;
    let keys = match load.keys {
        Keys::None => "none".to_owned(),
        Keys::Unique => "unique".to_owned(),
        Keys::Cycle(count) => count.to_string(),
    };
    let mut command = Command::new("wrk");
    command
        .args(["-t2", &format!("-c{concurrency}"), &format!("-d{seconds}s"), "-s"])
        .arg(&script)
        .arg(format!("http://{address}"))
        .env("HTTP_BENCH_PATH", load.path)
        .env("HTTP_BENCH_KEYS", keys)
        .env("HTTP_BENCH_PREFIX", load.prefix)
        .env("HTTP_BENCH_EXPECT", load.expect.to_string());
    match load.cookie {
        Some(cookie) => command.env("HTTP_BENCH_COOKIE", cookie),
        None => command.env_remove("HTTP_BENCH_COOKIE"),
    };
    let output = command.output().map_err(|error| format!("running wrk (apt install wrk): {error}"));
    let _ = std::fs::remove_file(&script);
    let output = output?;
    if !output.status.success() {
        return Err(format!("wrk failed: {}", String::from_utf8_lossy(&output.stderr)));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|error| format!("wrk printed {stdout:?}: {error}"))
}
