//! The console's flags: `console`, and `worker --console`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

use super::{SettingError, StatusArgs, socket_addr};

use crate::console::{ConsoleConfig, ConsoleTls, DEFAULT_ADDR, Token};
use crate::vars;

/// What the console lets be seen and done, and by whom.
#[derive(Debug, Args)]
#[command(next_help_heading = "Console")]
pub(crate) struct ConsoleAccessArgs {
    /// A file holding the token actions need (instead of IDEM_CONSOLE_TOKEN,
    /// which is read from the environment only, never from a flag).
    #[arg(long, env = vars::CONSOLE_TOKEN_FILE, value_name = "FILE")]
    pub(crate) console_token_file: Option<PathBuf>,
    /// Trust this header as naming the user a reverse proxy in front of the
    /// console authenticated (e.g. X-Forwarded-User): such a user may act.
    /// Only where nothing reaches the console but through that proxy.
    #[arg(long, value_name = "HEADER")]
    pub(crate) trust_user_header: Option<String>,
    /// Show of each letter's body only its size and SHA-256, and of its
    /// headers only their names.
    #[arg(long)]
    pub(crate) hide_bodies: bool,
    /// Where discards write their letters before removing them.
    #[arg(long, value_name = "DIR", default_value = "discarded")]
    pub(crate) discard_dir: PathBuf,
    /// Let whoever may act replay a letter with a body they edited, once the
    /// handler decodes it (both bodies are kept in the audit).
    #[arg(long, env = vars::CONSOLE_ALLOW_EDITS, conflicts_with = "hide_bodies")]
    pub(crate) allow_edits: bool,
}

impl ConsoleAccessArgs {
    /// The token: from the file, or from IDEM_CONSOLE_TOKEN.
    fn token(&self) -> Result<Option<Token>, SettingError> {
        match &self.console_token_file {
            Some(file) => {
                let text = std::fs::read_to_string(file).map_err(|e| {
                    SettingError::new(format!(
                        "--console-token-file {}: cannot read it: {e}",
                        file.display()
                    ))
                })?;
                Token::new(&text).map(Some).ok_or_else(|| {
                    SettingError::new(format!(
                        "--console-token-file {}: it is empty",
                        file.display()
                    ))
                })
            }
            None => Ok(std::env::var(vars::CONSOLE_TOKEN)
                .ok()
                .and_then(|text| Token::new(&text))),
        }
    }

    /// `config` with this access, for a console listening on `addr`.
    pub(crate) fn applied(
        &self,
        mut config: ConsoleConfig,
        addr: SocketAddr,
    ) -> Result<ConsoleConfig, SettingError> {
        config.token = self.token()?;
        config.trusted_user_header = self.trust_user_header.clone();
        config.hide_bodies = self.hide_bodies;
        config.allow_edits = self.allow_edits;
        config.discard_dir.clone_from(&self.discard_dir);
        config.reading_needs_token = !addr.ip().is_loopback();
        if config.reading_needs_token
            && config.token.is_none()
            && config.trusted_user_header.is_none()
        {
            // Every page would answer 401 to everyone.
            return Err(SettingError::new(format!(
                "the console would listen on {addr}, beyond loopback, where every page needs the \
                 token, and none is set: set {} (or --console-token-file), or --trust-user-header \
                 behind a proxy that authenticates, or listen on 127.0.0.1",
                vars::CONSOLE_TOKEN
            )));
        }
        Ok(config)
    }
}

/// `console`.
#[derive(Debug, Args)]
pub(crate) struct ConsoleArgs {
    /// Where the console listens. Beyond loopback, reading needs the token
    /// too.
    #[arg(long, env = vars::CONSOLE_ADDR, default_value = DEFAULT_ADDR, value_parser = socket_addr)]
    pub(crate) http_addr: SocketAddr,
    /// Serve HTTPS with the certificate chain in this PEM file (the
    /// console's certificate first), and --tls-key.
    #[arg(long, env = vars::CONSOLE_TLS_CERT, value_name = "FILE", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert, in a PEM file.
    #[arg(long, env = vars::CONSOLE_TLS_KEY, value_name = "FILE", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) access: ConsoleAccessArgs,
    /// The group, its queues and its servers, as `status` takes them.
    #[command(flatten)]
    pub(crate) target: StatusArgs,
}

impl ConsoleArgs {
    /// Settings of `console`.
    pub(crate) fn config(&self) -> Result<ConsoleConfig, SettingError> {
        let mut target = self.target.config()?;
        // Its pages, and an action's pass beside them.
        target.database.pool_size = 4;
        let mut config = ConsoleConfig::new(target);
        if let (Some(certificate), Some(key)) = (&self.tls_cert, &self.tls_key) {
            config.tls = Some(
                ConsoleTls::from_pem_files(certificate, key)
                    .map_err(|error| SettingError::new(error.to_string()))?,
            );
        }
        self.access.applied(config, self.http_addr)
    }
}
