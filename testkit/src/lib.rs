//! Throwaway Redis and Postgres servers on free loopback ports, in temporary directories, for
//! idemstore's tests, examples and benchmarks. Each server is stopped when its handle is dropped, and
//! only servers started here are ever stopped. Fault tests use the handles to kill, pause and restart.
//!
//! Postgres refuses to run as root; as root, the servers run as the `postgres` system user. A missing
//! `redis-server` is installed from Debian's packages when running as root.

#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![warn(missing_debug_implementations, unreachable_pub)]

mod postgres_server;
mod proxy;
#[cfg(feature = "cluster")]
mod redis_cluster;
mod redis_server;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};

use tempfile::TempDir;

pub use postgres_server::PostgresServer;
pub use proxy::{Proxy, ProxyMode};
#[cfg(feature = "cluster")]
pub use redis_cluster::RedisCluster;
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

/// A fresh directory for a server's files, under [`scratch_root`].
fn scratch_dir(prefix: &str, step: &'static str) -> Result<TempDir, TestkitError> {
    tempfile::Builder::new().prefix(prefix).tempdir_in(scratch_root()).map_err(io(step))
}

/// Where servers keep their files: `IDEMSTORE_TESTKIT_DIR` when set, else `/dev/shm` when it is a
/// writable directory, else the system's temporary directory. The files are throwaway, and memory is
/// where they cost least: on an ext4 disk mounted with `discard`, copying a Postgres cluster in and
/// deleting it took most of a second of system time per test, more than the test itself.
fn scratch_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("IDEMSTORE_TESTKIT_DIR") {
        return PathBuf::from(dir);
    }
    let shm = PathBuf::from("/dev/shm");
    let writable = tempfile::Builder::new().prefix(".idemstore-probe-").tempdir_in(&shm).is_ok();
    if writable { shm } else { std::env::temp_dir() }
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

/// Makes sure `program` runs, installing Debian's `package` when it is missing and this runs as root.
///
/// # Errors
/// [`TestkitError::Missing`] when it is missing and cannot be installed here; [`TestkitError::Failed`]
/// when apt-get fails.
pub fn ensure_installed(program: &'static str, package: &'static str) -> Result<(), TestkitError> {
    if Command::new(program).arg("--version").output().is_ok() {
        return Ok(());
    }
    if !is_root() || !std::path::Path::new("/usr/bin/apt-get").exists() {
        return Err(TestkitError::Missing { program, hint: "install it with apt-get (Debian) as root" });
    }
    // Parallel test processes may all get here: dpkg's lock timeout makes them queue, not fail.
    let apt = |args: &[&str]| {
        let mut command = Command::new("apt-get");
        command.args(["-o", "DPkg::Lock::Timeout=600", "-q"]).args(args).env("DEBIAN_FRONTEND", "noninteractive");
        command
    };
    run("apt-get update", &mut apt(&["update"]))?;
    run("apt-get install", &mut apt(&["install", "-y", package]))?;
    Ok(())
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// Servers for demos: `DATABASE_URL` and `REDIS_URL` when set, else throwaway servers (announced on
/// stderr, so that a program's stdout stays its own: an MCP server's protocol) that stop when this is dropped. `IDEMSTORE_MODE=postgres-only` leaves Redis out;
/// `IDEMSTORE_REDIS_CLUSTER` (comma-separated seed URLs) uses a Redis Cluster instead of `REDIS_URL`.
#[derive(Debug)]
pub struct LocalServers {
    /// The Postgres URL to use.
    pub database_url: String,
    /// The Redis URL to use; `None` in Postgres-only mode or on a cluster.
    pub redis_url: Option<String>,
    /// The Redis Cluster's seed URLs, from `IDEMSTORE_REDIS_CLUSTER`.
    pub redis_cluster: Option<Vec<String>>,
    _postgres: Option<PostgresServer>,
    _redis: Option<RedisServer>,
}

impl LocalServers {
    /// Reads the environment and starts what it does not name.
    ///
    /// # Errors
    /// [`TestkitError`] if a throwaway server cannot be started.
    pub fn from_env() -> Result<Self, TestkitError> {
        let (postgres, database_url) = match std::env::var("DATABASE_URL") {
            Ok(url) => (None, url),
            Err(_) => {
                let server = PostgresServer::start()?;
                eprintln!("started a throwaway Postgres at {}", server.url());
                let url = server.url();
                (Some(server), url)
            }
        };
        let postgres_only = std::env::var("IDEMSTORE_MODE").is_ok_and(|mode| mode == "postgres-only");
        // Only where the store can use a cluster (feature `cluster`); an empty list names none.
        let redis_cluster: Option<Vec<String>> = std::env::var("IDEMSTORE_REDIS_CLUSTER")
            .ok()
            .filter(|_| !postgres_only && cfg!(feature = "cluster"))
            .map(|seeds| seeds.split(',').map(|seed| seed.trim().to_owned()).filter(|s| !s.is_empty()).collect())
            .filter(|seeds: &Vec<String>| !seeds.is_empty());
        let (redis, redis_url) = match std::env::var("REDIS_URL") {
            _ if postgres_only || redis_cluster.is_some() => (None, None),
            Ok(url) => (None, Some(url)),
            Err(_) => {
                let server = RedisServer::start()?;
                eprintln!("started a throwaway Redis at {}", server.url());
                let url = server.url();
                (Some(server), Some(url))
            }
        };
        Ok(Self { database_url, redis_url, redis_cluster, _postgres: postgres, _redis: redis })
    }

    /// A store builder connected to these servers (Postgres-only when there is no Redis).
    pub fn store_builder(&self) -> idemstore::StoreBuilder {
        let builder = idemstore::Store::builder().database_url(&self.database_url);
        #[cfg(feature = "cluster")]
        if let Some(seeds) = &self.redis_cluster {
            return builder.redis_cluster(seeds.clone());
        }
        match &self.redis_url {
            Some(url) => builder.redis_url(url),
            None => builder,
        }
    }
}
