//! The scheduler process: builds its parts from the config and runs them until shutdown.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context as _;
use jr_bus::{Bus, ConsumerOptions, ConsumerSpec, Topology};
use jr_config::Config;
use jr_telemetry::{Shutdown, TaskSet};
use tokio_util::sync::CancellationToken;

use crate::facade::{Facade, FacadeSettings, TlsSettings, serve};
use crate::fetcher::{Dispatcher, Pacing};
use crate::forges::Forges;
use crate::ledger::JetStreamLedger;
use crate::registration::SharedCredentials;
use crate::routing::Router;
use crate::seal::Sealer;
use crate::unclaimed::Unclaimed;

/// The scheduler's parts that outlive `run` (for metrics and tests).
pub struct Handles {
    pub dispatcher: Arc<Dispatcher>,
    pub facade: Arc<Facade<JetStreamLedger>>,
}

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
) -> anyhow::Result<BTreeMap<jr_protocol::BackendName, jr_worker::TokenKey>> {
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
                let parsed =
                    jr_worker::TokenKey::from_base64(&text).with_context(|| key.clone())?;
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
    config: Arc<Config>,
    bus: Bus,
    readiness: jr_telemetry::Readiness,
    dispatcher: Arc<Dispatcher>,
    facade: Arc<Facade<JetStreamLedger>>,
    listener: tokio::net::TcpListener,
    tls: Option<TlsSettings>,
    unclaimed: Arc<Unclaimed>,
    forges: Forges,
    planned: Vec<crate::forges::Planned>,
    shared: BTreeMap<String, SharedCredentials>,
    commands: ConsumerSpec,
    github_forges: Vec<crate::github_forge::GitHubForge>,
    github_clients: Arc<crate::commands::GitHubClients>,
    store: jr_bus::async_nats::jetstream::kv::Store,
    me: String,
    policy: jr_lease::Policy,
    warm: bool,
}

