//! N concurrent fetchers under one registration, sharing one `tasks_version` exactly as the
//! runner protocol describes (a runner echoes the last version it saw), each publishing its task
//! durably before it fetches again.

use jr_protocol::now_ms;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use jr_bus::Bus;
use jr_forge::ForgeClient;
use jr_forge::proto::runner::v1::{FetchTaskRequest, Task};
use jr_protocol::{Assignment, AssignmentId, BackendName, Envelope, Message, subject};
use prost::Message as _;
use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::forge_report::report_failure;
use crate::routing::{Router, job_facts};
use crate::seal::Sealer;

/// Everything a fetcher needs; shared by all fetchers.
pub struct Dispatcher {
    pub bus: Bus,
    pub forge: ForgeClient,
    pub router: Router,
    pub sealer: Arc<Sealer>,
    /// Forge instance URL, part of every assignment id.
    pub forge_instance: String,
    pub max_duration: BTreeMap<BackendName, Duration>,
    pub stats: DispatchStats,
}

#[derive(Debug, Default)]
pub struct DispatchStats {
    pub fetched: AtomicU64,
    pub dispatched: AtomicU64,
    pub duplicates: AtomicU64,
    pub unroutable: AtomicU64,
    pub fetch_errors: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("the forge no longer knows this runner: {0}")]
    Unregistered(#[source] jr_forge::ForgeError),
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
    ) -> Result<Envelope, crate::seal::SealError> {
        let id = AssignmentId::for_task(&self.forge_instance, task.id);
        let sealed_task = self.sealer.seal(id, &task.encode_to_vec())?;
        let max = self
            .max_duration
            .get(backend)
            .copied()
            .unwrap_or(Duration::from_secs(3 * 3600));
        let fetched_at = now_ms();
        let assignment = Assignment {
            forge_instance: self.forge_instance.clone(),
            forge_task_id: task.id,
            backend: backend.clone(),
            provider: None,
            labels,
            repository: context_string(task, "repository"),
            job_name,
            max_duration_secs: max.as_secs(),
            fetched_at,
            sealed_task,
        };
        Ok(Envelope::new(
            format!("assignment:{id}:1"),
            fetched_at,
            id,
            1,
            Message::Assignment(assignment),
        ))
    }

    /// Routes, seals and publishes one task; returns once it is durable in JetStream (or was
    /// reported to the forge as unroutable), or when shutdown fires.
    pub async fn dispatch(&self, task: Task, shutdown: &CancellationToken) {
        let facts = job_facts(task.workflow_payload.as_deref());
        match self.router.route(&facts.runs_on) {
            Ok(backend) => {
                let envelope = match self.assignment_envelope(
                    &task,
                    &backend,
                    facts.runs_on,
                    facts.job_name,
                ) {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::error!(task = task.id, error = %e, "cannot seal task");
                        return self
                            .report_unroutable(
                                task.id,
                                &format!("jetrunner cannot seal the task: {e}"),
                                shutdown,
                            )
                            .await;
                    }
                };
                let subject = subject::assignment(&backend, envelope.assignment_id);
                match self
                    .bus
                    .publish_retrying(&subject, &envelope, shutdown)
                    .await
                {
                    Ok(outcome) => {
                        if outcome.duplicate {
                            self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                        }
                        self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(task = task.id, assignment = %envelope.assignment_id, %backend, seq = outcome.stream_seq, "assignment dispatched");
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
                self.report_unroutable(task.id, &no_route.to_string(), shutdown)
                    .await;
            }
        }
    }

    async fn report_unroutable(&self, task_id: i64, reason: &str, shutdown: &CancellationToken) {
        let lines = [reason.to_owned()];
        let mut delay = Duration::from_millis(200);
        loop {
            match report_failure(&self.forge, task_id, &lines).await {
                Ok(_) => return,
                Err(e) if e.is_retryable() => {
                    tracing::warn!(task = task_id, error = %e, "reporting unroutable task failed; retrying")
                }
                Err(e) => {
                    tracing::error!(task = task_id, error = %e, "forge refused the failure report");
                    return;
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(10));
        }
    }
}

/// Fetch pacing (from `[forge]`).
#[derive(Clone, Copy, Debug)]
pub struct Pacing {
    pub poll_interval: Duration,
    pub max_backoff: Duration,
}

/// Runs `n` fetchers until shutdown. Returns an error only when the runner is unregistered.
pub async fn run_fetchers(
    n: usize,
    dispatcher: Arc<Dispatcher>,
    pacing: Pacing,
    shutdown: CancellationToken,
) -> Result<(), FetchError> {
    let version = Arc::new(AtomicI64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for index in 0..n.max(1) {
        let (d, v, s) = (dispatcher.clone(), version.clone(), shutdown.clone());
        set.spawn(async move { fetch_loop(index, &d, &v, pacing, &s).await });
    }
    let mut result = Ok(());
    while let Some(joined) = set.join_next().await {
        if let Ok(Err(e)) = joined {
            // One fetcher learnt the registration is gone: stop all of them.
            shutdown.cancel();
            result = Err(e);
        }
    }
    result
}

async fn fetch_loop(
    index: usize,
    d: &Dispatcher,
    version: &AtomicI64,
    pacing: Pacing,
    shutdown: &CancellationToken,
) -> Result<(), FetchError> {
    let mut error_delay = pacing.poll_interval;
    // Spread the fetchers' first polls over one interval.
    let mut wait = pacing
        .poll_interval
        .mul_f64(index as f64 / 8.0)
        .min(pacing.poll_interval);
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
        // The forge hands a task out once: one fetched while NATS is unreachable cannot be made
        // durable until the bus is back, and is lost if the scheduler stops meanwhile (found by
        // the chaos suite). Fetch only while connected.
        if !d.bus.is_connected() {
            wait = jittered(pacing.poll_interval);
            continue;
        }
        let sent = version.load(Ordering::Acquire);
        match d
            .forge
            .fetch_task(&FetchTaskRequest {
                tasks_version: sent,
            })
            .await
        {
            Ok(reply) => {
                error_delay = pacing.poll_interval;
                if reply.tasks_version > sent {
                    version.fetch_max(reply.tasks_version, Ordering::AcqRel);
                }
                match reply.task {
                    Some(task) => {
                        d.stats.fetched.fetch_add(1, Ordering::Relaxed);
                        // More jobs may be queued: the next fetch must try an assignment.
                        version.store(0, Ordering::Release);
                        d.dispatch(task, shutdown).await;
                        wait = Duration::ZERO;
                    }
                    None => wait = jittered(pacing.poll_interval),
                }
            }
            Err(e) if e.is_unregistered() => return Err(FetchError::Unregistered(e)),
            Err(e) => {
                d.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(fetcher = index, error = %e, "fetch failed");
                wait = jittered(error_delay);
                error_delay = (error_delay * 2).min(pacing.max_backoff);
            }
        }
    }
}
