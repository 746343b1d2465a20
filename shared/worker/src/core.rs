//! The worker loop shared by both backends (docs/architecture.md, "The workers").

use jr_protocol::now_ms;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jr_bus::{Bus, ConsumerOptions, ConsumerSpec, Delivery, Disposition, Permit, Topology};
use jr_protocol::{
    Assignment, AssignmentId, BackendName, DeleteWorkload, Envelope, Kind, Message, Released,
    WorkloadCreated, WorkloadObserved, WorkloadPhase, WorkloadRequested, subject,
};
use jr_telemetry::{Shutdown, TaskSet};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec};
use crate::metrics::{ErrorLabels, WorkerMetrics};
use crate::slots::Slots;
use crate::token::{TokenKey, token_hash};

#[derive(Clone, Debug)]
pub struct WorkerSettings {
    pub backend: BackendName,
    pub capacity: usize,
    pub worker_id: String,
    pub facade_url: String,
    pub token_key: TokenKey,
    /// How often the backend is listed to catch changes a watch or poll missed.
    pub resync_interval: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("bus: {0}")]
    Bus(#[from] jr_bus::BusError),
}

struct Live {
    assignment_id: AssignmentId,
    attempt: u32,
    phase: WorkloadPhase,
    reason: Option<String>,
    _slot: Permit,
}

pub struct Worker<B: Backend> {
    bus: Bus,
    backend: Arc<B>,
    settings: WorkerSettings,
    slots: Arc<Slots>,
    live: Mutex<HashMap<String, Live>>,
    ready: AtomicBool,
    /// Workloads the projection counts as live on this backend (read at start, see `recover`).
    projected: Mutex<Vec<(AssignmentId, u32, String)>>,
    pub metrics: WorkerMetrics,
}

impl<B: Backend> Worker<B> {
    pub fn new(bus: Bus, backend: B, settings: WorkerSettings) -> Arc<Self> {
        let slots = Slots::new(settings.capacity);
        Arc::new(Self {
            bus,
            backend: Arc::new(backend),
            settings,
            slots,
            live: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
            projected: Mutex::new(Vec::new()),
            metrics: WorkerMetrics::default(),
        })
    }

    pub fn slots(&self) -> &Arc<Slots> {
        &self.slots
    }

    /// What the projection says is live on this backend: `(assignment, attempt, workload)`.
    /// At start, those the backend no longer lists are reported gone and released, so an
    /// assignment whose workload vanished while the worker was down does not wait forever.
    pub fn set_projected_live(&self, workloads: Vec<(AssignmentId, u32, String)>) {
        if let Ok(mut p) = self.projected.lock() {
            *p = workloads;
        }
    }

