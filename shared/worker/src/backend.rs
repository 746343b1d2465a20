//! The seam between the worker core and a concrete backend (Kubernetes Pods, OpenSandbox VMs).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use jr_protocol::{AssignmentId, BackendName, WorkloadPhase};
use tokio::sync::mpsc;

/// Environment variable names of the executor contract (docs/architecture.md, "Executor contract").
pub const ENV_FACADE_URL: &str = "JETRUNNER_FACADE_URL";
pub const ENV_ASSIGNMENT_ID: &str = "JETRUNNER_ASSIGNMENT_ID";
pub const ENV_RUNNER_TOKEN: &str = "JETRUNNER_RUNNER_TOKEN";
/// The job's `runs-on` labels, comma separated (the executor registers the runner with them).
pub const ENV_LABELS: &str = "JETRUNNER_LABELS";
/// `github` for a GitHub Actions job; absent for Gitea and Forgejo.
pub const ENV_FORGE: &str = "JETRUNNER_FORGE";

/// Everything a backend needs to create the workload of one assignment attempt.
#[derive(Clone, Debug)]
pub struct WorkloadSpec {
    pub assignment_id: AssignmentId,
    pub attempt: u32,
    pub backend: BackendName,
    pub provider: Option<String>,
    /// The job's `runs-on` labels (routing already happened; providers may use them).
    pub labels: Vec<String>,
    pub max_duration: Duration,
    /// Identity of the worker process creating it (recorded in metadata).
    pub worker_id: String,
    /// URL of the facade the executor talks to.
    pub facade_url: String,
    /// The per-attempt executor token. Backends must deliver it so that it is not readable by
    /// whoever can list workloads (e.g. a Secret owned by the Pod), never log it.
    pub executor_token: String,
    /// `owner/name` of the job's repository (placement: burst buckets, protected jobs).
    pub repository: String,
    /// The workflow's name; empty when the forge sent none.
    pub workflow: String,
    pub job_name: String,
    /// When the scheduler received the task (unix ms): how long the job has waited.
    pub fetched_at: u64,
    /// `JETRUNNER_FORGE` of the executor contract (`github`: the executor runs a just-in-time
    /// runner); `None` for act_runner against the facade.
    pub forge_env: Option<&'static str>,
}

impl WorkloadSpec {
    /// Deterministic workload name: a redelivered assignment finds the existing workload.
    pub fn name(&self) -> String {
        workload_name(self.assignment_id, self.attempt)
    }

    /// The executor environment of the executor contract (token included).
    pub fn executor_env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::from([
            (ENV_FACADE_URL.to_owned(), self.facade_url.clone()),
            (ENV_ASSIGNMENT_ID.to_owned(), self.assignment_id.to_string()),
            (ENV_RUNNER_TOKEN.to_owned(), self.executor_token.clone()),
            (ENV_LABELS.to_owned(), self.labels.join(",")),
        ]);
        if let Some(forge) = self.forge_env {
            env.insert(ENV_FORGE.to_owned(), forge.to_owned());
        }
        env
    }
}

/// `jr-<assignment uuid>-<attempt>`: a valid DNS-1123 label (≤ 63 characters).
pub fn workload_name(assignment_id: AssignmentId, attempt: u32) -> String {
    format!("jr-{assignment_id}-{attempt}")
}

/// What a backend reports about one of its workloads (from a list, a watch or a poll).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedWorkload {
    /// Backend reference: Pod name or sandbox id.
    pub workload: String,
    pub assignment_id: AssignmentId,
    pub attempt: u32,
    pub phase: WorkloadPhase,
    pub reason: Option<String>,
    /// The worker label it carries: the name of the worker process that created it (empty
    /// when it has none). Replicas of one backend manage only the workloads of creators they
    /// own.
    pub worker: String,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Worth retrying later (network, 5xx, timeouts, conflicts being resolved).
    #[error("{op}: {message}")]
    Transient {
        op: &'static str,
        message: String,
        retry_after: Option<Duration>,
    },
    /// The backend has no room now (e.g. OpenSandbox 429 POOL_CAPACITY_EXHAUSTED): stop pulling
    /// for `retry_after`; the assignment goes back pending without burning an attempt.
    #[error("{op}: backend full, retry after {retry_after:?}")]
    Full {
        op: &'static str,
        retry_after: Duration,
    },
    /// No room for this workload now, while the backend may take others (placement rules keep
    /// this job off the provider that has room): the assignment waits `retry_after` without
    /// burning an attempt, and pulling goes on.
    #[error("{op}: no room for this job now, retry after {retry_after:?}")]
    Wait {
        op: &'static str,
        retry_after: Duration,
    },
    /// Retrying the same request cannot succeed (bad template, missing pool, quota refused).
    #[error("{op}: {message}")]
    Permanent { op: &'static str, message: String },
}

impl BackendError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::Transient { .. } => "transient",
            BackendError::Full { .. } => "full",
            BackendError::Wait { .. } => "wait",
            BackendError::Permanent { .. } => "permanent",
        }
    }
}

/// A place where workloads run. Implementations must be idempotent: `create` for an attempt whose
/// workload already exists returns that workload; `delete` of a missing workload succeeds.
pub trait Backend: Send + Sync + 'static {
    /// Creates the workload of `spec` (or finds the existing one) and returns its reference.
    fn create(
        &self,
        spec: &WorkloadSpec,
    ) -> impl Future<Output = Result<String, BackendError>> + Send;

    /// Deletes a workload; returns once deletion is accepted. Missing = success.
    fn delete(&self, workload: &str) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Lists every workload of ours that still exists (any phase), for start-up recovery.
    fn list(&self) -> impl Future<Output = Result<Vec<ObservedWorkload>, BackendError>> + Send;

    /// Runs until `shutdown` resolves, sending an observation whenever a workload of ours changes
    /// phase (or disappears: phase `Gone`). Reconnects/resumes on its own after errors.
    fn observe(
        &self,
        tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send;
}

/// A workload spec for unit tests: attempt 1 of assignment `n + 1`, repository `acme/widgets`.
#[cfg(test)]
pub(crate) fn test_spec(n: u32) -> WorkloadSpec {
    WorkloadSpec {
        assignment_id: AssignmentId(uuid::Uuid::from_u128(u128::from(n) + 1)),
        attempt: 1,
        backend: BackendName::new("pod").expect("backend name"),
        provider: None,
        labels: vec!["pod".into()],
        max_duration: Duration::from_secs(60),
        worker_id: "w".into(),
        facade_url: "http://facade".into(),
        executor_token: "t".into(),
        repository: "acme/widgets".into(),
        workflow: "ci".into(),
        job_name: "build".into(),
        fetched_at: 0,
        forge_env: None,
    }
}
