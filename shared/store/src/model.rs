//! The projection as plain data: one [`AssignmentRecord`] aggregate per assignment id holding
//! everything every table row of that assignment says. The SQL store and the in-memory
//! [`crate::MemoryProjection`] both fold envelopes into these records with the same
//! [`AssignmentRecord::apply`], so they cannot disagree about semantics; only the encoding
//! differs.

use std::collections::BTreeMap;

use jr_protocol::{AssignmentId, BackendName, Reason, TaskResult, TerminalSource, WorkloadPhase};
use serde::Serialize;

/// The `reason` a worker puts on an observation when it cannot reach its backend.
pub const REASON_BACKEND_UNREACHABLE: &str = Reason::BackendUnreachable.as_str();

/// Where an assignment is in its life. Derived from the rest of the record, never set directly,
/// so the order in which the two streams are applied does not matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AssignmentState {
    /// Published (or only referenced), no workload requested for the current attempt: waiting in
    /// JetStream for capacity.
    Pending,
    /// A workload was requested or created for the current attempt; nobody claimed the task yet.
    Starting,
    /// An executor claimed the task; no final result yet.
    Running,
    /// The task is final (terminal marker or task failure) but a workload still holds a slot.
    Finishing,
    /// The executor's final result was accepted and every workload is released.
    Completed,
    /// jetrunner failed the task and every workload is released.
    Failed,
}

impl AssignmentState {
    pub const ALL: [AssignmentState; 6] = [
        AssignmentState::Pending,
        AssignmentState::Starting,
        AssignmentState::Running,
        AssignmentState::Finishing,
        AssignmentState::Completed,
        AssignmentState::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AssignmentState::Pending => "pending",
            AssignmentState::Starting => "starting",
            AssignmentState::Running => "running",
            AssignmentState::Finishing => "finishing",
            AssignmentState::Completed => "completed",
            AssignmentState::Failed => "failed",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Nothing is left to do for it: the task is final and no workload holds a slot.
    pub fn is_finished(self) -> bool {
        match self {
            AssignmentState::Completed | AssignmentState::Failed => true,
            AssignmentState::Pending
            | AssignmentState::Starting
            | AssignmentState::Running
            | AssignmentState::Finishing => false,
        }
    }
}

/// Routing fields of the assignment message (the sealed task is not projected).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AssignmentInfo {
    pub forge_instance: String,
    pub forge_task_id: i64,
    pub backend: BackendName,
    pub provider: Option<String>,
    /// Why it runs on this backend (the scheduler's trust decision), when recorded.
    pub placement: Option<String>,
    pub labels: Vec<String>,
    pub repository: String,
    pub job_name: String,
    pub max_duration_secs: u64,
    /// Unix ms at which the scheduler fetched the task.
    pub fetched_at: u64,
}

/// One attempt: published as an assignment message, then (maybe) a workload for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct AttemptRecord {
    pub attempt: u32,
    /// First time the assignment message of this attempt was projected (its `occurred_at`).
    pub published_at: Option<u64>,
    pub backend: Option<BackendName>,
    /// The attempt's workload reference: from `workload-created` when known, else from the
    /// first observation, else the name from `workload-requested`.
    pub workload: Option<String>,
    pub token_hash: Option<String>,
    pub worker_id: Option<String>,
    pub requested_at: Option<u64>,
    pub created_at: Option<u64>,
}

/// The latest observation applied to a workload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Observation {
    pub phase: WorkloadPhase,
    pub reason: Option<String>,
    /// `occurred_at` of the observation (unix ms).
    pub at: u64,
    /// Stream sequence of the observation, the tie-breaker when two share `at`.
    pub seq: u64,
    /// While the latest observations say `backend-unreachable`: when that run of them began.
    pub unreachable_since: Option<u64>,
}

impl Observation {
    pub fn is_unreachable(&self) -> bool {
        self.reason.as_deref() == Some(REASON_BACKEND_UNREACHABLE)
    }
}

/// A workload of ours as the backend reported it (`workloads` table).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkloadRecord {
    pub backend: BackendName,
    pub workload: String,
    pub attempt: u32,
    pub first_seen: u64,
    pub created_at: Option<u64>,
    pub observation: Option<Observation>,
    /// Latest `released` for it (the worker freed its slot).
    pub released_at: Option<u64>,
}

