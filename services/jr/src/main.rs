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
//! - `jr status`, `jr jobs [filters]`, `jr job ID|TASK`, `jr quarantine list` read the reconciler's status API
//!   (`--status-url`, `JR_STATUS_URL`): slots and queues per backend and provider, one job's
//!   timeline, the quarantined messages. Each prints text, or the API's JSON with `--json`.
//!   `jr status` also shows each intake (forge registration) of the scheduler: the labels it
//!   declares, and per backend whether its work is taken or why it waits at the forge.
//!
//! Options (`--server`, `--user`, `--password`, `--creds`, `--nkey`, `--status-url`, `--forge`,
//! `--json`) are accepted anywhere on the command line, before or after the subcommand and its
//! arguments.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod jobs;
mod provider;

use jobs::JobArgs;
use provider::{ProviderAction, provider};

#[derive(Parser)]
#[command(name = "jr", version, about = "jetrunner admin tool")]
struct Cli {
    #[command(flatten)]
    options: Options,
    #[command(subcommand)]
    command: Command,
}

/// Options every subcommand accepts, anywhere on the command line (`jr provider drain pod west
/// --server URL` and `jr --server URL provider drain pod west` are the same), as with `nats` and
/// `kubectl`. A subcommand ignores those it has no use for.
#[derive(clap::Args, Clone)]
struct Options {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    api: StatusArgs,
    /// The forge URL as configured (`forge.url`), to find a job by its forge task id.
    #[arg(long, env = "JR_FORGE_URL", global = true)]
    forge: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
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
        #[command(subcommand)]
        action: BurstAction,
    },
    /// Drain a provider (nothing new placed there; running work finishes) or undo it.
    Provider {
        #[command(subcommand)]
        action: ProviderAction,
    },
    /// Slots, queue and states per backend and provider, the burst switch, quarantine count,
    /// the scheduler's intakes.
    Status,
    /// Jobs newest first, with the status page's filters (`--forge` filters by forge).
    Jobs(JobArgs),
    /// One job's timeline: an assignment id, or a forge task id with `--forge`.
    Job {
        /// Assignment id (UUID) or forge task id (a number; needs `--forge`).
        job: String,
    },
    /// Messages the projection could not use.
    Quarantine {
        #[command(subcommand)]
        action: QuarantineAction,
    },
}

#[derive(Subcommand)]
enum QuarantineAction {
    /// The count and the most recent entries, newest first.
    List,
}

#[derive(clap::Args, Clone)]
struct StatusArgs {
    /// Base URL of the reconciler's status endpoint (`reconciler.status_listen`).
    #[arg(
        long,
        env = "JR_STATUS_URL",
        default_value = "http://127.0.0.1:8090",
        global = true
    )]
    status_url: String,
}

/// GET `path` of the status API as JSON; the API's own error message when it refuses.
async fn status_get(api: &StatusArgs, path: &str) -> anyhow::Result<serde_json::Value> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = format!("{}{path}", api.status_url.trim_end_matches('/'));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let response = client
        .get(&url)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the status API at {url}: {e}"))?;
    let status = response.status();
    let body: serde_json::Value = response
        .json()
        .await
        .map_err(|e| anyhow::anyhow!("{url} did not answer JSON ({status}): {e}"))?;
    if !status.is_success() {
        let message = body["error"].as_str().unwrap_or("no reason given");
        anyhow::bail!("{url}: {status}: {message}");
    }
    Ok(body)
}

fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

async fn status(options: &Options) -> anyhow::Result<()> {
    let body = status_get(&options.api, "/api/status").await?;
    if options.json {
        return print_json(&body);
    }
    print!("{}", render_status(&body, jr_protocol::now_ms()));
    Ok(())
}