    /// Recovered and pulling.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn topology(backend: &BackendName) -> (ConsumerSpec, ConsumerSpec) {
        (
            ConsumerSpec::worker_assignments(backend),
            ConsumerSpec::worker_commands(backend),
        )
    }

    /// Runs until `shutdown`: recovery, then assignments, commands, observation and resync.
    /// `report(ready)` is called every 250 ms (readiness endpoint); the slot gauges follow too.
    pub async fn run(
        self: Arc<Self>,
        report: impl Fn(bool) + Send + 'static,
        shutdown: CancellationToken,
    ) -> Result<(), WorkerError> {
        let (assignments, commands) = Self::topology(&self.settings.backend);
        self.metrics.slots_total.set(self.settings.capacity as i64);
        let mut tasks = TaskSet::new(Shutdown::from(shutdown.clone()));
        {
            let (me, stop) = (self.clone(), shutdown.clone());
            tasks.spawn("reporter", async move {
                loop {
                    me.metrics
                        .slots_used
                        .set(me.slots.used().min(me.settings.capacity) as i64);
                    report(me.is_ready());
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    }
                }
            });
        }
        self.bus
            .ensure_topology(
                &Topology::new()
                    .consumer(assignments.clone())
                    .consumer(commands.clone()),
            )
            .await?;
        self.recover(&shutdown).await;

        let (tx, mut rx) = mpsc::channel::<ObservedWorkload>(1024);
        {
            let (me, stop) = (self.clone(), shutdown.clone());
            tasks.spawn("observer", async move {
                me.backend
                    .observe(tx, async move { stop.cancelled().await })
                    .await
            });
        }
        {
            let (me, stop) = (self.clone(), shutdown.clone());
            tasks.spawn("observations", async move {
                while let Some(o) = rx.recv().await {
                    me.on_observed(o, &stop).await;
                }
            });
        }
        {
            let (me, stop) = (self.clone(), shutdown.clone());
            tasks.spawn("resync", async move { me.resync_loop(&stop).await });
        }
        {
            let (me, stop) = (self.clone(), shutdown.clone());
            tasks.spawn("command consumer", async move {
                let handler_me = me.clone();
                me.bus
                    .run_consumer(
                        &commands,
                        move |d| {
                            let me = handler_me.clone();
                            async move { me.on_command(d).await }
                        },
                        ConsumerOptions::default().concurrency(8),
                        stop,
                    )
                    .await
            });
        }
        self.ready.store(true, Ordering::Release);
        let handler_me = self.clone();
        let result = self
            .bus
            .run_consumer(
                &assignments,
                move |d| {
                    let me = handler_me.clone();
                    async move { me.on_assignment(d).await }
                },
                ConsumerOptions::default()
                    .concurrency(self.settings.capacity)
                    .gate(self.slots.clone()),
                shutdown.clone(),
            )
            .await;
        shutdown.cancel();
        self.ready.store(false, Ordering::Release);
        let report = tasks.join_all(Duration::from_secs(15)).await;
        if !report.is_clean() {
            tracing::warn!(failed = ?report.failed, unfinished = ?report.unfinished, "worker tasks did not end cleanly");
        }
        result.map_err(WorkerError::from)
    }

    /// Adopts every workload of ours that exists before anything is pulled, so the slot count
    /// is right from the first pull.
    async fn recover(&self, shutdown: &CancellationToken) {
        let mut delay = Duration::from_millis(200);
        let found = loop {
            match self.backend.list().await {
                Ok(found) => break found,
                Err(e) => tracing::warn!(error = %e, "cannot list workloads at start; retrying"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(10));
        };
        let listed: std::collections::HashSet<String> =
            found.iter().map(|o| o.workload.clone()).collect();
        let vanished: Vec<ObservedWorkload> = self
            .projected
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, _, workload)| !listed.contains(workload))
            .map(|(assignment_id, attempt, workload)| ObservedWorkload {
                workload,
                assignment_id,
                attempt,
                phase: WorkloadPhase::Gone,
                reason: Some("vanished-while-worker-down".to_owned()),
            })
            .collect();
        for o in found {
            if o.phase == WorkloadPhase::Gone {
                continue;
            }
            self.track(&o);
            self.publish_observed(&o, shutdown).await;
        }
        for o in vanished {
            tracing::info!(workload = %o.workload, assignment = %o.assignment_id, "workload vanished while the worker was down");
            self.on_observed(o, shutdown).await;
        }
        tracing::info!(
            adopted = self.live_count(),
            capacity = self.settings.capacity,
            "recovered workloads"
        );
    }

    fn live_count(&self) -> usize {
        self.live.lock().map(|l| l.len()).unwrap_or(0)
    }

    /// Starts tracking a workload found by listing or watching (takes a slot if one is free).
    fn track(&self, o: &ObservedWorkload) -> bool {
        let Ok(mut live) = self.live.lock() else {
            return false;
        };
        if live.contains_key(&o.workload) {
            return false;
        }
        let slot = match self.slots.adopt() {
            Some(p) => Permit::new(p),
            None => {
                // Usually the watch seeing a workload before its create handler recorded it (the
                // handler then hands over its own slot); after a restart, more workloads than
                // capacity: pulling waits until some are gone.
                tracing::debug!(workload = %o.workload, "no free slot for an untracked workload");
                Permit::unlimited()
            }
        };
        live.insert(
            o.workload.clone(),
            Live {
                assignment_id: o.assignment_id,
                attempt: o.attempt,
                phase: o.phase,
                reason: o.reason.clone(),
                _slot: slot,
            },
        );
        self.metrics.adopted.inc();
        true
    }

    async fn on_assignment(self: Arc<Self>, mut delivery: Delivery) -> Disposition {
        let envelope = &delivery.envelope;
        let Message::Assignment(assignment) = &envelope.message else {
            self.metrics.terminated_messages.inc();
            return Disposition::Term(format!("expected an assignment, got {}", envelope.kind()));
        };
        if assignment.backend != self.settings.backend {
            self.metrics.terminated_messages.inc();
            return Disposition::Term(format!(
                "assignment for backend {} reached {}",
                assignment.backend, self.settings.backend
            ));
        }
        let (id, attempt) = (envelope.assignment_id, envelope.attempt);
        if delivery.delivered_count > 1 {
            match self.claimed_and_gone(id, attempt).await {
                Ok(false) => {}
                Ok(true) => {
                    tracing::info!(assignment = %id, attempt, "redelivered assignment was claimed and its workload is gone; not creating it again");
                    return Disposition::Ack;
                }
                Err(message) => {
                    tracing::warn!(assignment = %id, %message, "cannot tell whether a redelivered assignment already ran; will retry");
                    return Disposition::Nak(Some(Duration::from_secs(2)));
                }
            }
        }
        let token = self.settings.token_key.token(id, attempt);
        let hash = token_hash(&token);
        let spec = self.spec(assignment, id, attempt, token);
        let name = spec.name();

        // The token hash is durable before the workload can start, so the facade can
        // authenticate the executor's first call.
        let requested = Envelope::new(
            format!("workload-requested:{id}:{attempt}"),
            now_ms(),
            id,
            attempt,
            Message::WorkloadRequested(WorkloadRequested {
                backend: self.settings.backend.clone(),
                workload: name.clone(),
                token_hash: hash.clone(),
                worker_id: self.settings.worker_id.clone(),
            }),
        );
        if let Err(e) = self
            .bus
            .publish(
                &subject::event(&self.settings.backend, id, Kind::WorkloadRequested),
                &requested,
            )
            .await
        {
            tracing::warn!(assignment = %id, error = %e, "cannot publish workload-requested");
            return Disposition::Nak(Some(Duration::from_secs(2)));
        }

        let workload = match self.backend.create(&spec).await {
            Ok(w) => w,
            Err(e) => return self.create_failed(id, attempt, &name, e).await,
        };
        self.metrics.created.inc();
        if attempt == 1 {
            self.metrics
                .dispatch_latency
                .observe(now_ms().saturating_sub(assignment.fetched_at) as f64 / 1000.0);
        }
        {
            let slot = delivery.permit.take().unwrap_or_else(Permit::unlimited);
            if let Ok(mut live) = self.live.lock() {
                match live.entry(workload.clone()) {
                    // Already tracked: the watch saw the workload before this handler got here
                    // (and may have found no free slot for it), or this is a redelivery. Either
                    // way the workload holds exactly this delivery's slot from now on.
                    std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut()._slot = slot,
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(Live {
                            assignment_id: id,
                            attempt,
                            phase: WorkloadPhase::Pending,
                            reason: None,
                            _slot: slot,
                        });
                    }
                }
            }
        }
        let created = Envelope::new(
            format!("workload-created:{id}:{attempt}"),
            now_ms(),
            id,
            attempt,
            Message::WorkloadCreated(WorkloadCreated {
                backend: self.settings.backend.clone(),
                workload: workload.clone(),
                token_hash: hash,
                worker_id: self.settings.worker_id.clone(),
            }),
        );
        match self
            .bus
            .publish(
                &subject::event(&self.settings.backend, id, Kind::WorkloadCreated),
                &created,
            )
            .await
        {
            Ok(_) => {
                tracing::info!(assignment = %id, attempt, %workload, "workload created");
                Disposition::Ack
            }
            // The workload exists and is tracked; the redelivery finds it and publishes again.
            Err(e) => {
                tracing::warn!(assignment = %id, error = %e, "cannot publish workload-created");
                Disposition::Nak(Some(Duration::from_secs(2)))
            }
        }
    }

    /// A redelivery may come after the attempt's workload was created, ran its job and was
    /// deleted (the worker died before its ack, or a create call timed out while the workload
    /// came up and finished). Creating it again would start a second workload for a task that an
    /// executor has already claimed. True when the task is claimed and no live workload of this
    /// attempt exists; an existing one is left to `create` to find.
    async fn claimed_and_gone(&self, id: AssignmentId, attempt: u32) -> Result<bool, String> {
        let claimed = subject::event(&self.settings.backend, id, Kind::Claimed);
        let claim = self
            .bus
            .last_on_subject(jr_protocol::STREAM_EVENTS, &claimed)
            .await
            .map_err(|e| e.to_string())?;
        if claim.is_none_or(|(_, e)| e.attempt != attempt) {
            return Ok(false);
        }
        let found = self.backend.list().await.map_err(|e| e.to_string())?;
        let live = found.iter().any(|o| {
            o.assignment_id == id
                && o.attempt == attempt
                && !matches!(o.phase, WorkloadPhase::Gone | WorkloadPhase::Terminating)
        });
        Ok(!live)
    }

    fn spec(&self, a: &Assignment, id: AssignmentId, attempt: u32, token: String) -> WorkloadSpec {
        WorkloadSpec {
            assignment_id: id,
            attempt,
            backend: self.settings.backend.clone(),
            provider: a.provider.clone(),
            labels: a.labels.clone(),
            max_duration: Duration::from_secs(a.max_duration_secs.max(60)),
            worker_id: self.settings.worker_id.clone(),
            facade_url: self.settings.facade_url.clone(),
            executor_token: token,
        }
    }

    async fn create_failed(
        &self,
        id: AssignmentId,
        attempt: u32,
        name: &str,
        e: BackendError,
    ) -> Disposition {
        self.metrics
            .create_errors
            .get_or_create(&ErrorLabels {
                kind: e.kind().to_owned(),
            })
            .inc();
        match e {
            BackendError::Full { retry_after, .. } => {
                self.metrics.full_pauses.inc();
                tracing::info!(assignment = %id, ?retry_after, "backend full; pausing pulls");
                self.slots.pause_for(retry_after);
                Disposition::Nak(Some(retry_after))
            }
            BackendError::Transient {
                retry_after,
                message,
                ..
            } => {
                tracing::warn!(assignment = %id, %message, "create failed; will retry");
                Disposition::Nak(Some(retry_after.unwrap_or(Duration::from_secs(5))))
            }
            BackendError::Permanent { message, .. } => {
                // Reported as a failed workload: the reconciler redispatches or fails the task
                // with this reason instead of the job waiting forever.
                tracing::error!(assignment = %id, %message, "backend refused the workload");
                let o = ObservedWorkload {
                    workload: name.to_owned(),
                    assignment_id: id,
                    attempt,
                    phase: WorkloadPhase::Failed,
                    reason: Some(format!("create-refused: {message}")),
                };
                match self.publish_observation(&o).await {
                    Ok(()) => Disposition::Ack,
                    Err(_) => Disposition::Nak(Some(Duration::from_secs(2))),
                }
            }
        }
    }

    async fn on_command(self: Arc<Self>, delivery: Delivery) -> Disposition {
        let envelope = delivery.envelope;
        let Message::DeleteWorkload(DeleteWorkload {
            backend,
            workload,
            reason,
        }) = envelope.message
        else {
            self.metrics.terminated_messages.inc();
            return Disposition::Term(format!("unexpected command {}", envelope.kind()));
        };
        if backend != self.settings.backend {
            return Disposition::Term(format!(
                "delete for backend {backend} reached {}",
                self.settings.backend
            ));
        }
        match self.backend.delete(&workload).await {
            Ok(()) => {
                self.metrics.deleted.inc();
                tracing::info!(assignment = %envelope.assignment_id, %workload, %reason, "workload deleted");
                let tracked = self
                    .live
                    .lock()
                    .map(|l| l.contains_key(&workload))
                    .unwrap_or(false);
                if !tracked {
                    // Nothing of ours holds a slot for it; say it is gone right away.
                    let released =
                        self.released(envelope.assignment_id, envelope.attempt, &workload);
                    if self
                        .bus
                        .publish(
                            &subject::event(&backend, envelope.assignment_id, Kind::Released),
                            &released,
                        )
                        .await
                        .is_err()
                    {
                        return Disposition::Nak(Some(Duration::from_secs(2)));
                    }
                }
                // Tracked workloads are released when the backend reports them gone.
                Disposition::Ack
            }
            Err(BackendError::Permanent { message, .. }) => {
                Disposition::Term(format!("delete refused: {message}"))
            }
            Err(e) => {
                tracing::warn!(%workload, error = %e, "delete failed; will retry");
                Disposition::Nak(Some(Duration::from_secs(2)))
            }
        }
    }

    fn released(&self, id: AssignmentId, attempt: u32, workload: &str) -> Envelope {
        Envelope::new(
            format!("released:{id}:{attempt}:{workload}"),
            now_ms(),
            id,
            attempt,
            Message::Released(Released {
                backend: self.settings.backend.clone(),
                workload: workload.to_owned(),
            }),
        )
    }

    async fn on_observed(&self, o: ObservedWorkload, shutdown: &CancellationToken) {
        let changed = {
            let Ok(mut live) = self.live.lock() else {
                return;
            };
            match live.get_mut(&o.workload) {
                Some(l) if l.phase == o.phase && l.reason == o.reason => false,
                Some(l) => {
                    l.phase = o.phase;
                    l.reason = o.reason.clone();
                    true
                }
                None => true,
            }
        };
        if o.phase != WorkloadPhase::Gone
            && changed
            && !self
                .live
                .lock()
                .map(|l| l.contains_key(&o.workload))
                .unwrap_or(true)
        {
            // A workload we did not create in this process (orphan or from a previous run).
            self.track(&o);
        }
        if changed {
            self.publish_observed(&o, shutdown).await;
        }
        if o.phase == WorkloadPhase::Gone {
            let was_live = self
                .live
                .lock()
                .ok()
                .and_then(|mut l| l.remove(&o.workload));
            let (id, attempt) = was_live.as_ref().map_or((o.assignment_id, o.attempt), |l| {
                (l.assignment_id, l.attempt)
            });
            let released = self.released(id, attempt, &o.workload);
            let subject = subject::event(&self.settings.backend, id, Kind::Released);
            if self
                .bus
                .publish_retrying(&subject, &released, shutdown)
                .await
                .is_ok()
            {
                self.metrics.released.inc();
            }
            // Dropping `was_live` here frees the slot.
            drop(was_live);
        }
    }

    async fn publish_observation(&self, o: &ObservedWorkload) -> Result<(), jr_bus::BusError> {
        let envelope = self.observed_envelope(o);
        self.bus
            .publish(
                &subject::event(
                    &self.settings.backend,
                    o.assignment_id,
                    Kind::WorkloadObserved,
                ),
                &envelope,
            )
            .await
            .map(|_| ())
    }

    fn observed_envelope(&self, o: &ObservedWorkload) -> Envelope {
        let phase = serde_label(o.phase);
        Envelope::new(
            format!(
                "observed:{}:{}:{}:{phase}:{}",
                o.assignment_id,
                o.attempt,
                o.workload,
                o.reason.as_deref().unwrap_or("")
            ),
            now_ms(),
            o.assignment_id,
            o.attempt,
            Message::WorkloadObserved(WorkloadObserved {
                backend: self.settings.backend.clone(),
                workload: o.workload.clone(),
                phase: o.phase,
                reason: o.reason.clone(),
            }),
        )
    }

    async fn publish_observed(&self, o: &ObservedWorkload, shutdown: &CancellationToken) {
        let envelope = self.observed_envelope(o);
        let subject = subject::event(
            &self.settings.backend,
            o.assignment_id,
            Kind::WorkloadObserved,
        );
        if let Err(e) = self
            .bus
            .publish_retrying(&subject, &envelope, shutdown)
            .await
        {
            tracing::warn!(workload = %o.workload, error = %e, "observation not published");
        }
    }

    /// Lists the backend now and then: tracked workloads that vanished without a watch event are
    /// released, unknown ones are adopted and reported.
    async fn resync_loop(&self, shutdown: &CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.settings.resync_interval) => {}
            }
            let Ok(found) = self.backend.list().await else {
                continue;
            };
            let present: std::collections::HashSet<&str> =
                found.iter().map(|o| o.workload.as_str()).collect();
            let vanished: Vec<ObservedWorkload> = self
                .live
                .lock()
                .map(|l| {
                    l.iter()
                        .filter(|(name, _)| !present.contains(name.as_str()))
                        .map(|(name, l)| ObservedWorkload {
                            workload: name.clone(),
                            assignment_id: l.assignment_id,
                            attempt: l.attempt,
                            phase: WorkloadPhase::Gone,
                            reason: None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            for o in vanished.into_iter().chain(found) {
                self.on_observed(o, shutdown).await;
            }
        }
    }
}

/// The kebab-case name of a phase, as on the wire.
fn serde_label(phase: WorkloadPhase) -> &'static str {
    match phase {
        WorkloadPhase::Pending => "pending",
        WorkloadPhase::Running => "running",
        WorkloadPhase::Succeeded => "succeeded",
        WorkloadPhase::Failed => "failed",
        WorkloadPhase::Terminating => "terminating",
        WorkloadPhase::Gone => "gone",
        WorkloadPhase::Unknown => "unknown",
    }
}