impl WorkloadRecord {
    /// Released, and nothing newer than the release says it still exists.
    pub fn is_released(&self) -> bool {
        match (self.released_at, &self.observation) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(released), Some(o)) => o.phase == WorkloadPhase::Gone || o.at <= released,
        }
    }

    /// The latest observed phase, if any.
    pub fn phase(&self) -> Option<WorkloadPhase> {
        self.observation.as_ref().map(|o| o.phase)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClaimRecord {
    pub attempt: u32,
    pub forge_task_id: i64,
    pub executor: String,
    pub claimed_at: u64,
}

/// The terminal marker. A row exists once either `terminal` or `executor-finished` was seen;
/// the task is final only when `result` is set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct TerminalRecord {
    pub attempt: Option<u32>,
    pub forge_task_id: Option<i64>,
    pub result: Option<TaskResult>,
    pub source: Option<TerminalSource>,
    pub log_closed: bool,
    pub reason: Option<String>,
    pub at: Option<u64>,
    pub executor_finished_at: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailureRecord {
    pub attempt: u32,
    pub forge_task_id: i64,
    pub reason: String,
    pub failed_at: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RedispatchRecord {
    pub from_attempt: u32,
    pub next_attempt: u32,
    pub reason: String,
    pub at: u64,
}

/// How the task ended, as far as the forge is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The executor's final result was accepted.
    Reported,
    /// jetrunner reported a failure itself (`fail-task`).
    FailedByUs,
}

/// Everything the projection knows about one assignment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AssignmentRecord {
    pub id: AssignmentId,
    /// From the assignment message of the highest attempt; `None` while only events are known.
    pub info: Option<AssignmentInfo>,
    pub attempts: BTreeMap<u32, AttemptRecord>,
    /// Keyed by (backend, workload reference).
    pub workloads: BTreeMap<(BackendName, String), WorkloadRecord>,
    pub claim: Option<ClaimRecord>,
    pub terminal: Option<TerminalRecord>,
    pub failure: Option<FailureRecord>,
    /// Keyed by the attempt they announce.
    pub redispatches: BTreeMap<u32, RedispatchRecord>,
    /// Greatest `occurred_at` of anything applied to it.
    pub updated_at: u64,
}

impl AssignmentRecord {
    pub fn new(id: AssignmentId) -> Self {
        Self {
            id,
            info: None,
            attempts: BTreeMap::new(),
            workloads: BTreeMap::new(),
            claim: None,
            terminal: None,
            failure: None,
            redispatches: BTreeMap::new(),
            updated_at: 0,
        }
    }

