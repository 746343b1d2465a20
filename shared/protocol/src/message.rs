//! The payloads. Every message travels in an [`Envelope`]; its `kind` names the payload type.

use serde::{Deserialize, Serialize};

use crate::ids::{AssignmentId, BackendName};
use crate::token_hash::TokenHash;

/// W3C trace context carried inside the envelope as well as in the `traceparent` header, so a
/// trace survives tools that copy bodies without headers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TraceContext {
    pub traceparent: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// One message on any jetrunner subject.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    pub schema_version: u32,
    /// Message id; also the `Nats-Msg-Id` header, so it must be deterministic for anything that
    /// can be re-published (see the constructors in each service).
    pub id: String,
    /// Unix time in milliseconds at which the fact happened.
    pub occurred_at: u64,
    pub assignment_id: AssignmentId,
    /// Attempt number (1-based) the message is about.
    pub attempt: u32,
    pub trace: Option<TraceContext>,
    pub message: Message,
}

impl Envelope {
    pub fn new(
        id: impl Into<String>,
        occurred_at: u64,
        assignment_id: AssignmentId,
        attempt: u32,
        message: Message,
    ) -> Self {
        Self {
            schema_version: crate::SCHEMA_VERSION,
            id: id.into(),
            occurred_at,
            assignment_id,
            attempt,
            trace: None,
            message,
        }
    }

    pub fn kind(&self) -> Kind {
        self.message.kind()
    }
}

/// Every kind of message. The string form is used in subjects, the `Jr-Kind` header and the
/// envelope's `kind` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Assignment,
    WorkloadRequested,
    WorkloadCreated,
    WorkloadObserved,
    Claimed,
    Terminal,
    ExecutorFinished,
    Released,
    Redispatched,
    TaskFailed,
    DeleteWorkload,
    FailTask,
    Redispatch,
}

impl Kind {
    pub const ALL: [Kind; 13] = [
        Kind::Assignment,
        Kind::WorkloadRequested,
        Kind::WorkloadCreated,
        Kind::WorkloadObserved,
        Kind::Claimed,
        Kind::Terminal,
        Kind::ExecutorFinished,
        Kind::Released,
        Kind::Redispatched,
        Kind::TaskFailed,
        Kind::DeleteWorkload,
        Kind::FailTask,
        Kind::Redispatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Assignment => "assignment",
            Kind::WorkloadRequested => "workload-requested",
            Kind::WorkloadCreated => "workload-created",
            Kind::WorkloadObserved => "workload-observed",
            Kind::Claimed => "claimed",
            Kind::Terminal => "terminal",
            Kind::ExecutorFinished => "executor-finished",
            Kind::Released => "released",
            Kind::Redispatched => "redispatched",
            Kind::TaskFailed => "task-failed",
            Kind::DeleteWorkload => "delete-workload",
            Kind::FailTask => "fail-task",
            Kind::Redispatch => "redispatch",
        }
    }

    pub fn parse(text: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == text)
    }

    /// Kinds published once per assignment with `Nats-Expected-Last-Subject-Sequence: 0`.
    pub fn is_once_only(self) -> bool {
        matches!(self, Kind::Claimed | Kind::Terminal)
    }

    pub fn is_event(self) -> bool {
        !matches!(
            self,
            Kind::Assignment | Kind::DeleteWorkload | Kind::FailTask | Kind::Redispatch
        )
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Assignment(Assignment),
    WorkloadRequested(WorkloadRequested),
    WorkloadCreated(WorkloadCreated),
    WorkloadObserved(WorkloadObserved),
    Claimed(Claimed),
    Terminal(Terminal),
    ExecutorFinished(ExecutorFinished),
    Released(Released),
    Redispatched(Redispatched),
    TaskFailed(TaskFailed),
    DeleteWorkload(DeleteWorkload),
    FailTask(FailTask),
    Redispatch(Redispatch),
}

impl Message {
    pub fn kind(&self) -> Kind {
        match self {
            Message::Assignment(_) => Kind::Assignment,
            Message::WorkloadRequested(_) => Kind::WorkloadRequested,
            Message::WorkloadCreated(_) => Kind::WorkloadCreated,
            Message::WorkloadObserved(_) => Kind::WorkloadObserved,
            Message::Claimed(_) => Kind::Claimed,
            Message::Terminal(_) => Kind::Terminal,
            Message::ExecutorFinished(_) => Kind::ExecutorFinished,
            Message::Released(_) => Kind::Released,
            Message::Redispatched(_) => Kind::Redispatched,
            Message::TaskFailed(_) => Kind::TaskFailed,
            Message::DeleteWorkload(_) => Kind::DeleteWorkload,
            Message::FailTask(_) => Kind::FailTask,
            Message::Redispatch(_) => Kind::Redispatch,
        }
    }
}

/// The forge task, encrypted with a key only the scheduler holds (XChaCha20-Poly1305; the
/// associated data binds it to the assignment id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedTask {
    /// Which scheduler key sealed it, so keys can rotate while old assignments are in flight.
    pub key_id: String,
    #[serde(with = "serde_bytes")]
    pub nonce: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub ciphertext: Vec<u8>,
}

