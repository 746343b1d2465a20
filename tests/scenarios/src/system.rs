//! The whole of jetrunner on one machine: real nats-server and PostgreSQL, the fake forge,
//! Kubernetes API and OpenSandbox server in this process, and the four service binaries as child
//! processes. Pods run the executor image's entrypoint script with the fake executor standing in
//! for act_runner (see `executor`); sandboxes run the fake executor in this process. Both talk to
//! the real facade.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use jr_bus::permissions::{BackendName, Role};
use jr_bus::testing::{NatsCluster, NatsServer, ServiceUsers, TestNats};
use jr_fake_executor::{ExecutorConfig, run_one_shot, run_one_shot_on};
use jr_fake_forge::{FakeForge, JobSpec, Outcome, Status, StopCause};
use jr_fake_kube::{FakeKube, FaultRule, SimConfig};
use jr_fake_sandbox::{FakeConfig, FakeSandbox, SandboxRun};

use crate::executor::{self, EntrypointLauncher};
use crate::pg::PgCluster;
use crate::process::{ServiceProcess, binary, free_port};

pub const JOBS_NAMESPACE: &str = "jetrunner-jobs";
pub const POOL: &str = "ci-vm";
const API_KEY: &str = "scenario-api-key";
/// The fake GitHub's personal access token (`[[github]] pat`).
pub const GITHUB_PAT: &str = "ghp_scenario";

/// What a scenario wants from the system.
#[derive(Clone, Debug)]
pub struct SystemSpec {
    pub pod_capacity: usize,
    pub vm_capacity: usize,
    /// Sandboxes the fake OpenSandbox pool holds. Defaults to twice `vm_capacity`, so only the
    /// vm-worker's own accounting keeps it within capacity (a pool exactly as large as capacity
    /// would hide an overshoot).
    pub vm_pool: Option<usize>,
    pub kube_faults: Vec<FaultRule>,
    /// How long the fake Kubernetes API takes to answer a DELETE (a slow API server).
    pub kube_delete_delay: Duration,
    pub pod_start_delay: Duration,
    pub claim_timeout: Duration,
    pub terminal_grace: Duration,
    pub lost_timeout: Duration,
    pub max_attempts: u32,
    pub forge_poll: Duration,
    /// The fake forge's behaviour (zombie timeout, Gitea's racing picks, Forgejo mode). Its
    /// reapers run every second, as the real forge's crons do.
    pub forge_behaviour: jr_fake_forge::Behaviour,
    /// `forge.flavor` (`gitea` or `forgejo`) and `forge.task_capacity`.
    pub forge_flavor: &'static str,
    pub task_capacity: usize,
    /// `forge.keepalive_interval`.
    pub keepalive: Duration,
    /// `[pod_worker]`/`[vm_worker]` `resync_interval` (default: the services' own).
    pub resync_interval: Option<Duration>,
    /// `[pod_worker]`/`[vm_worker]` `stray_grace` (default: the services' own, 60 s).
    pub stray_grace: Option<Duration>,
    /// `reconciler.unreachable_hold` (default: the service's own, 5 min).
    pub unreachable_hold: Option<Duration>,
    /// TOML appended to the generated configuration (e.g. `[[backend.pod.providers]]` tables).
    pub extra_toml: String,
    /// `backend.<name>.lookahead` of both backends.
    pub lookahead: usize,
    /// Extra environment of the scheduler process (fault hooks).
    pub scheduler_env: Vec<(String, String)>,
    pub log_filter: String,
    /// `backend.vm.opensandbox.create_timeout` (client-side limit of one create call); `None`
    /// leaves the service default (120 s).
    pub vm_create_timeout: Option<Duration>,
    /// Pods run the fake executor as a task of this process, as sandboxes do, instead of the
    /// executor image's entrypoint as a child process. The entrypoint is what the scenarios
    /// test; the benchmark uses this so that process start-up (fork, exec, dynamic loading)
    /// of the simulation does not compete with jetrunner for the machine.
    pub pod_executor_in_process: bool,
    /// Poll and heartbeat interval of the executors that run in this process (sandboxes', and
    /// Pods' with `pod_executor_in_process`).
    pub executor_poll: Duration,
    /// `forge.registration = "shared"`: one runner fetches for both backends (default: one
    /// runner per backend).
    pub shared_registration: bool,
    /// The layout a user migrating from an existing runner has: the harness registers one runner
    /// at the forge first (as an earlier act_runner did) and the configuration gives only its
    /// `forge.runner_uuid`/`runner_token`, no registration token and no `forge.registration`
    /// (so the shared layout is chosen automatically). Implies one registration for both backends.
    pub premade_runner: bool,
    /// A second replica of every service (`scheduler-b`, `reconciler-b`, `pod-worker-b`,
    /// `vm-worker-b`).
    /// Executors then reach the two facades through a harness TCP proxy on `ports.facade`, as
    /// through a Kubernetes Service: each connection goes to the next replica that accepts it.
    pub standbys: bool,
    /// `[backend.<name>.warm] min_idle` of both backends (0: no warm executors). The end
    /// invariants then expect exactly this many idle warm executors per backend and nothing else.
    pub warm_idle: usize,
    /// NATS is a three-node JetStream cluster on loopback and the streams have three replicas
    /// (`nats.stream_replicas = 3`); services get every node's URL.
    pub nats_cluster: bool,
    /// `[runtime] threads` of every service (1, the default: one thread; more: a multi-thread
    /// runtime).
    pub runtime_threads: usize,
    /// A GitHub `[[forge]]` entry (forge `gh`, scale set `jetrunner`, runners on `github_backend`)
    /// served by a fake GitHub next to the Gitea forge. Its jobs are enqueued with
    /// [`System::enqueue_github`]; the end invariants then cover them too.
    pub github: bool,
    /// The backend the GitHub scale set's runners run on (`pod` or `vm`).
    pub github_backend: &'static str,
    /// `[[github]] max_runners` (default: the backend's capacity plus its lookahead).
    pub github_max_runners: Option<u32>,
    /// `[[github]] min_idle`: warm GitHub runners kept registered and idle.
    pub github_min_idle: u32,
    /// The vm-worker (and with standbys `vm-worker-b`) is never started, although the VM
    /// backend stays configured: a deployment of the pod-worker alone. Start-up then waits for
    /// the other services only; [`System::violations`] still counts VM jobs the forge has not
    /// finished, so a scenario leaves those out itself.
    pub no_vm_worker: bool,
    /// No Gitea/Forgejo `[[forge]]` entry: a deployment serving GitHub alone (with [`SystemSpec::github`]).
    /// The fake forge still runs, and nothing may reach it.
    pub no_gitea: bool,
    /// Faults of the fake forge from its start (e.g. `error_rate` 1: the forge answers 500 to
    /// everything, as one that is down behind a proxy), until the scenario clears them.
    pub forge_faults: Option<jr_fake_forge::FaultConfig>,
    /// The fake GitHub refuses the configured token from its start (401) until the scenario
    /// calls [`FakeGitHub::set_pat`](jr_fake_github::FakeGitHub::set_pat) with
    /// [`GITHUB_PAT`].
    pub github_refuses_token: bool,
}

