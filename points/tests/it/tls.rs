//! PostgreSQL over TLS (`sslmode=require`), through a proxy that speaks TLS
//! to idem with a certificate of its own CA, and plain text to the server.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

use idem::secret::SecretUrl;
use idem::worker::Mode;

use crate::support::{RunningWorker, TestEnv, assert_exact};

/// The code of PostgreSQL's SSLRequest message.
const SSL_REQUEST: u32 = 80_877_103;

/// A CA of a test's own, its certificate in a PEM file removed on drop.
struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pem: TempFile,
}

impl TestCa {
    fn new(env: &TestEnv, name: &str) -> anyhow::Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("idem test CA {name}"));
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let pem = TempFile::write(env, &format!("{name}-ca.pem"), &issuer.pem())?;
        Ok(Self { issuer, pem })
    }

    fn file(&self) -> &std::path::Path {
        &self.pem.0
    }
}

/// A file of a test's own, removed when the test ends, however it ends.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn write(env: &TestEnv, name: &str, content: &str) -> anyhow::Result<Self> {
        let file = Self(std::env::temp_dir().join(format!("{}-{name}", env.name)));
        std::fs::write(&file.0, content)?;
        Ok(file)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// How a client starts TLS with the server behind a [`TlsProxy`].
#[derive(Debug, Clone, Copy)]
enum Protocol {
    /// PostgreSQL: an SSLRequest, answered `S`, then the handshake.
    Postgres,
    /// AMQP over TLS (`amqps://`): the handshake at once.
    Amqp,
}

impl Protocol {
    fn upstream(self) -> std::net::SocketAddr {
        match self {
            Protocol::Postgres => crate::support::postgres_address(),
            Protocol::Amqp => crate::support::amqp_address(),
        }
    }
}

/// Listens on a port of its own; each connection gets a TLS session with a
/// certificate for `127.0.0.1` signed by `ca`, and is forwarded in plain
/// text to the suite's server of `protocol`.
struct TlsProxy {
    port: u16,
    handshakes: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl TlsProxy {
    async fn start(ca: &TestCa, protocol: Protocol) -> anyhow::Result<Self> {
        let key = KeyPair::generate()?;
        let certificate =
            CertificateParams::new(vec!["127.0.0.1".to_owned()])?.signed_by(&key, &ca.issuer)?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(idem::tls::provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![certificate.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&handshakes);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    // A connection that fails ends here; the client sees why.
                    let _ = serve(client, protocol, acceptor, counted).await;
                });
            }
        });
        Ok(Self {
            port,
            handshakes,
            task,
        })
    }

    /// Its PostgreSQL URL with `sslmode=require`.
    fn url(&self, env: &TestEnv) -> String {
        self.url_with(env, "require")
    }

    fn url_with(&self, env: &TestEnv, sslmode: &str) -> String {
        crate::support::database_url_with(|url| {
            let _ = url.set_host(Some("127.0.0.1"));
            let _ = url.set_port(Some(self.port));
            crate::support::append_query(url, "sslmode", sslmode);
            crate::support::append_query(url, "application_name", &env.name);
        })
    }

    /// Its `amqps://` URL.
    fn amqps_url(&self) -> String {
        crate::support::amqp_url_with(|url| {
            let _ = url.set_scheme("amqps");
            let _ = url.set_host(Some("127.0.0.1"));
            let _ = url.set_port(Some(self.port));
        })
    }

    fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A server that declines every SSLRequest, as PostgreSQL with `ssl = off` does.
struct NoTlsServer {
    port: u16,
    task: JoinHandle<()>,
}

impl NoTlsServer {
    async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = [0u8; 8];
                    if client.read_exact(&mut request).await.is_ok() {
                        let _ = client.write_all(b"N").await;
                    }
                });
            }
        });
        Ok(Self { port, task })
    }
}

impl Drop for NoTlsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    mut client: TcpStream,
    protocol: Protocol,
    acceptor: TlsAcceptor,
    handshakes: Arc<AtomicUsize>,
) -> anyhow::Result<()> {
    if let Protocol::Postgres = protocol {
        let length = client.read_u32().await?;
        let code = client.read_u32().await?;
        anyhow::ensure!(
            (length, code) == (8, SSL_REQUEST),
            "not an SSLRequest: a client without TLS"
        );
        client.write_all(b"S").await?;
    }
    let mut tls = acceptor.accept(client).await?;
    handshakes.fetch_add(1, Ordering::SeqCst);
    let mut server = TcpStream::connect(protocol.upstream())
        .await
        .with_context(|| format!("{protocol:?}"))?;
    tokio::io::copy_bidirectional(&mut tls, &mut server).await?;
    Ok(())
}