/// A forge task routed to a backend; published on `jr.assignment.<backend>.<assignment-id>`, once
/// per attempt. Routing fields are in clear; the task itself is sealed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub forge_instance: String,
    pub forge_task_id: i64,
    pub backend: BackendName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Why the job runs on this backend: the trust decision over its forge context (the most
    /// trusted level it may use and what `runs-on` asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    pub labels: Vec<String>,
    pub repository: String,
    /// The workflow's name from the forge context, when it has one (burst-tier buckets and
    /// protected-job matchers use it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
    pub job_name: String,
    /// Upper bound on the job's run time; backends size workload lifetimes from it.
    pub max_duration_secs: u64,
    /// When the scheduler received the task from the forge (unix ms).
    pub fetched_at: u64,
    pub sealed_task: SealedTask,
}

impl Assignment {
    /// The forge the job came from (parsed from `forge_instance`).
    pub fn forge_kind(&self) -> crate::ForgeKind {
        crate::ForgeKind::parse(&self.forge_instance)
    }

    /// The job's time limit less the time it already waited since the fetch: the forge's
    /// endless-task clock started when the task was handed out, not when a workload starts.
    pub fn remaining_secs(&self, now_ms: u64) -> u64 {
        let queued_secs = now_ms.saturating_sub(self.fetched_at) / 1000;
        self.max_duration_secs.saturating_sub(queued_secs)
    }
}

/// Published before the workload can start: the token hash becomes durable before any executor
/// can present the token: the facade must be able to authenticate the executor's first call
/// (docs/architecture.md, "The workers").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadRequested {
    pub backend: BackendName,
    pub workload: String,
    /// Lower-case hex SHA-256 of the per-attempt executor token.
    pub token_hash: TokenHash,
    pub worker_id: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadCreated {
    pub backend: BackendName,
    /// Backend reference of the workload: Pod name or sandbox id.
    pub workload: String,
    pub token_hash: TokenHash,
    pub worker_id: String,
    /// Set when the workload is a warm executor bound to this attempt: its warm identity (the
    /// runner uuid its executor calls the facade with). Absent for a workload made for the
    /// attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<AssignmentId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadPhase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Terminating,
    Gone,
    /// A phase this build does not know; treated as non-terminal.
    #[serde(other)]
    Unknown,
}

impl WorkloadPhase {
    /// The workload can no longer run the job.
    pub fn is_terminal(self) -> bool {
        match self {
            WorkloadPhase::Succeeded | WorkloadPhase::Failed | WorkloadPhase::Gone => true,
            WorkloadPhase::Pending
            | WorkloadPhase::Running
            | WorkloadPhase::Terminating
            | WorkloadPhase::Unknown => false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadObserved {
    pub backend: BackendName,
    pub workload: String,
    pub phase: WorkloadPhase,
    /// Short machine-readable reason, e.g. `evicted`, `oom-killed`, `image-pull-failed`,
    /// `unschedulable`, `backend-unreachable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Once-only: the executor of this attempt received the forge task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claimed {
    pub forge_task_id: i64,
    /// How the executor authenticated: `token` or its SPIFFE id.
    pub executor: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TaskResult {
    Success,
    Failure,
    Cancelled,
    Skipped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TerminalSource {
    /// The executor's final UpdateTask, accepted by the forge.
    Executor,
    /// jetrunner reported the failure itself (`fail-task`).
    FailTask,
    /// The forge ended the task (cancelled, or failed by a reaper) while it still waited for an
    /// executor; the scheduler learnt it from a keepalive. No workload may run it any more.
    Withdrawn,
}

/// Once-only: the forge accepted a final result for the task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Terminal {
    pub forge_task_id: i64,
    pub result: TaskResult,
    pub source: TerminalSource,
    /// The executor had already closed its log (`UpdateLog(no_more)` acknowledged).
    pub log_closed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The executor closed its log after the final result was accepted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutorFinished {
    pub forge_task_id: i64,
}

/// The workload of this attempt is gone and its capacity slot is free again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    pub backend: BackendName,
    pub workload: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Redispatched {
    pub next_attempt: u32,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskFailed {
    pub forge_task_id: i64,
    pub reason: String,
}

/// Command to a worker (`jr.command.<backend>.delete-workload`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteWorkload {
    pub backend: BackendName,
    pub workload: String,
    pub reason: String,
}

/// Command to the scheduler (`jr.command.scheduler.fail-task`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailTask {
    pub forge_task_id: i64,
    pub backend: BackendName,
    pub reason: String,
}

/// Command to the scheduler (`jr.command.scheduler.redispatch`): publish attempt `next_attempt`
/// of the assignment named by the envelope, re-using the scheduler's own last published
/// assignment message. The scheduler is the only writer of `jr.assignment.>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Redispatch {
    pub backend: BackendName,
    pub next_attempt: u32,
    pub reason: String,
}
