//! A TCP proxy inside the test process, between idem and PostgreSQL or
//! RabbitMQ, that a test can sever and restore without touching the shared
//! servers.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Forwards `127.0.0.1:port` to an upstream address.
pub struct Proxy {
    pub port: u16,
    /// True while connections are let through; false while severed.
    open: watch::Sender<bool>,
    /// The forwarding tasks of live connections, aborted by a sever.
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    acceptor: JoinHandle<()>,
}

impl Proxy {
    /// A proxy to `upstream`, open.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with(upstream, true).await
    }

    /// A proxy to `upstream` whose port refuses connections until `restore`.
    pub async fn start_closed(upstream: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with(upstream, false).await
    }

    async fn start_with(upstream: SocketAddr, open: bool) -> anyhow::Result<Self> {
        // Reserve a port, then let the acceptor own listening on it.
        let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
        let (open, opened) = watch::channel(open);
        let connections = Arc::new(Mutex::new(Vec::new()));
        let acceptor = tokio::spawn(accept(port, upstream, opened, Arc::clone(&connections)));
        Ok(Self {
            port,
            open,
            connections,
            acceptor,
        })
    }

    /// Drops every connection through the proxy and refuses new ones (the
    /// port stops listening) until `restore`.
    pub fn sever(&self) {
        self.open.send_replace(false);
        self.cut();
    }

    /// Drops every connection through the proxy; new ones are accepted.
    pub fn cut(&self) {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        for connection in connections.drain(..) {
            connection.abort();
        }
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
    port: u16,
    upstream: SocketAddr,
    mut open: watch::Receiver<bool>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    loop {
        if open.wait_for(|open| *open).await.is_err() {
            return;
        }
        // Listening only while open: a severed proxy refuses connections.
        let listener = match TcpListener::bind(("127.0.0.1", port)).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("proxy: cannot listen on {port}: {error}");
                return;
            }
        };
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((client, _)) = accepted else { continue };
                    let task = tokio::spawn(forward(client, upstream));
                    connections.lock().unwrap_or_else(|e| e.into_inner()).push(task);
                }
                changed = open.wait_for(|open| !*open) => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

async fn forward(mut client: TcpStream, upstream: SocketAddr) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}
