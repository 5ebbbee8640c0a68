//! Removing what tests made, and sweeping what a crashed run left.

use super::*;

/// Runs `cleanup` to its end on a thread and runtime of its own: a `Drop`
/// runs inside the test's runtime, which cannot block on it.
pub fn clean_up(cleanup: impl Future<Output = anyhow::Result<()>> + Send + 'static) {
    let done = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(cleanup)
    })
    .join();
    if let Ok(Err(error)) = done {
        eprintln!("test cleanup failed: {error:#}");
    }
}

/// Removes `schema` and all it holds.
pub async fn drop_schema(schema: String) -> anyhow::Result<()> {
    let amqp = AmqpConfig::new(SecretUrl::new(amqp_url()));
    remove(amqp, vec![], vec![], vec![schema], vec![]).await
}

/// A client of the `postgres` database, for what a test does as an
/// administrator (creating and dropping databases, say).
pub async fn admin() -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) =
        tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

pub(crate) async fn remove(
    amqp: AmqpConfig,
    queues: Vec<String>,
    exchanges: Vec<String>,
    schemas: Vec<String>,
    databases: Vec<String>,
) -> anyhow::Result<()> {
    if !queues.is_empty() || !exchanges.is_empty() {
        let connection = connect(&amqp, "idem test cleanup").await?;
        let channel = connection.create_channel().await?;
        for queue in queues {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        for exchange in exchanges {
            channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        channel.close(200, "OK".into()).await?;
        connection.close(200, "OK".into()).await?;
    }
    if !schemas.is_empty() || !databases.is_empty() {
        let client = admin().await?;
        for schema in schemas {
            client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                .await?;
        }
        for database in databases {
            client
                .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
                .await?;
        }
    }
    Ok(())
}

/// Removes what earlier test processes that died left behind: objects whose
/// names carry the pid of a process that no longer runs.
pub(crate) fn sweep_leftovers_once() {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(|| {
        let swept = std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(sweep())
        })
        .join();
        if let Ok(Err(error)) = swept {
            eprintln!("sweeping leftovers of earlier test runs failed: {error:#}");
        }
    });
}

pub(crate) fn is_orphan(name: &str) -> bool {
    // A test's own objects, and those of a check the suite ran.
    let Some(rest) = ["idem_t", "idem-t", "idem_check_", "idem-check-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
    else {
        return false;
    };
    let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
    match pid.parse::<u32>() {
        Ok(pid) => {
            pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        }
        Err(_) => false,
    }
}

pub(crate) async fn sweep() -> anyhow::Result<()> {
    // Worker logs and certificates in the temporary directory.
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            if entry.file_name().to_str().is_some_and(is_orphan) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    // PostgreSQL servers of a test's own (`pg_createcluster`).
    for version in std::fs::read_dir("/etc/postgresql")
        .into_iter()
        .flatten()
        .flatten()
    {
        let clusters = std::fs::read_dir(version.path())
            .into_iter()
            .flatten()
            .flatten();
        for cluster in clusters {
            if cluster.file_name().to_str().is_some_and(is_orphan) {
                let _ = std::process::Command::new("pg_dropcluster")
                    .arg("--stop")
                    .arg(version.file_name())
                    .arg(cluster.file_name())
                    .output();
            }
        }
    }
    // Queues and exchanges live in the suite's vhost; vhosts are global.
    let vhost = amqp_vhost();
    let list = |what: &str| -> Vec<String> {
        let mut command = rabbitmqctl();
        command.args([what, "-q", "--no-table-headers", "name"]);
        if what != "list_vhosts" {
            command.args(["-p", &vhost]);
        }
        command
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| {
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let queues: Vec<String> = list("list_queues")
        .into_iter()
        .filter(|n| is_orphan(n))
        .collect();
    let exchanges: Vec<String> = list("list_exchanges")
        .into_iter()
        .filter(|n| is_orphan(n))
        .collect();
    for vhost in list("list_vhosts").into_iter().filter(|n| is_orphan(n)) {
        let _ = rabbitmqctl().args(["delete_vhost", &vhost]).output();
    }
    let (client, connection) =
        tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let orphans = |query: &'static str| {
        let client = &client;
        async move {
            anyhow::Ok(
                client
                    .query(query, &[])
                    .await?
                    .iter()
                    .map(|r| r.get::<_, String>(0))
                    .filter(|n| is_orphan(n))
                    .collect::<Vec<_>>(),
            )
        }
    };
    let schemas =
        orphans("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idem\\_%'").await?;
    let databases =
        orphans("SELECT datname::text FROM pg_database WHERE datname LIKE 'idem\\_t%'").await?;
    drop(client);
    let amqp = AmqpConfig::new(SecretUrl::new(amqp_url()));
    remove(amqp, queues, exchanges, schemas, databases).await
}
