//! The console over HTTPS, for a team with no proxy in front of it: a
//! certificate chain and its key from PEM files, served with rustls (the
//! provider of every other connection idem makes). Handshakes run each in
//! a task of its own, so that a client that never finishes one holds up
//! nobody else.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, warn};

/// Longest a client may take over its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections whose handshake ended, waiting for the server to take them.
const ACCEPTED_BACKLOG: usize = 64;

/// The console's certificate and key: what it serves HTTPS with.
#[derive(Clone)]
pub struct ConsoleTls {
    config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for ConsoleTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of every log line and error.
        f.write_str("ConsoleTls(..)")
    }
}

/// Why the console's certificate or key cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot serve the console over TLS with {path}: {reason}")]
pub struct ConsoleTlsError {
    /// The file at fault (the certificate's, or the key's).
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

impl ConsoleTls {
    /// The certificate chain in the PEM file `certificate` (the server's
    /// first, then its intermediates) and its private key in the PEM file
    /// `key` (PKCS#8, PKCS#1 or SEC1), checked to belong together.
    pub fn from_pem_files(certificate: &Path, key: &Path) -> Result<Self, ConsoleTlsError> {
        let unusable = |path: &Path, reason: String| ConsoleTlsError {
            path: path.to_owned(),
            reason,
        };
        let chain = CertificateDer::pem_file_iter(certificate)
            .map_err(|error| unusable(certificate, error.to_string()))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| unusable(certificate, error.to_string()))?;
        if chain.is_empty() {
            return Err(unusable(certificate, "no certificate in it".into()));
        }
        // The key's own words would not name the file; nor do they show it.
        let private = PrivateKeyDer::from_pem_file(key)
            .map_err(|error| unusable(key, format!("no private key read from it ({error})")))?;
        let mut config =
            rustls::ServerConfig::builder_with_provider(Arc::new(crate::tls::provider()))
                .with_safe_default_protocol_versions()
                .map_err(|error| unusable(certificate, error.to_string()))?
                .with_no_client_auth()
                .with_single_cert(chain, private)
                .map_err(|error| unusable(key, error.to_string()))?;
        // The console speaks HTTP/1.1 only.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            config: Arc::new(config),
        })
    }
}

/// A listener whose connections are TLS sessions: TCP connections accepted
/// on `tcp`, each handshake in a task of its own (at most
/// [`HANDSHAKE_TIMEOUT`]); a handshake that fails is logged and dropped.
pub(super) struct TlsListener {
    local: SocketAddr,
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    _accepting: AbortOnDropHandle<()>,
}

impl TlsListener {
    /// Sessions of `tcp`, bound to `local`.
    pub(super) fn new(tcp: TcpListener, local: SocketAddr, tls: &ConsoleTls) -> Self {
        let acceptor = TlsAcceptor::from(Arc::clone(&tls.config));
        let (sender, accepted) = mpsc::channel(ACCEPTED_BACKLOG);
        let accepting = tokio::spawn(async move {
            while !sender.is_closed() {
                let (stream, peer) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors, say: as axum's own
                        // listener does, wait a little before the next.
                        warn!(%error, "the console cannot accept a connection");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let sender = sender.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(session)) => {
                            let _ = sender.send((session, peer)).await;
                        }
                        Ok(Err(error)) => {
                            debug!(%peer, %error, "a TLS handshake with the console failed")
                        }
                        Err(_) => debug!(%peer, "a TLS handshake with the console took too long"),
                    }
                });
            }
        });
        Self {
            local,
            accepted,
            _accepting: AbortOnDropHandle::new(accepting),
        }
    }
}

/// A TLS client's address, as the console's handlers read it
/// ([`ConnectInfo`](axum::extract::ConnectInfo)).
#[derive(Debug, Clone, Copy)]
pub(super) struct TlsPeer(pub(super) SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>>
    for TlsPeer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accepting task ended: nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