/// `now_ms` places the intakes' times: a time of day alone when it is today's (UTC).
fn render_status(body: &serde_json::Value, now_ms: u64) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let empty = Vec::new();
    for b in body["backends"].as_array().unwrap_or(&empty) {
        let queue = b["queue_depth"]
            .as_u64()
            .map_or("?".to_owned(), |n| n.to_string());
        let oldest = b["oldest_wait_secs"]
            .as_f64()
            .map_or(String::new(), |s| format!(" (oldest for {s:.1} s)"));
        let _ = writeln!(
            out,
            "backend {}: {} of {} slots used, {} waiting{oldest}",
            b["name"].as_str().unwrap_or("?"),
            b["slots_used"].as_u64().unwrap_or(0),
            b["capacity"].as_u64().unwrap_or(0),
            queue
        );
        if let Some(providers) = b["providers"].as_object().filter(|p| !p.is_empty()) {
            let list: Vec<String> = providers
                .iter()
                .map(|(name, used)| {
                    let used = used.as_u64().unwrap_or(0);
                    let drained = b["drained"]
                        .as_array()
                        .is_some_and(|d| d.iter().any(|p| p == name.as_str()));
                    let drained = if drained { " (drained)" } else { "" };
                    match b["provider_capacity"][name].as_u64() {
                        Some(cap) => format!("{name} {used}/{cap}{drained}"),
                        None => format!("{name} {used}{drained}"),
                    }
                })
                .collect();
            let _ = writeln!(out, "  providers (slots used): {}", list.join(", "));
        }
        if let Some(states) = b["states"].as_object().filter(|s| !s.is_empty()) {
            let list: Vec<String> = states
                .iter()
                .map(|(state, n)| format!("{state} {}", n.as_u64().unwrap_or(0)))
                .collect();
            let _ = writeln!(out, "  assignments: {}", list.join(", "));
        }
    }
    let burst = &body["burst"];
    let shown = burst["value"].as_str().unwrap_or("(unset)");
    if burst["enabled"].as_bool() == Some(true) {
        let _ = writeln!(
            out,
            "burst {shown}: on for {}% of eligible jobs",
            burst["percent"].as_u64().unwrap_or(0)
        );
    } else if burst["invalid"].as_bool() == Some(true) {
        let _ = writeln!(out, "burst {shown}: not valid, workers treat it as off");
    } else {
        let _ = writeln!(out, "burst {shown}: off");
    }
    let _ = writeln!(
        out,
        "quarantined messages: {}",
        body["quarantined"].as_u64().unwrap_or(0)
    );
    render_intakes(&mut out, body, now_ms);
    out
}

/// Why a registration takes no work for a backend, in an operator's words (the status page
/// says the same).
fn blocked_reason(blocked: &str) -> &str {
    match blocked {
        "full" => "full: lookahead in use, jobs wait at the forge",
        "no-worker" => "no live worker",
        "unreachable" => "state unknown (NATS)",
        // A reason a newer scheduler knows: its own word.
        other => other,
    }
}

fn render_intakes(out: &mut String, body: &serde_json::Value, now_ms: u64) {
    use std::fmt::Write;
    if let Some(error) = body["intakes_error"].as_str() {
        let _ = writeln!(out, "intakes: cannot read JR_INTAKES: {error}");
    }
    // An older reconciler sends no intakes: nothing to say then.
    let Some(intakes) = body["intakes"].as_array() else {
        return;
    };
    if intakes.is_empty() {
        let _ = writeln!(
            out,
            "intakes: none recorded (no scheduler has written JR_INTAKES yet)"
        );
    }
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_owned();
    let count = |v: &serde_json::Value| v.as_u64().map_or("?".to_owned(), |n| n.to_string());
    for i in intakes {
        let labels: Vec<String> = i["declared_labels"]
            .as_array()
            .map(|l| l.iter().map(text).collect())
            .unwrap_or_default();
        let fetching = if i["fetching"].as_bool() == Some(true) {
            "fetching"
        } else {
            "not fetching"
        };
        let stale = if i["stale"].as_bool() == Some(true) {
            format!(
                " — STALE: last written {} by {}, its scheduler stopped",
                clock(i["updated_at_ms"].as_u64().unwrap_or(0), now_ms),
                text(&i["replica"])
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "intake {} ({}, {}): {fetching}, declares [{}]{stale}",
            text(&i["registration"]),
            text(&i["forge"]),
            text(&i["layout"]),
            labels.join(", ")
        );
        if let Some(error) = i["error"].as_str() {
            let _ = writeln!(out, "  NOT WORKING, retried: {error}");
        }
        for b in i["backends"].as_array().into_iter().flatten() {
            let counts = format!(
                "room {}, waiting {}",
                count(&b["room"]),
                count(&b["waiting"])
            );
            let state = match b["blocked"].as_str() {
                None => format!("taking work ({counts})"),
                Some(blocked) => format!(
                    "blocked — {} since {} ({counts})",
                    blocked_reason(blocked),
                    clock(b["since_ms"].as_u64().unwrap_or(0), now_ms)
                ),
            };
            let declared = if b["declared"].as_bool() == Some(false) {
                ", labels not declared"
            } else {
                ""
            };
            let _ = writeln!(out, "  {}: {state}{declared}", text(&b["backend"]));
        }
    }
}

/// `at_ms` as UTC `HH:MM:SS`, with the date in front unless it is `now_ms`'s day.
fn clock(at_ms: u64, now_ms: u64) -> String {
    const DAY_MS: u64 = 86_400_000;
    let secs = at_ms % DAY_MS / 1000;
    let time = format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    );
    if at_ms / DAY_MS == now_ms / DAY_MS {
        return time;
    }
    let (year, month, day) = civil_date(at_ms / DAY_MS);
    format!("{year:04}-{month:02}-{day:02} {time}")
}

