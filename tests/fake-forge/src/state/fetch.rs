//! FetchTask: the tasks_version fast path and picking a job for a runner.

use std::collections::BTreeMap;
use std::time::SystemTime;

use jr_forge::proto::runner::v1 as pb;

use super::{JobPhase, State, StepRecord, TaskPhase, TaskRecord, random_hex40};
use crate::error::RpcError;
use crate::model::Status;
use crate::payload::{self, TaskMaterial};

/// What the transport knows about one FetchTask call.
#[derive(Clone, Copy, Debug)]
pub struct FetchCall<'a> {
    /// From `fetch_begin`.
    pub seq: u64,
    /// `x-runner-request-key`.
    pub request_key: Option<&'a str>,
    /// Another call holds the same request key.
    pub key_locked: bool,
}

impl State {
    /// A FetchTask call of runner `uuid` begins (before any latency): its sequence number. A
    /// call that begins while another of the same runner is in flight races it.
    pub fn fetch_begin(&mut self, uuid: &str) -> u64 {
        self.next_fetch_seq += 1;
        let seq = self.next_fetch_seq;
        if self.fetches_in_flight.iter().any(|(u, _)| u == uuid) {
            self.racing_fetches.insert(seq);
        }
        self.fetches_in_flight.insert((uuid.to_owned(), seq));
        let concurrent = self
            .fetches_in_flight
            .iter()
            .filter(|(u, _)| u == uuid)
            .count() as u64;
        self.faults.max_concurrent_fetches = self.faults.max_concurrent_fetches.max(concurrent);
        seq
    }

    pub fn fetch_end(&mut self, uuid: &str, seq: u64) {
        self.fetches_in_flight.remove(&(uuid.to_owned(), seq));
        self.racing_fetches.remove(&seq);
    }

    /// Forgejo: marks `key` in use for the call; `false` if another call holds it.
    pub fn key_begin(&mut self, uuid: &str, key: &str) -> bool {
        self.keys_in_use.insert((uuid.to_owned(), key.to_owned()))
    }

    pub fn key_end(&mut self, uuid: &str, key: &str) {
        self.keys_in_use.remove(&(uuid.to_owned(), key.to_owned()));
    }

    pub fn fetch_task(
        &mut self,
        caller: &str,
        req: pb::FetchTaskRequest,
        call: FetchCall<'_>,
        now: SystemTime,
    ) -> Result<pb::FetchTaskResponse, RpcError> {
        let latest = self.latest_tasks_version();
        let forgejo = self.behaviour.forgejo;
        if forgejo && call.key_locked {
            return Err(RpcError::request_key_locked());
        }
        if forgejo
            && let Some(key) = call.request_key
            && let Some(ids) = self
                .request_keys
                .get(&(caller.to_owned(), key.to_owned()))
                .cloned()
        {
            // The reply under this key was lost: hand the same tasks out again with new tokens.
            self.faults.replayed_request_keys += 1;
            let mut tasks: Vec<pb::Task> = ids.iter().filter_map(|id| self.reissue(*id)).collect();
            let first = (!tasks.is_empty()).then(|| tasks.remove(0));
            return Ok(pb::FetchTaskResponse {
                task: first,
                tasks_version: 0,
                additional_tasks: tasks,
            });
        }
        if req.tasks_version == latest {
            return Ok(pb::FetchTaskResponse {
                task: None,
                tasks_version: latest,
                additional_tasks: Vec::new(),
            });
        }
        if self.behaviour.fetch_race && self.racing_fetches.contains(&call.seq) {
            // Gitea's `task_id = 0` guard: the later of two overlapping picks loses and reports
            // "no task" with the latest version, although jobs are waiting.
            self.faults.lost_fetch_races += 1;
            return Ok(pb::FetchTaskResponse {
                task: None,
                tasks_version: latest,
                additional_tasks: Vec::new(),
            });
        }
        let capacity = if forgejo {
            usize::try_from(req.task_capacity.unwrap_or(1).clamp(1, 64)).unwrap_or(1)
        } else {
            1
        };
        let mut tasks = Vec::new();
        while tasks.len() < capacity {
            match self.pick(caller, now)? {
                Some(task) => tasks.push(task),
                None => break,
            }
        }
        if forgejo
            && let Some(key) = call.request_key
            && !tasks.is_empty()
        {
            self.request_keys.insert(
                (caller.to_owned(), key.to_owned()),
                tasks.iter().map(|t| t.id).collect(),
            );
        }
        let first = (!tasks.is_empty()).then(|| tasks.remove(0));
        Ok(pb::FetchTaskResponse {
            task: first,
            tasks_version: latest,
            additional_tasks: tasks,
        })
    }

    /// A running task handed out again (Forgejo request-key replay), with a new task token.
    fn reissue(&mut self, task_id: i64) -> Option<pb::Task> {
        let task = self.tasks.get_mut(&task_id)?;
        if !matches!(task.phase, TaskPhase::Running) {
            return None;
        }
        task.handed_out += 1;
        let (job_id, attempt) = (task.job_id, task.attempt);
        let job = self.jobs.get(&job_id)?;
        Some(payload::build_task(&TaskMaterial {
            task_id,
            token: random_hex40(),
            job_id,
            attempt,
            spec: &job.spec,
            server_url: &self.server_url,
        }))
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
