//! [`VmBackend`]: `jr_worker::Backend` over pooled OpenSandbox sandboxes.
//!
//! The API has no client-chosen ids and no idempotency key, so every sandbox carries label-safe
//! metadata naming its assignment attempt, and `create` looks for an existing one by that
//! metadata before and (when the outcome is unknown) after creating. There is no watch either:
//! [`VmBackend::observe`] polls one paged list of all our sandboxes per cycle.

mod observe;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use jr_protocol::{AssignmentId, BackendName, Reason, WorkloadPhase, labels};
use jr_worker::{Backend, BackendError, ObservedWorkload, WorkloadSpec};
use time::OffsetDateTime;
use tokio::sync::{Notify, mpsc};

use crate::opensandbox::{
    CreateSandbox, MIN_TIMEOUT_SECS, Sandbox, SandboxClient, SandboxError, SandboxState,
    SandboxStatus, sanitize_label_value,
};

/// Metadata keys jetrunner writes on every sandbox, the same as on Pods (all label-safe; values
/// are sanitised). `LABEL_DEADLINE` holds the unix seconds until which the sandbox must live.
pub use jr_protocol::labels::{
    ASSIGNMENT as LABEL_ASSIGNMENT, ATTEMPT as LABEL_ATTEMPT, BACKEND as LABEL_BACKEND,
    DEADLINE as LABEL_DEADLINE, PROVIDER as LABEL_PROVIDER, WORKER as LABEL_WORKER,
};

/// One generation of the metadata keys on sandboxes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keys {
    assignment: &'static str,
    attempt: &'static str,
    backend: &'static str,
    worker: &'static str,
    provider: &'static str,
    deadline: &'static str,
}

/// The keys this worker writes.
const KEYS: Keys = Keys {
    assignment: labels::ASSIGNMENT,
    attempt: labels::ATTEMPT,
    backend: labels::BACKEND,
    worker: labels::WORKER,
    provider: labels::PROVIDER,
    deadline: labels::DEADLINE,
};

/// The keys older vm-workers wrote: never written, but listed and read, so sandboxes made
/// before an upgrade are adopted and cleaned up like any other.
const LEGACY_KEYS: Keys = Keys {
    assignment: labels::legacy_sandbox::ASSIGNMENT,
    attempt: labels::legacy_sandbox::ATTEMPT,
    backend: labels::legacy_sandbox::BACKEND,
    worker: labels::legacy_sandbox::WORKER,
    provider: labels::legacy_sandbox::PROVIDER,
    deadline: labels::legacy_sandbox::DEADLINE,
};

/// Every generation a sandbox of ours may carry, the current one first.
const GENERATIONS: [Keys; 2] = [KEYS, LEGACY_KEYS];

pub const DEFAULT_POOL: &str = "ci-vm";

/// How long to wait before trying again after a ResourceQuota refused a sandbox (the server
/// sends no Retry-After with it).
const QUOTA_RETRY_AFTER: Duration = Duration::from_secs(30);

/// How `observe` polls.
#[derive(Clone, Debug)]
pub struct PollConfig {
    /// Interval while some sandbox is in transition (pending, stopping, unknown, just created).
    pub active: Duration,
    /// Interval while every sandbox is steady (running, failed) or there are none.
    pub steady: Duration,
    /// Upper bound of the back-off while the server fails.
    pub max_backoff: Duration,
    /// Consecutive failed polls after which every tracked sandbox is reported
    /// `Unknown`/`backend-unreachable`.
    pub unreachable_after: u32,
    /// Renew the expiry when it is this close and earlier than the sandbox's deadline.
    pub renew_ahead: Duration,
    /// Minimum time between the start of one poll and a poll woken early by a create or a
    /// delete. Every create and delete wakes the poller; at saturation that is hundreds of
    /// wakes a second, and without a gap the poller would list back to back.
    pub woken_gap: Duration,
    /// Minimum time between two renewals of one sandbox (the server may cap expiries).
    pub renew_every: Duration,
}

