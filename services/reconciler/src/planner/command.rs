//! What the planner asks for. The reconciler's executor turns each into a command message
//! (`jr.command.<backend>.delete-workload`, `jr.command.scheduler.redispatch`,
//! `jr.command.scheduler.fail-task`) whose `Nats-Msg-Id` derives from [`PlannedCommand::id`], so
//! re-planning an unchanged state publishes nothing new.

use jr_protocol::{AssignmentId, BackendName};
use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum PlannedCommand {
    /// Delete a workload; the worker answers with `released`.
    DeleteWorkload {
        backend: BackendName,
        workload: String,
        assignment_id: AssignmentId,
        attempt: u32,
        reason: String,
    },
    /// Ask the scheduler to publish the assignment again as `next_attempt` (it also publishes
    /// the `redispatched` event, with this command's id as message id).
    Redispatch {
        assignment_id: AssignmentId,
        backend: BackendName,
        next_attempt: u32,
        reason: String,
    },
    /// Report a final failure to the forge (the scheduler then publishes `task-failed`).
    FailTask {
        assignment_id: AssignmentId,
        attempt: u32,
        backend: BackendName,
        forge_task_id: i64,
        reason: String,
    },
}

impl PlannedCommand {
    /// Deterministic identity: the same decision about the same state always has the same id.
    pub fn id(&self) -> String {
        match self {
            PlannedCommand::DeleteWorkload {
                assignment_id,
                attempt,
                workload,
                ..
            } => {
                format!("delete:{assignment_id}:{attempt}:{workload}")
            }
            PlannedCommand::Redispatch {
                assignment_id,
                next_attempt,
                ..
            } => {
                format!("redispatch:{assignment_id}:{next_attempt}")
            }
            PlannedCommand::FailTask { assignment_id, .. } => format!("fail:{assignment_id}"),
        }
    }

    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PlannedCommand::DeleteWorkload { .. } => "delete-workload",
            PlannedCommand::Redispatch { .. } => "redispatch",
            PlannedCommand::FailTask { .. } => "fail-task",
        }
    }

    pub fn assignment_id(&self) -> AssignmentId {
        match self {
            PlannedCommand::DeleteWorkload { assignment_id, .. }
            | PlannedCommand::Redispatch { assignment_id, .. }
            | PlannedCommand::FailTask { assignment_id, .. } => *assignment_id,
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            PlannedCommand::DeleteWorkload { reason, .. }
            | PlannedCommand::Redispatch { reason, .. }
            | PlannedCommand::FailTask { reason, .. } => reason,
        }
    }
}

/// Reasons the planner writes (on the wire in commands and events, and in logs).
pub mod reason {
    pub const TASK_FINISHED: &str = "task-finished";
    pub const TERMINAL_GRACE_EXPIRED: &str = "terminal-grace-expired";
    pub const SUPERSEDED_ATTEMPT: &str = "superseded-attempt";
    pub const DUPLICATE_WORKLOAD: &str = "duplicate-workload";
    pub const ORPHAN: &str = "orphan-unknown-assignment";
    pub const CLAIM_TIMEOUT: &str = "claim-timeout";
    pub const WORKLOAD_FAILED: &str = "workload-failed";
    pub const WORKLOAD_EXITED: &str = "workload-exited";
    pub const WORKLOAD_GONE: &str = "workload-gone";
    pub const WORKLOAD_RELEASED: &str = "workload-released";
    pub const WORKLOAD_UNKNOWN: &str = "workload-unknown";
    pub const BACKEND_UNREACHABLE: &str = "backend-unreachable";
    /// Prefix of fail-task reasons for work lost after the executor claimed it.
    pub const LOST_AFTER_CLAIM: &str = "lost-after-claim";
    /// Prefix of fail-task reasons when `max_attempts` is used up.
    pub const ATTEMPTS_EXHAUSTED: &str = "attempts-exhausted";
}
