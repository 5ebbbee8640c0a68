//! No password reaches the output of any subcommand, in either log format,
//! whatever the shape of the connection string that carries it: the forms
//! found by trying (an unencoded `/`, `#` or `@` in the password, a scheme
//! without its colon, a spaced or quoted key/value password) and a corpus
//! of malformed ones.

use std::time::Duration;

use futures::StreamExt;

use idem::vars;

use crate::support::{
    TestEnv, amqp_host_port, amqp_url, database_url, idem_command, patient, postgres_host_port,
};

/// The password of every string below: it must never be seen.
const PASSWORD: &str = "Pw0rdThatMustNotLeak";

fn amqp_corpus() -> Vec<String> {
    let (p, broker) = (PASSWORD, amqp_host_port());
    vec![
        format!("amqp://guest:{p}@{broker}/%2f"),
        format!("amqp://guest:pa/{p}@{broker}/%2f"),
        format!("amqp://guest:pa#{p}@{broker}/%2f"),
        format!("amqp://guest:p@{p}@{broker}/%2f"),
        format!("amqp//guest:{p}@{broker}/%2f"),
        format!("amqp:/guest:{p}@{broker}/%2f"),
        format!("amqps://guest:{p}@{broker}/%2f"),
        format!("amqp://guest:{p}@{broker}/%2f?heartbeat=often"),
        format!("amqp://guest:{p}@no-such-host.invalid/%2f"),
        format!("guest:{p}@{broker}"),
        format!("amqp://guest:{p}@[::1:5672/%2f"),
        format!("amqp://guest:{p}"),
        format!("amqp://guest:{p}@{broker}/%2f%zz"),
        // Several nodes: a refused one, then one that is malformed, or one
        // that refuses the password.
        format!("amqp://guest:{p}@127.0.0.1:1/%2f,amqp://guest:{p}@{broker}/%2f"),
        format!("amqp://guest:guest@127.0.0.1:1/%2f,amqp://guest:{p}@[::1:5672/%2f"),
        format!("amqp://guest:{p}@no-such-host.invalid/%2f,amqp//guest:{p}@{broker}/%2f"),
        format!("amqp://guest:{p}@{broker}/%2f,"),
    ]
}

fn postgres_corpus() -> Vec<String> {
    let (p, server) = (PASSWORD, postgres_host_port());
    let (host, port) = server.rsplit_once(':').unwrap_or((&server, "5432"));
    vec![
        format!("postgres://idem_no_such_role:{p}@{server}/postgres"),
        format!("postgres://u:pa/{p}@{server}/postgres"),
        format!("postgres://u:pa#{p}@{server}/postgres"),
        format!("postgres://u:p@{p}@{server}/postgres"),
        format!("postgres//u:{p}@{server}/postgres"),
        format!("postgres://u:{p}@127.0.0.1:notaport/postgres"),
        format!("postgres://{server}/postgres?user=u&password={p}"),
        format!("postgres://{server}/postgres?password={p}&sslmode=bogus"),
        format!("postgres://u:{p}@127.0.0.1:1/postgres"),
        format!("host={host} port={port} user=u password={p}"),
        format!("host={host} port={port} user=u password = {p}"),
        format!("host={host} port={port} user=u password='a {p}'"),
        format!("host={host} port={port} user=u password='{p}"),
        format!("host={host} port={port} user=u password {p}"),
        format!("host={host} port=1 user=u password={p}"),
    ]
}

/// For `idem lab`'s Redis.
fn redis_corpus() -> Vec<String> {
    let p = PASSWORD;
    vec![
        format!("redis://:{p}@127.0.0.1:6379"),
        format!("redis://user:{p}@127.0.0.1:6379/0"),
        format!("redis://:{p}@127.0.0.1:1"),
        format!("rediss://:{p}@127.0.0.1:6379"),
        format!("redis://:pa/{p}@127.0.0.1:6379"),
        format!("redis://:p@{p}@127.0.0.1:6379"),
        format!("redis//:{p}@127.0.0.1:6379"),
        format!("redis://:{p}@[::1:6379"),
        format!("redis://:{p}@127.0.0.1:6379/notadb"),
        p.to_owned(),
    ]
}

/// The smallest lab, should one of the strings above let it run.
const LAB: &[&str] = &[
    "lab",
    "--strategies",
    "redis",
    "--events",
    "1",
    "--load",
    "1",
    "--rounds",
    "1",
];

/// Every subcommand, with what it needs to get as far as a connection.
const SUBCOMMANDS: &[&[&str]] = &[
    &["migrate"],
    &["worker"],
    &[
        "publish",
        "--event-id",
        "e",
        "--order-id",
        "o",
        "--points",
        "1",
    ],
    &["requeue", "--dry-run"],
    &["relay", "--until-empty"],
    &["dlq", "summary"],
    &["demo"],
    &[
        "bench",
        "--messages",
        "10",
        "--rounds",
        "1",
        "--modes",
        "ceiling",
    ],
    LAB,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_password_reaches_any_output_whatever_the_shape_of_its_connection_string()
-> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let mut runs = Vec::new();
    for (variable, corpus, subcommands) in [
        (vars::AMQP_URL, amqp_corpus(), SUBCOMMANDS),
        (vars::DATABASE_URL, postgres_corpus(), SUBCOMMANDS),
        (vars::REDIS_URL, redis_corpus(), &[LAB] as &[&[&str]]),
    ] {
        for url in corpus {
            for args in subcommands {
                for format in ["text", "json"] {
                    runs.push((variable, url.clone(), *args, format));
                }
            }
        }
    }
    let env = &env;
    let outputs: Vec<anyhow::Result<(String, String)>> = futures::stream::iter(runs)
        .map(|(variable, url, args, format)| async move {
            let mut command = idem_command(env, &amqp_url(), &database_url());
            command
                .env(variable, &url)
                .env(vars::STARTUP_TIMEOUT, "1s")
                .args(["--log-format", format])
                .args(args);
            let output =
                tokio::time::timeout(patient(Duration::from_secs(60)), command.output()).await??;
            let what = format!(
                "{variable}={url} idem --log-format {format} {}",
                args.join(" ")
            );
            let said = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            Ok((what, said))
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let mut leaks = Vec::new();
    let mut runs = 0;
    for output in outputs {
        let (what, said) = output?;
        runs += 1;
        if said.contains(PASSWORD) {
            leaks.push(format!("{what}\n  said: {said}"));
        }
    }
    assert_eq!(
        runs,
        ((amqp_corpus().len() + postgres_corpus().len()) * SUBCOMMANDS.len()
            + redis_corpus().len())
            * 2
    );
    assert!(
        leaks.is_empty(),
        "the password leaked:\n{}",
        leaks.join("\n")
    );
    Ok(())
}
