//! FetchTask: the tasks_version fast path and picking a job for a runner.

use std::collections::BTreeMap;
use std::time::SystemTime;

use jr_forge::proto::runner::v1 as pb;

use super::{JobPhase, State, StepRecord, TaskPhase, TaskRecord, random_hex40};
use crate::error::RpcError;
use crate::model::Status;
use crate::payload::{self, TaskMaterial};

impl State {
    pub fn fetch_task(
        &mut self,
        caller: &str,
        req: pb::FetchTaskRequest,
        now: SystemTime,
    ) -> Result<pb::FetchTaskResponse, RpcError> {
        let latest = self.latest_tasks_version();
        if req.tasks_version == latest {
            return Ok(pb::FetchTaskResponse {
                task: None,
                tasks_version: latest,
            });
        }
        let task = self.pick(caller, now)?;
        Ok(pb::FetchTaskResponse {
            task,
            tasks_version: latest,
        })
    }

    /// The first waiting job (oldest first) whose `runs-on` ⊆ the runner's labels.
    fn pick(&mut self, caller: &str, now: SystemTime) -> Result<Option<pb::Task>, RpcError> {
        let ephemeral = self
            .runners
            .get(caller)
            .ok_or_else(RpcError::unregistered)?
            .ephemeral;
        if ephemeral {
            // An ephemeral runner gets one task; asking again after it finished removes it.
            let own = self.tasks.values().find(|t| t.runner_uuid == caller);
            match own.map(|t| &t.phase) {
                Some(TaskPhase::Running) => return Ok(None),
                Some(TaskPhase::Done { .. }) => {
                    self.remove_runner(caller);
                    return Err(RpcError::runner_removed());
                }
                None => {}
            }
        }
        let runner = self
            .runners
            .get(caller)
            .ok_or_else(RpcError::unregistered)?;
        let found = self.waiting.iter().find_map(|(seq, id)| {
            let job = self.jobs.get(id)?;
            job.spec
                .runs_on
                .iter()
                .all(|l| runner.labels.contains(l))
                .then_some((*seq, *id))
        });
        let Some((seq, job_id)) = found else {
            return Ok(None);
        };
        let (runner_uuid, runner_name) = (runner.uuid.clone(), runner.name.clone());
        self.waiting.remove(&seq);
        let task_id = self.next_task_id;
        self.next_task_id += 1;
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Ok(None);
        };
        job.phase = JobPhase::Running { task_id };
        job.attempt += 1;
        job.fetch_count += 1;
        job.task_ids.push(task_id);
        let material = TaskMaterial {
            task_id,
            token: random_hex40(),
            job_id,
            attempt: job.attempt,
            spec: &job.spec,
            server_url: &self.server_url,
        };
        let message = payload::build_task(&material);
        let steps = (0..job.spec.steps)
            .map(|_| StepRecord {
                status: Status::Waiting,
                log_index: 0,
                log_length: 0,
            })
            .collect();
        let task = TaskRecord {
            id: task_id,
            job_id,
            attempt: job.attempt,
            runner_uuid,
            runner_name,
            started: now,
            updated: now,
            phase: TaskPhase::Running,
            handed_out: 1,
            heartbeats: 0,
            final_reports: Vec::new(),
            final_accepted: 0,
            log: Vec::new(),
            log_archived: false,
            outputs: BTreeMap::new(),
            steps,
        };
        self.tasks.insert(task_id, task);
        tracing::debug!(task_id, job_id = job_id.0, "task assigned");
        Ok(Some(message))
    }
}