impl Default for SystemSpec {
    fn default() -> Self {
        Self {
            pod_capacity: 8,
            vm_capacity: 4,
            vm_pool: None,
            kube_faults: Vec::new(),
            kube_delete_delay: Duration::ZERO,
            pod_start_delay: Duration::from_millis(50),
            claim_timeout: Duration::from_secs(20),
            terminal_grace: Duration::from_secs(5),
            lost_timeout: Duration::from_secs(10),
            max_attempts: 3,
            forge_poll: Duration::from_millis(200),
            forge_behaviour: jr_fake_forge::Behaviour::default(),
            forge_flavor: "gitea",
            task_capacity: 1,
            keepalive: Duration::from_secs(180),
            extra_toml: String::new(),
            resync_interval: None,
            stray_grace: None,
            unreachable_hold: None,
            lookahead: 2,
            scheduler_env: Vec::new(),
            log_filter: "info".into(),
            vm_create_timeout: None,
            pod_executor_in_process: false,
            executor_poll: Duration::from_millis(100),
            shared_registration: false,
            premade_runner: false,
            standbys: false,
            warm_idle: 0,
            nats_cluster: false,
            runtime_threads: 1,
            github: false,
            github_backend: "pod",
            github_max_runners: None,
            github_min_idle: 0,
            no_vm_worker: false,
            no_gitea: false,
            forge_faults: None,
            github_refuses_token: false,
        }
    }
}

/// A jetrunner metadata value of a sandbox by key name, whatever the key's prefix.
pub fn sandbox_meta(metadata: &BTreeMap<String, String>, name: &str) -> Option<String> {
    metadata
        .iter()
        .find(|(k, _)| k.rsplit('/').next() == Some(name))
        .map(|(_, v)| v.clone())
}

/// Ports of the services' endpoints.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub facade: u16,
    pub scheduler_ops: u16,
    pub pod_ops: u16,
    pub vm_ops: u16,
    pub reconciler_ops: u16,
    pub status: u16,
    /// With standbys: each scheduler replica's own facade port (behind `facade`), the second
    /// scheduler's and reconciler's ops ports and the second reconciler's status API.
    pub facade_replicas: [u16; 2],
    pub scheduler_b_ops: u16,
    pub reconciler_b_ops: u16,
    pub status_b: u16,
    /// With standbys: the second pod-worker's and vm-worker's ops ports.
    pub pod_b_ops: u16,
    pub vm_b_ops: u16,
}

pub struct System {
    pub spec: SystemSpec,
    pub dir: tempfile::TempDir,
    /// Runs with the services' least-privilege users; connections without credentials (the
    /// harness, scenario checks) are its full-rights user.
    pub nats: TestNats,
    pub nats_users: ServiceUsers,
    pub pg: PgCluster,
    pub database_url: String,
    pub forge: FakeForge,
    /// With [`SystemSpec::github`].
    pub github: Option<jr_fake_github::FakeGitHub>,
    pub kube: FakeKube,
    pub sandbox: FakeSandbox,
    pub ports: Ports,
    pub scheduler: ServiceProcess,
    pub pod_worker: ServiceProcess,
    pub vm_worker: ServiceProcess,
    pub reconciler: ServiceProcess,
    /// With [`SystemSpec::standbys`]: `scheduler-b`, `reconciler-b`, `pod-worker-b` and
    /// `vm-worker-b`.
    pub standbys: Vec<ServiceProcess>,
    /// The facade proxy's accept loop (with standbys).
    facade_proxy: Option<tokio::task::JoinHandle<()>>,
    /// What the fake executor was told to report for each job the harness enqueued.
    expected: Mutex<BTreeMap<jr_fake_forge::JobId, Outcome>>,
}

/// Workloads and tasks a fault hit on purpose: their jobs' results are not the executor's.
#[derive(Clone, Debug, Default)]
pub struct Touched {
    /// Pod names and sandbox ids.
    pub workloads: HashSet<String>,
    /// Forge task ids.
    pub tasks: HashSet<i64>,
}

/// What [`System::outcome_violations`] compared.
#[derive(Debug, Default)]
pub struct OutcomeReport {
    /// Jobs whose forge result was compared with the executor's instruction.
    pub checked: usize,
    /// Jobs left out because a fault hit one of their workloads or tasks.
    pub touched: usize,
    pub violations: Vec<String>,
}

/// The result the fake executor reports for `vars` (its `JR_FAKE_OUTCOME`, default success).
pub fn instructed_outcome(vars: &BTreeMap<String, String>) -> Outcome {
    match vars.get(jr_fake_executor::VAR_OUTCOME).map(String::as_str) {
        Some("failure") => Outcome::Failure,
        _ => Outcome::Success,
    }
}

fn executor_config(env: &BTreeMap<String, String>, poll: Duration) -> Option<ExecutorConfig> {
    let mut cfg = ExecutorConfig::new(
        env.get("JETRUNNER_FACADE_URL")?.clone(),
        env.get("JETRUNNER_ASSIGNMENT_ID")?.clone(),
        env.get("JETRUNNER_RUNNER_TOKEN")?.clone(),
    );
    cfg.poll_interval = poll;
    // act_runner polls until its task comes; a warm executor may wait for minutes. A sandbox
    // whose executor gave up keeps running (as OpenSandbox reports it), so the stand-in
    // waits long.
    cfg.give_up_after = Duration::from_secs(600);
    Some(cfg)
}

