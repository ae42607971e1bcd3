//! A TCP proxy between the application and a server, to cut, stall or slow the connection at chosen
//! moments (`tc netem` is not available on these kernels).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// What the proxy does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProxyMode {
    /// Forward everything.
    Pass,
    /// Forward everything, each chunk after a delay.
    Delay(Duration),
    /// Hold all traffic (a partition): nothing is forwarded and nothing is closed until the mode changes.
    Blackhole,
}

/// A proxy on a free loopback port in front of `upstream`. Stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<ProxyMode>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    accepted: Arc<AtomicUsize>,
    listener: AbortHandle,
}

impl Proxy {
    /// Starts forwarding connections on a free port to `upstream`.
    ///
    /// # Errors
    /// If no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(ProxyMode::Pass);
        let (connections, accepted) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicUsize::new(0)));
        let accepting = {
            let (mode, connections, accepted) = (mode.clone(), connections.clone(), accepted.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::Relaxed);
                    let forwarding = tokio::spawn(forward(client, upstream, mode.subscribe()));
                    lock(&connections).push(forwarding.abort_handle());
                }
            })
        };
        Ok(Self { addr, mode, connections, accepted, listener: accepting.abort_handle() })
    }

    /// The port to connect to instead of the upstream's.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// How many connections the proxy accepted so far: after a [`Proxy::cut`], a client that went on
    /// had to connect again.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Changes what happens to traffic, on open connections too.
    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }

    /// Closes every open connection at once (as a reset or a crashed peer would); new connections are
    /// still accepted. Returns how many were open: a cut of none would prove nothing about a cut.
    pub fn cut(&self) -> usize {
        let mut open = 0;
        for connection in lock(&self.connections).drain(..) {
            open += usize::from(!connection.is_finished());
            connection.abort();
        }
        open
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.cut();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn forward(client: TcpStream, upstream: SocketAddr, mode: watch::Receiver<ProxyMode>) {
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pipe(client_read, server_write, mode.clone()) => {}
        _ = pipe(server_read, client_write, mode) => {}
    }
}

/// Copies one direction, obeying the mode before each chunk.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<ProxyMode>,
) -> io::Result<()> {
    let mut buffer = vec![0u8; 16 << 10];
    loop {
        // Stop reading while blackholed: bytes wait in the kernel buffers, as in a partition.
        if mode.wait_for(|m| *m != ProxyMode::Blackhole).await.is_err() {
            return Ok(());
        }
        let read = from.read(&mut buffer).await?;
        if read == 0 {
            return Ok(());
        }
        let current = *mode.borrow();
        match current {
            ProxyMode::Delay(delay) => tokio::time::sleep(delay).await,
            ProxyMode::Blackhole => {
                let _ = mode.wait_for(|m| *m != ProxyMode::Blackhole).await;
            }
            ProxyMode::Pass => {}
        }
        to.write_all(&buffer[..read]).await?;
    }
}
