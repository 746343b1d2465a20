//! How the planner reads a workload: usable, held (its backend cannot be reached and the hold
//! has not run out), or broken (failed, exited, gone, released, unknown for too long, or
//! unreachable beyond the hold).

use std::collections::BTreeMap;

use jr_protocol::{BackendName, Reason, WorkloadPhase};
use jr_store::{AssignmentRecord, Snapshot, WorkloadRecord};

use super::PlannerConfig;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Condition {
    /// The attempt has no workload yet (at most requested): it waits in JetStream or is starting.
    NotCreated,
    /// Existing and, as far as we know, able to run; `since` starts the claim timeout.
    Healthy { since: u64 },
    /// Its backend is unreachable and the hold has not expired: decide nothing yet.
    Held,
    /// It can no longer run the job.
    Broken { reason: String },
}

/// Since when each backend has been unreachable (only unreachable backends are present).
#[derive(Clone, Debug, Default)]
pub(crate) struct BackendHealth {
    unreachable_since: BTreeMap<BackendName, u64>,
}

impl BackendHealth {
    /// A backend is unreachable when its newest observations say `backend-unreachable` (newer
    /// than any other observation from it), or, with `backend_silence` set, when nothing was
    /// heard from it for that long while it still has live workloads.
    pub fn from_snapshot(snapshot: &Snapshot, now: u64, cfg: &PlannerConfig) -> Self {
        #[derive(Default)]
        struct Seen {
            reachable_at: Option<u64>,
            unreachable: Vec<(u64, u64)>, // (observed at, unreachable since)
            last_heard: u64,
            live: bool,
        }
        let mut seen: BTreeMap<&BackendName, Seen> = BTreeMap::new();
        for workload in snapshot
            .assignments
            .iter()
            .flat_map(|r| r.workloads.values())
        {
            let entry = seen.entry(&workload.backend).or_default();
            entry.live |= !workload.is_released();
            entry.last_heard = entry
                .last_heard
                .max(workload.created_at.unwrap_or(workload.first_seen));
            if let Some(o) = &workload.observation {
                entry.last_heard = entry.last_heard.max(o.at);
                if o.is_unreachable() {
                    entry
                        .unreachable
                        .push((o.at, o.unreachable_since.unwrap_or(o.at)));
                } else {
                    entry.reachable_at = Some(entry.reachable_at.map_or(o.at, |r| r.max(o.at)));
                }
            }
        }
        let mut unreachable_since = BTreeMap::new();
        for (backend, s) in seen {
            let reported = s
                .unreachable
                .iter()
                .filter(|(at, _)| s.reachable_at.is_none_or(|r| *at > r))
                .map(|(_, since)| *since)
                .min();
            let silent = cfg
                .backend_silence
                .map(|d| s.last_heard.saturating_add(millis(d)))
                .filter(|silent_from| s.live && now >= *silent_from);
            if let Some(since) = reported.into_iter().chain(silent).min() {
                unreachable_since.insert(backend.clone(), since);
            }
        }
        Self { unreachable_since }
    }

    pub fn unreachable_since(&self, backend: &BackendName) -> Option<u64> {
        self.unreachable_since.get(backend).copied()
    }
}

pub(crate) fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The condition of an attempt's own workload.
pub(crate) fn attempt_condition(
    record: &AssignmentRecord,
    attempt: u32,
    health: &BackendHealth,
    now: u64,
    cfg: &PlannerConfig,
) -> Condition {
    match record.attempt_workload(attempt) {
        Some(workload) => workload_condition(workload, health, now, cfg),
        None => Condition::NotCreated,
    }
}

pub(crate) fn workload_condition(
    workload: &WorkloadRecord,
    health: &BackendHealth,
    now: u64,
    cfg: &PlannerConfig,
) -> Condition {
    let broken = |reason: String| Condition::Broken { reason };
    if workload.is_released() {
        return broken(Reason::WorkloadReleased.to_string());
    }
    let observation = workload.observation.as_ref();
    if let Some(o) = observation {
        let detail = |base: Reason| match &o.reason {
            Some(r) if !o.is_unreachable() => base.with_detail(r),
            _ => base.to_string(),
        };
        match o.phase {
            WorkloadPhase::Failed => return broken(detail(Reason::WorkloadFailed)),
            WorkloadPhase::Succeeded => return broken(detail(Reason::WorkloadExited)),
            WorkloadPhase::Gone => return broken(detail(Reason::WorkloadGone)),
            WorkloadPhase::Pending
            | WorkloadPhase::Running
            | WorkloadPhase::Terminating
            | WorkloadPhase::Unknown => {}
        }
    }
    let own = observation
        .filter(|o| o.is_unreachable())
        .map(|o| o.unreachable_since.unwrap_or(o.at));
    let backend = health.unreachable_since(&workload.backend);
    if let Some(since) = own.into_iter().chain(backend).min() {
        return if now < since.saturating_add(millis(cfg.unreachable_hold)) {
            Condition::Held
        } else {
            broken(Reason::BackendUnreachable.to_string())
        };
    }
    if let Some(o) = observation.filter(|o| o.phase == WorkloadPhase::Unknown)
        && now >= o.at.saturating_add(millis(cfg.lost_timeout))
    {
        return broken(Reason::WorkloadUnknown.to_string());
    }
    Condition::Healthy {
        since: workload.created_at.unwrap_or(workload.first_seen),
    }
}
