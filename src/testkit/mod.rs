//! Throwaway Redis and Postgres servers on free loopback ports, in temporary directories, for tests,
//! examples and benchmarks (feature `testkit`). Each server is stopped when its handle is dropped, and
//! only servers started here are ever stopped. Fault tests use the handles to kill, pause and restart.
//!
//! Postgres refuses to run as root; as root, the servers run as the `postgres` system user. A missing
//! `redis-server` is installed from Debian's packages when running as root.

mod postgres_server;
mod redis_server;

use std::net::TcpListener;
use std::process::{Command, Output};

pub use postgres_server::PostgresServer;
pub use redis_server::RedisServer;

/// A throwaway server could not be started or controlled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestkitError {
    /// A program the server needs is not installed.
    #[error("{program} is not installed: {hint}")]
    Missing {
        /// The missing program.
        program: &'static str,
        /// How to install it.
        hint: &'static str,
    },
    /// A command could not be spawned or a file could not be created.
    #[error("{step} failed")]
    Io {
        /// What was being done.
        step: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed.
    #[error("{step} failed: {output}")]
    Failed {
        /// What was being done.
        step: &'static str,
        /// What the command printed.
        output: String,
    },
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> TestkitError {
    move |source| TestkitError::Io { step, source }
}

/// Runs `command`, turning a non-zero exit into [`TestkitError::Failed`] with what it printed.
fn run(step: &'static str, command: &mut Command) -> Result<Output, TestkitError> {
    let output = command.output().map_err(io(step))?;
    if output.status.success() {
        return Ok(output);
    }
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    Err(TestkitError::Failed { step, output: printed.trim().to_owned() })
}

/// A loopback port that was free a moment ago. Another process may take it first; callers retry.
fn free_port() -> Result<u16, TestkitError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io("finding a free port"))?;
    Ok(listener.local_addr().map_err(io("finding a free port"))?.port())
}

/// Runs `start` on a free port, trying up to five ports: another process may take a port between the
/// check and the server's bind.
fn on_free_port(mut start: impl FnMut(u16) -> Result<(), TestkitError>) -> Result<(), TestkitError> {
    let mut attempts = 1;
    loop {
        match start(free_port()?) {
            Err(_) if attempts < 5 => attempts += 1,
            result => return result,
        }
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}
