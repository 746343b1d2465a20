//! Fetching paced by capacity: one fetch loop per forge registration, one FetchTask in flight
//! at a time, and a task taken only while a backend the registration fetches for has room
//! (`backend.<name>.lookahead` minus the assignments already waiting for its worker). The
//! backlog beyond that stays at the forge, where no reaper fails waiting jobs. Every task is
//! published durably before the next fetch.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use jr_bus::lease::Leadership;
use jr_bus::{Backoff, Bus};
use jr_config::ForgeFlavor;
use jr_forge::proto::runner::v1::{FetchTaskRequest, Task};
use jr_intake::sink::{AssignmentSink, Draft};
use jr_protocol::{AssignmentId, BackendName, Envelope, ForgeKind, STREAM_ASSIGNMENTS};
use prost::Message as _;
use rand::Rng;
use sha2::Digest as _;
use tokio_util::sync::CancellationToken;

use crate::declaration::Declarer;
use crate::forges::{Forges, Registration};
use crate::request_key::RequestKeys;
use crate::tasks_version::TasksVersion;
use crate::unclaimed::Unclaimed;
use jr_forge::report::report_failure;
use jr_intake::board::IntakeBoard;
use jr_intake::presence::WorkerPresence;
use jr_intake::routing::{Placed, Router, forge_context, job_facts};

/// How often a registration with no room looks again.
const ROOM_RECHECK: Duration = Duration::from_millis(50);

/// A fetch starts only with at least this much of the lease left, so the reply normally
/// arrives while this replica still holds it (a renewal comes a third into the TTL, long
/// before this margin).
const FETCH_LEASE_MARGIN: Duration = Duration::from_millis(500);

/// Everything a fetcher needs; shared by all fetch loops.
pub struct Dispatcher {
    pub bus: Bus,
    pub forges: Forges,
    pub router: Router,
    /// Builds, seals and publishes the assignments.
    pub sink: AssignmentSink,
    /// Forge instance URL, part of every assignment id.
    pub forge_instance: String,
    pub max_duration: BTreeMap<BackendName, Duration>,
    /// `backend.<name>.lookahead`.
    pub lookahead: BTreeMap<BackendName, usize>,
    pub unclaimed: Arc<Unclaimed>,
    /// How far back a fetched task can still be waiting for a claim (the forge's endless-task
    /// horizon): what a new lease holder replays to keep those tasks alive.
    pub unclaimed_horizon: Duration,
    /// The fetch lease of each registration (by name); a registration without one always
    /// fetches (a single replica, tests).
    pub leases: BTreeMap<String, Leadership>,
    pub stats: DispatchStats,
    /// Whether each backend's worker lives (read from its capacity record).
    pub presence: WorkerPresence,
    /// What each registration fetches, and why not (logs, metric, `/readyz`, `JR_INTAKES`).
    pub intakes: Arc<IntakeBoard>,
}

