//! Pure mapping from a Pod to what the worker core reports, and the change tracker behind
//! `observe` (emit only when `(phase, reason)` of a Pod changes).

use std::collections::{HashMap, HashSet};

use jr_protocol::{AssignmentId, Reason, WorkloadPhase};
use jr_worker::ObservedWorkload;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use crate::template::{LABEL_ASSIGNMENT, LABEL_ATTEMPT, LABEL_WORKER};

/// Phase of a Pod: a set deletionTimestamp means Terminating whatever the status says.
pub fn pod_phase(pod: &Pod) -> WorkloadPhase {
    if pod.metadata.deletion_timestamp.is_some() {
        return WorkloadPhase::Terminating;
    }
    match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Pending") | None => WorkloadPhase::Pending,
        Some("Running") => WorkloadPhase::Running,
        Some("Succeeded") => WorkloadPhase::Succeeded,
        Some("Failed") => WorkloadPhase::Failed,
        Some(_) => WorkloadPhase::Unknown,
    }
}

/// A short machine-readable reason, when the status explains a problem.
pub fn pod_reason(pod: &Pod) -> Option<Reason> {
    let status = pod.status.as_ref()?;
    match status.reason.as_deref() {
        Some("Evicted") => return Some(Reason::Evicted),
        Some("DeadlineExceeded") => return Some(Reason::DeadlineExceeded),
        _ => {}
    }
    let containers: Vec<&ContainerStatus> = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .collect();
    let terminated = |c: &&ContainerStatus| {
        let now = c
            .state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .and_then(|t| t.reason.clone());
        let last = c
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .and_then(|t| t.reason.clone());
        [now, last].into_iter().flatten().collect::<Vec<_>>()
    };
    let waiting = |c: &&ContainerStatus| {
        c.state
            .as_ref()
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.clone())
    };
    if containers
        .iter()
        .flat_map(terminated)
        .any(|r| r == "OOMKilled")
    {
        return Some(Reason::OomKilled);
    }
    for reason in containers.iter().filter_map(waiting) {
        match reason.as_str() {
            "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" => {
                return Some(Reason::ImagePullFailed);
            }
            "CreateContainerConfigError" | "CreateContainerError" => {
                return Some(Reason::ConfigError);
            }
            _ => {}
        }
    }
    if containers
        .iter()
        .flat_map(terminated)
        .any(|r| r == "StartError" || r == "ContainerCannotRun")
    {
        return Some(Reason::StartFailed);
    }
    let unschedulable = status.conditions.iter().flatten().any(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    });
    unschedulable.then_some(Reason::Unschedulable)
}

/// What the worker core sees of a Pod; `None` for a Pod without valid jetrunner labels.
pub fn observe_pod(pod: &Pod) -> Option<ObservedWorkload> {
    let labels = pod.metadata.labels.as_ref()?;
    let assignment_id: AssignmentId = labels.get(LABEL_ASSIGNMENT)?.parse().ok()?;
    let attempt: u32 = labels.get(LABEL_ATTEMPT)?.parse().ok()?;
    Some(ObservedWorkload {
        workload: pod.metadata.name.clone()?,
        assignment_id,
        attempt,
        phase: pod_phase(pod),
        reason: pod_reason(pod).map(|r| r.to_string()),
        worker: labels.get(LABEL_WORKER).cloned().unwrap_or_default(),
    })
}

/// The last `(phase, reason)` reported per Pod. Kept by the backend across `observe` calls, so a
/// restarted watch reports what changed (including Pods deleted meanwhile) and nothing else.
#[derive(Debug, Default)]
pub struct Tracker {
    known: HashMap<String, ObservedWorkload>,
    relisting: Option<HashSet<String>>,
}

impl Tracker {
    /// A (re)list begins.
    pub fn begin_relist(&mut self) {
        self.relisting = Some(HashSet::new());
    }

    /// A Pod was added or changed: the observation to publish, if anything changed.
    pub fn apply(&mut self, pod: &Pod) -> Option<ObservedWorkload> {
        let observed = observe_pod(pod)?;
        if let Some(seen) = &mut self.relisting {
            seen.insert(observed.workload.clone());
        }
        let previous = self
            .known
            .insert(observed.workload.clone(), observed.clone());
        let changed =
            previous.is_none_or(|p| p.phase != observed.phase || p.reason != observed.reason);
        changed.then_some(observed)
    }