impl Default for PollConfig {
    fn default() -> Self {
        Self {
            active: Duration::from_secs(1),
            steady: Duration::from_secs(5),
            max_backoff: Duration::from_secs(30),
            unreachable_after: 3,
            renew_ahead: Duration::from_secs(600),
            renew_every: Duration::from_secs(60),
            woken_gap: Duration::from_millis(50),
        }
    }
}

#[derive(Clone, Debug)]
pub struct VmBackendConfig {
    pub backend: BackendName,
    /// `extensions.poolRef` for specs without a provider, or whose provider has no entry below.
    pub pool: String,
    /// Provider name → pool.
    pub provider_pools: BTreeMap<String, String>,
    /// Set when this is one provider of the backend: only sandboxes with its name in their
    /// metadata are listed and observed.
    pub provider: Option<String>,
    /// Command for the pool task; `None` lets the Pool's image decide.
    pub entrypoint: Option<Vec<String>>,
    /// Added to the job's `max_duration` for the sandbox TTL (a safety net against leaks; the
    /// reconciler deletes sandboxes long before).
    pub expiry_grace: Duration,
    pub poll: PollConfig,
}

impl VmBackendConfig {
    pub fn new(backend: BackendName) -> Self {
        Self {
            backend,
            pool: DEFAULT_POOL.to_owned(),
            provider_pools: BTreeMap::new(),
            provider: None,
            entrypoint: None,
            expiry_grace: Duration::from_secs(600),
            poll: PollConfig::default(),
        }
    }
}

/// Cheap to clone; clones share the tracked set.
#[derive(Clone)]
pub struct VmBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: SandboxClient,
    config: VmBackendConfig,
    /// Metadata filter matching every sandbox of this worker and backend.
    owner_filter: BTreeMap<String, String>,
    /// The same under the legacy keys.
    legacy_owner_filter: BTreeMap<String, String>,
    /// Sandboxes of this worker under the legacy keys may still exist. Cleared by the first
    /// listing that finds none: this worker never writes those keys, so none appear later.
    legacy_may_exist: AtomicBool,
    tracked: Mutex<HashMap<String, Tracked>>,
    /// Wakes the poller early after a create or delete.
    wake: Notify,
}

/// What the poller remembers about one sandbox of ours.
struct Tracked {
    assignment_id: AssignmentId,
    attempt: u32,
    /// The worker label: the worker process that created it.
    worker: String,
    last: Option<WorkloadPhase>,
    unreachable_reported: bool,
    last_renew: Option<Instant>,
}

impl Tracked {
    fn new(assignment_id: AssignmentId, attempt: u32, worker: String) -> Self {
        Self {
            assignment_id,
            attempt,
            worker,
            last: None,
            unreachable_reported: false,
            last_renew: None,
        }
    }

    /// Records `phase`; true when it must be reported.
    fn update(&mut self, phase: WorkloadPhase) -> bool {
        let changed = self.unreachable_reported || self.last != Some(phase);
        self.last = Some(phase);
        self.unreachable_reported = false;
        changed
    }

    fn observed(
        &self,
        workload: &str,
        phase: WorkloadPhase,
        reason: Option<String>,
    ) -> ObservedWorkload {
        ObservedWorkload {
            workload: workload.to_owned(),
            assignment_id: self.assignment_id,
            attempt: self.attempt,
            phase,
            reason,
            worker: self.worker.clone(),
        }
    }
}

/// Lifecycle state mapping: `Terminated | Failed` terminal, `Stopping` terminating, unknown strings
/// non-terminal. (A 404 is `Gone`, decided by the caller.)
pub fn phase_of(status: &SandboxStatus) -> (WorkloadPhase, Option<String>) {
    let reason = || {
        status
            .reason
            .as_deref()
            .map(|r| r.to_ascii_lowercase().replace('_', "-"))
    };
    match &status.state {
        SandboxState::Running => (WorkloadPhase::Running, None),
        SandboxState::Pending | SandboxState::Allocated => (WorkloadPhase::Pending, None),
        SandboxState::Stopping => (WorkloadPhase::Terminating, None),
        SandboxState::Terminated => (WorkloadPhase::Succeeded, reason()),
        SandboxState::Failed => (
            WorkloadPhase::Failed,
            reason().or_else(|| Some(Reason::Failed.to_string())),
        ),
        SandboxState::Pausing
        | SandboxState::Paused
        | SandboxState::Resuming
        | SandboxState::Unknown
        | SandboxState::Other(_) => (
            WorkloadPhase::Unknown,
            Some(status.state.as_str().to_ascii_lowercase()),
        ),
    }
}

