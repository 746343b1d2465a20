//! `jr`: small admin commands for operators.
//!
//! - `jr decode [FILE]` reads one CBOR message body (stdin by default, e.g. piped from
//!   `nats stream get … --raw` or `--translate 'jr decode'`) and prints it as JSON; sealed task
//!   bytes are summarised, never printed.
//! - `jr health URL` exits 0 when the URL answers 2xx (container healthchecks).
//! - `jr burst show` / `jr burst set VALUE` read and set the burst tier's run-time switch (KV
//!   bucket `JR_PLACEMENT`, key `burst`); `VALUE` is `off`, `on`, `on:<0-100>` or `<0-100>%`.
//! - `jr provider drain|undrain BACKEND PROVIDER` sets a provider's run-time drain switch (key
//!   `drain.<backend>.<provider>`): nothing new is placed there, running work finishes.

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
    /// Read or set the burst tier's run-time switch.
    Burst {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(subcommand)]
        action: BurstAction,
    },
    /// Drain a provider (nothing new placed there; running work finishes) or undo it.
    Provider {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(subcommand)]
        action: ProviderAction,
    },
}

#[derive(Subcommand)]
enum ProviderAction {
    Drain { backend: String, provider: String },
    Undrain { backend: String, provider: String },
}

async fn provider(nats: NatsArgs, action: ProviderAction) -> anyhow::Result<()> {
    let (backend, name, drained) = match action {
        ProviderAction::Drain { backend, provider } => (backend, provider, true),
        ProviderAction::Undrain { backend, provider } => (backend, provider, false),
    };
    for (what, text) in [("backend", &backend), ("provider", &name)] {
        anyhow::ensure!(
            !text.is_empty()
                && text
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{text:?} is not a {what} name"
        );
    }
    let js = connect(&nats).await?;
    let store = placement_store(&js).await?;
    let key = format!("drain.{backend}.{name}");
    store
        .put(key.as_str(), if drained { "on" } else { "off" }.into())
        .await
        .map_err(|e| anyhow::anyhow!("writing {key}: {e}"))?;
    if drained {
        println!("provider {name} of backend {backend} drained: nothing new is placed there");
    } else {
        println!("provider {name} of backend {backend} takes new work again");
    }
    Ok(())
}

async fn connect(nats: &NatsArgs) -> anyhow::Result<jr_bus::async_nats::jetstream::Context> {
    use jr_bus::async_nats;
    let mut options = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(Some(1));
    if let (Some(user), Some(password)) = (nats.user.clone(), nats.password.clone()) {
        options = options.user_and_password(user, password);
    }
    let client = options
        .connect(nats.server.as_str())
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to NATS at {}: {e}", nats.server))?;
    Ok(async_nats::jetstream::new(client))
}

/// The KV bucket of the placement switches, created when missing.
async fn placement_store(
    js: &jr_bus::async_nats::jetstream::Context,
) -> anyhow::Result<jr_bus::async_nats::jetstream::kv::Store> {
    let bucket = jr_bus::permissions::PLACEMENT_BUCKET;
    match js.get_key_value(bucket).await {
        Ok(store) => Ok(store),
        Err(_) => js
            .create_key_value(jr_bus::async_nats::jetstream::kv::Config {
                bucket: bucket.to_owned(),
                history: 10,
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("creating the KV bucket {bucket}: {e}")),
    }
}

#[derive(clap::Args)]
struct NatsArgs {
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    server: String,
    /// NATS user allowed to write the KV bucket JR_PLACEMENT (e.g. `admin`).
    #[arg(long, env = "NATS_USER")]
    user: Option<String>,
    #[arg(long, env = "NATS_PASSWORD")]
    password: Option<String>,
}

#[derive(Subcommand)]
enum BurstAction {
    /// Print the switch and what the workers make of it.
    Show {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Set the switch: off, on, on:<0-100> or <0-100>% (anything else is refused here; a
    /// value written another way that workers cannot read counts as off).
    Set { value: String },
}

async fn burst(nats: NatsArgs, action: BurstAction) -> anyhow::Result<()> {
    let bucket = jr_bus::permissions::PLACEMENT_BUCKET;
    let js = connect(&nats).await?;
    match action {
        BurstAction::Show { json } => {
            let raw = match js.get_key_value(bucket).await {
                Ok(store) => store
                    .get("burst")
                    .await
                    .map_err(|e| anyhow::anyhow!("reading {bucket}/burst: {e}"))?
                    .map(|b| String::from_utf8_lossy(&b).into_owned()),
                Err(_) => None,
            };
            let (setting, warning) = match &raw {
                Some(text) => jr_placement::parse_burst(text),
                None => (jr_placement::BurstSetting::OFF, None),
            };
            let warning =
                warning.map(|w| format!("{:?} is not valid ({})", w.input, w.problem.kind()));
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "value": raw,
                        "enabled": setting.enabled,
                        "percent": setting.percent,
                        "warning": warning,
                    })
                );
            } else {
                let shown = raw.as_deref().unwrap_or("(unset)");
                if setting.enabled {
                    println!(
                        "burst {shown}: on for {}% of eligible jobs",
                        setting.percent
                    );
                } else {
                    println!("burst {shown}: off");
                }
                if let Some(w) = warning {
                    println!("warning: {w}; workers treat it as off");
                }
            }
            Ok(())
        }
        BurstAction::Set { value } => {
            let (setting, warning) = jr_placement::parse_burst(&value);
            if let Some(w) = warning {
                anyhow::bail!(
                    "{:?} is not a burst value ({}): use off, on, on:<0-100> or <0-100>%",
                    w.input,
                    w.problem.kind()
                );
            }
            let store = placement_store(&js).await?;
            store
                .put("burst", value.trim().to_owned().into())
                .await
                .map_err(|e| anyhow::anyhow!("writing {bucket}/burst: {e}"))?;
            if setting.enabled {
                println!("burst on for {}% of eligible jobs", setting.percent);
            } else {
                println!("burst off");
            }
            Ok(())
        }
    }
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

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Decode { file } => decode(file),
        Command::Health { url, timeout_secs } => {
            runtime().and_then(|rt| rt.block_on(health(&url, Duration::from_secs(timeout_secs))))
        }
        Command::Burst { nats, action } => {
            runtime().and_then(|rt| rt.block_on(burst(nats, action)))
        }
        Command::Provider { nats, action } => {
            runtime().and_then(|rt| rt.block_on(provider(nats, action)))
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
