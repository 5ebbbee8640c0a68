//! idem as a team gets it: a crate of its own that depends on idem, writes
//! a handler, and gets every command in one call; and the library's own
//! refusal of settings that could never work.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, ensure};

use idem::broker::{AmqpConfig, Topology};
use idem::secret::SecretUrl;
use idem::store::DatabaseConfig;
use idem::worker::{ConfigError, Worker, WorkerConfig, WorkerError};
use idem_points::points::Points;
use tokio_util::sync::CancellationToken;

use crate::support::{amqp_url, clean_up, database_url, drop_schema, patient, unique_name};

/// A worker built through the library with a consumer group its column
/// cannot hold is refused before it connects to anything, rather than
/// holding its deliveries for ever as if the database were down. The
/// services named are unreachable: a worker that tried them would wait
/// out its start-up timeout.
#[tokio::test]
async fn a_worker_with_a_consumer_group_longer_than_its_column_is_refused_at_start() {
    let nowhere = |scheme: &str| SecretUrl::new(format!("{scheme}://nobody@127.0.0.1:1/x"));
    let topology = Topology::for_queue("inventory.reservations").bound_to("inventory", "reserve");
    let config = WorkerConfig::new(
        AmqpConfig::new(nowhere("amqp")),
        DatabaseConfig::new(nowhere("postgres")),
        topology,
        "g".repeat(65),
    );
    let ran = tokio::time::timeout(
        Duration::from_secs(5),
        Worker::new(config, Points).run(CancellationToken::new()),
    )
    .await;
    match ran {
        Ok(Err(WorkerError::Settings(ConfigError::ConsumerGroup { group }))) => {
            assert_eq!(group.len(), 65);
        }
        Ok(other) => panic!("expected the consumer group refused, got {other:?}"),
        Err(_) => panic!("the worker went on to the services instead of refusing its settings"),
    }
}

/// What a handler of a team's own looks like, in a crate outside idem.
const OUTSIDE_MAIN: &str = r#"
use idem::handler::{Handler, HandlerError, Invalid, Migration, Outbox, Transaction};

struct Inventory;

impl Handler for Inventory {
    type Event = String;
    const NAME: &'static str = "inventory";
    const MIGRATIONS: &'static [Migration] = &[Migration {
        version: 1,
        name: "0001_reserved.sql",
        sql: "CREATE TABLE reserved (event_id TEXT PRIMARY KEY)",
    }];

    fn decode(&self, body: &[u8]) -> Result<String, Invalid> {
        Ok(String::from_utf8(body.to_vec())?)
    }

    fn event_id<'e>(&self, event: &'e String) -> &'e str {
        event
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        events: &[&String],
        _: &mut Outbox<'_>,
    ) -> Result<(), HandlerError> {
        let ids: Vec<&str> = events.iter().map(|event| event.as_str()).collect();
        tx.execute("INSERT INTO reserved SELECT unnest($1::text[])", &[&ids]).await?;
        Ok(())
    }
}

fn main() -> std::process::ExitCode {
    idem::cli::run(Inventory)
}

/// The team's own test of its handler under idem's faults, on the servers
/// that DATABASE_URL and AMQP_URL name.
#[cfg(test)]
mod check {
    use idem::broker::AmqpConfig;
    use idem::check::CheckConfig;
    use idem::secret::SecretUrl;
    use idem::store::DatabaseConfig;

    #[tokio::test(flavor = "multi_thread")]
    async fn the_inventory_passes_idems_check() {
        let url = |name: &str| SecretUrl::new(std::env::var(name).expect(name));
        let events = (0..200).map(|n| format!("reservation-{n}").into_bytes()).collect();
        let config = CheckConfig::new(
            AmqpConfig::new(url("AMQP_URL")),
            DatabaseConfig::new(url("DATABASE_URL")),
            "inventory",
            events,
        )
        .witness("SELECT count(*) FROM reserved WHERE event_id = $1");
        let report = idem::check::run(&config, || super::Inventory).await.expect("the check ran");
        println!("{report}");
        assert!(report.passed(), "{report}");
    }
}
"#;

