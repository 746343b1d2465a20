//! What every jetrunner binary does before and after its own work (style: small mains):
//! parse `--config`, load and validate the whole config, start telemetry, install the signal
//! handler, serve `/healthz` `/readyz` `/metrics`, connect to NATS; at the end drain and flush.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches};
use jr_bus::Bus;
use jr_config::Config;
use jr_telemetry::{LogFormat, Metrics, Readiness, Shutdown, TelemetryConfig};

#[derive(clap::Parser, Debug)]
struct Args {
    /// The jetrunner configuration file (shared by all services).
    #[arg(
        long,
        env = "JETRUNNER_CONFIG",
        default_value = "/etc/jetrunner/jetrunner.toml"
    )]
    config: PathBuf,
    /// Check FILE as every service reads it (every section, every URL parsed, every file it
    /// names present and private enough), print every problem, and exit: 0 when it is valid,
    /// 2 when not. Starts nothing.
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
}

/// The version every binary reports (`--version`, the `starting` log line, `build_info`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Parses the command line of binary `service` (its name in `--help` and `--version`).
fn parse_args(service: &'static str) -> Args {
    let matches = Args::command()
        .name(service)
        .bin_name(service)
        .version(VERSION)
        .about(format!("jetrunner {service}"))
        .get_matches();
    match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.exit(),
    }
}

/// `--check-config FILE`: every problem of the file, one a line.
fn check_config(service: &str, path: &std::path::Path) -> ExitCode {
    match jr_config::check(path) {
        Ok(config) => {
            println!(
                "{}: valid for every service (intakes: {}; backends: {})",
                path.display(),
                config.intake_names().join(", "),
                config
                    .enabled_backends()
                    .map(|(n, _)| n.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            ExitCode::SUCCESS
        }
        Err(problems) => {
            eprintln!(
                "{service}: {} has {} problem(s):",
                path.display(),
                problems.len()
            );
            for problem in &problems {
                eprintln!("  - {problem}");
            }
            ExitCode::from(2)
        }
    }
}

/// Everything a service's `run` gets from the bootstrap.
pub struct Process {
    pub config: Config,
    pub bus: Bus,
    pub metrics: Arc<Metrics>,
    pub readiness: Readiness,
    pub shutdown: Shutdown,
}

/// Runs a service binary: `ops_listen` picks the ops address from the config, `checks` are the
/// readiness checks the service reports, `run` is the service itself.
pub fn main<F, Fut>(
    service: &'static str,
    ops_listen: impl FnOnce(&Config) -> SocketAddr,
    checks: &[&str],
    run: F,
) -> ExitCode
where
    F: FnOnce(Process) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let args = parse_args(service);
    if let Some(path) = &args.check_config {
        return check_config(service, path);
    }
    let config = match jr_config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{service}: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let mut builder = if config.runtime.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(config.runtime.threads);
        b
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{service}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let telemetry = TelemetryConfig {
            service_name: format!("jetrunner-{service}"),
            log_format: match config.telemetry.log_format {
                jr_config::LogFormat::Json => LogFormat::Json,
                jr_config::LogFormat::Pretty => LogFormat::Pretty,
            },
            filter: config
                .telemetry
                .log_filter
                .clone()
                .unwrap_or_else(|| "info".to_owned()),
            otlp_endpoint: config.telemetry.otlp_endpoint.clone(),
        };
        let guard = match jr_telemetry::init(telemetry) {
            Ok(g) => g,
            Err(e) => {
                eprintln!("{service}: telemetry: {e}");
                return ExitCode::FAILURE;
            }
        };
        let code = serve(service, config, ops_listen, checks, run).await;
        guard.shutdown_async().await;
        code
    })
}