/// The proleptic Gregorian date `days` after 1970-01-01 (H. Hinnant's `civil_from_days`), so
/// `jr` needs no calendar crate for one date.
fn civil_date(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// The assignment id of `job`: a UUID as given, or a forge task id on `forge`.
fn assignment_id(job: &str, forge: Option<&str>) -> anyhow::Result<jr_protocol::AssignmentId> {
    if let Ok(id) = job.parse::<jr_protocol::AssignmentId>() {
        return Ok(id);
    }
    let task: i64 = job.parse().map_err(|_| {
        anyhow::anyhow!("{job:?} is neither an assignment id (UUID) nor a forge task id")
    })?;
    let forge = forge.ok_or_else(|| {
        anyhow::anyhow!(
            "a forge task id needs --forge (or JR_FORGE_URL): the forge URL as configured"
        )
    })?;
    Ok(jr_protocol::AssignmentId::for_task(forge, task))
}

async fn job(job: &str, options: &Options) -> anyhow::Result<()> {
    let id = assignment_id(job, options.forge.as_deref())?;
    let body = status_get(&options.api, &format!("/api/assignments/{id}")).await?;
    if options.json {
        return print_json(&body);
    }
    print!("{}", render_timeline(&body));
    Ok(())
}

fn render_timeline(body: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "assignment {}",
        body["assignment"].as_str().unwrap_or("?")
    );
    let empty = Vec::new();
    let entries = body["timeline"].as_array().unwrap_or(&empty);
    let start = entries.first().and_then(|e| e["at"].as_u64()).unwrap_or(0);
    for e in entries {
        let at = e["at"].as_u64().unwrap_or(0);
        let attempt = e["attempt"]
            .as_u64()
            .map_or(String::new(), |a| format!("#{a}"));
        let detail = e["detail"].as_str().unwrap_or("");
        let _ = writeln!(
            out,
            "  +{:>9.3}s {:<4} {:<20} {detail}",
            at.saturating_sub(start) as f64 / 1000.0,
            attempt,
            e["step"].as_str().unwrap_or("?"),
        );
    }
    out
}

async fn quarantine(action: &QuarantineAction, options: &Options) -> anyhow::Result<()> {
    let QuarantineAction::List = action;
    let body = status_get(&options.api, "/api/quarantine").await?;
    if options.json {
        return print_json(&body);
    }
    print!("{}", render_quarantine(&body));
    Ok(())
}

fn render_quarantine(body: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let count = body["count"].as_u64().unwrap_or(0);
    let empty = Vec::new();
    let recent = body["recent"].as_array().unwrap_or(&empty);
    let _ = writeln!(out, "{count} quarantined message(s); newest first:");
    for q in recent {
        let _ = writeln!(
            out,
            "  {} seq {} on {} ({} bytes): {}",
            q["stream"].as_str().unwrap_or("?"),
            q["seq"].as_u64().unwrap_or(0),
            q["subject"].as_str().unwrap_or("?"),
            q["raw_size"].as_u64().unwrap_or(0),
            q["reason"].as_str().unwrap_or("?"),
        );
    }
    out
}