/// Settings of the worker serving `[backend.<name>]` with the `[pod_worker]`/`[vm_worker]`
/// section `section`: which backend (default `default_backend`), its capacity, identity, the
/// facade URL executors use and the token key.
pub fn settings_from_config(
    config: &jr_config::Config,
    section: &jr_config::WorkerConfig,
    section_name: &str,
    default_backend: &str,
) -> Result<(WorkerSettings, jr_config::BackendConfig), String> {
    let name = section
        .backend
        .clone()
        .unwrap_or_else(|| default_backend.to_owned());
    let backend_cfg = config
        .backend
        .get(&name)
        .cloned()
        .ok_or_else(|| format!("{section_name}.backend: no [backend.{name}] in the config"))?;
    let backend = BackendName::new(name.clone()).map_err(|e| format!("backend.{name}: {e}"))?;
    let key_text = jr_config::read_secret(&format!("{section_name}.token_key"), &section.token_key, &section.token_key_file)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{section_name}.token_key (or token_key_file) is required: base64 of at least 32 random bytes"))?;
    let token_key =
        TokenKey::from_base64(&key_text).map_err(|e| format!("{section_name}.token_key: {e}"))?;
    let settings = WorkerSettings {
        // Stable across restarts by default: workloads are listed by it after a restart.
        worker_id: section
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("{name}-worker")),
        backend,
        capacity: backend_cfg.capacity,
        facade_url: config.facade.public_url.clone(),
        token_key,
        resync_interval: Duration::from_secs(15),
    };
    Ok((settings, backend_cfg))
}