/// Runs a worker with `config` until it has applied `load`, which went
/// through `proxy`'s TLS sessions.
async fn applies_through(
    env: &TestEnv,
    config: idem::worker::WorkerConfig,
    load: &[idem_points::points::PaymentSucceeded],
    proxy: &TlsProxy,
) -> anyhow::Result<()> {
    let worker = RunningWorker::start(config);
    worker
        .wait_finished(load.len() as u64, Duration::from_secs(30))
        .await?;
    worker.stop().await?;
    assert!(proxy.handshakes() >= 1, "no TLS session was opened");
    assert_exact(env, load, &[]).await
}

/// Runs `idem worker` as `command` says, and asserts that it exits 1 at
/// once with one line that says `says` and no password.
async fn worker_ends_at_once(command: tokio::process::Command, says: &str) -> anyhow::Result<()> {
    let stderr = crate::support::worker_exits_at_once(command).await?;
    assert!(stderr.contains(says), "{says:?} not in {stderr}");
    assert!(
        !stderr.contains(&crate::support::amqp_credentials()),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sslmode_verify_full_the_worker_verifies_the_server_and_applies_over_tls()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let ca = TestCa::new(&env, "trusted")?;
    let postgres = TlsProxy::start(&ca, Protocol::Postgres).await?;
    let load = crate::support::load(&env, 300, 0.1, 10);
    env.publish_events(&load).await?;

    let mut config = env.worker_config(Mode::Batch);
    // libpq's name for what `require` does here.
    config.database.url = SecretUrl::new(postgres.url_with(&env, "verify-full"));
    config.database.ca_file = Some(ca.file().to_owned());
    applies_through(&env, config, &load, &postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_that_does_not_verify_or_a_bad_ca_file_ends_the_worker_at_once()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let trusted = TestCa::new(&env, "trusted")?;
    let other = TestCa::new(&env, "other")?;
    let postgres = TlsProxy::start(&trusted, Protocol::Postgres).await?;
    let not_pem = TempFile::write(&env, "not-a-ca.pem", "not a certificate\n")?;
    let plain = crate::support::database_url();
    let no_tls = NoTlsServer::start().await?;
    let no_tls_url = crate::support::database_url_with(|url| {
        let _ = url.set_port(Some(no_tls.port));
        let _ = url.set_host(Some("127.0.0.1"));
        crate::support::append_query(url, "sslmode", "require");
    });
    let cases = [
        // Signed by a CA the worker was not told to trust.
        (
            postgres.url(&env),
            Some(other.file()),
            "invalid peer certificate",
        ),
        // The system's CAs do not know the test's CA either.
        (postgres.url(&env), None, "invalid peer certificate"),
        (
            postgres.url(&env),
            Some(not_pem.0.as_path()),
            "cannot use the CA file",
        ),
        (
            no_tls_url,
            Some(trusted.file()),
            "server does not support TLS",
        ),
        // A CA file would be ignored: say so rather than connect in plain text.
        (plain, Some(trusted.file()), "does not say sslmode=require"),
    ];
    for (url, ca_file, says) in cases {
        let mut command = crate::support::idem_command(&env, &crate::support::amqp_url(), &url);
        if let Some(file) = ca_file {
            command.env("IDEM_DATABASE_CA_FILE", file);
        }
        worker_ends_at_once(command, says).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_amqps_with_a_ca_file_the_worker_verifies_the_broker_and_applies() -> anyhow::Result<()>
{
    let env = TestEnv::new().await?;
    let ca = TestCa::new(&env, "broker")?;
    let broker = TlsProxy::start(&ca, Protocol::Amqp).await?;
    let load = crate::support::load(&env, 300, 0.1, 10);
    env.publish_events(&load).await?;

    let mut config = env.worker_config(Mode::Batch);
    config.amqp = idem::broker::AmqpConfig::new(SecretUrl::new(broker.amqps_url()))
        .with_ca_file(ca.file().to_owned());
    applies_through(&env, config, &load, &broker).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_certificate_that_does_not_verify_or_a_bad_ca_file_ends_the_worker_at_once()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let trusted = TestCa::new(&env, "trusted")?;
    let other = TestCa::new(&env, "other")?;
    let broker = TlsProxy::start(&trusted, Protocol::Amqp).await?;
    let not_pem = TempFile::write(&env, "not-a-ca.pem", "not a certificate\n")?;
    let cases = [
        // Signed by a CA the worker was not told to trust.
        (
            broker.amqps_url(),
            Some(other.file()),
            "invalid peer certificate",
        ),
        // The system's CAs do not know the test's CA either.
        (broker.amqps_url(), None, "invalid peer certificate"),
        (
            broker.amqps_url(),
            Some(not_pem.0.as_path()),
            "cannot use the CA file",
        ),
        // A CA file would be ignored: say so rather than connect in plain text.
        (
            crate::support::amqp_url(),
            Some(trusted.file()),
            "not amqps://",
        ),
    ];
    for (url, ca_file, says) in cases {
        let mut command = crate::support::idem_command(&env, &url, &crate::support::database_url());
        if let Some(file) = ca_file {
            command.env("IDEM_AMQP_CA_FILE", file);
        }
        worker_ends_at_once(command, says).await?;
    }
    Ok(())
}