async fn connect(nats: &NatsArgs) -> anyhow::Result<jr_bus::async_nats::jetstream::Context> {
    use jr_bus::async_nats;
    let mut options = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(Some(1));
    if let (Some(user), Some(password)) = (nats.user.clone(), nats.password.clone()) {
        options = options.user_and_password(user, password);
    }
    if let Some(path) = &nats.creds {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| anyhow::anyhow!("reading the NATS credentials {}: {e}", path.display()))?;
    }
    if let Some(path) = &nats.nkey {
        let seed = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading the nkey seed {}: {e}", path.display()))?;
        options = options.nkey(seed.trim().to_owned());
    }
    let client = options
        .connect(jr_bus::server_urls(&nats.server).as_slice())
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

#[derive(clap::Args, Clone)]
struct NatsArgs {
    /// NATS server URL (several, comma-separated, for a cluster).
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true
    )]
    server: String,
    /// NATS user allowed to write the KV bucket JR_PLACEMENT (e.g. `admin`).
    #[arg(long, env = "NATS_USER", global = true)]
    user: Option<String>,
    #[arg(long, env = "NATS_PASSWORD", global = true)]
    password: Option<String>,
    /// A `.creds` file (user JWT and nkey seed, as `nsc` writes them).
    #[arg(long, env = "NATS_CREDS", global = true)]
    creds: Option<std::path::PathBuf>,
    /// A file holding the user's nkey seed (`SU...`).
    #[arg(long, env = "NATS_NKEY", global = true)]
    nkey: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum BurstAction {
    /// Print the switch and what the workers make of it.
    Show,
    /// Set the switch: off, on, on:<0-100> or <0-100>% (anything else is refused here; a
    /// value written another way that workers cannot read counts as off).
    Set { value: String },
}

