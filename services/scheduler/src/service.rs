//! The scheduler process: builds its parts from the config and runs them until shutdown.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context as _;
use jr_bus::{Bus, ConsumerOptions, ConsumerSpec, Topology};
use jr_config::Config;
use jr_telemetry::{Shutdown, TaskSet};
use tokio_util::sync::CancellationToken;

use jr_facade::{Facade, FacadeSettings, TlsSettings, serve};
use jr_gitea_intake::{Gitea, GiteaParts, Unclaimed};
use jr_github_intake::{GitHub, GitHubParts};
use jr_intake::board::IntakeBoard;
use jr_intake::sink::AssignmentSink;
use jr_intake::{ForgeCommands, Intake};
use jr_seal::Sealer;

use crate::ledger::JetStreamLedger;

pub fn sealer_from_config(config: &Config) -> anyhow::Result<Sealer> {
    let s = &config.scheduler;
    let mut keys: BTreeMap<String, String> = s.seal_keys.clone();
    if let Some(path) = &s.seal_keys_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading scheduler.seal_keys_file {}", path.display()))?;
        let table: BTreeMap<String, String> = toml::from_str(&text)
            .with_context(|| format!("{}: expected `key_id = \"base64\"` lines", path.display()))?;
        keys.extend(table);
    }
    let current = s
        .seal_key_id
        .clone()
        .or_else(|| keys.keys().next_back().cloned())
        .context("scheduler.seal_key_id / scheduler.seal_keys: the scheduler needs a seal key")?;
    Sealer::new(&current, &keys).context("scheduler.seal_keys")
}

/// The executor token keys of every enabled backend (from the `[pod_worker]`/`[vm_worker]`
/// sections of the shared file), so the facade checks tokens itself. All or nothing: without
/// every key the facade falls back to the hashes workers publish, and says so.
pub fn token_keys_from_config(
    config: &Config,
) -> anyhow::Result<BTreeMap<jr_protocol::BackendName, jr_seal::TokenKey>> {
    let mut keys = BTreeMap::new();
    let mut missing = Vec::new();
    for (section, worker, default) in [
        ("pod_worker", &config.pod_worker, "pod"),
        ("vm_worker", &config.vm_worker, "vm"),
    ] {
        let backend = worker.backend.as_deref().unwrap_or(default);
        let Some((name, _)) = config
            .enabled_backends()
            .find(|(n, _)| n.as_str() == backend)
        else {
            continue;
        };
        let key = format!("{section}.token_key");
        match jr_config::read_secret(&key, &worker.token_key, &worker.token_key_file)
            .with_context(|| format!("reading {key} for the facade"))?
        {
            Some(text) => {
                let parsed = jr_seal::TokenKey::from_base64(&text).with_context(|| key.clone())?;
                keys.insert(name, parsed);
            }
            None => missing.push(name),
        }
    }
    let unkeyed: Vec<_> = config
        .enabled_backends()
        .map(|(n, _)| n)
        .filter(|n| !keys.contains_key(n))
        .collect();
    if !unkeyed.is_empty() {
        tracing::warn!(
            ?unkeyed,
            ?missing,
            "the facade has no token key for some backends: it trusts the token hashes workers publish; give the scheduler every worker's token_key(_file), or set publish_requested on the workers"
        );
        keys.clear();
    }
    Ok(keys)
}

pub fn tls_from_config(config: &Config) -> anyhow::Result<Option<TlsSettings>> {
    let f = &config.facade;
    let (Some(cert), Some(key)) = (&f.tls_cert_file, &f.tls_key_file) else {
        return Ok(None);
    };
    TlsSettings::from_pem_files(cert, key, f.trust_bundle_file.as_deref())
        .map(Some)
        .context("facade TLS settings")
}

/// Runs the forge intakes, the facade and the command consumer until `shutdown`. A forge that
/// is down or refuses a runner is retried and reported, never the end of the scheduler.
pub async fn run(
    config: Config,
    bus: Bus,
    readiness: jr_telemetry::Readiness,
    metrics: Option<&jr_telemetry::Metrics>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    build(config, bus, readiness, metrics, &shutdown)
        .await?
        .run(shutdown)
        .await
}

/// The scheduler's parts, built and connected, not running yet.
pub struct Scheduler {
    bus: Bus,
    readiness: jr_telemetry::Readiness,
    facade: Arc<Facade<JetStreamLedger>>,
    listener: tokio::net::TcpListener,
    tls: Option<TlsSettings>,
    board: Arc<IntakeBoard>,
    /// Every source of work, each run as its own task.
    intakes: Vec<Box<dyn Intake>>,
    /// The Gitea/Forgejo forge's keepalives of unclaimed tasks, when one is configured.
    gitea: Option<Gitea>,
    commands: ConsumerSpec,
    context: crate::commands::Context,
    warm: bool,
}

