//! A fake act_runner in one-shot mode that follows the executor contract (docs/architecture.md,
//! "Executor contract") and act_runner's one-shot behaviour: Declare, poll FetchTask until one
//! task arrives, run it as the task's `JR_FAKE_*` vars describe while reporting logs and state,
//! then send the final `UpdateLog(no_more)` followed by the final `UpdateTask(result)`.
//!
//! [`runner_cli`] lets the binary stand in for the `act_runner` / `forgejo-runner` command that
//! the executor image's entrypoint (`executor/entrypoint.sh`, docs/executor.md) execs.

mod behaviour;
pub mod github_runner;
mod log;
pub mod runner_cli;
mod task;

use std::time::Duration;

use jr_forge::proto::runner::v1::{DeclareRequest, FetchTaskRequest, Result as TaskResult};
use jr_forge::{Credentials, ForgeClient, ForgeError};
use tokio::time::Instant;

pub use behaviour::{Outcome, TaskBehaviour, VAR_DURATION_MS, VAR_OUTCOME, VAR_OUTPUTS, VAR_STEPS};

/// Version string sent in Declare.
pub const EXECUTOR_VERSION: &str = concat!("jr-fake-executor/", env!("CARGO_PKG_VERSION"));

/// A deliberate protocol violation, to test how the facade and the reconciler cope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misbehaviour {
    /// Send UpdateLog/UpdateTask for task id + 1 instead of the claimed task.
    WrongTaskId,
    /// Return right after FetchTask delivered a task, without reporting anything.
    CrashAfterClaim,
    /// Skip the final `UpdateLog(no_more)`; still send the final UpdateTask.
    NoFinalLog,
}

/// How to reach the facade and how patient to be.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// Base URL of the facade (act_runner's `address`); calls go to `<url>/api/actions/...`.
    pub facade_url: String,
    /// Sent as `x-runner-uuid`.
    pub assignment_id: String,
    /// Sent as `x-runner-token`.
    pub token: String,
    /// Interval between Declare retries and FetchTask polls; also the heartbeat interval while a
    /// step runs and the delay between retries of the final calls.
    pub poll_interval: Duration,
    /// Bound on Declare + polling without a task (then `ExecutorReport::NoTask`), and separately
    /// on retrying each final call.
    pub give_up_after: Duration,
    /// Timeout of each single RPC.
    pub request_timeout: Duration,
    pub misbehaviour: Option<Misbehaviour>,
    /// Label names sent in Declare (a runner declares its labels at every start).
    pub labels: Vec<String>,
    /// forgejo-runner `one-job`: one Declare and one FetchTask; no task is not waited for.
    pub single_fetch: bool,
    /// forgejo-runner's reporting: a FAILURE reply stops the job as CANCELLED does, and the
    /// final result is sent before the last log upload.
    pub forgejo_reporting: bool,
}

impl ExecutorConfig {
    /// Defaults: poll every 1 s, give up after 120 s, 10 s per request, well behaved.
    pub fn new(
        facade_url: impl Into<String>,
        assignment_id: impl Into<String>,
        token: impl Into<String>,
    ) -> Self {
        ExecutorConfig {
            facade_url: facade_url.into(),
            assignment_id: assignment_id.into(),
            token: token.into(),
            poll_interval: Duration::from_secs(1),
            give_up_after: Duration::from_secs(120),
            request_timeout: Duration::from_secs(10),
            misbehaviour: None,
            labels: Vec::new(),
            single_fetch: false,
            forgejo_reporting: false,
        }
    }
}

/// How a one-shot run ended (without an executor error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecutorReport {
    /// No task arrived within `give_up_after`.
    NoTask,
    /// `Misbehaviour::CrashAfterClaim`: the task was received and then dropped.
    Abandoned { task_id: i64 },
    /// The task ran and its final state was accepted.
    Finished(TaskReport),
}

/// What the executor reported for its task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskReport {
    /// The task id FetchTask delivered.
    pub task_id: i64,
    /// Result sent in the final UpdateTask.
    pub final_result: TaskResult,
    /// Result in the reply to the final UpdateTask (the forge's word; final states are sticky).
    pub forge_result: TaskResult,
    /// Log rows acknowledged by the facade.
    pub rows_sent: i64,
    /// An UpdateTask reply said CANCELLED and the job stopped.
    pub cancelled: bool,
    /// The final `UpdateLog(no_more)` was acknowledged (false under `NoFinalLog`, or when the log
    /// was already archived).
    pub final_log_sent: bool,
    /// `sent_outputs` of the final UpdateTask reply.
    pub outputs_acknowledged: Vec<String>,
}

