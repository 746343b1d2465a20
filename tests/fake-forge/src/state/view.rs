//! Read-only projections of the state: snapshots for invariant checks and aggregate stats.

use super::{JobPhase, JobRecord, RunnerRecord, State, StepRecord, TaskPhase, TaskRecord};
use crate::model::{JobView, RunnerView, Snapshot, Stats, Status, StepView, TaskView};

fn job_status(phase: &JobPhase) -> Status {
    match phase {
        JobPhase::Waiting { .. } => Status::Waiting,
        JobPhase::Running { .. } => Status::Running,
        JobPhase::Done(outcome) => Status::Done(*outcome),
    }
}

fn runner_view(r: &RunnerRecord) -> RunnerView {
    RunnerView {
        id: r.id,
        uuid: r.uuid.clone(),
        name: r.name.clone(),
        version: r.version.clone(),
        labels: r.labels.clone(),
        ephemeral: r.ephemeral,
        deleted: r.deleted,
        last_online: r.last_online,
        last_active: r.last_active,
    }
}

fn job_view(j: &JobRecord) -> JobView {
    JobView {
        id: j.id,
        repo: j.spec.repo.clone(),
        name: j.spec.name.clone(),
        runs_on: j.spec.runs_on.clone(),
        status: job_status(&j.phase),
        attempt: j.attempt,
        fetch_count: j.fetch_count,
        abandoned: j.abandoned,
        task_ids: j.task_ids.clone(),
    }
}

fn step_view(index: usize, s: &StepRecord) -> StepView {
    StepView {
        index: u32::try_from(index).unwrap_or(u32::MAX),
        status: s.status,
        log_index: s.log_index,
        log_length: s.log_length,
    }
}

fn task_view(t: &TaskRecord) -> TaskView {
    let (status, stop_cause, stopped_at) = match t.phase {
        TaskPhase::Running => (Status::Running, None, None),
        TaskPhase::Done {
            outcome,
            stopped_at,
            cause,
        } => (Status::Done(outcome), Some(cause), Some(stopped_at)),
    };
    TaskView {
        id: t.id,
        job_id: t.job_id,
        attempt: t.attempt,
        runner_uuid: t.runner_uuid.clone(),
        runner_name: t.runner_name.clone(),
        status,
        stop_cause,
        started_at: t.started,
        stopped_at,
        handed_out: t.handed_out,
        heartbeats: t.heartbeats,
        final_reports: t.final_reports.clone(),
        final_accepted: t.final_accepted,
        log: t.log.clone(),
        log_archived: t.log_archived,
        outputs: t.outputs.clone(),
        steps: t
            .steps
            .iter()
            .enumerate()
            .map(|(i, s)| step_view(i, s))
            .collect(),
    }
}

impl State {
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            tasks_version: self.tasks_version.max(1),
            runners: self.runners.values().map(runner_view).collect(),
            jobs: self.jobs.values().map(job_view).collect(),
            tasks: self.tasks.values().map(task_view).collect(),
            faults: self.faults.clone(),
        }
    }

    pub fn has_task(&self, id: i64) -> bool {
        self.tasks.contains_key(&id)
    }

    pub fn queued_count(&self) -> usize {
        self.waiting.len()
    }

    pub fn all_final(&self) -> bool {
        self.jobs
            .values()
            .all(|j| matches!(j.phase, JobPhase::Done(_)))
    }

    pub fn stats(&self) -> Stats {
        let mut stats = Stats {
            tasks_version: self.tasks_version.max(1),
            runners: self.runners.values().filter(|r| !r.deleted).count() as u64,
            faults: self.faults.clone(),
            ..Stats::default()
        };
        for job in self.jobs.values() {
            match job.phase {
                JobPhase::Waiting { .. } => stats.queued += 1,
                JobPhase::Running { .. } => stats.running += 1,
                JobPhase::Done(outcome) => {
                    *stats.done.entry(outcome.as_str().to_owned()).or_default() += 1
                }
            }
            for label in &job.spec.runs_on {
                let entry = stats.labels.entry(label.clone()).or_default();
                match job.phase {
                    JobPhase::Waiting { .. } => entry.queued += 1,
                    JobPhase::Running { .. } => entry.running += 1,
                    JobPhase::Done(_) => entry.done += 1,
                }
            }
        }
        stats
    }
}