    /// The highest attempt anything refers to (at least 1).
    pub fn current_attempt(&self) -> u32 {
        let attempts = self.attempts.keys().copied();
        let redispatched = self.redispatches.keys().copied();
        let claimed = self.claim.iter().map(|c| c.attempt);
        let terminal = self.terminal.iter().filter_map(|t| t.attempt);
        let failed = self.failure.iter().map(|f| f.attempt);
        attempts
            .chain(redispatched)
            .chain(claimed)
            .chain(terminal)
            .chain(failed)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// Whether the task is final for the forge, and how.
    pub fn outcome(&self) -> Option<Outcome> {
        let terminal_source = self
            .terminal
            .as_ref()
            .filter(|t| t.result.is_some())
            .and_then(|t| t.source);
        match (terminal_source, &self.failure) {
            // Withdrawn: the forge itself ended the task, so it holds the final state.
            (Some(TerminalSource::Executor | TerminalSource::Withdrawn), _) => {
                Some(Outcome::Reported)
            }
            (Some(TerminalSource::FailTask), _) | (None, Some(_)) => Some(Outcome::FailedByUs),
            (None, None) => None,
        }
    }

    /// When the task became final (terminal marker time, else failure time).
    pub fn final_at(&self) -> Option<u64> {
        self.terminal
            .as_ref()
            .and_then(|t| t.at)
            .or(self.failure.as_ref().map(|f| f.failed_at))
    }

    /// The backend the assignment is routed to.
    pub fn backend(&self) -> Option<&BackendName> {
        self.info.as_ref().map(|i| &i.backend).or_else(|| {
            self.attempts
                .values()
                .rev()
                .find_map(|a| a.backend.as_ref())
        })
    }

    /// The forge task id, from whichever message carried it.
    pub fn forge_task_id(&self) -> Option<i64> {
        self.info
            .as_ref()
            .map(|i| i.forge_task_id)
            .or(self.claim.as_ref().map(|c| c.forge_task_id))
            .or(self.terminal.as_ref().and_then(|t| t.forge_task_id))
            .or(self.failure.as_ref().map(|f| f.forge_task_id))
    }

    /// The workload record of an attempt's own workload reference.
    pub fn attempt_workload(&self, attempt: u32) -> Option<&WorkloadRecord> {
        let a = self.attempts.get(&attempt)?;
        let backend = a.backend.clone()?;
        let workload = a.workload.clone()?;
        self.workloads.get(&(backend, workload))
    }

    /// Workloads still holding a slot (not released).
    pub fn live_workloads(&self) -> impl Iterator<Item = &WorkloadRecord> {
        self.workloads.values().filter(|w| !w.is_released())
    }

    /// The attempt holds a capacity slot: its workload was created and is not released.
    pub fn attempt_holds_slot(&self, attempt: u32) -> bool {
        let created = self
            .attempts
            .get(&attempt)
            .is_some_and(|a| a.created_at.is_some());
        created
            && self
                .attempt_workload(attempt)
                .is_some_and(|w| !w.is_released())
    }

    pub fn state(&self) -> AssignmentState {
        let all_released = self.workloads.values().all(WorkloadRecord::is_released);
        match self.outcome() {
            Some(Outcome::Reported) if all_released => AssignmentState::Completed,
            Some(Outcome::FailedByUs) if all_released => AssignmentState::Failed,
            Some(_) => AssignmentState::Finishing,
            None if self.claim.is_some() => AssignmentState::Running,
            None => {
                let current = self.attempts.get(&self.current_attempt());
                let started = current
                    .is_some_and(|a| a.requested_at.is_some() || a.created_at.is_some())
                    || self
                        .workloads
                        .values()
                        .any(|w| w.attempt == self.current_attempt());
                if started {
                    AssignmentState::Starting
                } else {
                    AssignmentState::Pending
                }
            }
        }
    }

    /// Lifecycle steps in time order, for the status API.
    pub fn timeline(&self) -> Vec<TimelineEntry> {
        let mut out = Vec::new();
        let mut push =
            |at: Option<u64>, attempt: Option<u32>, step: &'static str, detail: Option<String>| {
                if let Some(at) = at {
                    out.push(TimelineEntry {
                        at,
                        attempt,
                        step,
                        detail,
                    });
                }
            };
        if let Some(info) = &self.info {
            push(
                Some(info.fetched_at),
                None,
                "fetched",
                Some(match &info.placement {
                    Some(placement) => format!("forge task {}; {placement}", info.forge_task_id),
                    None => format!("forge task {}", info.forge_task_id),
                }),
            );
        }
        for a in self.attempts.values() {
            push(a.published_at, Some(a.attempt), "published", None);
            push(
                a.requested_at,
                Some(a.attempt),
                "workload-requested",
                a.workload.clone(),
            );
            push(
                a.created_at,
                Some(a.attempt),
                "workload-created",
                a.workload.clone(),
            );
        }
        for w in self.workloads.values() {
            if let Some(o) = &w.observation {
                let detail = match &o.reason {
                    Some(r) => format!("{} {:?} ({r})", w.workload, o.phase),
                    None => format!("{} {:?}", w.workload, o.phase),
                };
                push(
                    Some(o.at),
                    Some(w.attempt),
                    "workload-observed",
                    Some(detail),
                );
            }
            push(
                w.released_at,
                Some(w.attempt),
                "released",
                Some(w.workload.clone()),
            );
        }
        if let Some(c) = &self.claim {
            push(
                Some(c.claimed_at),
                Some(c.attempt),
                "claimed",
                Some(c.executor.clone()),
            );
        }
        if let Some(t) = &self.terminal {
            let detail = t.result.map(|r| format!("{r:?}"));
            push(t.at, t.attempt, "terminal", detail);
            push(t.executor_finished_at, t.attempt, "executor-finished", None);
        }
        for r in self.redispatches.values() {
            push(
                Some(r.at),
                Some(r.from_attempt),
                "redispatched",
                Some(r.reason.clone()),
            );
        }
        if let Some(f) = &self.failure {
            push(
                Some(f.failed_at),
                Some(f.attempt),
                "task-failed",
                Some(f.reason.clone()),
            );
        }
        out.sort_by(|a, b| (a.at, a.step).cmp(&(b.at, b.step)));
        out
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TimelineEntry {
    /// Unix ms.
    pub at: u64,
    pub attempt: Option<u32>,
    pub step: &'static str,
    pub detail: Option<String>,
}

/// What the planner reads: every assignment that is not finished, with all its rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct Snapshot {
    /// The `now` (unix ms) the snapshot was taken for.
    pub taken_at: u64,
    /// Sorted by id.
    pub assignments: Vec<AssignmentRecord>,
}
