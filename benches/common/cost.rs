//! What a request pays, counted rather than timed: Postgres round trips (pings, BEGIN and COMMIT
//! included), Postgres write transactions (each one a durable commit), Redis commands and heap
//! allocations. Shared by the library and HTTP benchmarks; each counts a pass of its own, untimed, so
//! that the counting never slows the timed cells.

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The process's allocator, counting every allocation (reallocations included) of every thread.
pub struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the counter is an atomic.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations so far in this process.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// A proxy in front of Postgres that counts round trips: every Sync (the end of an extended-protocol
/// exchange, and the whole of sqlx's ping) and every simple Query (BEGIN, COMMIT) earns one
/// ReadyForQuery from the server, so their sum is the number of waits for the server.
pub struct RoundTripCounter {
    addr: SocketAddr,
    round_trips: Arc<AtomicU64>,
    listener: tokio::task::AbortHandle,
}

impl RoundTripCounter {
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let round_trips = Arc::new(AtomicU64::new(0));
        let counted = round_trips.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, upstream, counted.clone()));
            }
        });
        Ok(Self { addr, round_trips, listener: accepting.abort_handle() })
    }

    /// The options of `url`, connecting through the proxy instead, in clear: the proxy reads the messages.
    pub fn options(&self, url: &str) -> Result<sqlx::postgres::PgConnectOptions, sqlx::Error> {
        let options = url.parse::<sqlx::postgres::PgConnectOptions>()?;
        Ok(options.host("127.0.0.1").port(self.addr.port()).ssl_mode(sqlx::postgres::PgSslMode::Disable))
    }

    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }
}

impl Drop for RoundTripCounter {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

async fn forward(client: TcpStream, upstream: SocketAddr, round_trips: Arc<AtomicU64>) {
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upward = async {
        let mut messages = FrontendMessages::default();
        let mut buffer = vec![0u8; 16 << 10];
        loop {
            let read = client_read.read(&mut buffer).await?;
            if read == 0 {
                return Ok::<_, std::io::Error>(());
            }
            round_trips.fetch_add(messages.waits_in(&buffer[..read]), Ordering::Relaxed);
            server_write.write_all(&buffer[..read]).await?;
        }
    };
    tokio::select! {
        _ = upward => {}
        _ = tokio::io::copy(&mut server_read, &mut client_write) => {}
    }
}

/// The client's side of the Postgres protocol, split into messages as the bytes arrive. It opens with
/// untyped messages (an SSL or GSS request, then the startup message), then every message is a type byte
/// and a length that counts itself.
#[derive(Default)]
struct FrontendMessages {
    started: bool,
    /// The current message's header (type byte and length) as far as it arrived.
    header: Vec<u8>,
    /// Bytes of the current message's body still to skip.
    remaining: usize,
}

impl FrontendMessages {
    /// SSLRequest and GSSENCRequest: the startup message still follows.
    const ENCRYPTION_REQUESTS: [u32; 2] = [80_877_103, 80_877_104];