/// The assignment attempt a sandbox belongs to, from its metadata (current or legacy keys).
fn ownership(sandbox: &Sandbox) -> Option<(AssignmentId, u32, String)> {
    GENERATIONS.iter().find_map(|keys| {
        let assignment = sandbox.metadata.get(keys.assignment)?.parse().ok()?;
        let attempt = sandbox.metadata.get(keys.attempt)?.parse().ok()?;
        let worker = sandbox
            .metadata
            .get(keys.worker)
            .cloned()
            .unwrap_or_default();
        Some((assignment, attempt, worker))
    })
}

/// The worker label of a sandbox (empty when it has none).
fn creator(sandbox: &Sandbox) -> String {
    ownership(sandbox)
        .map(|(_, _, worker)| worker)
        .unwrap_or_default()
}

/// The unix second until which a sandbox must live, from its metadata (current or legacy keys).
fn deadline(sandbox: &Sandbox) -> Option<i64> {
    GENERATIONS
        .iter()
        .find_map(|keys| sandbox.metadata.get(keys.deadline)?.parse().ok())
}

/// Sandboxes of several listings, each once.
fn merge(lists: impl IntoIterator<Item = Vec<Sandbox>>) -> Vec<Sandbox> {
    let mut seen = HashSet::new();
    lists
        .into_iter()
        .flatten()
        .filter(|s| seen.insert(s.id.clone()))
        .collect()
}

/// The one mapping from API errors to worker dispositions.
fn backend_error(op: &'static str, error: SandboxError) -> BackendError {
    match error {
        SandboxError::CapacityExhausted { retry_after, .. } => {
            BackendError::Full { op, retry_after }
        }
        SandboxError::PoolNotFound { message, .. } => BackendError::Permanent {
            op,
            message: format!(
                "OpenSandbox pool not found (check the Pool CR and extensions.poolRef): {message}"
            ),
        },
        // A quota is capacity too: back-pressure, not a failure of the job.
        SandboxError::QuotaExceeded { .. } => BackendError::Full {
            op,
            retry_after: QUOTA_RETRY_AFTER,
        },
        e @ (SandboxError::Forbidden { .. }
        | SandboxError::Invalid { .. }
        | SandboxError::Config(_)) => BackendError::Permanent {
            op,
            message: e.to_string(),
        },
        // A wrong API key is an operator mistake that can be fixed without failing jobs.
        e @ SandboxError::Unauthorized { .. } => BackendError::Transient {
            op,
            message: e.to_string(),
            retry_after: Some(Duration::from_secs(30)),
        },
        e @ (SandboxError::ReadyTimeout { .. }
        | SandboxError::NotFound { .. }
        | SandboxError::Conflict { .. }
        | SandboxError::Server { .. }
        | SandboxError::Connect { .. }
        | SandboxError::Transport { .. }
        | SandboxError::Timeout { .. }
        | SandboxError::Decode { .. }
        | SandboxError::Unexpected { .. }) => BackendError::Transient {
            op,
            message: e.to_string(),
            retry_after: None,
        },
    }
}

impl VmBackend {
    pub fn new(client: SandboxClient, config: VmBackendConfig) -> Self {
        // Every replica of the backend lists all of its sandboxes (the worker core keeps to
        // those of the creators it manages, and takes over those of replicas that stopped).
        let owner_filter = |keys: Keys| {
            let mut filter = BTreeMap::from([(
                keys.backend.to_owned(),
                sanitize_label_value(config.backend.as_str()),
            )]);
            if let Some(provider) = &config.provider {
                filter.insert(keys.provider.to_owned(), sanitize_label_value(provider));
            }
            filter
        };
        let (current, legacy) = (owner_filter(KEYS), owner_filter(LEGACY_KEYS));
        Self {
            inner: Arc::new(Inner {
                client,
                config,
                owner_filter: current,
                legacy_owner_filter: legacy,
                legacy_may_exist: AtomicBool::new(true),
                tracked: Mutex::new(HashMap::new()),
                wake: Notify::new(),
            }),
        }
    }