/// Reads what the projection counts as live on `backend`, for the start-up comparison with the
/// backend's own listing. Postgres being unreachable is not fatal: the worker then recovers from
/// the listing alone.
pub async fn projected_live(
    database_url: &str,
    backend: &str,
) -> Vec<(jr_protocol::AssignmentId, u32, String)> {
    let read = async {
        let store = jr_store::Store::connect(database_url).await?;
        store.slot_holders(backend).await
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), read).await {
        Ok(Ok(live)) => live,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read the projection; recovering from the backend listing only");
            Vec::new()
        }
        Err(_) => {
            tracing::warn!("projection read timed out; recovering from the backend listing only");
            Vec::new()
        }
    }
}

/// The tail every worker binary shares: read the projection's view of this backend, build the
/// worker, register its metrics and run it with readiness reporting until shutdown.
pub async fn run_service<B: Backend>(
    p: jr_service::Process,
    backend: B,
    settings: WorkerSettings,
) -> Result<(), WorkerError> {
    let projected = projected_live(&p.config.database.url, settings.backend.as_str()).await;
    let worker = Worker::new(p.bus, backend, settings);
    worker.set_projected_live(projected);
    worker.metrics.register(&mut p.metrics.registry());
    let readiness = p.readiness.clone();
    worker
        .run(
            move |ready| readiness.set("worker", ready),
            p.shutdown.token(),
        )
        .await
}