    /// How many messages in `bytes` wait for a ReadyForQuery (Sync and Query).
    fn waits_in(&mut self, mut bytes: &[u8]) -> u64 {
        let mut waits = 0;
        while !bytes.is_empty() {
            if self.remaining > 0 {
                let skipped = self.remaining.min(bytes.len());
                self.remaining -= skipped;
                bytes = &bytes[skipped..];
                continue;
            }
            let header_len = if self.started { 5 } else { 8 };
            let wanted = header_len - self.header.len();
            let taken = wanted.min(bytes.len());
            self.header.extend_from_slice(&bytes[..taken]);
            bytes = &bytes[taken..];
            if self.header.len() < header_len {
                break;
            }
            let length_at = usize::from(self.started);
            let length = u32::from_be_bytes(self.header[length_at..length_at + 4].try_into().expect("4 bytes"));
            if self.started {
                waits += u64::from(matches!(self.header[0], b'S' | b'Q'));
                self.remaining = (length as usize).saturating_sub(4);
            } else {
                let code = u32::from_be_bytes(self.header[4..8].try_into().expect("4 bytes"));
                self.started = !Self::ENCRYPTION_REQUESTS.contains(&code);
                self.remaining = (length as usize).saturating_sub(8);
            }
            self.header.clear();
        }
        waits
    }
}

/// Write transactions Postgres has started so far: each takes a transaction id, and each that commits
/// is a durable commit. Reading it takes one id too.
pub async fn transaction_ids(pool: &sqlx::PgPool) -> Result<u64, sqlx::Error> {
    let id: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint").fetch_one(pool).await?;
    Ok(id as u64)
}

/// Commands the Redis servers at `urls` have run so far, apart from INFO itself.
pub async fn redis_commands(urls: &[String]) -> Result<u64, redis::RedisError> {
    let mut total = 0;
    for url in urls {
        let mut conn = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await?;
        total += info
            .lines()
            .filter(|line| line.starts_with("cmdstat_") && !line.starts_with("cmdstat_info:"))
            .filter_map(|line| line.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
            .sum::<u64>();
    }
    Ok(total)
}

/// CPU time (user and system) of the processes `pids`, in microseconds, from `/proc` (Linux; 0 elsewhere
/// or for a process that is gone).
pub fn cpu_micros(pids: impl IntoIterator<Item = u32>) -> u64 {
    // Clock ticks per second: 100 on every Linux this runs on.
    const TICK_MICROS: u64 = 10_000;
    pids.into_iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the command name, which is in parentheses and may hold spaces.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum::<u64>()
        * TICK_MICROS
}

/// The Postgres backends serving the store's connections (all client backends of the server).
async fn backend_pids(direct: &sqlx::PgPool) -> Result<Vec<u32>, sqlx::Error> {
    let pids: Vec<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'")
        .fetch_all(direct)
        .await?;
    Ok(pids.into_iter().filter_map(|pid| u32::try_from(pid).ok()).collect())
}

/// What one request cost on average over a counted pass.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Cost {
    pub postgres_round_trips: f64,
    pub write_transactions: f64,
    pub redis_commands: f64,
    pub allocations: f64,
    /// CPU microseconds of the Postgres backends and of this process (the store, its clients and the
    /// benchmark's workers).
    pub postgres_cpu_us: f64,
    pub process_cpu_us: f64,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Counters {
    round_trips: u64,
    transaction_ids: u64,
    redis_commands: u64,
    /// Allocations before and after the reading's own.
    allocations: (u64, u64),
    postgres_cpu_us: u64,
    process_cpu_us: u64,
}

impl Counters {
    pub async fn read(
        proxy: &RoundTripCounter,
        direct: &sqlx::PgPool,
        redis_urls: &[String],
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let before = allocations();
        let process_cpu_us = cpu_micros([std::process::id()]);
        let round_trips = proxy.round_trips();
        let postgres_cpu_us = cpu_micros(backend_pids(direct).await?);
        let transaction_ids = transaction_ids(direct).await?;
        let redis_commands = redis_commands(redis_urls).await?;
        Ok(Self {
            round_trips,
            transaction_ids,
            redis_commands,
            allocations: (before, allocations()),
            postgres_cpu_us,
            process_cpu_us,
        })
    }

    /// The cost per request of `requests` made since `self` was read. The readings' own transaction id
    /// and allocations are left out of the count.
    pub fn per_request(&self, after: &Counters, requests: u64) -> Cost {
        let per = |before: u64, after: u64| after.saturating_sub(before) as f64 / requests.max(1) as f64;
        Cost {
            postgres_round_trips: per(self.round_trips, after.round_trips),
            write_transactions: per(self.transaction_ids + 1, after.transaction_ids),
            redis_commands: per(self.redis_commands, after.redis_commands),
            allocations: per(self.allocations.1, after.allocations.0),
            postgres_cpu_us: per(self.postgres_cpu_us, after.postgres_cpu_us),
            process_cpu_us: per(self.process_cpu_us, after.process_cpu_us),
        }
    }
}

/// The counted pass's table: `intro`, then one row per (workload, subject) with what a request paid.
pub fn markdown(intro: &str, rows: &[(String, String, Cost)]) -> String {
    let mut md = format!(
        "\n{intro} Postgres round trips are counted by a proxy (every Sync and simple Query, so pings, BEGIN and \
         COMMIT included); write transactions are the transaction ids Postgres assigned (each commit of one is \
         durable); Redis commands come from INFO commandstats (the scripts' own commands included); \
         allocations and CPU time are this process's (the store, its clients and the counting proxy) and the \
         Postgres backends' (read from /proc: only for a server on this machine).\n\n| workload | subject | PG round trips | PG write transactions | Redis commands | \
         allocations | PG CPU µs | process CPU µs |\n|---|---|---:|---:|---:|---:|---:|---:|\n"
    );
    for (workload, subject, c) in rows {
        md.push_str(&format!(
            "| {workload} | {subject} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.0} |\n",
            c.postgres_round_trips,
            c.write_transactions,
            c.redis_commands,
            c.allocations,
            c.postgres_cpu_us,
            c.process_cpu_us,
        ));
    }
    md
}
