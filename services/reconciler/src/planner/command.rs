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