    pub fn client(&self) -> &SandboxClient {
        &self.inner.client
    }

    /// Carries this worker's owner labels, current or legacy (what `list` selects by).
    fn is_ours(&self, sandbox: &Sandbox) -> bool {
        [&self.inner.owner_filter, &self.inner.legacy_owner_filter]
            .into_iter()
            .any(|filter| {
                filter
                    .iter()
                    .all(|(key, value)| sandbox.metadata.get(key) == Some(value))
            })
    }

    /// Every sandbox of this worker and backend: those under the current keys, and those under
    /// the legacy keys while any may exist.
    pub(crate) async fn list_owned(&self) -> Result<Vec<Sandbox>, SandboxError> {
        let inner = &self.inner;
        let current = inner.client.list_all(&inner.owner_filter).await?;
        if !inner.legacy_may_exist.load(Ordering::Relaxed) {
            return Ok(current);
        }
        let legacy = inner.client.list_all(&inner.legacy_owner_filter).await?;
        if legacy.is_empty() {
            inner.legacy_may_exist.store(false, Ordering::Relaxed);
        }
        Ok(merge([current, legacy]))
    }

    /// Metadata filter selecting one attempt's sandboxes, whichever worker made them (a
    /// redelivery may reach another replica).
    fn attempt_filter(
        &self,
        keys: Keys,
        assignment_id: AssignmentId,
        attempt: u32,
    ) -> BTreeMap<String, String> {
        let backend = sanitize_label_value(self.inner.config.backend.as_str());
        BTreeMap::from([
            (keys.backend.to_owned(), backend),
            (keys.assignment.to_owned(), assignment_id.to_string()),
            (keys.attempt.to_owned(), attempt.to_string()),
        ])
    }

    /// One attempt's sandboxes under either generation of keys (a replica of an older version
    /// may have made it).
    async fn find_attempt(&self, spec: &WorkloadSpec) -> Result<Vec<Sandbox>, BackendError> {
        let mut found = Vec::new();
        for keys in GENERATIONS {
            let filter = self.attempt_filter(keys, spec.assignment_id, spec.attempt);
            found.push(
                self.inner
                    .client
                    .list_all(&filter)
                    .await
                    .map_err(|e| backend_error("create", e))?,
            );
        }
        Ok(merge(found))
    }

    fn request_for(&self, spec: &WorkloadSpec) -> CreateSandbox {
        let config = &self.inner.config;
        let ttl = (spec.max_duration + config.expiry_grace)
            .as_secs()
            .max(MIN_TIMEOUT_SECS);
        let deadline = OffsetDateTime::now_utc()
            .unix_timestamp()
            .saturating_add_unsigned(ttl);
        let mut metadata = self.attempt_filter(KEYS, spec.assignment_id, spec.attempt);
        metadata.extend(self.inner.owner_filter.clone());
        metadata.insert(
            KEYS.worker.to_owned(),
            sanitize_label_value(&spec.worker_id),
        );
        metadata.insert(KEYS.deadline.to_owned(), deadline.to_string());
        let pool = match &spec.provider {
            Some(provider) => {
                metadata.insert(KEYS.provider.to_owned(), sanitize_label_value(provider));
                config.provider_pools.get(provider).unwrap_or(&config.pool)
            }
            None => &config.pool,
        };
        CreateSandbox {
            pool: pool.clone(),
            timeout_secs: Some(ttl),
            metadata,
            env: spec.executor_env(),
            entrypoint: config.entrypoint.clone(),
        }
    }