/// Builds the scheduler from `config`: checks what the config gives (keys, TLS, GitHub
/// credentials), declares the streams, starts the registrations' leases, builds the dispatcher
/// and the facade and binds the facade's port. Nothing talks to a forge yet.
pub async fn build(
    config: Config,
    bus: Bus,
    readiness: jr_telemetry::Readiness,
    metrics: Option<&jr_telemetry::Metrics>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Scheduler> {
    let ready = |check: &str, ok: bool| readiness.set(check, ok);
    let router = Router::from_config(&config);
    let sealer = Arc::new(sealer_from_config(&config)?);
    let tls = tls_from_config(&config)?;
    let commands = ConsumerSpec::scheduler_commands();
    let (github_forges, github_broken): (Vec<_>, Vec<_>) =
        crate::github_forge::GitHubForge::from_config(&config)
            .into_iter()
            .partition(Result::is_ok);
    let github_forges: Vec<_> = github_forges.into_iter().filter_map(Result::ok).collect();
    let github_broken: Vec<(String, anyhow::Error)> =
        github_broken.into_iter().filter_map(Result::err).collect();
    let github_clients: Arc<crate::commands::GitHubClients> = Arc::new(
        github_forges
            .iter()
            .map(|f| (f.entry.name.clone(), f.client.clone()))
            .collect(),
    );
    bus.ensure_topology_retrying(
        &Topology::new()
            .replicas(config.nats.stream_replicas)
            .stream_limits(jr_service::stream_limits(&config.nats))
            .consumer(commands.clone()),
        shutdown,
    )
    .await
    .context("declaring streams and consumers")?;
    ready("nats", true);

    // One fetching replica per registration: the holder of its lease in `JR_SCHEDULER`. It
    // registers the runner when none is known yet (the others wait for its sealed credentials)
    // and replays the tasks fetched before and still waiting for a claim when it takes over.
    let policy = jr_service::lease_policy(&config)?;
    let store = crate::request_key::open_bucket(&bus)
        .await
        .context("opening the KV bucket JR_SCHEDULER")?;
    let me = jr_bus::lease::replica_id("scheduler");
    tracing::info!(replica = %me, "scheduler replica");
    let leases: BTreeMap<String, jr_bus::lease::Leadership> = Forges::registration_names(&config)
        .into_iter()
        .map(|name| {
            let spec = jr_bus::lease::LeaseSpec {
                store: store.clone(),
                key: format!("lease.{name}"),
                me: me.clone(),
                policy,
            };
            let leadership = jr_bus::lease::spawn_lease(spec, shutdown.clone());
            (name, leadership)
        })
        .collect();
    let shared: BTreeMap<String, SharedCredentials> = leases
        .iter()
        .map(|(name, leadership)| {
            (
                name.clone(),
                SharedCredentials {
                    store: store.clone(),
                    sealer: sealer.clone(),
                    leadership: leadership.clone(),
                    registration: name.clone(),
                },
            )
        })
        .collect();

    // Each registration is established by its own intake task, below: a forge that is down or
    // refuses the runner holds up nothing else (the facade, GitHub, the other registrations).
    let (forges, planned) = Forges::plan(&config, &router);

    let backends: Vec<_> = config.enabled_backends().map(|(n, _)| n).collect();
    let max_duration: BTreeMap<_, _> = config
        .enabled_backends()
        .map(|(n, b)| (n, b.max_duration))
        .collect();
    let lookahead = config
        .enabled_backends()
        .map(|(n, b)| (n, b.lookahead))
        .collect();
    // Tasks fetched before a restart and still unclaimed need their heartbeats again. The
    // forge's endless-task timeout (3 h on Gitea) bounds how far back one can still be alive.
    let unclaimed = Arc::new(Unclaimed::new(config.forge.keepalive_interval));
    let horizon = max_duration
        .values()
        .copied()
        .max()
        .unwrap_or(std::time::Duration::from_secs(3 * 3600))
        + std::time::Duration::from_secs(600);
    let dispatcher = Arc::new(Dispatcher {
        bus: bus.clone(),
        forges: forges.clone(),
        router,
        sealer: sealer.clone(),
        forge_instance: config.forge.url.trim_end_matches('/').to_owned(),
        max_duration,
        lookahead,
        unclaimed: unclaimed.clone(),
        unclaimed_horizon: horizon,
        leases,
        stats: Default::default(),
        presence: Default::default(),
        intakes: Arc::new(crate::intakes::IntakeBoard::new(
            config.forge.flavor.as_str(),
            config.forge.layout().as_str(),
            &me,
            Some(readiness.clone()),
        )),
    });
    // A `[[github]]` entry that cannot be built is reported as its intake's error, and the
    // rest of the scheduler runs (its fix, in the config or the files it names, needs a restart).
    for (intake, error) in &github_broken {
        let why = format!("{error:#}");
        tracing::error!(%intake, error = %why, "this GitHub scale set cannot start; everything else runs");
        dispatcher
            .intakes
            .report(intake, Some(("github", "scale-set")), Some(why), true);
    }
    let token_keys = token_keys_from_config(&config)?;
    let mode: crate::facade::AuthMode = config.facade.mode.into();
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
    let facade = Arc::new(Facade::new(
        FacadeSettings {
            mode,
            trust_domain: config.facade.trust_domain.clone(),
            forges: forges.clone(),
            forge_base_url: config.forge.url.clone(),
            sealer: sealer.clone(),
            token_keys,
            limits: (&config.facade).into(),
            spiffe_path: config.facade.spiffe_path.clone(),
            insecure_plain_http: config.facade.insecure_plain_http,
        },
        JetStreamLedger::new(bus.clone(), backends, unclaimed.clone(), sealer.clone())
            .reading_token_hashes(reads_token_hashes),
    )?);
    if let Some(metrics) = metrics {
        metrics
            .registry()
            .register_collector(Box::new(crate::metrics::SchedulerCollector {
                dispatcher: dispatcher.clone(),
                facade: facade.clone(),
            }));
    }
    let listener = tokio::net::TcpListener::bind(config.facade.listen)
        .await
        .with_context(|| format!("binding facade.listen {}", config.facade.listen))?;
    tracing::info!(listen = %config.facade.listen, registrations = forges.registrations().len(), "scheduler running");

    Ok(Scheduler {
        config: Arc::new(config),
        bus,
        readiness,
        dispatcher,
        facade,
        listener,
        tls,
        unclaimed,
        forges,
        planned,
        shared,
        commands,
        github_forges,
        github_clients,
        store,
        me,
        policy,
        warm,
    })
}

impl Scheduler {
    /// Runs every part until `shutdown`, then waits for each to finish.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let Scheduler {
            config,
            bus,
            readiness,
            dispatcher,
            facade,
            listener,
            tls,
            unclaimed,
            forges,
            planned,
            shared,
            commands,
            github_forges,
            github_clients,
            store,
            me,
            policy,
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
            let (board, b, stop) = (dispatcher.intakes.clone(), bus.clone(), shutdown.clone());
            tasks.spawn("intake records", async move {
                board.run_writer(b, stop).await;
                Ok::<(), anyhow::Error>(())
            });
        }
        {
            let (u, f, b, stop) = (unclaimed, forges.clone(), bus.clone(), shutdown.clone());
            tasks.spawn("keepalive", async move {
                crate::unclaimed::run_keepalive(u, f, b, stop).await
            });
        }
        {
            let context = crate::commands::Context {
                bus: bus.clone(),
                forges: forges.clone(),
                github: github_clients.clone(),
                sealer: dispatcher.sealer.clone(),
            };
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
        // Each `[[github]]` entry: a scale set listener on the replica holding its lease.
        for forge in github_forges {
            let name = forge.entry.name.clone();
            let leadership = jr_bus::lease::spawn_lease(
                jr_bus::lease::LeaseSpec {
                    store: store.clone(),
                    key: format!("lease.github.{name}"),
                    me: me.clone(),
                    policy,
                },
                shutdown.clone(),
            );
            let (b, kv, sealer, owner, stop) = (
                bus.clone(),
                store.clone(),
                dispatcher.sealer.clone(),
                me.clone(),
                shutdown.clone(),
            );
            let board = dispatcher.intakes.clone();
            tasks.spawn("github listener", async move {
                forge
                    .run(b, kv, sealer, leadership, owner, Some(board), stop)
                    .await
            });
        }
        readiness.set("facade", true);
        let pacing = Pacing {
            poll_interval: config.forge.poll_interval,
            max_backoff: config.forge.max_backoff,
            version_reset_interval: config.forge.version_reset_interval,
            flavor: config.forge.flavor,
            task_capacity: config.forge.task_capacity,
        };
        for registration in planned {
            let credentials = shared.get(&registration.name).cloned();
            let (d, c, stop) = (dispatcher.clone(), config.clone(), shutdown.clone());
            tasks.spawn("forge registration", async move {
                crate::intake::run_registration(d, c, registration, credentials, pacing, stop)
                    .await;
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
    let mut backoff = std::time::Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let mut sub = match bus.client().subscribe(jr_bus::warm::WAKE_ALL).await {
            Ok(sub) => sub,
            Err(error) => {
                tracing::warn!(%error, "cannot subscribe to warm wake-ups; retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                continue;
            }
        };
        backoff = std::time::Duration::from_millis(100);
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
