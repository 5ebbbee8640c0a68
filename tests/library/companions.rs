//! A worker run from a team's own `main` with what runs beside it: the
//! console's pages on the worker's address, refusing a stranger's action,
//! and the pruner dropping epochs past the window.

use std::sync::Arc;
use std::time::Duration;

use idem::commands::prune::PruneSettings;
use idem::console::{Console, ConsoleConfig};
use idem::{Companions, Mode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::deposits::{self, Deposits};
use crate::support::{wait_for, with_env};

/// The status line of a request to `addr`: `GET /` or a form `POST`.
async fn status_of(addr: std::net::SocketAddr, request: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let answer = String::from_utf8_lossy(&answer);
    Ok(answer.lines().next().unwrap_or_default().to_owned())
}

fn free_port() -> anyhow::Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_main_runs_the_worker_with_its_console_and_its_pruner() -> anyhow::Result<()> {
    with_env::<Deposits, _, _>(deposits::topology(), |env| async move {
        let shutdown = CancellationToken::new();
        let mut config = env.worker_config(Mode::Batch, "deposits");
        let addr = free_port()?;
        config.http_addr = Some(addr);
        let handler = Arc::new(Deposits::default());
        let console = ConsoleConfig::new(config.target());
        let console = Console::new(console, Arc::clone(&handler), shutdown.clone()).await?;
        let window = Duration::from_secs(8 * 24 * 3600);
        let retention = PruneSettings {
            target: config.target(),
            older_than: window,
            min_retention: PruneSettings::DEFAULT_MIN_RETENTION,
            epoch_length: PruneSettings::epoch_length(window, None),
            lock_timeout: PruneSettings::DEFAULT_LOCK_TIMEOUT,
            dry_run: false,
        };
        // A first epoch past the window, a second current for longer than
        // half of it: the pruner drops the first and closes the second.
        let second = env.number("SELECT mq_open_epoch()::bigint").await?;
        env.number(
            "WITH aged AS (UPDATE mq_consume_epoch SET opened_at = opened_at - interval '10 days' \
             RETURNING 1) SELECT count(*) FROM aged",
        )
        .await?;

        let companions = Companions::new()
            .console(console)
            .pruning(retention, Duration::from_millis(100));
        let worker = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { companions.run(config, handler, &shutdown).await }
        });
        let epochs = "SELECT coalesce(array_agg(epoch ORDER BY epoch)::text, '') FROM mq_consume_epoch";
        let wanted = format!("{{{second},{}}}", second + 1);
        wait_for("the pruner", Duration::from_secs(30), || async {
            let client = env.pool.get().await?;
            let now: String = client.query_one(epochs, &[]).await?.get(0);
            Ok(now == wanted)
        })
        .await?;
        wait_for("the console", Duration::from_secs(30), || async {
            Ok(status_of(addr, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .is_ok_and(|status| status.contains(" 200 ")))
        })
        .await?;
        let stranger = "POST /actions/preview HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
                        Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 0\r\n\r\n";
        let refused = status_of(addr, stranger).await?;
        assert!(refused.contains(" 403 "), "{refused}");
        shutdown.cancel();
        worker.await??;
        Ok(())
    })
    .await
}