async fn serve<F, Fut>(
    service: &'static str,
    config: Config,
    ops_listen: impl FnOnce(&Config) -> SocketAddr,
    checks: &[&str],
    run: F,
) -> ExitCode
where
    F: FnOnce(Process) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let shutdown = Shutdown::new();
    let signals = tokio::spawn(shutdown.clone().trigger_on_signal());
    let metrics = Arc::new(Metrics::with_prefix("jetrunner"));
    metrics.register_build_info(service, VERSION);
    let readiness = Readiness::new();
    for check in checks {
        readiness.register(check);
    }
    let listen = ops_listen(&config);
    let ops = {
        let (m, r, s) = (metrics.clone(), readiness.clone(), shutdown.clone());
        tokio::spawn(async move { jr_telemetry::serve_ops(listen, m, r, s).await })
    };
    let (role, credentials) = match nats_identity(service, &config) {
        Ok(identity) => identity,
        Err(e) => {
            tracing::error!(error = %e, "NATS credentials");
            return ExitCode::FAILURE;
        }
    };
    let inbox = role
        .as_ref()
        .map(jr_bus::permissions::Role::inbox_prefix)
        .unwrap_or_else(|| "_INBOX".to_owned());
    let bus = match jr_bus::Bus::connect_with_inbox(&config.nats.url, service, credentials, &inbox)
        .await
    {
        // With replicated streams a direct get may come from a follower that lags behind.
        Ok(b) => b.with_replicas(config.nats.stream_replicas),
        Err(e) => {
            tracing::error!(error = %e, "cannot connect to NATS");
            return ExitCode::FAILURE;
        }
    };
    bus.metrics().register(&mut metrics.registry());
    tracing::info!(service, version = VERSION, "starting");
    let process = Process {
        config,
        bus,
        metrics,
        readiness,
        shutdown: shutdown.clone(),
    };
    let result = run(process).await;
    shutdown.trigger();
    signals.abort();
    if let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(5), ops).await {
        tracing::warn!(error = %e, "ops endpoint failed");
    }
    match result {
        Ok(()) => {
            tracing::info!(service, "stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(service, error = format!("{e:#}"), "fatal");
            ExitCode::FAILURE
        }
    }
}

/// The NATS role of binary `service` (for its inbox prefix, which its user's permissions
/// name) and its credentials: the service's own `[<section>.nats]` user, else
/// `nats.credentials_file`. Unknown binaries (tools) get neither role nor credentials of a
/// service.
fn nats_identity(
    service: &str,
    config: &Config,
) -> Result<
    (
        Option<jr_bus::permissions::Role>,
        Option<jr_bus::Credentials>,
    ),
    anyhow::Error,
> {
    use jr_bus::permissions::Role;
    let worker = |section: &jr_config::WorkerConfig, default: &str| {
        let name = section
            .backend
            .clone()
            .unwrap_or_else(|| default.to_owned());
        jr_protocol_backend(&name).map(Role::Worker)
    };
    let (section, role) = match service {
        "scheduler" => ("scheduler", Some(Role::Scheduler)),
        "pod-worker" => ("pod_worker", worker(&config.pod_worker, "pod")),
        "vm-worker" => ("vm_worker", worker(&config.vm_worker, "vm")),
        "reconciler" => ("reconciler", Some(Role::Reconciler)),
        _ => return Ok((None, None)),
    };
    let credentials = config.nats_auth(section)?.map(|auth| match auth {
        jr_config::NatsAuth::CredentialsFile(path) => jr_bus::Credentials::File(path),
        jr_config::NatsAuth::UserPassword { user, password } => {
            jr_bus::Credentials::UserPassword { user, password }
        }
        jr_config::NatsAuth::NKeySeed(seed) => jr_bus::Credentials::NKeySeed(seed),
    });
    Ok((role, credentials))
}

/// A backend name from the config; an invalid one is reported by the worker itself.
fn jr_protocol_backend(name: &str) -> Option<jr_bus::permissions::BackendName> {
    jr_bus::permissions::BackendName::new(name.to_owned()).ok()
}

/// The stream limits configured under `[nats.streams]`, for [`jr_bus::Topology::stream_limits`].
/// The lease timing of `[lease]` (the scheduler's fetch leases, the reconciler's lease).
pub fn lease_policy(config: &Config) -> anyhow::Result<jr_lease::Policy> {
    use anyhow::Context as _;
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    jr_lease::Policy::new(ms(config.lease.ttl), ms(config.lease.max_clock_skew)).context("[lease]")
}

pub fn stream_limits(nats: &jr_config::NatsConfig) -> jr_bus::StreamLimits {
    let limit = |c: &jr_config::StreamLimitConfig| jr_bus::StreamLimit {
        max_messages: i64::try_from(c.max_messages.get()).unwrap_or(i64::MAX),
        max_bytes: i64::try_from(c.max_bytes.get()).unwrap_or(i64::MAX),
    };
    jr_bus::StreamLimits {
        assignments: limit(&nats.streams.assignments),
        events: limit(&nats.streams.events),
        commands: limit(&nats.streams.commands),
    }
}

#[cfg(test)]
mod tests {
    /// Each binary takes its own role (inbox prefix) and its own section's NATS user.
    #[test]
    fn each_binary_connects_as_its_own_nats_user() {
        use jr_bus::permissions::{BackendName, Role};
        let example = include_str!("../../../config/jetrunner.toml");
        let config = jr_config::load_str(example, "config/jetrunner.toml", std::iter::empty())
            .unwrap_or_else(|e| panic!("{e}"));
        let backend = |n: &str| BackendName::new(n).unwrap_or_else(|e| panic!("{e}"));
        for (service, role, user) in [
            ("scheduler", Role::Scheduler, "scheduler"),
            ("pod-worker", Role::Worker(backend("pod")), "pod-worker"),
            ("vm-worker", Role::Worker(backend("vm")), "vm-worker"),
            ("reconciler", Role::Reconciler, "reconciler"),
        ] {
            let (got_role, credentials) =
                super::nats_identity(service, &config).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got_role, Some(role), "{service}");
            match credentials {
                Some(jr_bus::Credentials::UserPassword {
                    user: got,
                    password,
                }) => {
                    assert_eq!(got, user, "{service}");
                    assert_eq!(password, format!("dev-{user}"), "{service}");
                }
                other => panic!("{service}: {other:?}"),
            }
        }
        let (role, credentials) =
            super::nats_identity("jr", &config).unwrap_or_else(|e| panic!("{e}"));
        assert!(role.is_none() && credentials.is_none());
        // A worker serving another backend takes that backend's role.
        let env = [("JETRUNNER__VM_WORKER__BACKEND".to_owned(), "pod".to_owned())];
        let config = jr_config::load_str(example, "config/jetrunner.toml", env)
            .unwrap_or_else(|e| panic!("{e}"));
        let (role, _) =
            super::nats_identity("vm-worker", &config).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(role, Some(Role::Worker(backend("pod"))));
    }

    /// The config's defaults are the bus's defaults (the bus's apply where no config is given),
    /// and configured values reach the bus.
    #[test]
    fn stream_limits_come_from_the_config() {
        let example = include_str!("../../../config/jetrunner.toml");
        let config = jr_config::load_str(example, "config/jetrunner.toml", std::iter::empty())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            super::stream_limits(&config.nats),
            jr_bus::StreamLimits::default()
        );
        let env = [(
            "JETRUNNER__NATS__STREAMS__EVENTS".to_owned(),
            "{ max_messages = 5, max_bytes = 4096 }".to_owned(),
        )];
        let config = jr_config::load_str(example, "config/jetrunner.toml", env)
            .unwrap_or_else(|e| panic!("{e}"));
        let limits = super::stream_limits(&config.nats);
        assert_eq!(
            (limits.events.max_messages, limits.events.max_bytes),
            (5, 4096)
        );
        assert_eq!(
            limits.assignments,
            jr_bus::StreamLimits::default().assignments
        );
    }
}
