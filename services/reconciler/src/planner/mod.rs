//! The planner (docs/architecture.md, "Planner"): a pure function from a projection
//! [`Snapshot`] and `now` to the commands that clean up and retry. Every decision has a
//! deterministic id, so running it after every batch and on a timer is safe. [`plan`] over a
//! whole snapshot is the reference; the reconciler runs [`IncrementalPlanner`], which keeps the
//! unfinished records in memory and plans only the records that changed and the ones whose
//! deadline came, with the same per-record rules.
//!
//! Per assignment that is not finished:
//! - task final (terminal marker or task failure): delete each live workload at once when the
//!   executor finished reporting (log closed or `executor-finished`), when we failed the task, when
//!   the workload is terminal/gone, or when the executor never ran in it; otherwise after
//!   `terminal_grace`;
//! - routing unknown (events without an assignment message): delete its workloads as orphans
//!   after `orphan_grace`, never redispatch or fail it;
//! - claimed: delete workloads of other attempts; if the claiming attempt's workload is broken,
//!   fail the task (its workload is deleted once the failure is final);
//! - not claimed: delete workloads of older attempts and duplicates; if the current attempt's
//!   workload is broken or unclaimed after `claim_timeout`, delete it and redispatch as the next
//!   attempt, or fail the task when `max_attempts` is used up; no workload yet = waiting in
//!   JetStream, nothing to do;
//! - a workload whose backend is unreachable is held for `unreachable_hold` before it counts as
//!   lost.
//!
//! Whatever the rules say, a workload whose executor claimed the task and which is not broken is
//! never deleted before the task is final.

mod command;
mod condition;
#[cfg(test)]
mod equivalence;
mod incremental;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

use std::time::Duration;

use jr_protocol::Reason;
use jr_store::{AssignmentRecord, Outcome, Snapshot, WorkloadRecord};

pub use command::PlannedCommand;
use condition::{BackendHealth, Clock, Condition, attempt_condition, millis, workload_condition};
pub use incremental::{IncrementalPlanner, fold_into, time_plan_cycles};

/// Planner timeouts (all from the `reconciler` config section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannerConfig {
    /// A created workload whose executor has not claimed the task by then is replaced.
    pub claim_timeout: Duration,
    /// How long a final task's workload may keep running for the executor's last log upload.
    pub terminal_grace: Duration,
    /// How long a workload may stay in phase `Unknown` before it counts as lost.
    pub lost_timeout: Duration,
    /// How long to hold workloads of an unreachable backend before they count as lost.
    pub unreachable_hold: Duration,
    /// How long a workload of an assignment whose message was never projected may live.
    pub orphan_grace: Duration,
    /// Treat a backend with live workloads as unreachable after this long without any
    /// observation from it. `None` (default): workers only report changes, so silence is normal.
    pub backend_silence: Option<Duration>,
    /// Attempts per assignment, the first included.
    pub max_attempts: u32,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            claim_timeout: Duration::from_secs(120),
            terminal_grace: Duration::from_secs(30),
            lost_timeout: Duration::from_secs(60),
            unreachable_hold: Duration::from_secs(300),
            orphan_grace: Duration::from_secs(120),
            backend_silence: None,
            max_attempts: 3,
        }
    }
}

/// Decides what to do about `snapshot` at `now_ms` (unix ms). Sorted by command id, no duplicates.
pub fn plan(snapshot: &Snapshot, now_ms: u64, cfg: &PlannerConfig) -> Vec<PlannedCommand> {
    let health = BackendHealth::from_snapshot(snapshot, now_ms, cfg);
    let mut out = Vec::new();
    for record in &snapshot.assignments {
        out.append(&mut plan_record(record, &health, now_ms, cfg).0);
    }
    out.sort_by_key(PlannedCommand::id);
    out.dedup_by_key(|c| c.id());
    out
}

/// The commands for one record at `now` (sorted by id, no duplicates), and the earliest later
/// time at which they could differ while the record and `health` stay as they are (`None`:
/// never).
pub(crate) fn plan_record(
    record: &AssignmentRecord,
    health: &BackendHealth,
    now: u64,
    cfg: &PlannerConfig,
) -> (Vec<PlannedCommand>, Option<u64>) {
    let mut planner = AssignmentPlanner {
        record,
        health,
        clock: Clock::new(now),
        cfg,
        out: Vec::new(),
    };
    planner.plan();
    let mut out = planner.out;
    out.sort_by_key(PlannedCommand::id);
    out.dedup_by_key(|c| c.id());
    (out, planner.clock.wake())
}

struct AssignmentPlanner<'a> {
    record: &'a AssignmentRecord,
    health: &'a BackendHealth,
    clock: Clock,
    cfg: &'a PlannerConfig,
    out: Vec<PlannedCommand>,
}