/// Why a one-shot run failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error("cannot build the facade client")]
    Client(#[source] ForgeError),
    #[error("Declare was not accepted within the give-up time")]
    Declare(#[source] ForgeError),
    #[error("the facade says this runner is unregistered")]
    Unregistered(#[source] ForgeError),
    #[error("{call} failed")]
    Rpc {
        call: &'static str,
        #[source]
        source: ForgeError,
    },
    #[error("UpdateLog acknowledged {ack} with {sent} rows sent from index {offset}")]
    LogAck { ack: i64, offset: i64, sent: usize },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("failed to load registration file: {0}")]
    Registration(String),
}

impl ExecutorError {
    /// Low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ExecutorError::Client(_) => "client",
            ExecutorError::Declare(_) => "declare",
            ExecutorError::Unregistered(_) => "unregistered",
            ExecutorError::Rpc { .. } => "rpc",
            ExecutorError::LogAck { .. } => "log_ack",
            ExecutorError::Config(_) => "config",
            ExecutorError::Registration(_) => "registration",
        }
    }

    /// Worth another attempt of the same call (transport trouble, retryable codes, bad acks).
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            ExecutorError::Rpc { source, .. } => source.is_retryable(),
            ExecutorError::LogAck { .. } => true,
            ExecutorError::Client(_)
            | ExecutorError::Declare(_)
            | ExecutorError::Unregistered(_)
            | ExecutorError::Config(_)
            | ExecutorError::Registration(_) => false,
        }
    }
}

/// Runs one task to completion against the facade (act_runner `daemon --once`).
pub async fn run_one_shot(cfg: ExecutorConfig) -> Result<ExecutorReport, ExecutorError> {
    let client = ForgeClient::new(&cfg.facade_url, None, cfg.request_timeout)
        .map_err(ExecutorError::Client)?;
    run_one_shot_on(&client, cfg).await
}

/// [`run_one_shot`] through `base`'s connection pool (a client for the facade at
/// `cfg.facade_url`; its credentials are replaced by the config's), so many executors in one
/// process share one HTTP client.
pub async fn run_one_shot_on(
    base: &ForgeClient,
    cfg: ExecutorConfig,
) -> Result<ExecutorReport, ExecutorError> {
    let client = base.with_credentials(Credentials {
        uuid: cfg.assignment_id.clone(),
        token: cfg.token.clone(),
    });
    let deadline = Instant::now() + cfg.give_up_after;
    declare(&client, &cfg, deadline).await?;
    let Some(task) = poll_for_task(&client, &cfg, deadline).await? else {
        tracing::info!("no task before giving up");
        return Ok(ExecutorReport::NoTask);
    };
    tracing::info!(task_id = task.id, "claimed task");
    if cfg.misbehaviour == Some(Misbehaviour::CrashAfterClaim) {
        return Ok(ExecutorReport::Abandoned { task_id: task.id });
    }
    task::run_task(&client, &cfg, task)
        .await
        .map(ExecutorReport::Finished)
}

async fn declare(
    client: &ForgeClient,
    cfg: &ExecutorConfig,
    deadline: Instant,
) -> Result<(), ExecutorError> {
    let request = DeclareRequest {
        version: EXECUTOR_VERSION.to_owned(),
        labels: cfg.labels.clone(),
        capabilities: Vec::new(),
    };
    loop {
        match client.declare(&request).await {
            Ok(_) => return Ok(()),
            Err(err) if !cfg.single_fetch && Instant::now() + cfg.poll_interval < deadline => {
                tracing::warn!(error = %err, kind = err.kind(), "Declare refused, retrying");
                tokio::time::sleep(cfg.poll_interval).await;
            }
            Err(err) => return Err(ExecutorError::Declare(err)),
        }
    }
}

/// Polls FetchTask, keeping `tasks_version` as act_runner does, until a task or the
/// deadline. An "unregistered runner" reply ends the run (the 2026 runner stops polling too).
async fn poll_for_task(
    client: &ForgeClient,
    cfg: &ExecutorConfig,
    deadline: Instant,
) -> Result<Option<jr_forge::proto::runner::v1::Task>, ExecutorError> {
    let mut tasks_version = 0_i64;
    loop {
        match client
            .fetch_task(&FetchTaskRequest {
                tasks_version,
                ..FetchTaskRequest::default()
            })
            .await
        {
            Ok(reply) => {
                if reply.tasks_version > tasks_version {
                    tasks_version = reply.tasks_version;
                }
                if let Some(task) = reply.task {
                    return Ok(Some(task));
                }
            }
            Err(err) if err.is_unregistered() => return Err(ExecutorError::Unregistered(err)),
            Err(err) if cfg.single_fetch => {
                return Err(ExecutorError::Rpc {
                    call: "FetchTask",
                    source: err,
                });
            }
            Err(err) => tracing::warn!(error = %err, kind = err.kind(), "FetchTask failed"),
        }
        if cfg.single_fetch || Instant::now() + cfg.poll_interval >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(cfg.poll_interval).await;
    }
}
