//! The chaos driver: a seeded schedule of faults played against a running [`System`], with a
//! log of everything it did (print it when a scenario fails; rerun with the same seed through
//! `JR_CHAOS_SEED`).
//!
//! Faults: SIGKILL a service and start it again after a pause; kill and restart nats-server or
//! PostgreSQL; evict a running Pod; fail a running sandbox; cancel a running forge task. Which
//! Pod, sandbox or task is hit depends on what is running at that moment, so a seed fixes the
//! kinds and times of the faults, not every target. While it runs the driver also acts as the
//! supervisor a Deployment would be: a service that exits on its own is started again.

use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom as _, SliceRandom as _};
use rand::{Rng as _, SeedableRng as _};

use crate::process::{ServiceProcess, binary};
use crate::system::{JOBS_NAMESPACE, System, Touched};

/// The services the driver kills.
pub const SERVICES: [&str; 4] = ["scheduler", "pod-worker", "vm-worker", "reconciler"];

/// One fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL the service, start it again after `down`.
    KillService {
        service: &'static str,
        down: Duration,
    },
    /// SIGKILL nats-server, start it again (same port and store) after `down`.
    RestartNats { down: Duration },
    /// Immediate-mode stop of PostgreSQL, start again after `down`.
    RestartPostgres { down: Duration },
    /// Evict one running jetrunner Pod.
    EvictPod,
    /// Mark one running sandbox `Failed`.
    FailSandbox,
    /// Cancel one running forge task (as a user would).
    CancelTask,
}

impl Action {
    /// Short name of the kind (for counting).
    pub fn kind(&self) -> &'static str {
        match self {
            Action::KillService { .. } => "kill-service",
            Action::RestartNats { .. } => "restart-nats",
            Action::RestartPostgres { .. } => "restart-postgres",
            Action::EvictPod => "evict-pod",
            Action::FailSandbox => "fail-sandbox",
            Action::CancelTask => "cancel-task",
        }
    }

    pub const KINDS: [&'static str; 6] = [
        "kill-service",
        "restart-nats",
        "restart-postgres",
        "evict-pod",
        "fail-sandbox",
        "cancel-task",
    ];
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::KillService { service, down } => write!(f, "kill -9 {service} (down {down:?})"),
            Action::RestartNats { down } => write!(f, "kill -9 nats-server (down {down:?})"),
            Action::RestartPostgres { down } => write!(f, "crash postgres (down {down:?})"),
            Action::EvictPod => f.write_str("evict a running Pod"),
            Action::FailSandbox => f.write_str("fail a running sandbox"),
            Action::CancelTask => f.write_str("cancel a running task"),
        }
    }
}

/// Shape of a chaos run.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    pub seed: u64,
    /// Faults are scheduled within this window from the start of [`Chaos::run`].
    pub duration: Duration,
    /// Pause between two faults, drawn uniformly from this range.
    pub gap: (Duration, Duration),
    /// Longest outage of a service, NATS or Postgres.
    pub max_down: Duration,
    /// The kinds of fault drawn ([`Action::KINDS`] by default).
    pub kinds: Vec<&'static str>,
}

impl ChaosConfig {
    pub fn new(seed: u64, duration: Duration) -> Self {
        Self {
            seed,
            duration,
            gap: (Duration::from_millis(1500), Duration::from_millis(4000)),
            max_down: Duration::from_secs(3),
            kinds: Action::KINDS.to_vec(),
        }
    }
}