async fn burst(action: BurstAction, options: &Options) -> anyhow::Result<()> {
    let bucket = jr_bus::permissions::PLACEMENT_BUCKET;
    let js = connect(&options.nats).await?;
    let json = options.json;
    match action {
        BurstAction::Show => {
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
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "value": value.trim(),
                        "enabled": setting.enabled,
                        "percent": setting.percent,
                    })
                );
            } else if setting.enabled {
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
    let Cli { options, command } = Cli::parse();
    let result = match command {
        Command::Decode { file } => decode(file),
        Command::Health { url, timeout_secs } => {
            runtime().and_then(|rt| rt.block_on(health(&url, Duration::from_secs(timeout_secs))))
        }
        Command::Burst { action } => runtime().and_then(|rt| rt.block_on(burst(action, &options))),
        Command::Provider { action } => {
            runtime().and_then(|rt| rt.block_on(provider(action, &options)))
        }
        Command::Status => runtime().and_then(|rt| rt.block_on(status(&options))),
        Command::Jobs(args) => runtime().and_then(|rt| rt.block_on(jobs::jobs(&args, &options))),
        Command::Job { job: j } => runtime().and_then(|rt| rt.block_on(job(&j, &options))),
        Command::Quarantine { action } => {
            runtime().and_then(|rt| rt.block_on(quarantine(&action, &options)))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_found_by_assignment_id_or_by_forge_task() {
        let id = jr_protocol::AssignmentId::for_task("https://forge.test", 42);
        assert_eq!(assignment_id(&id.to_string(), None).expect("uuid"), id);
        assert_eq!(
            assignment_id("42", Some("https://forge.test/")).expect("task"),
            id
        );
        assert!(
            assignment_id("42", None).is_err(),
            "a task id needs the forge"
        );
        assert!(assignment_id("x42", Some("https://forge.test")).is_err());
    }

    #[test]
    fn text_renderings_show_the_figures() {
        let status = serde_json::json!({
            "backends": [{"name": "pod", "capacity": 4, "slots_used": 3, "queue_depth": 7,
                          "states": {"running": 2}, "providers": {"east": 2, "west": 1}, "drained": ["west"],
                          "provider_capacity": {"east": 3},
                          "oldest_wait_secs": 12.34}],
            "quarantined": 5,
            "burst": {"value": "on:30", "enabled": true, "percent": 30, "invalid": false},
            "intakes": [{"registration": "shared", "forge": "gitea", "layout": "shared",
                         "declared_labels": ["vm"], "fetching": true, "replica": "scheduler_1",
                         "updated_at_ms": 1_709_294_590_000_u64, "stale": false,
                         "backends": [
                             {"backend": "pod", "blocked": "no-worker", "room": 0, "waiting": 3,
                              "declared": false, "since_ms": 1_709_294_584_000_u64},
                             {"backend": "vm", "blocked": null, "room": 2, "waiting": 0,
                              "declared": true, "since_ms": 1_709_251_200_000_u64}]},
                        {"registration": "vm", "forge": "forgejo", "layout": "per-backend",
                         "declared_labels": ["vm", "vm-large"], "fetching": false,
                         "replica": "scheduler_0", "updated_at_ms": 1_709_164_800_000_u64,
                         "stale": true,
                         "backends": [{"backend": "vm", "blocked": "full", "room": 0,
                                       "waiting": 4, "declared": true,
                                       "since_ms": 1_709_164_000_000_u64}]}]
        });
        // 2024-03-01 12:03:30 UTC.
        let now = 1_709_294_610_000;
        let text = render_status(&status, now);
        assert!(
            text.contains("backend pod: 3 of 4 slots used, 7 waiting"),
            "{text}"
        );
        assert!(text.contains("east 2/3, west 1 (drained)"), "{text}");
        assert!(
            text.contains("burst on:30: on for 30% of eligible jobs"),
            "{text}"
        );
        assert!(text.contains("quarantined messages: 5"), "{text}");
        assert!(
            text.contains("intake shared (gitea, shared): fetching, declares [vm]\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "  pod: blocked — no live worker since 12:03:04 UTC (room 0, waiting 3), labels not declared\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("  vm: taking work (room 2, waiting 0)\n"),
            "{text}"
        );
        // A record from another day carries its date; a stale one says its scheduler stopped.
        assert!(
            text.contains(
                "intake vm (forgejo, per-backend): not fetching, declares [vm, vm-large] — STALE: last written 2024-02-29 00:00:00 UTC by scheduler_0"
            ),
            "{text}"
        );
        assert!(
            text.contains("  vm: blocked — full: lookahead in use, jobs wait at the forge since 2024-02-28 23:46:40 UTC (room 0, waiting 4)\n"),
            "{text}"
        );
        // An intake whose forge refuses it says why.
        let refused = render_status(
            &serde_json::json!({"backends": [], "intakes": [{"registration": "github.gh",
                "forge": "github", "layout": "scale-set", "declared_labels": [], "fetching": false,
                "backends": [], "replica": "scheduler_1", "updated_at_ms": now, "stale": false,
                "error": "registration token: HTTP 401: Bad credentials"}]}),
            now,
        );
        assert!(
            refused.contains(
                "intake github.gh (github, scale-set): not fetching, declares []\n  NOT WORKING, retried: registration token: HTTP 401: Bad credentials\n"
            ),
            "{refused}"
        );
        let unreadable = render_status(
            &serde_json::json!({"backends": [], "intakes_error": "key-value bucket JR_INTAKES: timed out"}),
            now,
        );
        assert!(
            unreadable.contains(
                "intakes: cannot read JR_INTAKES: key-value bucket JR_INTAKES: timed out"
            ),
            "{unreadable}"
        );
        let timeline = serde_json::json!({"assignment": "a", "timeline": [
            {"at": 1000, "attempt": 1, "step": "fetched", "detail": null},
            {"at": 3500, "attempt": 1, "step": "claimed", "detail": "token"}]});
        let text = render_timeline(&timeline);
        assert!(text.contains("+    2.500s #1   claimed"), "{text}");
        let q = serde_json::json!({"count": 1, "recent": [{"stream": "JR_EVENTS", "seq": 9,
            "subject": "jr.event.x", "raw_size": 3, "reason": "undecodable"}]});
        assert!(
            render_quarantine(&q).contains("JR_EVENTS seq 9 on jr.event.x (3 bytes): undecodable")
        );
    }
}
