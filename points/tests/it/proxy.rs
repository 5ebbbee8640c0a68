//! The TCP proxy the fault tests put between idem and the servers: the
//! library's, which `check` cuts its workers' connections with.

pub use idem::trial::proxy::Proxy;

use crate::support::{database_url, database_url_at, postgres_address};

async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// What `check`'s "commit in flight" run does to a worker: its COMMIT
/// reaches PostgreSQL and runs, and the client hears only that the
/// connection is gone.
#[tokio::test]
async fn a_cut_after_the_next_write_lets_the_commit_run_unheard() -> anyhow::Result<()> {
    let table = format!("idem_proxy_{:08x}", fastrand::u32(..));
    let direct = connect(&database_url()).await?;
    direct
        .batch_execute(&format!("CREATE TABLE {table} (n int)"))
        .await?;
    let proxy = Proxy::start(postgres_address()).await?;
    let outcome = async {
        let client = connect(&database_url_at(proxy.port)).await?;
        client
            .batch_execute(&format!("BEGIN; INSERT INTO {table} VALUES (1)"))
            .await?;
        proxy.cut_after_next_write();
        let commit = client.batch_execute("COMMIT").await;
        anyhow::ensure!(commit.is_err(), "the client heard its commit: {commit:?}");
        // The server finishes the commit before it finds the socket closed.
        crate::support::wait_for(
            "the commit the client never heard of",
            std::time::Duration::from_secs(10),
            || async {
                let row = direct
                    .query_one(&format!("SELECT count(*) FROM {table}"), &[])
                    .await?;
                Ok(row.get::<_, i64>(0) == 1)
            },
        )
        .await
    }
    .await;
    direct.batch_execute(&format!("DROP TABLE {table}")).await?;
    outcome
}