/// `JR_CHAOS_SEED` when set (to replay a failed run), else a fresh random seed.
pub fn seed_from_env() -> u64 {
    std::env::var("JR_CHAOS_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(rand::random)
}

/// Something down that comes back at a given time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Revive {
    Service(&'static str),
    Nats,
    Postgres,
}

pub struct Chaos {
    config: ChaosConfig,
    rng: StdRng,
    schedule: Vec<(Duration, Action)>,
    next: usize,
    pending: Vec<(Instant, Revive)>,
    last_respawn: Vec<(&'static str, Instant)>,
    started: Instant,
    log: Vec<String>,
    done: Vec<&'static str>,
    /// Services actually killed, one entry per kill.
    killed: Vec<&'static str>,
    /// When the scheduler was killed (wall clock, comparable with the fake forge's times).
    scheduler_kills: Vec<SystemTime>,
    touched: Touched,
}

fn between(rng: &mut StdRng, lo: Duration, hi: Duration) -> Duration {
    if hi <= lo {
        lo
    } else {
        rng.random_range(lo..hi)
    }
}

impl Chaos {
    /// Draws the whole schedule from the seed. The first faults are one of every kind, with a
    /// kill of every service (in a seeded order), so every run disrupts every service, NATS and
    /// PostgreSQL and exercises every kind; the rest are drawn with weights.
    pub fn new(config: ChaosConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(config.seed);
        let max_down = config.max_down.max(Duration::from_millis(200));
        let draw_kind = |rng: &mut StdRng, kind: &str| -> Action {
            match kind {
                "kill-service" => Action::KillService {
                    service: SERVICES.choose(rng).copied().unwrap_or("scheduler"),
                    down: between(rng, Duration::ZERO, max_down),
                },
                "restart-nats" => Action::RestartNats {
                    down: between(rng, Duration::from_millis(200), max_down),
                },
                "restart-postgres" => Action::RestartPostgres {
                    down: between(rng, Duration::from_millis(500), max_down),
                },
                "evict-pod" => Action::EvictPod,
                "fail-sandbox" => Action::FailSandbox,
                _ => Action::CancelTask,
            }
        };
        let mut first: Vec<Option<&'static str>> = SERVICES.iter().copied().map(Some).collect();
        first.extend(
            Action::KINDS
                .iter()
                .filter(|k| **k != "kill-service")
                .map(|_| None),
        );
        let mut kinds: Vec<(&str, Option<&'static str>)> = Vec::new();
        let allowed = config.kinds.clone();
        let mut others = Action::KINDS
            .iter()
            .filter(|k| **k != "kill-service" && allowed.contains(k));
        for service in first {
            match service {
                Some(service) => kinds.push(("kill-service", Some(service))),
                None => {
                    if let Some(kind) = others.next() {
                        kinds.push((kind, None));
                    }
                }
            }
        }
        kinds.shuffle(&mut rng);
        let weighted: Vec<(&str, u32)> = [
            ("kill-service", 30),
            ("restart-nats", 8),
            ("restart-postgres", 8),
            ("evict-pod", 22),
            ("fail-sandbox", 16),
            ("cancel-task", 16),
        ]
        .into_iter()
        .filter(|(k, _)| allowed.contains(k))
        .collect();
        let mut schedule = Vec::new();
        let mut at = between(&mut rng, config.gap.0, config.gap.1);
        while at < config.duration {
            let action = match kinds.pop() {
                Some((_, Some(service))) => Action::KillService {
                    service,
                    down: between(&mut rng, Duration::ZERO, max_down),
                },
                Some((kind, None)) => draw_kind(&mut rng, kind),
                None => {
                    let kind = weighted
                        .choose_weighted(&mut rng, |(_, w)| *w)
                        .map(|(k, _)| *k)
                        .unwrap_or("evict-pod");
                    draw_kind(&mut rng, kind)
                }
            };
            schedule.push((at, action));
            at += between(&mut rng, config.gap.0, config.gap.1);
        }
        Self {
            rng: StdRng::seed_from_u64(config.seed ^ 0x5eed),
            config,
            schedule,
            next: 0,
            pending: Vec::new(),
            last_respawn: Vec::new(),
            started: Instant::now(),
            log: Vec::new(),
            done: Vec::new(),
            killed: Vec::new(),
            scheduler_kills: Vec::new(),
            touched: Touched::default(),
        }
    }

    pub fn seed(&self) -> u64 {
        self.config.seed
    }

    pub fn schedule(&self) -> &[(Duration, Action)] {
        &self.schedule
    }

    /// Everything the driver did, one line each, with the time since the start.
    pub fn log(&self) -> String {
        let mut text = format!(
            "chaos seed {} (replay with JR_CHAOS_SEED={})\n",
            self.config.seed, self.config.seed
        );
        for line in &self.log {
            text.push_str(line);
            text.push('\n');
        }
        text
    }

    /// How many faults of `kind` ([`Action::kind`]) actually hit something.
    pub fn count(&self, kind: &str) -> usize {
        self.done.iter().filter(|k| **k == kind).count()
    }

    /// How many times `service` was killed.
    pub fn killed(&self, service: &str) -> usize {
        self.killed.iter().filter(|s| **s == service).count()
    }

    /// The Pods, sandboxes and tasks the faults hit (their jobs' results are the fault's).
    pub fn touched(&self) -> &Touched {
        &self.touched
    }

    /// When the scheduler was killed, in order.
    pub fn scheduler_kills(&self) -> &[SystemTime] {
        &self.scheduler_kills
    }

    /// Marks tasks as hit by a fault (see [`fetch_window_losses`]).
    pub fn touch_tasks(&mut self, tasks: impl IntoIterator<Item = i64>) {
        self.touched.tasks.extend(tasks);
    }

    fn note(&mut self, line: String) {
        let line = format!("[{:>6.1}s] {line}", self.started.elapsed().as_secs_f64());
        tracing::info!(target: "chaos", "{line}");
        self.log.push(line);
    }

    /// Plays the schedule against `system`, calling `tick` about every 100 ms with the elapsed
    /// time (to enqueue work as the run goes). Returns when the schedule is played and every
    /// outage is over; then [`Chaos::settle`] waits for the services to be ready.
    pub async fn run(
        &mut self,
        system: &mut System,
        mut tick: impl FnMut(&System, Duration),
    ) -> anyhow::Result<()> {
        self.started = Instant::now();
        self.next = 0;
        loop {
            let elapsed = self.started.elapsed();
            tick(system, elapsed);
            self.revive_due(system, false).await?;
            self.supervise(system)?;
            while let Some((at, action)) = self.schedule.get(self.next).cloned() {
                if at > elapsed {
                    break;
                }
                self.next += 1;
                self.apply(system, action).await?;
            }
            if self.next >= self.schedule.len()
                && self.pending.is_empty()
                && elapsed >= self.config.duration
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Ends every outage now and waits until all four services answer `/readyz`.
    pub async fn settle(&mut self, system: &mut System, timeout: Duration) -> anyhow::Result<()> {
        self.revive_due(system, true).await?;
        self.supervise(system)?;
        let deadline = tokio::time::Instant::now() + timeout;
        for p in system.services_mut() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if p.exited().is_some() || p.pid().is_none() {
                p.restart()?;
            }
            p.wait_ready(left).await?;
        }
        self.note("settled: every service ready".into());
        Ok(())
    }

    async fn apply(&mut self, system: &mut System, action: Action) -> anyhow::Result<()> {
        let kind = action.kind();
        let outcome = match &action {
            Action::KillService { service, down } => {
                if self
                    .pending
                    .iter()
                    .any(|(_, r)| *r == Revive::Service(service))
                {
                    None
                } else {
                    let p = system.service(service).context("unknown service")?;
                    p.kill9();
                    if *service == "scheduler" {
                        self.scheduler_kills.push(SystemTime::now());
                    }
                    self.killed.push(service);
                    self.pending
                        .push((Instant::now() + *down, Revive::Service(service)));
                    Some(String::new())
                }
            }
            Action::RestartNats { down } => {
                if self.pending.iter().any(|(_, r)| *r == Revive::Nats) {
                    None
                } else {
                    system.nats.kill();
                    self.pending.push((Instant::now() + *down, Revive::Nats));
                    Some(String::new())
                }
            }
            Action::RestartPostgres { down } => {
                if self.pending.iter().any(|(_, r)| *r == Revive::Postgres) {
                    None
                } else {
                    system.pg.kill()?;
                    self.pending
                        .push((Instant::now() + *down, Revive::Postgres));
                    Some(String::new())
                }
            }
            Action::EvictPod => {
                let running: Vec<String> = system
                    .kube
                    .pods(JOBS_NAMESPACE)
                    .iter()
                    .filter(|p| {
                        p.pointer("/status/phase").and_then(|v| v.as_str()) == Some("Running")
                    })
                    .filter(|p| p.pointer("/metadata/deletionTimestamp").is_none())
                    .filter_map(|p| {
                        p.pointer("/metadata/name")
                            .and_then(|v| v.as_str())
                            .map(str::to_owned)
                    })
                    .collect();
                match running.choose(&mut self.rng) {
                    Some(name) => system.kube.evict(JOBS_NAMESPACE, name).ok().map(|_| {
                        self.touched.workloads.insert(name.clone());
                        name.clone()
                    }),
                    None => None,
                }
            }
            Action::FailSandbox => {
                let running: Vec<String> = system
                    .sandbox
                    .sandboxes()
                    .into_iter()
                    .filter(|s| s.state == jr_fake_sandbox::SandboxState::Running)
                    .map(|s| s.id)
                    .collect();
                match running.choose(&mut self.rng) {
                    Some(id) => system.sandbox.fail_sandbox(id, "ChaosCrash").then(|| {
                        self.touched.workloads.insert(id.clone());
                        id.clone()
                    }),
                    None => None,
                }
            }
            Action::CancelTask => {
                let running: Vec<i64> = system
                    .forge
                    .snapshot()
                    .tasks
                    .iter()
                    .filter(|t| t.status == jr_fake_forge::Status::Running)
                    .map(|t| t.id)
                    .collect();
                match running.choose(&mut self.rng) {
                    Some(id) => system.forge.cancel_task(*id).then(|| {
                        self.touched.tasks.insert(*id);
                        format!("task {id}")
                    }),
                    None => None,
                }
            }
        };
        match outcome {
            Some(target) if target.is_empty() => {
                self.done.push(kind);
                self.note(format!("{action}"));
            }
            Some(target) => {
                self.done.push(kind);
                self.note(format!("{action}: {target}"));
            }
            None => self.note(format!("{action}: nothing to hit, skipped")),
        }
        Ok(())
    }

    /// Brings back what is down and due (or everything with `all`).
    async fn revive_due(&mut self, system: &mut System, all: bool) -> anyhow::Result<()> {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = self
            .pending
            .drain(..)
            .partition(|(at, _)| all || *at <= now);
        self.pending = later;
        for (_, what) in due {
            match what {
                Revive::Service(name) => {
                    system.service(name).context("unknown service")?.restart()?;
                    self.note(format!("started {name} again"));
                }
                Revive::Nats => {
                    system
                        .nats
                        .restart()
                        .await
                        .context("restarting nats-server")?;
                    self.note("nats-server back".into());
                }
                Revive::Postgres => {
                    system
                        .pg
                        .start_server()
                        .await
                        .context("restarting postgres")?;
                    self.note("postgres back".into());
                }
            }
        }
        Ok(())
    }

    /// Starts again any service that exited on its own (at most once a second per service),
    /// except the ones the schedule is keeping down.
    fn supervise(&mut self, system: &mut System) -> anyhow::Result<()> {
        for name in SERVICES {
            if self
                .pending
                .iter()
                .any(|(_, r)| *r == Revive::Service(name))
            {
                continue;
            }
            let recent = self
                .last_respawn
                .iter()
                .any(|(n, at)| *n == name && at.elapsed() < Duration::from_secs(1));
            let p = system.service(name).context("unknown service")?;
            if let Some(status) = p.exited() {
                if recent {
                    continue;
                }
                p.restart()?;
                self.last_respawn.retain(|(n, _)| *n != name);
                self.last_respawn.push((name, Instant::now()));
                self.note(format!(
                    "{name} exited on its own ({status}); started again"
                ));
            }
        }
        Ok(())
    }
}

/// Replaces `system`'s process for `service` by one with extra environment variables (e.g. a
/// `JETRUNNER__…` config override) and starts it; the log file is shared with the old process.
/// Relies on the harness's layout: config at `<dir>/jetrunner.toml`, log in `<dir>`.
pub async fn respawn_with_env(
    system: &mut System,
    service: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<()> {
    let config = system.dir.path().join("jetrunner.toml");
    anyhow::ensure!(
        config.exists(),
        "harness config not at {}",
        config.display()
    );
    let port = match service {
        "scheduler" => system.ports.scheduler_ops,
        "pod-worker" => system.ports.pod_ops,
        "vm-worker" => system.ports.vm_ops,
        "reconciler" => system.ports.reconciler_ops,
        other => anyhow::bail!("unknown service {other}"),
    };
    let args = vec!["--config".to_owned(), config.display().to_string()];
    let mut process = ServiceProcess::new(service, binary(service)?, args, system.dir.path(), port)
        .env("RUST_LOG", &system.spec.log_filter);
    for (k, v) in env {
        process = process.env(k, v);
    }
    let slot = system.service(service).context("unknown service")?;
    slot.kill9();
    *slot = process;
    slot.spawn()?;
    slot.wait_ready(Duration::from_secs(60)).await
}

/// Copies the services' logs out of the system's temporary directory (removed with the system)
/// into `<tmp>/jr-scenario-logs-<label>/`, so a failed run can be read afterwards.
pub fn keep_logs(system: &System, label: &str) -> anyhow::Result<std::path::PathBuf> {
    let dest = std::env::temp_dir().join(format!("jr-scenario-logs-{label}"));
    std::fs::create_dir_all(&dest)?;
    for entry in std::fs::read_dir(system.dir.path())? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "log")
            && let Some(name) = path.file_name()
        {
            std::fs::copy(&path, dest.join(name))?;
        }
    }
    Ok(dest)
}

/// What is unfinished, for a failure message: jobs that are not final (with their tasks), live
/// workloads, and projection records that are not settled.
pub async fn diagnose(system: &System) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let forge = system.forge.snapshot();
    for job in forge.jobs.iter().filter(|j| !j.status.is_final()) {
        let _ = writeln!(
            out,
            "job {} {:?} fetched {}x, tasks {:?}",
            job.id, job.status, job.fetch_count, job.task_ids
        );
        for task in job.task_ids.iter().filter_map(|id| forge.task(*id)) {
            let _ = writeln!(
                out,
                "  task {} {:?} heartbeats {} finals {:?} log tail {:?}",
                task.id,
                task.status,
                task.heartbeats,
                task.final_reports,
                task.log.iter().rev().take(3).collect::<Vec<_>>()
            );
        }
    }
    for pod in system.kube.pods(JOBS_NAMESPACE) {
        let name = pod
            .pointer("/metadata/name")
            .and_then(|v| v.as_str())
            .unwrap_or("?");
        let phase = pod
            .pointer("/status/phase")
            .and_then(|v| v.as_str())
            .unwrap_or("?");
        let _ = writeln!(out, "live Pod {name} {phase}");
    }
    for s in system.sandbox.sandboxes() {
        let _ = writeln!(out, "live sandbox {} {:?} {:?}", s.id, s.state, s.metadata);
    }
    match jr_store::Store::connect(&system.database_url).await {
        Ok(store) => match store.records().await {
            Ok(records) => {
                for r in records
                    .iter()
                    .filter(|r| !crate::consistency::is_settled(r))
                {
                    let _ = writeln!(
                        out,
                        "projection {} {:?} task {:?} claim {:?} terminal {:?} failure {:?} redispatches {:?}\n  attempts {:?}\n  workloads {:?}",
                        r.id,
                        r.state(),
                        r.forge_task_id(),
                        r.claim,
                        r.terminal,
                        r.failure,
                        r.redispatches,
                        r.attempts.values().collect::<Vec<_>>(),
                        r.workloads.values().collect::<Vec<_>>()
                    );
                }
            }
            Err(e) => {
                let _ = writeln!(out, "projection unreadable: {e}");
            }
        },
        Err(e) => {
            let _ = writeln!(out, "projection unreachable: {e}");
        }
    }
    out
}

/// Tasks the forge's zombie reaper failed, and tasks cancelled at the forge with no assignment
/// behind them, split into the ones the documented Gitea window explains and the ones nothing
/// excuses.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ZombieReport {
    /// Handed out by the last fetch of a scheduler killed before that task was durable.
    pub fetch_window: Vec<i64>,
    pub violations: Vec<String>,
}

/// Classifies every task the fake forge stopped as a zombie. On Gitea a task the forge handed
/// out is lost when the scheduler dies after the forge picked it and before its assignment has
/// a PubAck (the reply carries no key to ask for it again); the forge's zombie reaper then fails
/// it. Because a registration's fetcher never fetches again before the PubAck of its current
/// task, such a task is the last one handed out to its runner before a scheduler kill, and
/// jetrunner never said a word about it (no keepalive, no log, no result) and no assignment for
/// it reached the streams (`durable`: the forge task ids of every assignment). Any other zombie
/// is a task jetrunner lost or forgot to keep alive. A task cancelled at the forge (a chaos
/// fault) while in that window ends cancelled instead of failed, with no assignment either: it
/// is held to the same test; a cancelled task with an assignment is ordinary.
/// The forge task ids whose assignment reached the projection (was durable), for
/// [`fetch_window_losses`].
pub async fn published_tasks(database_url: &str) -> anyhow::Result<std::collections::HashSet<i64>> {
    Ok(jr_store::Store::connect(database_url)
        .await?
        .records()
        .await?
        .iter()
        .filter_map(|r| r.info.as_ref().map(|i| i.forge_task_id))
        .collect())
}

pub fn fetch_window_losses(
    forge: &jr_fake_forge::Snapshot,
    scheduler_kills: &[SystemTime],
    durable: &std::collections::HashSet<i64>,
) -> ZombieReport {
    use jr_fake_forge::StopCause;
    let mut report = ZombieReport::default();
    for task in forge.tasks.iter().filter(|t| match t.stop_cause {
        Some(StopCause::Zombie) => true,
        Some(StopCause::Cancelled) => !durable.contains(&t.id),
        _ => false,
    }) {
        let silent = task.heartbeats == 0
            && task.log.is_empty()
            && task.final_reports.is_empty()
            && !durable.contains(&task.id);
        // The first kill at or after the hand-out; the task must be its runner's last hand-out
        // before that kill.
        let kill = scheduler_kills
            .iter()
            .copied()
            .filter(|k| *k >= task.started_at)
            .min();
        let last_before_kill = kill.is_some_and(|kill| {
            !forge.tasks.iter().any(|other| {
                other.id != task.id
                    && other.runner_uuid == task.runner_uuid
                    && other.started_at > task.started_at
                    && other.started_at <= kill
            })
        });
        if silent && last_before_kill {
            report.fetch_window.push(task.id);
        } else {
            report.violations.push(format!(
                "task {} (job {:?}) stopped ({:?}) unexplained: {} keepalives, {} log lines, \
                 {} results, assignment published: {}, {}",
                task.id,
                task.job_id,
                task.stop_cause,
                task.heartbeats,
                task.log.len(),
                task.final_reports.len(),
                durable.contains(&task.id),
                match kill {
                    None => "handed out after the last scheduler kill".to_owned(),
                    Some(_) if !last_before_kill =>
                        "its runner fetched again before the next scheduler kill".to_owned(),
                    Some(_) => "the scheduler knew it".to_owned(),
                }
            ));
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zombie(id: i64, runner: &str, at_secs: u64) -> jr_fake_forge::TaskView {
        jr_fake_forge::TaskView {
            id,
            job_id: jr_fake_forge::JobId(id as u64),
            attempt: 1,
            runner_uuid: runner.into(),
            runner_name: runner.into(),
            status: jr_fake_forge::Status::Done(jr_fake_forge::Outcome::Failure),
            stop_cause: Some(jr_fake_forge::StopCause::Zombie),
            started_at: SystemTime::UNIX_EPOCH + Duration::from_secs(at_secs),
            stopped_at: None,
            handed_out: 1,
            heartbeats: 0,
            final_reports: Vec::new(),
            final_accepted: 0,
            log: Vec::new(),
            log_archived: false,
            outputs: Default::default(),
            steps: Vec::new(),
        }
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn only_a_silent_last_fetch_before_a_scheduler_kill_is_excused() {
        let mut forge = jr_fake_forge::Snapshot::default();
        // Task 1: the last hand-out to runner "pod" before the kill at 10 s, never heard of.
        forge.tasks.push(zombie(1, "pod", 9));
        // Task 2 on another runner, also its last before the kill.
        forge.tasks.push(zombie(2, "vm", 5));
        let none = std::collections::HashSet::new();
        let report = fetch_window_losses(&forge, &[at(10)], &none);
        assert_eq!(report.fetch_window, vec![1, 2]);
        assert!(report.violations.is_empty());
        // Its assignment reached the stream: jetrunner had it and lost it.
        let report = fetch_window_losses(&forge, &[at(10)], &[1].into_iter().collect());
        assert_eq!(report.fetch_window, vec![2]);
        assert_eq!(report.violations.len(), 1, "{report:?}");

        // The same runner fetched again before the kill: the first task was durable by then.
        let mut later = jr_fake_forge::TaskView {
            stop_cause: Some(jr_fake_forge::StopCause::Runner),
            ..zombie(3, "pod", 9)
        };
        later.started_at = at(9) + Duration::from_millis(500);
        forge.tasks.push(later);
        let report = fetch_window_losses(&forge, &[at(10)], &none);
        assert_eq!(report.fetch_window, vec![2]);
        assert_eq!(report.violations.len(), 1, "{report:?}");

        // Kept alive once: jetrunner knew the task, so its loss is not the window.
        let mut forge = jr_fake_forge::Snapshot::default();
        forge.tasks.push(jr_fake_forge::TaskView {
            heartbeats: 1,
            ..zombie(4, "pod", 9)
        });
        // Handed out after the last kill.
        forge.tasks.push(zombie(5, "vm", 11));
        let report = fetch_window_losses(&forge, &[at(10)], &none);
        assert!(report.fetch_window.is_empty());
        assert_eq!(report.violations.len(), 2, "{report:?}");
        // Without any kill nothing is excused.
        assert_eq!(fetch_window_losses(&forge, &[], &none).violations.len(), 2);

        // Cancelled at the forge while in the window: the same test. With an assignment it is
        // an ordinary cancellation and not looked at.
        let cancelled = |id, at_secs| jr_fake_forge::TaskView {
            stop_cause: Some(jr_fake_forge::StopCause::Cancelled),
            ..zombie(id, "pod", at_secs)
        };
        let mut forge = jr_fake_forge::Snapshot::default();
        forge.tasks.push(cancelled(6, 9));
        let report = fetch_window_losses(&forge, &[at(10)], &none);
        assert_eq!(report.fetch_window, vec![6]);
        let report = fetch_window_losses(&forge, &[at(10)], &[6].into_iter().collect());
        assert_eq!(report, ZombieReport::default());
        // Cancelled with no assignment and no scheduler kill to explain it: jetrunner lost it.
        let report = fetch_window_losses(&forge, &[at(8)], &none);
        assert_eq!(report.violations.len(), 1, "{report:?}");
    }

    #[test]
    fn every_schedule_disrupts_every_service_nats_and_postgres() {
        for seed in 0..500 {
            let chaos = Chaos::new(ChaosConfig::new(seed, Duration::from_secs(60)));
            let schedule = chaos.schedule();
            for service in SERVICES {
                assert!(
                    schedule.iter().any(
                        |(_, a)| matches!(a, Action::KillService { service: s, .. } if *s == service)
                    ),
                    "seed {seed}: {service} never killed"
                );
            }
            for kind in Action::KINDS {
                assert!(
                    schedule.iter().any(|(_, a)| a.kind() == kind),
                    "seed {seed}: no {kind}"
                );
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let a = Chaos::new(ChaosConfig::new(42, Duration::from_secs(60)));
        let b = Chaos::new(ChaosConfig::new(42, Duration::from_secs(60)));
        let c = Chaos::new(ChaosConfig::new(43, Duration::from_secs(60)));
        assert_eq!(a.schedule(), b.schedule());
        assert_ne!(a.schedule(), c.schedule());
    }
}