/// The in-process executors' shared HTTP client for the facade (one connection pool instead of
/// one client, and one load of the system's root certificates, per executor).
#[derive(Clone)]
struct ExecutorClients {
    cached: Arc<std::sync::Mutex<Option<(String, jr_forge::ForgeClient)>>>,
    poll: Duration,
    /// The fake GitHub's URL, for GitHub jobs' runners.
    github: Option<String>,
}

impl ExecutorClients {
    fn new(poll: Duration, github: Option<String>) -> Self {
        Self {
            cached: Arc::default(),
            poll,
            github,
        }
    }

    fn for_url(&self, cfg: &ExecutorConfig) -> Option<jr_forge::ForgeClient> {
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((url, client)) = cached.as_ref()
            && *url == cfg.facade_url
        {
            return Some(client.clone());
        }
        let client = jr_forge::ForgeClient::new(&cfg.facade_url, None, cfg.request_timeout).ok()?;
        *cached = Some((cfg.facade_url.clone(), client.clone()));
        Some(client)
    }

    async fn run(&self, env: &BTreeMap<String, String>) {
        if env.get("JETRUNNER_FORGE").map(String::as_str) == Some("github") {
            if let Some(server) = &self.github
                && let Err(error) =
                    crate::executor::run_github_in_process(env, server, self.poll).await
            {
                tracing::warn!(%error, "in-process GitHub runner failed");
            }
            return;
        }
        if let Some(cfg) = executor_config(env, self.poll) {
            let _ = match self.for_url(&cfg) {
                Some(client) => run_one_shot_on(&client, cfg).await,
                None => run_one_shot(cfg).await,
            };
        }
    }
}

/// A sandbox's pool task: the same fake executor (the sandbox stays Running afterwards).
fn sandbox_runner(clients: ExecutorClients) -> jr_fake_sandbox::Runner {
    Arc::new(move |run: SandboxRun| {
        let clients = clients.clone();
        Box::pin(async move { clients.run(&run.env).await })
    })
}

/// A Pod's container as a task of this process: the fake executor with the Pod's environment,
/// exiting 0 when it ran (the entrypoint's exit status is what the scenarios check).
fn in_process_pod_runner(clients: ExecutorClients) -> jr_fake_kube::PodRunner {
    Arc::new(move |run: jr_fake_kube::PodRun| {
        let clients = clients.clone();
        Box::pin(async move {
            clients.run(&run.env).await;
            jr_fake_kube::ExitStatus::success()
        })
    })
}

/// The messages about GitHub assignments: their assignments, then their events, with their
/// stream sequences.
async fn github_messages(
    js: &jr_bus::async_nats::jetstream::Context,
) -> anyhow::Result<Vec<(u64, jr_protocol::Envelope)>> {
    let (assignments, _) =
        crate::consistency::read_stream(js, jr_protocol::STREAM_ASSIGNMENTS).await?;
    let ours: HashSet<jr_protocol::AssignmentId> = assignments
        .iter()
        .filter(|(_, e)| matches!(&e.message, jr_protocol::Message::Assignment(a) if matches!(a.forge_kind(), jr_protocol::ForgeKind::GitHub(_))))
        .map(|(_, e)| e.assignment_id)
        .collect();
    let (events, _) = crate::consistency::read_stream(js, jr_protocol::STREAM_EVENTS).await?;
    Ok(assignments
        .into_iter()
        .chain(events)
        .filter(|(_, e)| ours.contains(&e.assignment_id))
        .collect())
}