impl AssignmentPlanner<'_> {
    fn plan(&mut self) {
        let record = self.record;
        if record.state().is_finished() {
            return;
        }
        if let Some(outcome) = record.outcome() {
            self.plan_final(outcome);
        } else if record.info.is_none() {
            self.plan_unknown();
        } else if let Some(claim) = &record.claim {
            self.plan_claimed(claim.attempt);
        } else {
            self.plan_unclaimed();
        }
    }

    fn plan_final(&mut self, outcome: Outcome) {
        let record = self.record;
        let final_at = record.final_at().unwrap_or(self.clock.now());
        let terminal = record.terminal.as_ref();
        let reported = outcome == Outcome::FailedByUs
            || terminal.is_some_and(|t| t.log_closed || t.executor_finished_at.is_some());
        let claimed_attempt = record.claim.as_ref().map(|c| c.attempt);
        let grace_end = final_at.saturating_add(millis(self.cfg.terminal_grace));
        for workload in record.live_workloads() {
            let workload_done = workload.phase().is_some_and(|p| p.is_terminal());
            let executor_here = claimed_attempt == Some(workload.attempt);
            if reported || workload_done || !executor_here {
                self.delete(workload, Reason::TaskFinished.as_str());
            } else if self.clock.reached(grace_end) {
                self.delete(workload, Reason::TerminalGraceExpired.as_str());
            }
        }
    }

    fn plan_unknown(&mut self) {
        let grace = millis(self.cfg.orphan_grace);
        for workload in self.record.live_workloads() {
            if self
                .clock
                .reached(workload.first_seen.saturating_add(grace))
            {
                self.delete(workload, Reason::OrphanUnknownAssignment.as_str());
            }
        }
    }

    fn plan_claimed(&mut self, claimed: u32) {
        let record = self.record;
        for workload in record.live_workloads().filter(|w| w.attempt != claimed) {
            self.delete(workload, Reason::SupersededAttempt.as_str());
        }
        if let Condition::Broken { reason } =
            attempt_condition(record, claimed, self.health, &mut self.clock, self.cfg)
        {
            self.fail(claimed, Reason::LostAfterClaim.with_detail(reason));
        }
    }

    fn plan_unclaimed(&mut self) {
        let record = self.record;
        let current = record.current_attempt();
        let own = record
            .attempt_workload(current)
            .map(|w| (w.backend.clone(), w.workload.clone()));
        let authoritative = record
            .attempts
            .get(&current)
            .is_some_and(|a| a.created_at.is_some());
        for workload in record.live_workloads() {
            if workload.attempt != current {
                self.delete(workload, Reason::SupersededAttempt.as_str());
            } else if authoritative
                && own.as_ref() != Some(&(workload.backend.clone(), workload.workload.clone()))
            {
                self.delete(workload, Reason::DuplicateWorkload.as_str());
            }
        }
        // A redispatch that was announced but whose assignment message is not projected yet:
        // ask again with the same id (deduplicated if it was in fact published).
        let published = record
            .attempts
            .get(&current)
            .is_some_and(|a| a.published_at.is_some());
        if let Some(redispatch) = record.redispatches.get(&current)
            && !published
        {
            self.redispatch(current, redispatch.reason.clone());
            return;
        }
        match attempt_condition(record, current, self.health, &mut self.clock, self.cfg) {
            Condition::NotCreated | Condition::Held => {}
            Condition::Healthy { since } => {
                if self
                    .clock
                    .reached(since.saturating_add(millis(self.cfg.claim_timeout)))
                {
                    self.retry(current, Reason::ClaimTimeout.to_string());
                }
            }
            Condition::Broken { reason } => self.retry(current, reason),
        }
    }

    /// The current attempt failed before anyone claimed the task: replace it or give up.
    fn retry(&mut self, current: u32, why: String) {
        if let Some(workload) = self
            .record
            .attempt_workload(current)
            .filter(|w| !w.is_released())
        {
            self.delete(workload, &why);
        }
        if current < self.cfg.max_attempts {
            self.redispatch(current + 1, why);
        } else {
            self.fail(
                current,
                format!("{} ({current}): {why}", Reason::AttemptsExhausted),
            );
        }
    }

    fn delete(&mut self, workload: &WorkloadRecord, why: &str) {
        if self.protected(workload) {
            return;
        }
        self.out.push(PlannedCommand::DeleteWorkload {
            backend: workload.backend.clone(),
            workload: workload.workload.clone(),
            assignment_id: self.record.id,
            attempt: workload.attempt,
            reason: why.to_owned(),
        });
    }

    /// The one rule no other rule may break: the claiming executor's workload stays while it is
    /// usable and the task is not final.
    fn protected(&mut self, workload: &WorkloadRecord) -> bool {
        let record = self.record;
        record.outcome().is_none()
            && record
                .claim
                .as_ref()
                .is_some_and(|c| c.attempt == workload.attempt)
            && !matches!(
                workload_condition(workload, self.health, &mut self.clock, self.cfg),
                Condition::Broken { .. }
            )
    }

    fn redispatch(&mut self, next_attempt: u32, why: String) {
        let Some(backend) = self.record.backend() else {
            return;
        };
        self.out.push(PlannedCommand::Redispatch {
            assignment_id: self.record.id,
            backend: backend.clone(),
            next_attempt,
            reason: why,
        });
    }

    fn fail(&mut self, attempt: u32, why: String) {
        let (Some(backend), Some(forge_task_id)) =
            (self.record.backend(), self.record.forge_task_id())
        else {
            return;
        };
        self.out.push(PlannedCommand::FailTask {
            assignment_id: self.record.id,
            attempt,
            backend: backend.clone(),
            forge_task_id,
            reason: why,
        });
    }
}
