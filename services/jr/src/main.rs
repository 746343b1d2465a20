//! `jr`: small admin commands for operators.
//!
//! - `jr decode [FILE]` reads one CBOR message body (stdin by default, e.g. piped from
//!   `nats stream get … --raw` or `--translate 'jr decode'`) and prints it as JSON; sealed task
//!   bytes are summarised, never printed.
//! - `jr health URL` exits 0 when the URL answers 2xx (container healthchecks).

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "jr", version, about = "jetrunner admin tool")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Decode a jetrunner CBOR message (file or stdin) to JSON.
    Decode {
        /// File holding the message body; stdin when absent or `-`.
        file: Option<String>,
    },
    /// Exit 0 if the URL answers with a 2xx status within the timeout.
    Health {
        url: String,
        #[arg(long, default_value = "3")]
        timeout_secs: u64,
    },
}

fn decode(file: Option<String>) -> anyhow::Result<()> {
    let mut bytes = Vec::new();
    match file.as_deref() {
        None | Some("-") => {
            std::io::stdin().read_to_end(&mut bytes)?;
        }
        Some(path) => bytes = std::fs::read(path)?,
    }
    let envelope =
        jr_protocol::decode(&bytes).map_err(|e| anyhow::anyhow!("not a jetrunner message: {e}"))?;
    println!(
        "{}",
        serde_json::to_string_pretty(&jr_protocol::to_json(&envelope))?
    );
    Ok(())
}

async fn health(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder().timeout(timeout).build()?;
    let status = client.get(url).send().await?.status();
    anyhow::ensure!(status.is_success(), "{url} answered {status}");
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Decode { file } => decode(file),
        Command::Health { url, timeout_secs } => {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(health(&url, Duration::from_secs(timeout_secs))),
                Err(e) => Err(e.into()),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("jr: {e}");
            ExitCode::FAILURE
        }
    }
}