/// A crate under a temporary directory with a path dependency on this
/// idem, its handler and `main` above; built into a target directory of
/// its own beside the suite's, which keeps its compiled dependencies
/// between runs.
fn build_outside_crate() -> anyhow::Result<(tempfile_dir::Dir, PathBuf)> {
    let root = crate::support::repository();
    let root = root.as_path();
    let dir = tempfile_dir::Dir::new()?;
    // The dependencies the README tells a service to take, idem's from here.
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    let stanza = readme
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .context("no ```toml block in the README")?;
    ensure!(
        stanza.contains("idem = { version = "),
        "the README's stanza names no idem version:\n{stanza}"
    );
    let dependencies = stanza.replacen(
        "idem = { version = \"0.1\"",
        &format!("idem = {{ path = {:?}", root.display().to_string()),
        1,
    );
    let manifest = format!(
        "[package]\nname = \"inventory\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n\
         {dependencies}\n\
         [dev-dependencies]\ntokio = {{ version = \"1\", features = [\"macros\", \"rt-multi-thread\"] }}\n\n\
         [workspace]\n"
    );
    std::fs::write(dir.path().join("Cargo.toml"), manifest)?;
    // The versions idem is tested with.
    std::fs::copy(root.join("Cargo.lock"), dir.path().join("Cargo.lock"))?;
    std::fs::create_dir(dir.path().join("src"))?;
    std::fs::write(dir.path().join("src/main.rs"), OUTSIDE_MAIN)?;
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(|deps| deps.parent())
        .and_then(|debug| debug.parent())
        .context("no target directory above the test binary")?
        .join("outside-crate");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = std::process::Command::new(cargo)
        .args(["build", "--quiet"])
        .current_dir(dir.path())
        .env("CARGO_TARGET_DIR", &target)
        .output()?;
    ensure!(
        built.status.success(),
        "the outside crate does not build: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    Ok((dir, target.join("debug").join("inventory")))
}

/// The headings of `binary`'s help for `args`: `RabbitMQ:`, `Topology:` …
fn help_sections(binary: &Path, args: &[&str]) -> anyhow::Result<BTreeSet<String>> {
    let help = std::process::Command::new(binary).args(args).output()?;
    ensure!(
        help.status.success(),
        "{} {args:?} failed",
        binary.display()
    );
    Ok(String::from_utf8(help.stdout)?
        .lines()
        .filter(|line| !line.starts_with(' ') && line.ends_with(':'))
        .map(str::to_owned)
        .collect())
}

#[tokio::test]
async fn a_crate_outside_idem_gets_every_command_for_its_handler_with_one_call()
-> anyhow::Result<()> {
    let built = tokio::task::spawn_blocking(build_outside_crate).await??;
    let (dir, binary) = built;
    let help = std::process::Command::new(&binary).arg("--help").output()?;
    let help = String::from_utf8(help.stdout)?;
    for command in [
        "migrate",
        "worker",
        "requeue",
        "dlq",
        "status",
        "reconcile",
        "relay",
        "prune",
        "check",
    ] {
        assert!(
            help.lines()
                .any(|line| line.trim_start().starts_with(command)),
            "no {command} in:\n{help}"
        );
    }
    let idem = Path::new(env!("CARGO_BIN_EXE_idem"));
    assert_eq!(
        help_sections(&binary, &["worker", "--help"])?,
        help_sections(idem, &["worker", "--help"])?,
        "the worker's help has idem's sections"
    );
    let worker_help = std::process::Command::new(&binary)
        .args(["worker", "--help"])
        .output()?;
    let worker_help = String::from_utf8(worker_help.stdout)?;
    assert!(
        worker_help.contains("[default: inventory.dlq]"),
        "the dead-letter queue follows from the handler's name:\n{worker_help}"
    );

    // Its migrate applies idem's tables and the handler's own.
    let schema = unique_name();
    let migrated = tokio::process::Command::new(&binary)
        .arg("migrate")
        .env("DATABASE_URL", database_url())
        .env("IDEM_SCHEMA", &schema)
        .output()
        .await?;
    clean_up(drop_schema(schema));
    let stdout = String::from_utf8_lossy(&migrated.stdout);
    ensure!(
        migrated.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    assert!(stdout.contains("0001_reserved.sql"), "{stdout}");

    // The worker of a topology bound to nothing is told to name it.
    let unbound = tokio::time::timeout(
        patient(Duration::from_secs(10)),
        tokio::process::Command::new(&binary)
            .arg("worker")
            .env_remove("IDEM_EXCHANGE")
            .output(),
    )
    .await??;
    assert_eq!(unbound.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&unbound.stderr);
    assert!(
        stderr.starts_with("inventory: ") && stderr.contains("--exchange"),
        "{stderr}"
    );

    // Its own cargo test proves the handler through the library's check.
    let target = binary
        .parent()
        .and_then(Path::parent)
        .context("no target directory above the outside binary")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tested = tokio::time::timeout(
        patient(Duration::from_secs(600)),
        tokio::process::Command::new(cargo)
            .args(["test", "--quiet", "--", "--show-output"])
            .current_dir(dir.path())
            .env("CARGO_TARGET_DIR", target)
            .env("DATABASE_URL", database_url())
            .env("AMQP_URL", amqp_url())
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    let stdout = String::from_utf8_lossy(&tested.stdout);
    ensure!(
        tested.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&tested.stderr)
    );
    ensure!(
        stdout.contains("check passed: ") && stdout.contains("1 passed"),
        "{stdout}"
    );
    Ok(())
}

/// A directory removed when dropped.
mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> std::io::Result<Self> {
            let path = std::env::temp_dir().join(format!("idem-outside-{:08x}", fastrand::u32(..)));
            std::fs::create_dir_all(&path)?;
            Ok(Self(path))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
