//! The wire contract of the events workers publish: their `Nats-Msg-Id` formats and the phase
//! names. Ids are deterministic, so a worker that publishes the same fact twice (a redelivery,
//! a restart) is deduplicated by JetStream instead of storing it again.

use crate::ids::AssignmentId;
use crate::message::WorkloadPhase;

impl WorkloadPhase {
    /// The kebab-case name, as serialized on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadPhase::Pending => "pending",
            WorkloadPhase::Running => "running",
            WorkloadPhase::Succeeded => "succeeded",
            WorkloadPhase::Failed => "failed",
            WorkloadPhase::Terminating => "terminating",
            WorkloadPhase::Gone => "gone",
            WorkloadPhase::Unknown => "unknown",
        }
    }
}

/// `Nats-Msg-Id` constructors of worker events.
pub mod msg_id {
    use super::{AssignmentId, WorkloadPhase};

    /// `workload-requested` of one attempt (published before the create call).
    pub fn workload_requested(assignment: AssignmentId, attempt: u32) -> String {
        format!("workload-requested:{assignment}:{attempt}")
    }

    /// `workload-created` of one attempt (at most one workload per attempt).
    pub fn workload_created(assignment: AssignmentId, attempt: u32) -> String {
        format!("workload-created:{assignment}:{attempt}")
    }

    /// `workload-observed`: one id per distinct (workload, phase, reason), so a repeated
    /// observation of an unchanged phase is deduplicated.
    pub fn workload_observed(
        assignment: AssignmentId,
        attempt: u32,
        workload: &str,
        phase: WorkloadPhase,
        reason: Option<&str>,
    ) -> String {
        format!(
            "observed:{assignment}:{attempt}:{workload}:{}:{}",
            phase.as_str(),
            reason.unwrap_or("")
        )
    }

    /// `released`: one per workload, however often the worker learns that it is gone.
    pub fn released(assignment: AssignmentId, attempt: u32, workload: &str) -> String {
        format!("released:{assignment}:{attempt}:{workload}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_names_match_the_serialized_form() {
        for phase in [
            WorkloadPhase::Pending,
            WorkloadPhase::Running,
            WorkloadPhase::Succeeded,
            WorkloadPhase::Failed,
            WorkloadPhase::Terminating,
            WorkloadPhase::Gone,
            WorkloadPhase::Unknown,
        ] {
            let json = serde_json::to_string(&phase).expect("serializes");
            assert_eq!(json, format!("\"{}\"", phase.as_str()));
        }
    }

    #[test]
    fn worker_message_ids_are_golden() {
        let a: AssignmentId = "6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1"
            .parse()
            .expect("uuid");
        assert_eq!(
            msg_id::workload_requested(a, 2),
            "workload-requested:6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1:2"
        );
        assert_eq!(
            msg_id::workload_created(a, 1),
            "workload-created:6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1:1"
        );
        assert_eq!(
            msg_id::workload_observed(a, 1, "jr-x-1", WorkloadPhase::Failed, Some("evicted")),
            "observed:6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1:1:jr-x-1:failed:evicted"
        );
        assert_eq!(
            msg_id::workload_observed(a, 3, "sb", WorkloadPhase::Running, None),
            "observed:6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1:3:sb:running:"
        );
        assert_eq!(
            msg_id::released(a, 1, "sb-1"),
            "released:6a2f4c1e-9b7d-4e0a-8f3c-5d217e90b4a1:1:sb-1"
        );
    }
}