impl System {
    pub async fn start(spec: SystemSpec) -> anyhow::Result<System> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::Builder::new().prefix("jr-system-").tempdir()?;
        let backends = [BackendName::new("pod")?, BackendName::new("vm")?];
        let (nats, nats_users) = if spec.nats_cluster {
            let (cluster, users) = NatsCluster::start_with_users(&backends)
                .await
                .context("starting a three-node nats-server cluster (need ≥ 2.10 on PATH)")?;
            (TestNats::Cluster(cluster), users)
        } else {
            let (server, users) = NatsServer::start_with_users(&backends)
                .await
                .context("starting nats-server (need ≥ 2.10 on PATH)")?;
            (TestNats::Single(server), users)
        };
        let pg = PgCluster::start().await.context("starting PostgreSQL")?;
        pg.create_database("jetrunner").await?;
        let database_url = pg.url("jetrunner");
        let forge = FakeForge::start(jr_fake_forge::Config {
            registration_token: Some("scenario-registration-token".into()),
            // A Forgejo-flavoured system talks to a forge that is Forgejo (request keys,
            // several tasks per fetch), whatever else the scenario's behaviour sets.
            behaviour: jr_fake_forge::Behaviour {
                forgejo: spec.forge_behaviour.forgejo || spec.forge_flavor == "forgejo",
                ..spec.forge_behaviour.clone()
            },
            reap_interval: Some(Duration::from_secs(1)),
            faults: spec.forge_faults.clone().unwrap_or_default(),
            ..Default::default()
        })
        .await?;
        let premade = if spec.premade_runner {
            Some(register_premade_runner(forge.url()).await?)
        } else {
            None
        };
        let github = if spec.github {
            let fake = jr_fake_github::FakeGitHub::start(GITHUB_PAT).await?;
            // Jobs wait for runners to start; the listener's long poll is held as GitHub does.
            fake.set_poll_hold(Duration::from_secs(5));
            // A runner killed with its workload stops renewing its job: GitHub fails the job.
            fake.set_runner_lost_after(Some(Duration::from_secs(5)));
            if spec.github_refuses_token {
                fake.set_pat("ghp_another-token");
            }
            Some(fake)
        } else {
            None
        };
        let github_url = github.as_ref().map(jr_fake_github::FakeGitHub::url);
        let clients = ExecutorClients::new(spec.executor_poll, github_url.clone());
        let pod_runner = if spec.pod_executor_in_process {
            in_process_pod_runner(clients.clone())
        } else {
            executor::pod_runner(Arc::new(EntrypointLauncher::prepare(
                dir.path(),
                github_url.clone(),
            )?))
        };
        let kube = FakeKube::start(SimConfig {
            faults: spec.kube_faults.clone(),
            start_delay: spec.pod_start_delay,
            delete_call_delay: spec.kube_delete_delay,
            ..SimConfig::simulated(pod_runner)
        })
        .await?;
        let sandbox = FakeSandbox::start(FakeConfig {
            api_key: Some(API_KEY.into()),
            pools: BTreeMap::from([(
                POOL.to_owned(),
                spec.vm_pool.unwrap_or(spec.vm_capacity * 2),
            )]),
            stopping_for: Duration::from_millis(200),
            runner: Some(sandbox_runner(clients)),
            ..Default::default()
        })
        .await?;
        let ports = Ports {
            facade: free_port()?,
            scheduler_ops: free_port()?,
            pod_ops: free_port()?,
            vm_ops: free_port()?,
            reconciler_ops: free_port()?,
            status: free_port()?,
            facade_replicas: [free_port()?, free_port()?],
            scheduler_b_ops: free_port()?,
            reconciler_b_ops: free_port()?,
            status_b: free_port()?,
            pod_b_ops: free_port()?,
            vm_b_ops: free_port()?,
        };
        let config_path = dir.path().join("jetrunner.toml");
        let text = config_toml(
            &spec,
            &ports,
            &nats.url(),
            &database_url,
            forge.url(),
            &kube.url(),
            &sandbox.base_url(),
            &dir.path().join("runner.json").display().to_string(),
            premade.as_ref(),
        );
        let warm = if spec.warm_idle > 0 {
            format!(
                "\n[backend.pod.warm]\nmin_idle = {n}\n\n[backend.vm.warm]\nmin_idle = {n}\n",
                n = spec.warm_idle
            )
        } else {
            String::new()
        };
        let github_toml = match &github_url {
            Some(api) => format!(
                "\n[[forge]]\nkind = \"github\"\nname = \"gh\"\nurl = \"https://github.com/acme\"\napi_url = \"{api}\"\nbackend = \"{}\"\npat = \"{GITHUB_PAT}\"\nmin_idle = {}\n{}",
                spec.github_backend,
                spec.github_min_idle,
                spec.github_max_runners
                    .map(|n| format!("max_runners = {n}\n"))
                    .unwrap_or_default()
            ),
            None => String::new(),
        };
        let text = if spec.no_gitea {
            without_table(&text, "[[forge]]")
        } else {
            text
        };
        let text = text
            + &spec.extra_toml
            + &warm
            + &github_toml
            + &service_users_toml(&nats_users, &backends);
        std::fs::write(&config_path, text)?;
        let args = vec!["--config".to_owned(), config_path.display().to_string()];
        let svc = |name: &str, port| -> anyhow::Result<ServiceProcess> {
            Ok(
                ServiceProcess::new(name, binary(name)?, args.clone(), dir.path(), port)
                    .env("RUST_LOG", &spec.log_filter),
            )
        };
        let scheduler = spec
            .scheduler_env
            .iter()
            .try_fold(svc("scheduler", ports.scheduler_ops)?, |p, (k, v)| {
                anyhow::Ok(p.env(k, v))
            })?;
        let listen = |port: u16| format!("127.0.0.1:{port}");
        let (scheduler, standbys, facade_proxy) = if spec.standbys {
            let scheduler_b = ServiceProcess::new(
                "scheduler-b",
                binary("scheduler")?,
                args.clone(),
                dir.path(),
                ports.scheduler_b_ops,
            )
            .env("RUST_LOG", &spec.log_filter)
            .env(
                "JETRUNNER__FACADE__LISTEN",
                &listen(ports.facade_replicas[1]),
            )
            .env(
                "JETRUNNER__SCHEDULER__OPS_LISTEN",
                &listen(ports.scheduler_b_ops),
            );
            let scheduler_b = spec
                .scheduler_env
                .iter()
                .fold(scheduler_b, |p, (k, v)| p.env(k, v));
            let reconciler_b = ServiceProcess::new(
                "reconciler-b",
                binary("reconciler")?,
                args.clone(),
                dir.path(),
                ports.reconciler_b_ops,
            )
            .env("RUST_LOG", &spec.log_filter)
            .env(
                "JETRUNNER__RECONCILER__OPS_LISTEN",
                &listen(ports.reconciler_b_ops),
            )
            .env(
                "JETRUNNER__RECONCILER__STATUS_LISTEN",
                &listen(ports.status_b),
            );
            // Second worker replicas share their backend's capacity with the first.
            let worker_b = |kind: &str, port: u16| -> anyhow::Result<ServiceProcess> {
                let section = kind.replace('-', "_").to_uppercase();
                Ok(ServiceProcess::new(
                    &format!("{kind}-b"),
                    binary(kind)?,
                    args.clone(),
                    dir.path(),
                    port,
                )
                .env("RUST_LOG", &spec.log_filter)
                .env(&format!("JETRUNNER__{section}__OPS_LISTEN"), &listen(port))
                .env(
                    &format!("JETRUNNER__{section}__WORKER_ID"),
                    &format!("{kind}-b"),
                ))
            };
            let pod_worker_b = worker_b("pod-worker", ports.pod_b_ops)?;
            let vm_worker_b = worker_b("vm-worker", ports.vm_b_ops)?;
            let proxy = crate::proxy::spawn(ports.facade, ports.facade_replicas.to_vec()).await?;
            (
                scheduler.env(
                    "JETRUNNER__FACADE__LISTEN",
                    &listen(ports.facade_replicas[0]),
                ),
                vec![scheduler_b, reconciler_b, pod_worker_b, vm_worker_b],
                Some(proxy),
            )
        } else {
            (scheduler, Vec::new(), None)
        };
        let mut system = System {
            standbys,
            facade_proxy,
            scheduler,
            pod_worker: svc("pod-worker", ports.pod_ops)?,
            vm_worker: svc("vm-worker", ports.vm_ops)?,
            reconciler: svc("reconciler", ports.reconciler_ops)?,
            spec,
            dir,
            nats,
            nats_users,
            pg,
            database_url,
            forge,
            github,
            kube,
            sandbox,
            ports,
            expected: Mutex::new(BTreeMap::new()),
        };
        let absent = system.absent_services();
        for p in system.all_mut() {
            if !absent.contains(&p.name.as_str()) {
                p.spawn()?;
            }
        }
        for p in system.all_mut() {
            if !absent.contains(&p.name.as_str()) {
                p.wait_ready(Duration::from_secs(60)).await?;
            }
        }
        system.check_nats_users().await?;
        Ok(system)
    }

    /// The services this system never starts ([`SystemSpec::no_vm_worker`]).
    pub fn absent_services(&self) -> &'static [&'static str] {
        if self.spec.no_vm_worker {
            &["vm-worker", "vm-worker-b"]
        } else {
            &[]
        }
    }

    /// Every service is connected to NATS as its own user (not as the full-rights user that
    /// connections without credentials get), as the server's `/connz` reports.
    pub async fn check_nats_users(&self) -> anyhow::Result<()> {
        // Each server reports only its own clients: gather them from every node.
        let mut connections = Vec::new();
        for monitor in self.nats.monitor_urls() {
            let url = format!("{monitor}/connz?auth=true&limit=1024");
            let connz: serde_json::Value = reqwest::get(&url).await?.json().await?;
            connections.extend(connz["connections"].as_array().cloned().unwrap_or_default());
        }
        for (service, user) in [
            ("scheduler", "scheduler"),
            ("pod-worker", "pod-worker"),
            ("vm-worker", "vm-worker"),
            ("reconciler", "reconciler"),
        ]
        .into_iter()
        .filter(|(service, _)| !self.absent_services().contains(service))
        {
            let users: Vec<&str> = connections
                .iter()
                .filter(|c| c["name"].as_str() == Some(service))
                .map(|c| c["authorized_user"].as_str().unwrap_or(""))
                .collect();
            anyhow::ensure!(
                !users.is_empty() && users.iter().all(|u| *u == user),
                "{service} is connected to NATS as {users:?}, expected user {user}"
            );
        }
        Ok(())
    }

    /// The permission violations nats-server logged (a service used a subject its NATS user
    /// may not use).
    pub fn nats_permission_violations(&self) -> Vec<String> {
        self.nats
            .log()
            .lines()
            .filter(|l| l.contains("Violation"))
            .map(str::to_owned)
            .collect()
    }

    pub fn services_mut(&mut self) -> [&mut ServiceProcess; 4] {
        [
            &mut self.reconciler,
            &mut self.pod_worker,
            &mut self.vm_worker,
            &mut self.scheduler,
        ]
    }

    /// The four services and the standbys.
    pub fn all_mut(&mut self) -> Vec<&mut ServiceProcess> {
        let mut all: Vec<&mut ServiceProcess> = vec![
            &mut self.reconciler,
            &mut self.pod_worker,
            &mut self.vm_worker,
            &mut self.scheduler,
        ];
        all.extend(self.standbys.iter_mut());
        all
    }

    pub fn service(&mut self, name: &str) -> Option<&mut ServiceProcess> {
        self.all_mut().into_iter().find(|p| p.name == name)
    }

    /// Queues `n` jobs for the GitHub scale set (`runs-on: jetrunner`, pushes to `acme/app`);
    /// the runner stand-in fails those whose request id is a multiple of three.
    pub fn enqueue_github(&self, n: usize) -> Vec<i64> {
        let Some(github) = &self.github else {
            return Vec::new();
        };
        (0..n)
            .map(|_| github.enqueue(jr_fake_github::JobSpec::push(&["jetrunner"])))
            .collect()
    }

    /// Until every GitHub job is completed on the fake GitHub.
    pub async fn wait_github_final(&self, timeout: Duration) -> anyhow::Result<()> {
        let Some(github) = &self.github else {
            return Ok(());
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let open: Vec<_> = github
                .jobs()
                .into_iter()
                .filter(|j| !matches!(j.state, jr_fake_github::JobState::Completed { .. }))
                .map(|j| (j.request_id, j.state))
                .collect();
            if open.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("after {timeout:?} GitHub jobs not completed: {open:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The GitHub invariants on the fake GitHub: every job completed with the result its
    /// runner reports (unless `touched` names it), and no runner left registered.
    pub fn github_violations(&self, touched: &HashSet<i64>) -> Vec<String> {
        let Some(github) = &self.github else {
            return Vec::new();
        };
        let mut v = Vec::new();
        for job in github.jobs() {
            match &job.state {
                jr_fake_github::JobState::Completed { result } => {
                    // A job whose runner was killed with its workload fails on GitHub.
                    let expected = if job.runner_lost {
                        "failed"
                    } else {
                        jr_fake_executor::github_runner::github_result(job.request_id)
                    };
                    if !touched.contains(&job.request_id) && result != expected {
                        v.push(format!(
                            "GitHub job {} ended {result:?}, its runner reports {expected:?}",
                            job.request_id
                        ));
                    }
                }
                other => v.push(format!(
                    "GitHub job {} not final: {other:?}",
                    job.request_id
                )),
            }
        }
        for runner in github.runners() {
            v.push(format!(
                "GitHub runner {} left registered (started {}, job {:?})",
                runner.name, runner.started, runner.job
            ));
        }
        v
    }

    /// The GitHub invariants on the bus: each GitHub job final once (one `terminal` among the
    /// GitHub assignments names it), and no runner config readable in any message of any
    /// stream.
    pub async fn github_bus_violations(&self) -> anyhow::Result<Vec<String>> {
        let Some(github) = &self.github else {
            return Ok(Vec::new());
        };
        let mut v = Vec::new();
        let js =
            jr_bus::async_nats::jetstream::new(jr_bus::async_nats::connect(self.nats.url()).await?);
        let mut finals: BTreeMap<i64, usize> = BTreeMap::new();
        for (_, e) in github_messages(&js).await? {
            if let jr_protocol::Message::Terminal(t) = &e.message
                && t.source != jr_protocol::TerminalSource::Withdrawn
            {
                *finals.entry(t.forge_task_id).or_default() += 1;
            }
        }
        for job in github.jobs() {
            let ran = job.runner.is_some();
            let n = finals.get(&job.request_id).copied().unwrap_or(0);
            if ran && n != 1 {
                v.push(format!(
                    "GitHub job {} has {n} terminals on the bus",
                    job.request_id
                ));
            }
        }
        let secrets: Vec<String> = github
            .runners()
            .into_iter()
            .chain(github.removed_runners())
            .map(|r| r.encoded_jit_config)
            .collect();
        for stream in crate::consistency::stream_names(&js).await? {
            for (_, payload) in crate::consistency::raw_messages(&js, &stream).await? {
                if let Some(secret) = secrets
                    .iter()
                    .find(|s| payload.windows(s.len()).any(|w| w == s.as_bytes()))
                {
                    v.push(format!(
                        "a runner config ({} bytes) is readable in stream {stream}",
                        secret.len()
                    ));
                }
            }
        }
        Ok(v)
    }

    /// Every message about GitHub assignments on the bus, one line each, for failure reports.
    pub async fn github_ledger_dump(&self) -> anyhow::Result<String> {
        let js =
            jr_bus::async_nats::jetstream::new(jr_bus::async_nats::connect(self.nats.url()).await?);
        Ok(github_messages(&js)
            .await?
            .iter()
            .map(|(seq, e)| format!("{seq} {} {} {:?}\n", e.assignment_id, e.attempt, e.message))
            .collect())
    }

    /// Queues `n` jobs with `runs-on: [label]`; `vars` steer the fake executor (JR_FAKE_*).
    pub fn enqueue(&self, label: &str, n: u32, vars: &[(&str, &str)]) {
        self.enqueue_ids(label, n, vars);
    }

    /// Like [`System::enqueue`], returning the forge's ids of the new jobs.
    pub fn enqueue_ids(
        &self,
        label: &str,
        n: u32,
        vars: &[(&str, &str)],
    ) -> Vec<jr_fake_forge::JobId> {
        let spec = JobSpec {
            repo: "acme/widgets".into(),
            name: format!("{label}-job"),
            runs_on: vec![label.to_owned()],
            vars: vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            steps: 2,
            ..Default::default()
        };
        let outcome = instructed_outcome(&spec.vars);
        let ids = self.forge.enqueue_jobs(spec, n);
        let mut expected = self
            .expected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for id in &ids {
            expected.insert(*id, outcome);
        }
        ids
    }

    /// Compares every enqueued job's forge result with what its executor was told to report,
    /// except for jobs a fault hit: one of their workloads is in `touched` or was faulted by
    /// the fake Kubernetes, or their task is in `touched` or was cancelled through the forge.
    /// A job no fault touched must have run once, through a runner's report, with exactly the
    /// instructed result; anything else (a failure invented by jetrunner, a zombie, a second
    /// task) is a violation. Reads the projection to map workloads to forge tasks.
    pub async fn outcome_violations(&self, touched: &Touched) -> anyhow::Result<OutcomeReport> {
        let records = jr_store::Store::connect(&self.database_url)
            .await?
            .records()
            .await?;
        let mut workloads = touched.workloads.clone();
        for (pod, _) in self.kube.faulted_pods() {
            let name = pod.rsplit('/').next().unwrap_or(&pod).to_owned();
            workloads.insert(name);
        }
        let forge = self.forge.snapshot();
        let mut tasks = touched.tasks.clone();
        tasks.extend(
            forge
                .tasks
                .iter()
                .filter(|t| t.stop_cause == Some(StopCause::Cancelled))
                .map(|t| t.id),
        );
        for record in &records {
            let hit = record
                .workloads
                .keys()
                .any(|(_, workload)| workloads.contains(workload));
            if let (true, Some(info)) = (hit, &record.info) {
                tasks.insert(info.forge_task_id);
            }
        }
        let expected = self
            .expected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let mut report = OutcomeReport::default();
        for (id, want) in expected {
            let Some(job) = forge.job(id) else {
                report
                    .violations
                    .push(format!("job {id:?} unknown to the forge"));
                continue;
            };
            if job.task_ids.iter().any(|t| tasks.contains(t)) {
                report.touched += 1;
                continue;
            }
            report.checked += 1;
            let runs: Vec<_> = job
                .task_ids
                .iter()
                .filter_map(|t| forge.task(*t))
                .map(|t| (t.id, t.status, t.stop_cause))
                .collect();
            let as_told = job.status == Status::Done(want)
                && matches!(runs.as_slice(), [(_, status, Some(StopCause::Runner))] if *status == Status::Done(want));
            if !as_told {
                report.violations.push(format!(
                    "job {id:?}: the executor was told {}, the forge has {:?} from tasks {runs:?}",
                    want.as_str(),
                    job.status
                ));
            }
        }
        Ok(report)
    }

    /// How many of `jobs` have a final result.
    pub fn final_count(&self, jobs: &[jr_fake_forge::JobId]) -> usize {
        let s = self.forge.snapshot();
        jobs.iter()
            .filter(|id| s.job(**id).is_some_and(|j| j.status.is_final()))
            .count()
    }

    /// Waits until every one of `jobs` has a final result.
    pub async fn wait_jobs_final(
        &self,
        jobs: &[jr_fake_forge::JobId],
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let wanted: HashSet<jr_fake_forge::JobId> = jobs.iter().copied().collect();
        let done = |s: &jr_fake_forge::Snapshot| {
            s.jobs
                .iter()
                .filter(|j| wanted.contains(&j.id) && j.status.is_final())
                .count()
        };
        match self
            .forge
            .wait_until(|s| done(s) == wanted.len(), timeout)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => anyhow::bail!(
                "{e}: {} of {} jobs final",
                done(&self.forge.snapshot()),
                wanted.len()
            ),
        }
    }

    /// Waits until every job the forge knows has a final result.
    pub async fn wait_all_final(
        &self,
        timeout: Duration,
    ) -> anyhow::Result<jr_fake_forge::Snapshot> {
        self.forge
            .wait_until(|s| !s.jobs.is_empty() && s.all_final(), timeout)
            .await
            .map_err(|e| {
                let s = self.forge.snapshot();
                anyhow::anyhow!(
                    "{e}: {} of {} jobs final",
                    s.jobs
                        .iter()
                        .filter(|j| matches!(j.status, jr_fake_forge::Status::Done(_)))
                        .count(),
                    s.jobs.len()
                )
            })
    }

    /// Waits until no workload of ours exists in either backend.
    /// The configuration file the services run with: rewrite it and restart a service to
    /// change its configuration.
    pub fn config_path(&self) -> std::path::PathBuf {
        self.dir.path().join("jetrunner.toml")
    }

    /// With warm executors: until only the `warm_idle` idle warm executors of each backend
    /// are left (running, none terminating), and no token Secret but theirs.
    pub async fn wait_no_workloads(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = self.workloads_left();
            if left.pods == 0
                && left.sandboxes == 0
                && left.secrets == left.warm_pods
                && left.warm_pods == self.spec.warm_idle
                && left.warm_sandboxes == self.spec.warm_idle
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!(
                    "after {timeout:?}: {left:?} (warm executors wanted: {} per backend)",
                    self.spec.warm_idle
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What exists on the fake backends now: job workloads, and running idle warm executors
    /// (attempt 0 of a warm id; a terminating or exited one counts as a job workload left).
    pub fn workloads_left(&self) -> WorkloadsLeft {
        let pods = self.kube.pods(JOBS_NAMESPACE);
        let warm_pod = |p: &serde_json::Value| {
            p["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-0"))
                && p["metadata"]["deletionTimestamp"].is_null()
                && p["status"]["phase"].as_str() == Some("Running")
        };
        let warm_pods = pods.iter().filter(|p| warm_pod(p)).count();
        let sandboxes = self.sandbox.sandboxes();
        let warm_sandboxes = sandboxes
            .iter()
            .filter(|s| {
                sandbox_meta(&s.metadata, "attempt").as_deref() == Some("0")
                    && s.state == jr_fake_sandbox::SandboxState::Running
            })
            .count();
        WorkloadsLeft {
            pods: self.kube.records().live - warm_pods,
            warm_pods,
            sandboxes: sandboxes.len() - warm_sandboxes,
            warm_sandboxes,
            secrets: self.kube.records().secrets,
        }
    }

    /// The end-of-scenario invariants (issue: chaos suite). Returns every violation found.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let forge = self.forge.snapshot();
        for job in &forge.jobs {
            if job.fetch_count != 1 {
                v.push(format!(
                    "job {:?} fetched {} times",
                    job.id, job.fetch_count
                ));
            }
            if !matches!(job.status, jr_fake_forge::Status::Done(_)) {
                v.push(format!("job {:?} not final: {:?}", job.id, job.status));
            }
        }
        for task in &forge.tasks {
            if task.final_accepted > 1 {
                v.push(format!(
                    "task {} accepted {} final results",
                    task.id, task.final_accepted
                ));
            }
            // One final report per task reaches the forge: a retried final is answered by the
            // facade, never forwarded again.
            if task.final_reports.len() > 1 {
                v.push(format!(
                    "task {} got {} final reports ({:?}): a final after its final",
                    task.id,
                    task.final_reports.len(),
                    task.final_reports
                ));
            }
        }
        let kube = self.kube.records();
        if kube.max_live > self.spec.pod_capacity {
            v.push(format!(
                "{} live Pods at once, capacity {}",
                kube.max_live, self.spec.pod_capacity
            ));
        }
        let mut seen = HashSet::new();
        for name in &kube.created {
            if !seen.insert(name) {
                v.push(format!("Pod {name} created twice"));
            }
        }
        let left = self.workloads_left();
        if left.pods != 0 {
            v.push(format!("{} Pods left", left.pods));
        }
        if left.secrets != left.warm_pods {
            v.push(format!(
                "{} token Secrets left for {} idle warm Pods",
                left.secrets, left.warm_pods
            ));
        }
        if left.warm_pods != self.spec.warm_idle || left.warm_sandboxes != self.spec.warm_idle {
            v.push(format!(
                "{} warm Pods and {} warm sandboxes idle at the end, min_idle {}",
                left.warm_pods, left.warm_sandboxes, self.spec.warm_idle
            ));
        }
        // By the server's own view: every sandbox holding or waiting for a VM.
        if self.sandbox.max_held() > self.spec.vm_capacity {
            v.push(format!(
                "{} sandboxes held at once, capacity {}",
                self.sandbox.max_held(),
                self.spec.vm_capacity
            ));
        }
        let mut attempts = HashSet::new();
        for s in self.sandbox.created().iter().filter(|s| s.allocated) {
            let key = (
                sandbox_meta(&s.metadata, "assignment"),
                sandbox_meta(&s.metadata, "attempt"),
            );
            if !attempts.insert(key.clone()) {
                v.push(format!("two sandboxes for assignment attempt {key:?}"));
            }
        }
        if left.sandboxes != 0 {
            v.push(format!("{} sandboxes left", left.sandboxes));
        }
        v.extend(
            self.nats_permission_violations()
                .into_iter()
                .map(|l| format!("NATS refused a service: {l}")),
        );
        v
    }

    /// Copies every service's log into `dest` (created if needed), e.g. to read them after a
    /// failed scenario has removed its temp dir.
    pub fn save_logs(&mut self, dest: &std::path::Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dest)?;
        for p in self.all_mut() {
            if p.log_path().exists() {
                std::fs::copy(p.log_path(), dest.join(format!("{}.log", p.name)))?;
            }
        }
        let executors = self.dir.path().join("executors.log");
        if executors.exists() {
            std::fs::copy(&executors, dest.join("executors.log"))?;
        }
        Ok(())
    }

    /// Everything the Pods' containers (entrypoint and runner stand-in) wrote.
    pub fn executor_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("executors.log")).unwrap_or_default()
    }

    /// Tail of every service's log, for failure messages.
    pub fn logs(&mut self) -> String {
        self.all_mut()
            .iter()
            .map(|p| format!("--- {} ---\n{}\n", p.name, p.log_tail(30)))
            .collect()
    }
}

