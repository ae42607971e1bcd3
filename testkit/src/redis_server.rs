//! A throwaway `redis-server`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::{TestkitError, io, on_free_port, run, scratch_dir};

/// A `redis-server` child process (or another Redis-compatible server) bound to 127.0.0.1, without
/// persistence unless its extra arguments ask for it. Its controls take `&self`, so a fault can be
/// injected while a workload shares the handle.
#[derive(Debug)]
pub struct RedisServer {
    child: Mutex<Option<Child>>,
    port: u16,
    dir: TempDir,
    program: PathBuf,
    extra_args: Vec<String>,
}

impl RedisServer {
    /// Starts a server (installing `redis-server` first if it is missing and this runs as root).
    ///
    /// # Errors
    /// [`TestkitError`] if `redis-server` is missing or does not come up.
    pub fn start() -> Result<Self, TestkitError> {
        Self::start_with(&[])
    }

    /// Starts a server with extra arguments, e.g. `["--maxmemory", "2mb"]`.
    ///
    /// # Errors
    /// As [`RedisServer::start`].
    pub fn start_with(extra_args: &[&str]) -> Result<Self, TestkitError> {
        ensure_installed()?;
        Self::start_program("redis-server", extra_args)
    }

    /// Starts another build of a Redis-compatible server, such as a newer Redis or Valkey than
    /// Debian ships, with extra arguments. Nothing is installed.
    ///
    /// # Errors
    /// [`TestkitError`] if `program` cannot be started or does not come up.
    pub fn start_program(program: impl Into<PathBuf>, extra_args: &[&str]) -> Result<Self, TestkitError> {
        let dir = scratch_dir("idemstore-redis-", "creating a Redis directory")?;
        let mut server = Self {
            child: Mutex::new(None),
            port: 0,
            dir,
            program: program.into(),
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
        };
        on_free_port(|port| {
            server.port = port;
            server.spawn()
        })?;
        Ok(server)
    }

    /// `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server with SIGKILL: everything it held is gone, including its script cache.
    pub fn kill(&self) {
        if let Some(mut child) = self.lock().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty (after [`RedisServer::kill`]).
    ///
    /// # Errors
    /// As [`RedisServer::start`].
    pub fn restart(&self) -> Result<(), TestkitError> {
        self.kill();
        self.spawn()
    }

    /// Kills the server, deletes everything it wrote to disk (its append-only file, if it was started
    /// with one) and starts it again: an empty server even where a plain restart would reload its data.
    ///
    /// # Errors
    /// As [`RedisServer::start`], or if its directory cannot be emptied.
    pub fn restart_empty(&self) -> Result<(), TestkitError> {
        self.kill();
        for entry in std::fs::read_dir(self.dir.path()).map_err(io("emptying the Redis directory"))? {
            let path = entry.map_err(io("emptying the Redis directory"))?.path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.map_err(io("emptying the Redis directory"))?;
        }
        self.spawn()
    }

    /// Stops the process with SIGSTOP: connections stay open and nothing answers.
    ///
    /// # Errors
    /// [`TestkitError`] if the signal could not be sent.
    pub fn pause(&self) -> Result<(), TestkitError> {
        self.signal("-STOP")
    }

    /// Resumes a paused server with SIGCONT.
    ///
    /// # Errors
    /// [`TestkitError`] if the signal could not be sent.
    pub fn resume(&self) -> Result<(), TestkitError> {
        self.signal("-CONT")
    }

    fn signal(&self, signal: &str) -> Result<(), TestkitError> {
        let pid = self.lock().as_ref().map(Child::id).unwrap_or_default().to_string();
        run("signalling redis-server", Command::new("kill").args([signal, &pid])).map(drop)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn spawn(&self) -> Result<(), TestkitError> {
        let port = self.port.to_string();
        let child = Command::new(&self.program)
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(io("starting a Redis server"))?;
        *self.lock() = Some(child);
        wait_for_pong(self.port).inspect_err(|_| self.kill())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn wait_for_pong(port: u16) -> Result<(), TestkitError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            let mut reply = [0u8; 7];
            if stream.write_all(b"PING\r\n").is_ok() && stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
            {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(TestkitError::Failed {
        step: "waiting for redis-server",
        output: format!("no PONG on port {port} within 10 s"),
    })
}

fn ensure_installed() -> Result<(), TestkitError> {
    super::ensure_installed("redis-server", "redis-server")
}