/// Builds the scheduler from `config`: checks what the config gives (keys, TLS, GitHub
/// credentials), declares the streams, assembles each forge's intakes (starting their leases),
/// the facade and the command handlers, and binds the facade's port. Nothing talks to a forge
/// yet.
pub async fn build(
    config: Config,
    bus: Bus,
    readiness: jr_telemetry::Readiness,
    metrics: Option<&jr_telemetry::Metrics>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Scheduler> {
    let config = Arc::new(config);
    let sealer = Arc::new(sealer_from_config(&config)?);
    let tls = tls_from_config(&config)?;
    let commands = ConsumerSpec::scheduler_commands();
    let github = GitHub::build(&config);
    bus.ensure_topology_retrying(
        &Topology::new()
            .replicas(config.nats.stream_replicas)
            .stream_limits(jr_service::stream_limits(&config.nats))
            .consumer(commands.clone()),
        shutdown,
    )
    .await
    .context("declaring streams and consumers")?;
    readiness.set("nats", true);

    let policy = jr_service::lease_policy(&config)?;
    let store = jr_gitea_intake::request_key::open_bucket(&bus)
        .await
        .context("opening the KV bucket JR_SCHEDULER")?;
    let me = jr_bus::lease::replica_id("scheduler");
    tracing::info!(replica = %me, "scheduler replica");
    let board = Arc::new(IntakeBoard::new(
        config.forge.flavor.as_str(),
        config.forge.layout().as_str(),
        &me,
        Some(readiness.clone()),
    ));
    let sink = AssignmentSink::new(bus.clone(), sealer.clone());

    // Each intake is established and run by its own task: a forge that is down or refuses a
    // runner holds up nothing else (the facade, the other forge, the other registrations).
    let gitea = config.gitea().is_some().then(|| {
        Gitea::build(
            GiteaParts {
                config: config.clone(),
                bus: bus.clone(),
                sink: sink.clone(),
                board: board.clone(),
                store: store.clone(),
                me: &me,
                policy,
            },
            shutdown,
        )
    });
    // A `[[github]]` entry that cannot be built is reported as its intake's error, and the
    // rest of the scheduler runs (its fix, in the config or the files it names, needs a restart).
    github.report_broken(&board);
    let mut forge_commands: Vec<Arc<dyn ForgeCommands>> = Vec::new();
    let mut intakes: Vec<Box<dyn Intake>> = Vec::new();
    if let Some(gitea) = &gitea {
        forge_commands.push(Arc::new(gitea.commands()));
        intakes.extend(gitea.intakes());
    }
    forge_commands.push(Arc::new(github.commands(bus.clone())));
    let github_stats = github.stats();
    intakes.extend(github.intakes(&GitHubParts {
        bus: bus.clone(),
        store: store.clone(),
        sink: sink.clone(),
        board: board.clone(),
        me: me.clone(),
        policy,
    }));

    let token_keys = token_keys_from_config(&config)?;
    let mode: jr_facade::AuthMode = config.facade.mode.into();
    let warm_backends: Vec<&String> = config
        .backend
        .iter()
        .filter(|(_, b)| b.enabled && b.warm.as_ref().is_some_and(|w| w.max_idle() > 0))
        .map(|(name, _)| name)
        .collect();
    let warm = !warm_backends.is_empty();
    if warm && (token_keys.is_empty() || !mode.uses_token()) {
        anyhow::bail!(
            "backend(s) {warm_backends:?} keep warm executors, which authenticate with a token the facade checks itself: give the scheduler every worker's token_key(_file) and use facade.mode token or both"
        );
    }
    // With every worker's token key the facade checks tokens itself and never needs the hashes
    // workers may publish.
    let reads_token_hashes = mode.uses_token() && token_keys.is_empty();
    let directory: Arc<dyn jr_facade::ForgeDirectory> = match &gitea {
        Some(gitea) => Arc::new(gitea.forges().clone()),
        None => Arc::new(jr_gitea_intake::Forges::default()),
    };
    // Without a Gitea forge no claim ever needs a keepalive settled.
    let unclaimed = gitea.as_ref().map_or_else(
        || Arc::new(Unclaimed::new(config.forge.keepalive_interval)),
        Gitea::unclaimed,
    );
    let backends: Vec<_> = config.enabled_backends().map(|(n, _)| n).collect();
    let facade = Arc::new(Facade::new(
        FacadeSettings {
            mode,
            trust_domain: config.facade.trust_domain.clone(),
            forges: directory,
            forge_base_url: config.forge.url.clone(),
            sealer: sealer.clone(),
            token_keys,
            limits: (&config.facade).into(),
            spiffe_path: config.facade.spiffe_path.clone(),
            insecure_plain_http: config.facade.insecure_plain_http,
        },
        JetStreamLedger::new(bus.clone(), backends, unclaimed, sealer.clone())
            .reading_token_hashes(reads_token_hashes),
    )?);
    if let Some(metrics) = metrics {
        metrics
            .registry()
            .register_collector(Box::new(crate::metrics::SchedulerCollector {
                dispatcher: gitea.as_ref().map(|g| g.dispatcher.clone()),
                board: board.clone(),
                github: github_stats,
                facade: facade.clone(),
            }));
    }
    let listener = tokio::net::TcpListener::bind(config.facade.listen)
        .await
        .with_context(|| format!("binding facade.listen {}", config.facade.listen))?;
    tracing::info!(listen = %config.facade.listen, intakes = intakes.len(), "scheduler running");

    let context = crate::commands::Context {
        bus: bus.clone(),
        forges: forge_commands,
        sealer,
    };
    Ok(Scheduler {
        bus,
        readiness,
        facade,
        listener,
        tls,
        board,
        intakes,
        gitea,
        commands,
        context,
        warm,
    })
}

impl Scheduler {
    /// Runs every part until `shutdown`, then waits for each to finish.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let Scheduler {
            bus,
            readiness,
            facade,
            listener,
            tls,
            board,
            intakes,
            gitea,
            commands,
            context,
            warm,
        } = self;
        let mut tasks = TaskSet::new(Shutdown::from(shutdown.clone()));
        {
            let (f, stop) = (facade.clone(), shutdown.clone());
            tasks.spawn("facade", async move {
                serve(listener, f, tls, async move { stop.cancelled().await }).await
            });
        }
        {
            let (b, stop) = (bus.clone(), shutdown.clone());
            tasks.spawn("intake records", async move {
                board.run_writer(b, stop).await;
                Ok::<(), anyhow::Error>(())
            });
        }
        if let Some(gitea) = &gitea {
            tasks.spawn("keepalive", gitea.keepalive(shutdown.clone()));
        }
        {
            let (b, stop) = (bus.clone(), shutdown.clone());
            tasks.spawn("command consumer", async move {
                b.run_consumer(
                    &commands,
                    move |d| {
                        let context = context.clone();
                        async move { crate::commands::handle(&context, d).await }
                    },
                    ConsumerOptions::default().concurrency(4),
                    stop,
                )
                .await
            });
        }
        if warm {
            let (f, b, stop) = (facade.clone(), bus.clone(), shutdown.clone());
            tasks.spawn("warm wake-ups", async move {
                follow_warm_wakeups(b, f, stop).await;
                Ok::<(), anyhow::Error>(())
            });
        }
        readiness.set("facade", true);
        for intake in intakes {
            let stop = shutdown.clone();
            tasks.spawn(format!("intake {}", intake.name()), async move {
                intake.run(stop).await;
                Ok::<(), anyhow::Error>(())
            });
        }
        shutdown.cancelled().await;
        let report = tasks.join_all(std::time::Duration::from_secs(15)).await;
        anyhow::ensure!(
            report.is_clean(),
            "scheduler tasks failed: {:?} unfinished: {:?}",
            report.failed,
            report.unfinished
        );
        Ok(())
    }
}

/// Wakes the facade's held FetchTask calls of warm executors when their worker binds them
/// (core NATS notices on `jr.warm.>`; a lost notice only delays the executor to its next look).
async fn follow_warm_wakeups(
    bus: jr_bus::Bus,
    facade: Arc<Facade<JetStreamLedger>>,
    shutdown: CancellationToken,
) {
    use futures::StreamExt as _;
    let mut backoff = jr_bus::Backoff::new(
        std::time::Duration::from_millis(100),
        std::time::Duration::from_secs(5),
    );
    while !shutdown.is_cancelled() {
        let mut sub = match bus.client().subscribe(jr_bus::warm::WAKE_ALL).await {
            Ok(sub) => sub,
            Err(error) => {
                tracing::warn!(%error, "cannot subscribe to warm wake-ups; retrying");
                if !backoff.pause(&shutdown).await {
                    return;
                }
                continue;
            }
        };
        backoff.reset();
        loop {
            let message = tokio::select! {
                () = shutdown.cancelled() => return,
                message = sub.next() => message,
            };
            let Some(message) = message else { break };
            if let Some((_, warm)) = jr_bus::warm::parse_wake_subject(message.subject.as_str()) {
                facade.wake_warm(warm);
            }
        }
    }
}
