//! A TCP proxy inside the process, between idem and PostgreSQL or
//! RabbitMQ, that a check (or a test) can cut, sever and restore without
//! touching the servers: to the server, a cut is a client that died.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// Forwards `127.0.0.1:port` to an upstream address.
#[derive(Debug)]
pub struct Proxy {
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    /// True while connections are let through; false while severed.
    open: watch::Sender<bool>,
    /// The live connections, dropped by a sever.
    connections: Arc<Mutex<Vec<Link>>>,
    /// Connections closed at once because the proxy was severed.
    turned_away: Arc<AtomicUsize>,
    acceptor: JoinHandle<()>,
}

impl Proxy {
    /// A proxy to `upstream`, open.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        Self::start_with(upstream, true).await
    }

    /// A proxy to `upstream` that closes every connection until `restore`.
    pub async fn start_closed(upstream: SocketAddr) -> std::io::Result<Self> {
        Self::start_with(upstream, false).await
    }

    async fn start_with(upstream: SocketAddr, open: bool) -> std::io::Result<Self> {
        // The port stays bound for the proxy's whole life: freeing it while
        // severed would let another socket take it.
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (open, opened) = watch::channel(open);
        let connections = Arc::new(Mutex::new(Vec::new()));
        let turned_away = Arc::new(AtomicUsize::new(0));
        let acceptor = tokio::spawn(accept(
            listener,
            upstream,
            opened,
            Arc::clone(&connections),
            Arc::clone(&turned_away),
        ));
        Ok(Self {
            port,
            open,
            connections,
            turned_away,
            acceptor,
        })
    }

    /// Drops every connection through the proxy, and closes new ones as soon
    /// as they are accepted, until `restore`.
    pub fn sever(&self) {
        self.open.send_replace(false);
        self.cut();
    }

    /// Drops every connection through the proxy; new ones are accepted.
    pub fn cut(&self) {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        for connection in connections.drain(..) {
            connection.task.abort();
        }
    }

    /// Drops the client's side of every connection through the proxy at
    /// once and the server's side `late`, as a network cut does that the
    /// server notices only when a heartbeat is missed; new connections are
    /// accepted.
    pub fn cut_noticed_late(&self, late: Duration) {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        for connection in connections.drain(..) {
            let _ = connection.cut_late.send(late);
        }
    }

    /// Drops each connection through the proxy right after the next bytes
    /// its client sends have reached the server, before any answer comes
    /// back: a statement the client sends next (a `COMMIT`) runs, and the
    /// client never hears how it went. New connections are not touched.
    pub fn cut_after_next_write(&self) {
        let connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        for connection in connections.iter() {
            connection.armed.store(true, Ordering::Relaxed);
        }
    }

    /// How many connections were closed at once while severed: attempts of
    /// a client that could not get through.
    pub fn turned_away(&self) -> usize {
        self.turned_away.load(Ordering::Relaxed)
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.open.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.cut();
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    open: watch::Receiver<bool>,
    connections: Arc<Mutex<Vec<Link>>>,
    turned_away: Arc<AtomicUsize>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if !*open.borrow() {
            // Severed: the connection is closed at once, as a server that
            // is going down would.
            drop(client);
            turned_away.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let (cut_late, cut) = oneshot::channel();
        let armed = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(forward(client, upstream, cut, Arc::clone(&armed)));
        connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Link {
                task,
                cut_late,
                armed,
            });
    }
}

/// A connection through the proxy.
#[derive(Debug)]
struct Link {
    /// Forwards it; aborted, it drops both sides.
    task: JoinHandle<()>,
    /// Drops the client's side, and the server's this much later.
    cut_late: oneshot::Sender<Duration>,
    /// Drops both sides once the client's next bytes reached the server.
    armed: Arc<AtomicBool>,
}

async fn forward(
    client: TcpStream,
    upstream: SocketAddr,
    cut: oneshot::Receiver<Duration>,
    armed: Arc<AtomicBool>,
) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_reads, mut client_writes) = client.into_split();
    let (mut server_reads, mut server_writes) = server.into_split();
    // Client to server by hand, to stop right after a write once armed.
    let up = async {
        let mut buffer = vec![0; 16 * 1024];
        loop {
            match client_reads.read(&mut buffer).await {
                Ok(0) => {
                    // The client is done sending; the server's answer
                    // still comes back.
                    let _ = server_writes.shutdown().await;
                    return std::future::pending().await;
                }
                Ok(read) => {
                    if server_writes.write_all(&buffer[..read]).await.is_err()
                        || armed.load(Ordering::Relaxed)
                    {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
    };
    let down = tokio::io::copy(&mut server_reads, &mut client_writes);
    tokio::select! {
        () = up => {}
        _ = down => {}
        Ok(late) = cut => {
            drop(client_writes);
            drop(client_reads);
            tokio::time::sleep(late).await;
        }
    }
}