    /// A Pod was deleted.
    pub fn delete(&mut self, pod: &Pod) -> Option<ObservedWorkload> {
        let name = pod.metadata.name.as_deref()?;
        let known = self.known.remove(name);
        let base = known.or_else(|| observe_pod(pod))?;
        Some(ObservedWorkload {
            phase: WorkloadPhase::Gone,
            reason: None,
            ..base
        })
    }

    /// The (re)list is complete: every known Pod it did not contain is gone.
    pub fn end_relist(&mut self) -> Vec<ObservedWorkload> {
        let Some(seen) = self.relisting.take() else {
            return Vec::new();
        };
        let gone: Vec<String> = self
            .known
            .keys()
            .filter(|name| !seen.contains(*name))
            .cloned()
            .collect();
        let mut observations: Vec<ObservedWorkload> = gone
            .into_iter()
            .filter_map(|name| self.known.remove(&name))
            .map(|o| ObservedWorkload {
                phase: WorkloadPhase::Gone,
                reason: None,
                ..o
            })
            .collect();
        observations.sort_by(|a, b| a.workload.cmp(&b.workload));
        observations
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {
                LABEL_ASSIGNMENT: "6f1c1f4e-8f4a-4a39-9a52-2b3f9e1c0d11", LABEL_ATTEMPT: "1"}},
            "status": status,
        }))
        .expect("valid pod")
    }

    fn reason(status: serde_json::Value) -> Option<String> {
        pod_reason(&pod("p", status)).map(|r| r.to_string())
    }

    #[test]
    fn reasons_are_derived_from_the_status() {
        assert_eq!(
            reason(json!({"phase": "Failed", "reason": "Evicted"})).as_deref(),
            Some("evicted")
        );
        let oom = json!({"phase": "Failed", "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]});
        assert_eq!(reason(oom).as_deref(), Some("oom-killed"));
        let pull = json!({"phase": "Pending", "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}}]});
        assert_eq!(reason(pull).as_deref(), Some("image-pull-failed"));
        let unsched = json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]});
        assert_eq!(reason(unsched).as_deref(), Some("unschedulable"));
        let start = json!({"phase": "Failed", "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": 128, "reason": "StartError"}}}]});
        assert_eq!(reason(start).as_deref(), Some("start-failed"));
        assert_eq!(reason(json!({"phase": "Running"})), None);
    }

    #[test]
    fn deletion_timestamp_means_terminating() {
        let mut p = pod("p", json!({"phase": "Running"}));
        assert_eq!(pod_phase(&p), WorkloadPhase::Running);
        p.metadata.deletion_timestamp = serde_json::from_value(json!("2026-01-01T00:00:00Z")).ok();
        assert_eq!(pod_phase(&p), WorkloadPhase::Terminating);
    }

    #[test]
    fn tracker_reports_changes_only_and_relists_find_deleted_pods() {
        let mut tracker = Tracker::default();
        tracker.begin_relist();
        assert!(
            tracker
                .apply(&pod("a", json!({"phase": "Pending"})))
                .is_some()
        );
        assert!(
            tracker
                .apply(&pod("b", json!({"phase": "Running"})))
                .is_some()
        );
        assert!(tracker.end_relist().is_empty());
        assert!(
            tracker
                .apply(&pod("a", json!({"phase": "Pending"})))
                .is_none(),
            "no change, no report"
        );
        let running = tracker
            .apply(&pod("a", json!({"phase": "Running"})))
            .expect("phase change");
        assert_eq!(running.phase, WorkloadPhase::Running);

        // The watch restarts; `b` was deleted while nobody watched.
        tracker.begin_relist();
        assert!(
            tracker
                .apply(&pod("a", json!({"phase": "Running"})))
                .is_none()
        );
        let gone = tracker.end_relist();
        assert_eq!(gone.len(), 1);
        assert_eq!(
            (gone[0].workload.as_str(), gone[0].phase),
            ("b", WorkloadPhase::Gone)
        );

        let deleted = tracker
            .delete(&pod("a", json!({"phase": "Running"})))
            .expect("gone");
        assert_eq!(deleted.phase, WorkloadPhase::Gone);
    }
}