/// A scenario's NATS log outlives it when `JR_SCENARIO_NATS_LOGS` names a directory (to audit a
/// whole suite for permission violations); violations are always printed.
impl Drop for System {
    fn drop(&mut self) {
        if let Some(proxy) = self.facade_proxy.take() {
            proxy.abort();
        }
        for line in self.nats_permission_violations() {
            eprintln!("NATS refused a service: {line}");
        }
        if let Some(dir) = std::env::var_os("JR_SCENARIO_NATS_LOGS") {
            let dir = std::path::PathBuf::from(dir);
            let name = format!(
                "nats-{}-{}.log",
                std::process::id(),
                self.dir
                    .path()
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            );
            if std::fs::create_dir_all(&dir).is_ok() {
                let _ = std::fs::write(dir.join(name), self.nats.log());
            }
        }
    }
}

/// `[<service>.nats]` of every service: its own user with its password.
fn service_users_toml(users: &ServiceUsers, backends: &[BackendName]) -> String {
    Role::all(backends)
        .iter()
        .filter_map(|role| {
            let section = match role {
                Role::Scheduler => "scheduler".to_owned(),
                Role::Worker(backend) => format!("{backend}_worker"),
                Role::Reconciler => "reconciler".to_owned(),
            };
            let password = users.password(role)?;
            Some(format!(
                "\n[{section}.nats]\nuser = \"{}\"\npassword = \"{password}\"\n",
                role.user()
            ))
        })
        .collect()
}

