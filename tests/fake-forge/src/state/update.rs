//! UpdateTask, UpdateLog, server-side cancellation and the reapers.

use std::time::{Duration, SystemTime};

use jr_forge::proto::runner::v1 as pb;

use super::{JobPhase, State, TaskPhase, TaskRecord};
use crate::error::RpcError;
use crate::model::{JobId, Outcome, ReapReport, Status, StopCause};

/// Gitea silently ignores outputs over these sizes.
const MAX_OUTPUT_KEY_BYTES: usize = 255;
const MAX_OUTPUT_VALUE_BYTES: usize = 1024 * 1024;
/// Gitea truncates each stored log line to 64 KiB.
const MAX_LOG_LINE_BYTES: usize = 64 * 1024;

fn to_system_time(ts: Option<&prost_types::Timestamp>) -> SystemTime {
    ts.and_then(|t| SystemTime::try_from(*t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

fn truncate_line(mut line: String) -> String {
    if line.len() > MAX_LOG_LINE_BYTES {
        let mut end = MAX_LOG_LINE_BYTES;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line
}

fn older_than(now: SystemTime, then: SystemTime, limit: Duration) -> bool {
    now.duration_since(then).is_ok_and(|age| age > limit)
}

fn apply_steps(task: &mut TaskRecord, reported: &[pb::StepState]) {
    for step in reported {
        let Some(record) = usize::try_from(step.id)
            .ok()
            .and_then(|i| task.steps.get_mut(i))
        else {
            continue; // unknown step ids are ignored
        };
        record.log_index = step.log_index;
        record.log_length = step.log_length;
        match Outcome::from_proto(step.result) {
            Ok(Some(outcome)) => record.status = Status::Done(outcome),
            Ok(None) | Err(_) => {
                let started = step
                    .started_at
                    .is_some_and(|t| t.seconds != 0 || t.nanos != 0);
                if started {
                    record.status = Status::Running;
                }
            }
        }
    }
}

impl State {
    fn finish_job(&mut self, job_id: JobId, task_id: i64, outcome: Outcome) {
        if let Some(job) = self.jobs.get_mut(&job_id)
            && matches!(job.phase, JobPhase::Running { task_id: t } if t == task_id)
        {
            job.phase = JobPhase::Done(outcome);
        }
    }

    pub fn update_task(
        &mut self,
        caller: &str,
        req: pb::UpdateTaskRequest,
        now: SystemTime,
    ) -> Result<pb::UpdateTaskResponse, RpcError> {
        let state = req
            .state
            .ok_or_else(|| RpcError::invalid_argument("missing state"))?;
        let reported = Outcome::from_proto(state.result)
            .map_err(|v| RpcError::invalid_argument(format!("unknown result {v}")))?;
        let task = self
            .tasks
            .get_mut(&state.id)
            .ok_or_else(|| RpcError::update_task_not_found(state.id))?;
        if task.runner_uuid != caller {
            return Err(RpcError::update_invalid_runner(state.id));
        }
        let mut accepted_final = None;
        match task.phase {
            // Final is sticky: nothing changes, the reply tells the runner the server's result.
            TaskPhase::Done { .. } => {}
            TaskPhase::Running => {
                match reported {
                    Some(outcome) => {
                        let stopped_at = to_system_time(state.stopped_at.as_ref());
                        task.phase = TaskPhase::Done {
                            outcome,
                            stopped_at,
                            cause: StopCause::Runner,
                        };
                        task.final_accepted += 1;
                        accepted_final = Some(outcome);
                    }
                    None => task.updated = now,
                }
                apply_steps(task, &state.steps);
            }
        }
        match reported {
            Some(outcome) => task.final_reports.push(outcome),
            None => task.heartbeats += 1,
        }
        for (key, value) in req.outputs {
            if key.len() <= MAX_OUTPUT_KEY_BYTES && value.len() <= MAX_OUTPUT_VALUE_BYTES {
                task.outputs.entry(key).or_insert(value);
            }
        }
        let result = match task.phase {
            TaskPhase::Running => pb::Result::Unspecified,
            TaskPhase::Done { outcome, .. } => outcome.to_proto(),
        };
        let reply = pb::UpdateTaskResponse {
            state: Some(pb::TaskState {
                id: task.id,
                result: result as i32,
                ..Default::default()
            }),
            sent_outputs: task.outputs.keys().cloned().collect(),
        };
        if let Some(outcome) = accepted_final {
            let job_id = task.job_id;
            self.finish_job(job_id, state.id, outcome);
            if self.runners.get(caller).is_some_and(|r| r.ephemeral) {
                self.remove_runner(caller);
            }
        }
        Ok(reply)
    }

    pub fn update_log(
        &mut self,
        caller: &str,
        req: pb::UpdateLogRequest,
    ) -> Result<pb::UpdateLogResponse, RpcError> {
        let archive_on_empty_final = self.behaviour.archive_on_empty_final;
        let task = self
            .tasks
            .get_mut(&req.task_id)
            .ok_or_else(|| RpcError::log_task_not_found(req.task_id))?;
        if task.runner_uuid != caller {
            return Err(RpcError::log_invalid_runner());
        }
        if req.index < 0 {
            return Err(RpcError::invalid_argument("negative log index"));
        }
        let ack = i64::try_from(task.log.len()).unwrap_or(i64::MAX);
        let count = i64::try_from(req.rows.len()).unwrap_or(i64::MAX);
        if req.rows.is_empty() || req.index > ack || req.index.saturating_add(count) <= ack {
            // Gitea ignores `no_more` on this path; the fixed behaviour archives on an empty final.
            if req.rows.is_empty() && req.no_more && archive_on_empty_final {
                task.log_archived = true;
            }
            return Ok(pb::UpdateLogResponse { ack_index: ack });
        }
        if task.log_archived {
            return Err(RpcError::log_archived());
        }
        let skip = usize::try_from(ack - req.index).unwrap_or(0);
        task.log.extend(
            req.rows
                .into_iter()
                .skip(skip)
                .map(|r| truncate_line(r.content)),
        );
        if req.no_more {
            task.log_archived = true;
        }
        Ok(pb::UpdateLogResponse {
            ack_index: i64::try_from(task.log.len()).unwrap_or(i64::MAX),
        })
    }

    /// User cancel: the next UpdateTask reply says CANCELLED; the log stays open.
    pub fn cancel_task(&mut self, task_id: i64, now: SystemTime) -> bool {
        let Some(task) = self.tasks.get_mut(&task_id) else {
            return false;
        };
        if !matches!(task.phase, TaskPhase::Running) {
            return false;
        }
        task.phase = TaskPhase::Done {
            outcome: Outcome::Cancelled,
            stopped_at: now,
            cause: StopCause::Cancelled,
        };
        let job_id = task.job_id;
        self.finish_job(job_id, task_id, Outcome::Cancelled);
        true
    }

    /// Cancels a waiting job, or the running task of a running job.
    pub fn cancel_job(&mut self, job_id: JobId, now: SystemTime) -> bool {
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return false;
        };
        match job.phase {
            JobPhase::Waiting { seq, .. } => {
                job.phase = JobPhase::Done(Outcome::Cancelled);
                self.waiting.remove(&seq);
                true
            }
            JobPhase::Running { task_id } => self.cancel_task(task_id, now),
            JobPhase::Done(_) => false,
        }
    }

    /// Zombie/endless stop: failure, unfinished steps fail, log archived.
    fn kill_task(&mut self, task_id: i64, cause: StopCause, now: SystemTime) {
        let Some(task) = self.tasks.get_mut(&task_id) else {
            return;
        };
        task.phase = TaskPhase::Done {
            outcome: Outcome::Failure,
            stopped_at: now,
            cause,
        };
        for step in &mut task.steps {
            if !step.status.is_final() {
                step.status = Status::Done(Outcome::Failure);
            }
        }
        task.log_archived = true;
        let job_id = task.job_id;
        self.finish_job(job_id, task_id, Outcome::Failure);
    }

    pub fn reap(&mut self, now: SystemTime) -> ReapReport {
        let b = &self.behaviour;
        let mut report = ReapReport::default();
        for task in self
            .tasks
            .values()
            .filter(|t| matches!(t.phase, TaskPhase::Running))
        {
            if older_than(now, task.updated, b.zombie_timeout) {
                report.zombie_tasks.push(task.id);
            } else if older_than(now, task.started, b.endless_timeout) {
                report.endless_tasks.push(task.id);
            }
        }
        for job in self.jobs.values() {
            if let JobPhase::Waiting { since, .. } = job.phase
                && older_than(now, since, b.abandoned_timeout)
            {
                report.abandoned_jobs.push(job.id);
            }
        }
        for &id in &report.zombie_tasks {
            self.kill_task(id, StopCause::Zombie, now);
        }
        for &id in &report.endless_tasks {
            self.kill_task(id, StopCause::Endless, now);
        }
        for &id in &report.abandoned_jobs {
            self.cancel_job(id, now);
            if let Some(job) = self.jobs.get_mut(&id) {
                job.abandoned = true;
            }
        }
        if report != ReapReport::default() {
            tracing::info!(?report, "reaped");
        }
        report
    }
}
