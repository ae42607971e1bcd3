//! A throwaway PostgreSQL cluster.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use tempfile::TempDir;

use super::{TestkitError, is_root, on_free_port, run, scratch_dir, scratch_root};

/// A PostgreSQL cluster in a temporary directory, listening on 127.0.0.1 only, with trust auth for the
/// `postgres` role. Stopped (immediate mode) and deleted on drop. Its controls take `&self`, so a fault
/// can be injected while a workload shares the handle.
#[derive(Debug)]
pub struct PostgresServer {
    dir: TempDir,
    port: u16,
    durable: bool,
    running: AtomicBool,
}

impl PostgresServer {
    /// Starts a cluster tuned for tests: fsync off, so a crash of the whole machine would lose data but
    /// a crash of the server process (`stop`, which is immediate) loses no committed transaction.
    ///
    /// # Errors
    /// [`TestkitError`] if `initdb` or `pg_ctl` is missing or fails.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with(false)
    }

    /// Starts a cluster with production durability (fsync and synchronous commit on), for benchmarks.
    ///
    /// # Errors
    /// As [`PostgresServer::start`].
    pub fn start_durable() -> Result<Self, TestkitError> {
        Self::start_with(true)
    }

    fn start_with(durable: bool) -> Result<Self, TestkitError> {
        let dir = scratch_dir("idemstore-pg-", "creating a Postgres directory")?;
        let mut server = Self { dir, port: 0, durable, running: AtomicBool::new(false) };
        if is_root() {
            run(
                "chown of the Postgres directory",
                Command::new("chown").args(["-R", "postgres:"]).arg(server.dir.path()),
            )?;
        }
        // A template that cannot be made or copied (a full disk, another user's files): initdb here.
        let copied = template().and_then(|template| {
            run("copying the initdb template", server.command("cp").arg("-a").arg(&template).arg(server.data()))
        });
        if copied.is_err() {
            let _ = std::fs::remove_dir_all(server.data());
            run("initdb", &mut initdb(server.data()))?;
        }
        on_free_port(|port| {
            server.port = port;
            server.restart()
        })?;
        Ok(server)
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of another database on this server.
    pub fn url_for(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`): like a crash, recovered on restart.
    ///
    /// # Errors
    /// [`TestkitError`] if `pg_ctl` fails.
    pub fn stop(&self) -> Result<(), TestkitError> {
        if self.running.swap(false, Ordering::SeqCst) {
            let mut stop = self.command("pg_ctl");
            stop.arg("-D").arg(self.data()).args(["-m", "immediate", "-w", "stop"]);
            run("pg_ctl stop", &mut stop)?;
        }
        Ok(())
    }

    /// Starts the server again on the same port (stopping it first if it runs).
    ///
    /// # Errors
    /// [`TestkitError`] if `pg_ctl` fails.
    pub fn restart(&self) -> Result<(), TestkitError> {
        self.stop()?;
        let sync = if self.durable { "on" } else { "off" };
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync={sync} \
             -c full_page_writes={sync} -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        let mut start = self.command("pg_ctl");
        start.arg("-D").arg(self.data()).arg("-l").arg(self.dir.path().join("server.log"));
        start.args(["-o", &options, "-w", "-t", "30", "start"]);
        run("pg_ctl start", &mut start)?;
        self.running.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, program: &str) -> Command {
        as_postgres(program)
    }
}

/// Postgres refuses to run as root: its programs run as the `postgres` system user then.
fn as_postgres(program: &str) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--", program]);
        command
    } else {
        Command::new(program)
    }
}

/// `initdb` of a throwaway cluster into `data`.
fn initdb(data: PathBuf) -> Command {
    let mut initdb = as_postgres("initdb");
    initdb.arg("-D").arg(data);
    // 1 MiB WAL segments, not 16: a copy of the cluster is then 23 MB, not 39.
    initdb.args(["-U", "postgres", "-A", "trust", "-N", "-E", "UTF8", "--wal-segsize=1", "--no-instructions"]);
    initdb
}

/// A cluster that `initdb` made once per machine (and Postgres version), which every server copies:
/// `initdb` takes seconds on a small machine, most of a test's set-up, and a copy of its files a
/// fraction of that. Made in a directory of its own and renamed into place, so processes that race to
/// make it never see half of one.
fn template() -> Result<PathBuf, TestkitError> {
    let version = run("initdb --version", as_postgres("initdb").arg("--version"))?;
    let version: String = String::from_utf8_lossy(&version.stdout)
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '-' })
        .collect();
    // One per user: a template is trusted as it is found, so no other user may have made it.
    let user = run("id -u", Command::new("id").arg("-u"))?;
    let user = String::from_utf8_lossy(&user.stdout).trim().to_owned();
    let root = scratch_root().join(format!("idemstore-initdb-wal1-{user}-{}", version.trim_matches('-')));
    let data = root.join("data");
    if data.join("PG_VERSION").exists() {
        return Ok(data);
    }
    let staging = scratch_dir("idemstore-initdb-staging-", "creating the initdb template directory")?;
    if is_root() {
        run("chown of the initdb template", Command::new("chown").args(["-R", "postgres:"]).arg(staging.path()))?;
    }
    run("initdb", &mut initdb(staging.path().join("data")))?;
    let staging = staging.keep();
    // Another process may have published its template first: then this one is not needed.
    if std::fs::rename(&staging, &root).is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    Ok(data)
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