#[derive(Debug, Default)]
pub struct DispatchStats {
    pub fetched: AtomicU64,
    pub dispatched: AtomicU64,
    pub duplicates: AtomicU64,
    pub unroutable: AtomicU64,
    pub fetch_errors: AtomicU64,
    /// Times this replica became the fetching replica of a registration (with leases).
    pub takeovers: AtomicU64,
    /// Fetch decisions skipped because no backend of the registration had room.
    pub paused: AtomicU64,
    /// Declares that changed a shared registration's labels.
    pub declares: AtomicU64,
    /// Most FetchTask calls in flight at once under one registration (always 1 here; the
    /// figure proves it).
    pub max_in_flight: AtomicU64,
    /// Times a full `JR_ASSIGNMENTS` stream paused intake.
    pub stream_full: AtomicU64,
    /// Tasks fetched that wait for room in a full `JR_ASSIGNMENTS` stream now.
    pub intake_blocked: AtomicU64,
    pub in_flight: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the forge no longer knows this runner: {0}")]
    Unregistered(#[source] jr_forge::ForgeError),
}

/// A stream's limits and fill for a log line: `12/12 messages, 3.1 KiB/1.0 MiB, discard new`.
async fn stream_limits_text(bus: &Bus, stream: &str) -> String {
    match bus.jetstream().get_stream(stream).await {
        Ok(mut s) => match s.info().await {
            Ok(info) => format!(
                "{}/{} messages, {}/{} bytes, discard {:?}",
                info.state.messages,
                info.config.max_messages,
                info.state.bytes,
                info.config.max_bytes,
                info.config.discard
            ),
            Err(e) => format!("limits unknown: {e}"),
        },
        Err(e) => format!("limits unknown: {e}"),
    }
}

fn jittered(base: Duration) -> Duration {
    let factor = rand::rng().random_range(0.8..1.2);
    base.mul_f64(factor)
}

fn context_string(task: &Task, key: &str) -> String {
    task.context
        .as_ref()
        .and_then(|c| c.fields.get(key))
        .and_then(|v| match &v.kind {
            Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

impl Dispatcher {
    /// The assignment message of attempt 1 for `task` routed to `backend`.
    pub fn assignment_envelope(
        &self,
        task: &Task,
        backend: &BackendName,
        labels: Vec<String>,
        job_name: String,
        placement: String,
    ) -> Result<Envelope, jr_seal::SealError> {
        let plaintext = task.encode_to_vec();
        // Publishing the same fetched task again is deduplicated; the same task handed out
        // again by the forge (Forgejo's request-key replay, with a new task token) is a new
        // message that replaces the earlier copy.
        let digest = hex::encode(&sha2::Sha256::digest(&plaintext)[..6]);
        self.sink.build(Draft {
            id: AssignmentId::for_task(&self.forge_instance, task.id),
            forge: ForgeKind::Gitea(self.forge_instance.clone()),
            forge_task_id: task.id,
            backend: backend.clone(),
            placement,
            labels,
            repository: context_string(task, "repository"),
            workflow: Some(context_string(task, "workflow")).filter(|w| !w.is_empty()),
            job_name,
            max_duration: self
                .max_duration
                .get(backend)
                .copied()
                .unwrap_or(Duration::from_secs(3 * 3600)),
            plaintext,
            dedup: digest,
        })
    }

    /// Routes, seals and publishes one task; returns once it is durable in JetStream (or was
    /// reported to the forge as unroutable), or when shutdown fires.
    /// `taking`: the backends taking work now; a job without `runs-on` (which the forge hands
    /// to any runner) goes to the first of them in routing order.
    pub async fn dispatch(
        &self,
        registration: &Registration,
        task: Task,
        taking: &[BackendName],
        shutdown: &CancellationToken,
    ) {
        let facts = job_facts(task.workflow_payload.as_deref());
        let context = forge_context(task.context.as_ref());
        let routed = self.router.place_preferring(
            registration.own_backend.as_ref(),
            &facts.runs_on,
            &context,
            taking,
        );
        let forge = &registration.client;
        match routed {
            Ok(Placed { backend, reason }) => {
                let envelope = match self.assignment_envelope(
                    &task,
                    &backend,
                    facts.runs_on,
                    facts.job_name,
                    reason,
                ) {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::error!(task = task.id, error = %e, "cannot seal task");
                        return self
                            .report_unroutable(
                                forge,
                                task.id,
                                &format!("jetrunner cannot seal the task: {e}"),
                                shutdown,
                            )
                            .await;
                    }
                };
                // The root of the job's trace: the assignment carries it to the worker, the
                // facade and the reconciler.
                let job = tracing::info_span!(
                    parent: None,
                    "job",
                    forge_task = task.id,
                    assignment = %envelope.assignment_id,
                    %backend,
                );
                match tracing::Instrument::instrument(
                    self.publish_assignment(forge, task.id, &backend, &envelope, shutdown),
                    job,
                )
                .await
                {
                    // The forge ended the task while it waited for room: nothing to run.
                    Ok(None) => {}
                    Ok(Some(outcome)) => {
                        if outcome.duplicate {
                            self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                        }
                        self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
                        self.unclaimed.fetched(
                            envelope.assignment_id,
                            task.id,
                            backend.clone(),
                            envelope.attempt,
                            Instant::now(),
                        );
                        tracing::debug!(task = task.id, assignment = %envelope.assignment_id, %backend, seq = outcome.stream_seq, "assignment dispatched");
                    }
                    Err(jr_bus::BusError::ShutDown) => tracing::warn!(
                        task = task.id,
                        "dispatch abandoned at shutdown; the forge's reaper will fail the task"
                    ),
                    // Not transient (e.g. larger than the server's max_payload): retrying cannot
                    // help, so the job fails now with the reason instead of vanishing.
                    Err(e) => {
                        tracing::error!(task = task.id, error = %e, "assignment cannot be published");
                        self.report_unroutable(
                            forge,
                            task.id,
                            &format!("jetrunner cannot publish the assignment: {e}"),
                            shutdown,
                        )
                        .await;
                    }
                }
            }
            Err(no_route) => {
                self.stats.unroutable.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(task = task.id, error = %no_route, "unroutable task");
                self.report_unroutable(forge, task.id, &no_route.to_string(), shutdown)
                    .await;
            }
        }
    }

    /// Publishes an assignment through transient failures. A full `JR_ASSIGNMENTS` stream is
    /// backpressure: the task waits here (kept alive at the forge, so no reaper fails it) and
    /// this registration fetches nothing more until the stream takes it, logged once with the
    /// stream's limits and counted (`jetrunner_scheduler_intake_blocked`). `None` when the forge
    /// ended the task meanwhile.
    async fn publish_assignment(
        &self,
        forge: &jr_forge::ForgeClient,
        task_id: i64,
        backend: &BackendName,
        envelope: &Envelope,
        shutdown: &CancellationToken,
    ) -> Result<Option<jr_bus::PublishOutcome>, jr_bus::BusError> {
        let mut backoff = jr_bus::nats_backoff();
        let mut full_since: Option<Instant> = None;
        let mut next_keepalive = Instant::now() + self.unclaimed.interval();
        let result = loop {
            if shutdown.is_cancelled() {
                break Err(jr_bus::BusError::ShutDown);
            }
            let error = match self.sink.publish(backend, envelope).await {
                Ok(outcome) => break Ok(Some(outcome)),
                Err(e) if !e.is_transient() => break Err(e),
                Err(e) => e,
            };
            if error.publish_failure() == Some(jr_bus::PublishFailure::StreamFull) {
                if full_since.is_none() {
                    full_since = Some(Instant::now());
                    // Counted once the reason is logged: whoever sees the gauge finds the line.
                    let limits = stream_limits_text(&self.bus, STREAM_ASSIGNMENTS).await;
                    tracing::error!(
                        stream = STREAM_ASSIGNMENTS,
                        limits = %limits,
                        task = task_id,
                        "stream {STREAM_ASSIGNMENTS} is full ({limits}): intake paused, this task \
                         waits (kept alive at the forge) and the rest stay queued there until the \
                         stream has room (messages age out, or raise nats.streams limits)"
                    );
                    self.stats.stream_full.fetch_add(1, Ordering::Relaxed);
                    self.stats.intake_blocked.fetch_add(1, Ordering::AcqRel);
                }
                if Instant::now() >= next_keepalive {
                    next_keepalive = Instant::now() + self.unclaimed.interval();
                    match jr_forge::report::keepalive(forge, task_id).await {
                        Ok(Some(result)) => {
                            tracing::info!(
                                task = task_id,
                                ?result,
                                "the forge ended a task waiting for room in {STREAM_ASSIGNMENTS}; dropped"
                            );
                            break Ok(None);
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(task = task_id, error = %e, "keepalive of a task waiting for room failed")
                        }
                    }
                }
            } else {
                tracing::warn!(task = task_id, error = %error, "publishing the assignment failed; retrying");
            }
            tokio::select! {
                () = shutdown.cancelled() => break Err(jr_bus::BusError::ShutDown),
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        };
        if let Some(since) = full_since {
            self.stats.intake_blocked.fetch_sub(1, Ordering::AcqRel);
            if matches!(result, Ok(Some(_))) {
                tracing::info!(
                    stream = STREAM_ASSIGNMENTS,
                    task = task_id,
                    waited_ms = since.elapsed().as_millis() as u64,
                    "stream {STREAM_ASSIGNMENTS} has room again: intake resumes"
                );
            }
        }
        result
    }

    async fn report_unroutable(
        &self,
        forge: &jr_forge::ForgeClient,
        task_id: i64,
        reason: &str,
        shutdown: &CancellationToken,
    ) {
        let lines = [reason.to_owned()];
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        loop {
            match report_failure(forge, task_id, &lines).await {
                Ok(_) => return,
                Err(e) if e.is_retryable() => {
                    tracing::warn!(task = task_id, error = %e, "reporting unroutable task failed; retrying")
                }
                Err(e) => {
                    tracing::error!(task = task_id, error = %e, "forge refused the failure report");
                    return;
                }
            }
            if !backoff.pause(shutdown).await {
                return;
            }
        }
    }
}

/// Fetch pacing (from `[forge]`).
#[derive(Clone, Copy, Debug)]
pub struct Pacing {
    pub poll_interval: Duration,
    pub max_backoff: Duration,
    pub version_reset_interval: Duration,
    pub flavor: ForgeFlavor,
    /// Most tasks asked for in one call (Forgejo).
    pub task_capacity: usize,
}

/// Runs one fetch loop per registration until shutdown. Returns an error only when a runner is
/// unregistered.
pub async fn run_fetchers(
    dispatcher: Arc<Dispatcher>,
    pacing: Pacing,
    shutdown: CancellationToken,
) -> Result<(), FetchError> {
    let mut set = tokio::task::JoinSet::new();
    for registration in dispatcher.forges.registrations().to_vec() {
        let (d, s) = (dispatcher.clone(), shutdown.clone());
        set.spawn(async move { fetch_loop(registration, &d, pacing, &s).await });
    }
    let mut result = Ok(());
    while let Some(joined) = set.join_next().await {
        if let Ok(Err(e)) = joined {
            // One loop learnt its registration is gone: stop all of them.
            shutdown.cancel();
            result = Err(e);
        }
    }
    result
}

/// Test fault hook: with this probability (`JR_FAULT_ABORT_AFTER_FETCH`, 0–1) the process
/// aborts right after the forge handed out tasks and before any is published, the window a
/// request key must cover. Unset in every deployment.
fn abort_probability() -> f64 {
    std::env::var("JR_FAULT_ABORT_AFTER_FETCH")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|p| (0.0..=1.0).contains(p))
        .unwrap_or(0.0)
}

pub(crate) async fn fetch_loop(
    registration: Registration,
    d: &Dispatcher,
    pacing: Pacing,
    shutdown: &CancellationToken,
) -> Result<(), FetchError> {
    let forgejo = pacing.flavor == ForgeFlavor::Forgejo;
    let abort_after_fetch = abort_probability();
    let mut keys: Option<RequestKeys> = None;
    let mut version = TasksVersion::new(pacing.version_reset_interval);
    // Failed fetches back off from the poll interval up to `max_backoff`.
    let mut errors = Backoff::new(pacing.poll_interval, pacing.max_backoff);
    let mut wait = Duration::ZERO;
    // Room read from the bus and not yet used by this loop's own dispatches. Room only grows
    // between reads (workers take waiting assignments) except through this loop's dispatches
    // and the reconciler's redispatches, so it is spent across consecutive fetches that bring
    // tasks and read again after any fetch that does not (or a pause), which bounds what a
    // redispatch can add to one backend's waiting assignments.
    let mut budget = 0_usize;
    // A registration serving several backends declares only the labels of those taking work.
    let mut declarer = (registration.backends.len() > 1)
        .then(|| Declarer::new(&d.router, d.router.declared_labels().to_vec()));
    let mut taking: Vec<BackendName> = Vec::new();
    let mut leadership = d
        .leases
        .get(&registration.name)
        .cloned()
        .unwrap_or_else(Leadership::always);
    // The lease term this loop last fetched under.
    let mut term: Option<u64> = None;
    loop {
        if !wait.is_zero() {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(wait) => {}
            }
        }
        if shutdown.is_cancelled() {
            return Ok(());
        }
        // Only the holder of the registration's lease fetches (any replica serves the facade).
        match leadership.acting() {
            Some(_) if leadership.remaining() < FETCH_LEASE_MARGIN => {
                // Held but due for renewal: wait for it rather than fetch past the lease.
                wait = Duration::from_millis(20);
                continue;
            }
            Some(now_term) => {
                if term != Some(now_term) {
                    term = Some(now_term);
                    // New holder of the lease: what another replica did meanwhile is unknown
                    // here. The request key is read again, the tasks version starts over and
                    // the tasks it fetched that wait for a claim get their heartbeats here.
                    keys = None;
                    version = TasksVersion::new(pacing.version_reset_interval);
                    budget = 0;
                    // Another replica may have declared other labels meanwhile: apply ours.
                    declarer = (registration.backends.len() > 1)
                        .then(|| Declarer::new(&d.router, d.router.declared_labels().to_vec()));
                    if !d.leases.is_empty() {
                        d.stats.takeovers.fetch_add(1, Ordering::Relaxed);
                        match d
                            .unclaimed
                            .rebuild(&d.bus, &registration.backends, d.unclaimed_horizon)
                            .await
                        {
                            Ok(n) => {
                                tracing::info!(registration = %registration.name, term = now_term, unclaimed = n, "fetching for this registration")
                            }
                            Err(e) => {
                                tracing::warn!(registration = %registration.name, error = %e, "cannot replay the unclaimed tasks; their keepalives start with their next fetch")
                            }
                        }
                        continue;
                    }
                }
            }
            None => {
                if term.take().is_some() {
                    tracing::warn!(registration = %registration.name, "lease lost: fetching stops");
                    d.intakes.forget(&registration.name);
                }
                if leadership.until_acting(shutdown).await.is_none() {
                    return Ok(());
                }
                wait = Duration::ZERO;
                continue;
            }
        }
        // The forge hands a task out once: one fetched while NATS is unreachable cannot be made
        // durable until the bus is back, and is lost if the scheduler stops meanwhile. Fetch
        // only while connected.
        if !d.bus.is_connected() {
            wait = jittered(pacing.poll_interval);
            continue;
        }
        if budget == 0 {
            let (room, declared) = d
                .decide(&registration, declarer.as_mut(), &mut taking)
                .await;
            if declared {
                // The forge's labels changed: the next fetch must not take the fast path on
                // a version from before (jobs it now hands out did not bump it).
                version = TasksVersion::new(pacing.version_reset_interval);
                wait = Duration::ZERO;
                continue;
            }
            budget = room;
        }
        let room = budget;
        if room == 0 {
            d.stats.paused.fetch_add(1, Ordering::Relaxed);
            wait = ROOM_RECHECK;
            continue;
        }
        let request_key = if forgejo {
            if keys.is_none() {
                match RequestKeys::open(&d.bus, &registration.name).await {
                    Ok(k) => keys = Some(k),
                    Err(e) => {
                        tracing::warn!(registration = %registration.name, error = %e, "cannot open the request key store");
                        wait = jittered(pacing.poll_interval);
                        continue;
                    }
                }
            }
            match keys.as_mut().map(|k| k.current()) {
                Some(fut) => match fut.await {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!(registration = %registration.name, error = %e, "cannot read the request key");
                        wait = jittered(pacing.poll_interval);
                        continue;
                    }
                },
                None => None,
            }
        } else {
            None
        };
        let sent = version.to_send(Instant::now());
        let task_capacity = (forgejo && pacing.task_capacity > 1)
            .then(|| i64::try_from(room.min(pacing.task_capacity)).unwrap_or(1));
        let request = FetchTaskRequest {
            tasks_version: sent,
            task_capacity,
        };
        let in_flight = d.stats.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        d.stats.max_in_flight.fetch_max(in_flight, Ordering::AcqRel);
        let reply = registration
            .client
            .fetch_tasks(&request, request_key.as_deref())
            .await;
        d.stats.in_flight.fetch_sub(1, Ordering::AcqRel);
        match reply {
            Ok(reply) => {
                errors.reset();
                let tasks: Vec<Task> = reply
                    .task
                    .into_iter()
                    .chain(reply.additional_tasks)
                    .collect();
                version.after_reply(sent, reply.tasks_version, !tasks.is_empty());
                if tasks.is_empty() {
                    if let Some(keys) = keys.as_mut()
                        && keys.reused()
                        && let Err(e) = keys.rotate().await
                    {
                        tracing::warn!(registration = %registration.name, error = %e, "cannot rotate the request key");
                    }
                    budget = 0;
                    wait = jittered(pacing.poll_interval);
                    continue;
                }
                budget = budget.saturating_sub(tasks.len());
                d.stats
                    .fetched
                    .fetch_add(tasks.len() as u64, Ordering::Relaxed);
                if abort_after_fetch > 0.0 && rand::rng().random_bool(abort_after_fetch) {
                    tracing::error!("JR_FAULT_ABORT_AFTER_FETCH: aborting before publishing");
                    std::process::abort();
                }
                for task in tasks {
                    d.dispatch(&registration, task, &taking, shutdown).await;
                }
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                if let Some(keys) = keys.as_mut()
                    && let Err(e) = keys.rotate().await
                {
                    // The old key stays: the next fetch returns the same tasks again, and
                    // their assignments are already durable (deduplicated or replaced).
                    tracing::warn!(registration = %registration.name, error = %e, "cannot rotate the request key");
                }
                wait = Duration::ZERO;
            }
            Err(e) if e.is_unregistered() => return Err(FetchError::Unregistered(e)),
            Err(e) => {
                budget = 0;
                d.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(registration = %registration.name, error = %e, "fetch failed");
                wait = errors.next_delay();
            }
        }
    }
}