    /// Picks the sandbox an attempt keeps among those found by metadata and deletes the rest, so
    /// exactly one lives per attempt. `Stopping` ones are on their way out (deleted, expired, or
    /// cleaned up by the server after a failed create) and are ignored.
    async fn adopt(&self, found: Vec<Sandbox>, spec: &WorkloadSpec) -> Option<String> {
        let mut live: Vec<Sandbox> = found
            .into_iter()
            .filter(|s| s.status.state != SandboxState::Stopping)
            .collect();
        // Prefer a running one (its executor may already work), then the oldest.
        live.sort_by(|a, b| {
            let rank = |s: &Sandbox| s.status.state != SandboxState::Running;
            (rank(a), a.created_at, &a.id).cmp(&(rank(b), b.created_at, &b.id))
        });
        let mut live = live.into_iter();
        let keep = live.next()?;
        for extra in live {
            tracing::warn!(sandbox = %extra.id, keep = %keep.id, assignment = %spec.assignment_id,
                attempt = spec.attempt, "deleting a duplicate sandbox of one attempt");
            if let Err(e) = self.inner.client.delete(&extra.id).await {
                tracing::warn!(sandbox = %extra.id, error = %e, "deleting a duplicate sandbox failed");
            }
        }
        self.track(&keep.id, spec.assignment_id, spec.attempt, &creator(&keep));
        Some(keep.id)
    }

    fn tracked(&self) -> MutexGuard<'_, HashMap<String, Tracked>> {
        // A panic while holding the lock leaves the map consistent (plain inserts/removes).
        self.inner
            .tracked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn track(&self, id: &str, assignment_id: AssignmentId, attempt: u32, worker: &str) {
        self.tracked()
            .entry(id.to_owned())
            .or_insert_with(|| Tracked::new(assignment_id, attempt, worker.to_owned()));
        self.inner.wake.notify_one();
    }
}

impl Backend for VmBackend {
    async fn create(&self, spec: &WorkloadSpec) -> Result<String, BackendError> {
        let client = &self.inner.client;
        let existing = self.find_attempt(spec).await?;
        if let Some(id) = self.adopt(existing, spec).await {
            tracing::info!(sandbox = %id, assignment = %spec.assignment_id, attempt = spec.attempt,
                "adopted the existing sandbox of this attempt");
            return Ok(id);
        }
        match client.create(&self.request_for(spec)).await {
            Ok(sandbox) => {
                tracing::debug!(sandbox = %sandbox.id, assignment = %spec.assignment_id,
                    attempt = spec.attempt, state = %sandbox.status.state, "sandbox created");
                self.track(
                    &sandbox.id,
                    spec.assignment_id,
                    spec.attempt,
                    &sanitize_label_value(&spec.worker_id),
                );
                Ok(sandbox.id)
            }
            Err(error) if error.create_outcome_unknown() => {
                tracing::warn!(assignment = %spec.assignment_id, attempt = spec.attempt, %error,
                    "create outcome unknown; looking for what the server made");
                let found = self.find_attempt(spec).await?;
                let stopping = found
                    .iter()
                    .filter(|s| s.status.state == SandboxState::Stopping)
                    .min_by_key(|s| (s.created_at, s.id.clone()))
                    .map(|s| s.id.clone());
                match (self.adopt(found, spec).await, stopping) {
                    (Some(id), _) => Ok(id),
                    // The server made this attempt's sandbox and it is already going (its job
                    // ran and it was deleted while the reply was late, or the server cleaned it
                    // up). It is this attempt's workload: report it rather than make a second
                    // one; its disappearance is then observed like any other.
                    (None, Some(id)) => {
                        tracing::info!(sandbox = %id, assignment = %spec.assignment_id,
                            attempt = spec.attempt, "the sandbox made for this attempt is already stopping");
                        self.track(
                            &id,
                            spec.assignment_id,
                            spec.attempt,
                            &sanitize_label_value(&spec.worker_id),
                        );
                        Ok(id)
                    }
                    (None, None) => Err(backend_error("create", error)),
                }
            }
            Err(error) => Err(backend_error("create", error)),
        }
    }

