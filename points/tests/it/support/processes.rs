//! The idem binary and the examples run as processes, their HTTP endpoints,
//! and where the repository is.

use super::*;

/// The `idem` binary with nothing of this process's environment but `PATH`,
/// pointed at `env`'s schema and topology and at the given services.
pub fn idem_command(env: &TestEnv, amqp_url: &str, database_url: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(vars::AMQP_URL, amqp_url)
        .env(vars::DATABASE_URL, database_url)
        .env(vars::SCHEMA, &env.schema)
        .envs(vars::topology(&env.topology))
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// `idem dlq replay --rate 100` of `env`'s dead letters, against the
/// database at `database_url`, once at least 100 of them are back in the
/// work queue: a replay under way, for a test to cut.
pub async fn replay_under_way(env: &TestEnv, database_url: &str) -> anyhow::Result<WorkerProcess> {
    let replay = WorkerProcess::start({
        let mut command = idem_command(env, &amqp_url(), database_url);
        command.args(["dlq", "replay", "--rate", "100"]);
        command
    })?;
    wait_for(
        "the replay to be under way",
        Duration::from_secs(60),
        || async { Ok(env.ready(&env.topology.queue).await? >= 100) },
    )
    .await?;
    Ok(replay)
}

/// What a run of `idem` printed, and its exit code.
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `idem` with `args` on `env`, against the session's servers, and
/// waits (patiently, up to a minute) for it to exit.
pub async fn run_idem(env: &TestEnv, args: &[&str]) -> anyhow::Result<Ran> {
    let output = tokio::time::timeout(
        patient(Duration::from_secs(60)),
        idem_command(env, &amqp_url(), &database_url())
            .args(args)
            .output(),
    )
    .await??;
    Ok(Ran {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

/// Runs `idem worker` as `command` says, and asserts that it exits 1 at
/// once, without retrying, with one line on stderr; returns that line.
pub async fn worker_exits_at_once(command: tokio::process::Command) -> anyhow::Result<String> {
    worker_exits_at_once_with(command, 1).await
}

/// [`worker_exits_at_once`], with exit code `code` (2 for settings that
/// can never work, as for clap's usage errors).
pub async fn worker_exits_at_once_with(
    mut command: tokio::process::Command,
    code: i32,
) -> anyhow::Result<String> {
    command.arg("worker");
    let started = std::time::Instant::now();
    let output = tokio::time::timeout(patient(Duration::from_secs(60)), command.output())
        .await
        .context("the worker did not exit")??;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(code), "{stderr}");
    assert!(
        started.elapsed() < patient(Duration::from_secs(10)),
        "it retried: {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    Ok(stderr)
}

/// `idem worker` as a real process, with its log in a file of its own.
pub struct WorkerProcess {
    child: tokio::process::Child,
    log: std::path::PathBuf,
}

impl WorkerProcess {
    /// Starts `idem worker` on `env`'s schema and topology, reaching the
    /// services at the given URLs (a proxy's, say), with extra arguments.
    pub fn spawn(
        env: &TestEnv,
        mode: Mode,
        amqp_url: &str,
        database_url: &str,
        args: &[&str],
    ) -> anyhow::Result<Self> {
        let mut command = idem_command(env, amqp_url, database_url);
        command
            .args(["worker", "--mode", mode.as_flag()])
            .args(args);
        Self::start(command)
    }

    /// Starts `command` (a worker), logging at `info` to a file of its own.
    pub fn start(mut command: tokio::process::Command) -> anyhow::Result<Self> {
        let log = std::env::temp_dir().join(format!("{}.log", unique_name()));
        let file = std::fs::File::create(&log)?;
        let child = command
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()?;
        Ok(Self { child, log })
    }

    /// SIGKILL, and wait until it is gone.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// Sends `signal` (e.g. `-TERM`) and returns at once.
    pub async fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.child.id().context("the worker already exited")?;
        let status = tokio::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "kill {signal} {pid} failed");
        Ok(())
    }

    /// Waits for it to exit, for at most `patient(timeout)`; returns its exit code.
    pub async fn wait(&mut self, timeout: Duration) -> anyhow::Result<Option<i32>> {
        let timeout = patient(timeout);
        let status = tokio::time::timeout(timeout, self.child.wait())
            .await
            .with_context(|| {
                format!(
                    "the worker did not exit within {timeout:?}; its log:\n{}",
                    self.log()
                )
            })??;
        Ok(status.code())
    }

    /// SIGTERM, then wait; asserts a clean exit.
    pub async fn stop(mut self) -> anyhow::Result<String> {
        self.signal("-TERM").await?;
        let code = self.wait(Duration::from_secs(40)).await?;
        let log = self.log();
        anyhow::ensure!(
            code == Some(0),
            "the worker exited with {code:?}; its log:\n{log}"
        );
        Ok(log)
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A port nothing listens on now, for a server a test is about to start.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET path` from the HTTP server on `127.0.0.1:port`: its status code and
/// body.
pub async fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no status line")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of the sample `name{labels…}` of a Prometheus text page whose
/// labels include every one of `labels` (`outcome="applied"`, say).
pub fn sample(page: &str, name: &str, labels: &[&str]) -> Option<f64> {
    page.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
        (metric == name && labels.iter().all(|label| rest.contains(label)))
            .then(|| value.parse().ok())?
    })
}

/// The repository's root: the library's crate, above this suite's.
pub fn repository() -> std::path::PathBuf {
    let suite = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    suite.parent().unwrap_or(suite).to_path_buf()
}

/// Example `name`'s binary, which `cargo test` builds beside this test binary
/// (`cargo test --test it` does not: a binary older than its sources would
/// test old code, so it is refused).
pub fn example_binary(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(|deps| deps.parent())
        .context("no target directory above the test binary")?;
    let binary = target.join("examples").join(name);
    let rebuild = "`cargo test` builds it, as does `cargo build --examples`";
    let built = std::fs::metadata(&binary)
        .and_then(|meta| meta.modified())
        .with_context(|| format!("{} is missing: {rebuild}", binary.display()))?;
    // The library's sources and this crate's, and the example's own
    // (the library's examples or this crate's).
    let library = repository();
    let suite = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = newest(&library.join("src"))?.max(newest(&suite.join("src"))?);
    for examples in [library.join("examples"), suite.join("examples")] {
        if examples.join(name).exists() {
            sources = sources.max(newest(&examples.join(name))?);
        }
    }
    anyhow::ensure!(
        built >= sources,
        "{} is older than its sources: {rebuild}",
        binary.display()
    );
    Ok(binary)
}

/// When the newest file under `dir` was last changed.
pub(crate) fn newest(dir: &std::path::Path) -> anyhow::Result<std::time::SystemTime> {
    let mut latest = std::time::SystemTime::UNIX_EPOCH;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let changed = if entry.file_type()?.is_dir() {
            newest(&entry.path())?
        } else {
            entry.metadata()?.modified()?
        };
        latest = latest.max(changed);
    }
    Ok(latest)
}