/// `text` without the table headed `header` (its header line up to the next table's).
fn without_table(text: &str, header: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut skipping = false;
    for line in text.lines() {
        if line.starts_with('[') {
            skipping = line.trim() == header;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[allow(
    clippy::too_many_arguments,
    reason = "one flat list of endpoints, written once"
)]
fn config_toml(
    spec: &SystemSpec,
    ports: &Ports,
    nats: &str,
    database: &str,
    forge: &str,
    kube: &str,
    sandbox: &str,
    credentials: &str,
    premade: Option<&jr_forge::Credentials>,
) -> String {
    let secs = |d: Duration| format!("{}ms", d.as_millis());
    // An existing runner's credentials select the shared layout by themselves; otherwise the
    // scheduler registers with the token, in the layout the spec asks for.
    let registration = match premade {
        Some(c) => format!(
            "runner_uuid = \"{}\"\nrunner_token = \"{}\"",
            c.uuid, c.token
        ),
        None => format!(
            "registration_token = \"scenario-registration-token\"\nregistration = \"{}\"",
            if spec.shared_registration {
                "shared"
            } else {
                "per-backend"
            }
        ),
    };
    format!(
        r#"[nats]
url = "{nats}"
stream_replicas = {replicas}

[database]
url = "{database}"

[[forge]]
kind = "{flavor}"
url = "{forge}"
runner_name = "jetrunner-scenario"
{registration}
credentials_file = "{credentials}"
poll_interval = "{poll}"
max_backoff = "2s"
task_capacity = {task_capacity}
keepalive_interval = "{keepalive}"

[facade]
listen = "127.0.0.1:{facade}"
public_url = "http://127.0.0.1:{facade}"
insecure_plain_http = true

[[routing.rules]]
label = "vm"
backend = "vm"

[[routing.rules]]
label = "pod"
backend = "pod"

[backend.pod]
kind = "pod"
capacity = {pod_capacity}
lookahead = {lookahead}
labels = ["pod"]
kubernetes = {{ namespace = "{JOBS_NAMESPACE}", api_url = "{kube}" }}

[backend.pod.runner]
image = "jetrunner/executor:scenario"

[backend.vm]
kind = "vm"
capacity = {vm_capacity}
lookahead = {lookahead}
labels = ["vm"]
opensandbox = {{ url = "{sandbox}", api_key = "{API_KEY}", pool = "{POOL}", poll_interval = "200ms"{create_timeout} }}

[scheduler]
ops_listen = "127.0.0.1:{scheduler_ops}"
seal_key_id = "k1"
seal_keys = {{ k1 = "c2NlbmFyaW8tc2VhbC1rZXktc2NlbmFyaW8tc2VhbCE=" }}

[pod_worker]
ops_listen = "127.0.0.1:{pod_ops}"
token_key = "c2NlbmFyaW8tdG9rZW4ta2V5LXNjZW5hcmlvLXRva2Vu"{resync}

[vm_worker]
ops_listen = "127.0.0.1:{vm_ops}"
token_key = "c2NlbmFyaW8tdG9rZW4ta2V5LXNjZW5hcmlvLXRva2Vu"{resync}

[reconciler]
ops_listen = "127.0.0.1:{reconciler_ops}"
status_listen = "127.0.0.1:{status}"
claim_timeout = "{claim}"
terminal_grace = "{grace}"
lost_timeout = "{lost}"
max_attempts = {max_attempts}
plan_interval = "500ms"{hold}

[runtime]
threads = {threads}

[telemetry]
log_format = "json"
"#,
        threads = spec.runtime_threads,
        poll = secs(spec.forge_poll),
        flavor = spec.forge_flavor,
        task_capacity = spec.task_capacity,
        keepalive = secs(spec.keepalive),
        lookahead = spec.lookahead,
        replicas = if spec.nats_cluster { 3 } else { 1 },
        facade = ports.facade,
        pod_capacity = spec.pod_capacity,
        vm_capacity = spec.vm_capacity,
        scheduler_ops = ports.scheduler_ops,
        pod_ops = ports.pod_ops,
        vm_ops = ports.vm_ops,
        reconciler_ops = ports.reconciler_ops,
        status = ports.status,
        claim = secs(spec.claim_timeout),
        grace = secs(spec.terminal_grace),
        lost = secs(spec.lost_timeout),
        max_attempts = spec.max_attempts,
        resync = spec
            .resync_interval
            .map(|d| format!("\nresync_interval = \"{}\"", secs(d)))
            .into_iter()
            .chain(
                spec.stray_grace
                    .map(|d| format!("\nstray_grace = \"{}\"", secs(d))),
            )
            .collect::<String>(),
        hold = spec
            .unreachable_hold
            .map(|d| format!("\nunreachable_hold = \"{}\"", secs(d)))
            .unwrap_or_default(),
        create_timeout = spec
            .vm_create_timeout
            .map(|d| format!(", create_timeout = \"{}\"", secs(d)))
            .unwrap_or_default(),
    )
}

/// Registers a runner at the forge as an earlier act_runner would have (its own labels, which
/// the scheduler's `Declare` replaces), for [`SystemSpec::premade_runner`].
async fn register_premade_runner(forge_url: &str) -> anyhow::Result<jr_forge::Credentials> {
    let client = jr_forge::ForgeClient::new(forge_url, None, Duration::from_secs(10))?;
    let reply = client
        .register(&jr_forge::proto::runner::v1::RegisterRequest {
            name: "existing-runner".into(),
            token: "scenario-registration-token".into(),
            version: "v0.2.11".into(),
            labels: vec!["self-hosted".into()],
            ..Default::default()
        })
        .await
        .context("registering the pre-made runner")?;
    let runner = reply.runner.context("Register answered no runner")?;
    Ok(jr_forge::Credentials {
        uuid: runner.uuid,
        token: runner.token,
    })
}

/// What a scenario left on the fake backends (see [`System::workloads_left`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkloadsLeft {
    pub pods: usize,
    pub warm_pods: usize,
    pub sandboxes: usize,
    pub warm_sandboxes: usize,
    pub secrets: usize,
}