    /// Deletes only a sandbox carrying this worker's owner labels (backend and worker id): a
    /// `delete-workload` naming anything else is refused, whoever published it.
    async fn delete(&self, workload: &str) -> Result<(), BackendError> {
        let client = &self.inner.client;
        let sandbox = match client.get(workload).await {
            Ok(sandbox) => sandbox,
            Err(SandboxError::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(backend_error("delete", e)),
        };
        if !self.is_ours(&sandbox) {
            return Err(BackendError::Permanent {
                op: "delete",
                message: format!(
                    "sandbox {workload} does not carry this worker's labels; not deleting it"
                ),
            });
        }
        let deleted = client
            .delete(workload)
            .await
            .map_err(|e| backend_error("delete", e))?;
        tracing::debug!(
            sandbox = workload,
            already_gone = !deleted,
            "sandbox deleted"
        );
        self.inner.wake.notify_one();
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ObservedWorkload>, BackendError> {
        let sandboxes = self
            .list_owned()
            .await
            .map_err(|e| backend_error("list", e))?;
        let mut observed = Vec::with_capacity(sandboxes.len());
        for sandbox in sandboxes {
            let Some((assignment_id, attempt, worker)) = ownership(&sandbox) else {
                tracing::warn!(sandbox = %sandbox.id, "sandbox with our owner labels but no attempt labels");
                continue;
            };
            let (phase, reason) = phase_of(&sandbox.status);
            self.track(&sandbox.id, assignment_id, attempt, &worker);
            observed.push(ObservedWorkload {
                workload: sandbox.id,
                assignment_id,
                attempt,
                phase,
                reason,
                worker,
            });
        }
        Ok(observed)
    }

    async fn observe(
        &self,
        tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        observe::run(self, tx, shutdown).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(state: &str, reason: Option<&str>) -> SandboxStatus {
        SandboxStatus {
            state: SandboxState::from(state.to_owned()),
            reason: reason.map(str::to_owned),
            message: None,
            last_transition_at: None,
        }
    }

    #[test]
    fn states_map_to_phases_per_the_doc() {
        assert_eq!(
            phase_of(&status("Running", Some("RUNNING"))),
            (WorkloadPhase::Running, None)
        );
        assert_eq!(
            phase_of(&status("Allocated", Some("IP_ASSIGNED"))).0,
            WorkloadPhase::Pending
        );
        assert_eq!(phase_of(&status("Pending", None)).0, WorkloadPhase::Pending);
        assert_eq!(
            phase_of(&status("Stopping", Some("DELETING"))).0,
            WorkloadPhase::Terminating
        );
        assert_eq!(
            phase_of(&status("Failed", Some("TASK_FAILED"))),
            (WorkloadPhase::Failed, Some("task-failed".into()))
        );
        assert_eq!(
            phase_of(&status("Failed", None)),
            (WorkloadPhase::Failed, Some("failed".into()))
        );
        assert_eq!(
            phase_of(&status("Terminated", None)).0,
            WorkloadPhase::Succeeded
        );
        let (phase, reason) = phase_of(&status("Hibernating", None));
        assert_eq!(
            (phase, reason.as_deref()),
            (WorkloadPhase::Unknown, Some("hibernating"))
        );
        assert!(!phase.is_terminal());
    }

    #[test]
    fn errors_map_to_worker_dispositions() {
        let full = backend_error(
            "create",
            SandboxError::CapacityExhausted {
                op: "create",
                retry_after: Duration::from_secs(7),
                message: String::new(),
            },
        );
        assert!(
            matches!(full, BackendError::Full { retry_after, .. } if retry_after == Duration::from_secs(7))
        );
        let pool = backend_error(
            "create",
            SandboxError::PoolNotFound {
                op: "create",
                message: "ci-vm".into(),
            },
        );
        assert_eq!(pool.kind(), "permanent");
        let quota = backend_error(
            "create",
            SandboxError::QuotaExceeded {
                op: "create",
                message: "q".into(),
            },
        );
        assert!(
            matches!(quota, BackendError::Full { retry_after, .. } if retry_after == QUOTA_RETRY_AFTER),
            "a quota is back-pressure: {quota:?}"
        );
        let ready = backend_error(
            "create",
            SandboxError::ReadyTimeout {
                op: "create",
                message: "t".into(),
            },
        );
        assert_eq!(ready.kind(), "transient");
    }
}
