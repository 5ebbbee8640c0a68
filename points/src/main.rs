//! The `idem` binary: every idem command for the points handler
//! ([`idem::cli`]), and what only points has (`demo`, `bench`, `lab`,
//! `publish`'s generated load and single event, and the worker's
//! `--credits-exchange`).

use std::process::ExitCode;

use idem::cli::Service;
use idem_points::points::{self, Points};

mod tools;

fn main() -> ExitCode {
    service().run()
}

/// The points handler's commands, and the binary's own.
fn service() -> Service<Points, tools::Tools, tools::Credits, tools::Payments> {
    Service::new(Points)
        .name("idem")
        .about("idem: exactly-once effects from at-least-once RabbitMQ delivery.")
        .version(env!("CARGO_PKG_VERSION"))
        .topology(points::topology())
        .consumer_group(points::CONSUMER_GROUP)
        .commands::<tools::Tools>()
        .worker_flags::<tools::Credits>()
        .publish_sources::<tools::Payments>()
}

#[cfg(test)]
mod tests {
    use clap::FromArgMatches;

    use super::service;
    use super::tools::Tools;

    fn tool(args: &[&str]) -> Result<Tools, String> {
        let matches = service()
            .command()
            .try_get_matches_from(args)
            .map_err(|e| e.to_string())?;
        Tools::from_arg_matches(&matches).map_err(|e| e.to_string())
    }

    #[test]
    fn verify_cli() {
        service().command().debug_assert();
    }

    #[test]
    fn a_prefill_size_given_twice_is_refused_by_name() -> Result<(), String> {
        let bench = |prefill: &str| {
            let Tools::Bench(args) = tool(&["idem", "bench", "--prefill", prefill])? else {
                return Err("parsed as another command".to_owned());
            };
            args.config()
                .map(|config| config.prefill)
                .map_err(|e| e.to_string())
        };
        assert_eq!(bench("0,5000,20000")?, [0, 5000, 20000]);
        assert_eq!(
            bench("0,5000,0"),
            Err("--prefill gives 0 twice: give each size once, and --rounds to repeat them".into())
        );
        Ok(())
    }

    #[test]
    fn publish_needs_exactly_one_source() {
        let parses = |args: &[&str]| service().command().try_get_matches_from(args).is_ok();
        assert!(!parses(&["idem", "publish"]));
        assert!(!parses(&["idem", "publish", "--count", "3", "--file", "x"]));
        assert!(!parses(&["idem", "publish", "--event-id", "e"]));
        assert!(parses(&["idem", "publish", "--count", "3"]));
        assert!(parses(&["idem", "publish", "--file", "-"]));
    }

    #[test]
    fn publish_takes_the_broker_and_the_points_route_only() {
        let command = service().command();
        let publish: Vec<String> = command
            .find_subcommand("publish")
            .map(|sub| {
                sub.get_arguments()
                    .filter_map(|arg| arg.get_long().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            publish.contains(&"amqp-url".to_owned()) && publish.contains(&"exchange".to_owned())
        );
        assert!(!publish.iter().any(|flag| flag.starts_with("database")));
        assert!(!publish.contains(&"consumer-group".to_owned()));
    }
}
