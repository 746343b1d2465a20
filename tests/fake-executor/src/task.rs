//! Running one claimed task: simulated steps with log and state reporting, cancellation, and
//! the final flush (UpdateLog(no_more) strictly before UpdateTask(result)).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use jr_forge::ForgeClient;
use jr_forge::proto::runner::v1::{
    Result as TaskResult, StepState, Task, TaskState, UpdateTaskRequest, UpdateTaskResponse,
};
use prost_types::Timestamp;
use tokio::time::Instant;

use crate::behaviour::{Outcome, TaskBehaviour};
use crate::log::LogUploader;
use crate::{ExecutorConfig, ExecutorError, Misbehaviour, TaskReport};

/// Rows every step writes: one when it starts, one when it ends.
const ROWS_PER_STEP: i64 = 2;

struct TaskRun<'a> {
    client: &'a ForgeClient,
    cfg: &'a ExecutorConfig,
    /// Id used in requests (differs from the claimed id under `WrongTaskId`).
    reported_id: i64,
    started_at: Timestamp,
    log: LogUploader,
    steps: Vec<StepState>,
    outputs: BTreeMap<String, String>,
    acknowledged_outputs: BTreeSet<String>,
    cancelled: bool,
}

pub(crate) async fn run_task(
    client: &ForgeClient,
    cfg: &ExecutorConfig,
    task: Task,
) -> Result<TaskReport, ExecutorError> {
    let reported_id = match cfg.misbehaviour {
        Some(Misbehaviour::WrongTaskId) => task.id + 1,
        Some(Misbehaviour::CrashAfterClaim | Misbehaviour::NoFinalLog) | None => task.id,
    };
    let mut run = TaskRun {
        client,
        cfg,
        reported_id,
        started_at: Timestamp::from(SystemTime::now()),
        log: LogUploader::new(reported_id),
        steps: Vec::new(),
        outputs: BTreeMap::new(),
        acknowledged_outputs: BTreeSet::new(),
        cancelled: false,
    };
    let result = match TaskBehaviour::from_vars(&task.vars) {
        Ok(behaviour) => run.run_steps(&behaviour).await,
        Err(reason) => {
            tracing::warn!(task_id = task.id, %reason, "bad fake vars, failing the task");
            run.log.push(format!("fake executor: {reason}"));
            TaskResult::Failure
        }
    };
    let send_log = cfg.misbehaviour != Some(Misbehaviour::NoFinalLog);
    if send_log {
        run.log
            .push(format!("Job finished: {}", result.as_str_name()));
    }
    // act_runner closes the log first; forgejo-runner reports the result first, so the facade
    // sees `terminal` before the log is closed.
    let (final_log_sent, reply) = if cfg.forgejo_reporting {
        let reply = run.send_final_state(result).await?;
        let sent = send_log && run.send_final_log().await?;
        (sent, reply)
    } else {
        let sent = send_log && run.send_final_log().await?;
        (sent, run.send_final_state(result).await?)
    };
    Ok(TaskReport {
        task_id: task.id,
        final_result: result,
        forge_result: reply_result(&reply),
        rows_sent: run.log.acknowledged(),
        cancelled: run.cancelled,
        final_log_sent,
        outputs_acknowledged: reply.sent_outputs,
    })
}

impl TaskRun<'_> {
    /// Runs the steps; returns the job result (CANCELLED if a reply said so).
    async fn run_steps(&mut self, behaviour: &TaskBehaviour) -> TaskResult {
        self.outputs = behaviour.outputs.clone();
        self.steps = (0..i64::from(behaviour.steps))
            .map(|id| StepState {
                id,
                ..Default::default()
            })
            .collect();
        let last = self.steps.len().saturating_sub(1);
        for index in 0..self.steps.len() {
            if self.cancelled {
                break;
            }
            let log_index = self.log.next_index();
            self.log.push(format!("::group::step {index}"));
            if let Some(step) = self.steps.get_mut(index) {
                step.started_at = Some(Timestamp::from(SystemTime::now()));
                step.log_index = log_index;
                step.log_length = 1;
            }
            self.heartbeat().await;
            self.work(behaviour.step_duration()).await;
            let result = if self.cancelled {
                TaskResult::Cancelled
            } else if index == last && behaviour.outcome == Outcome::Failure {
                TaskResult::Failure
            } else {
                TaskResult::Success
            };
            self.log
                .push(format!("step {index}: {}", result.as_str_name()));
            if let Some(step) = self.steps.get_mut(index) {
                step.result = result as i32;
                step.stopped_at = Some(Timestamp::from(SystemTime::now()));
                step.log_length = ROWS_PER_STEP;
            }
            self.heartbeat().await;
        }
        if self.cancelled {
            for step in self
                .steps
                .iter_mut()
                .filter(|s| s.result == TaskResult::Unspecified as i32)
            {
                step.result = TaskResult::Cancelled as i32;
            }
            return TaskResult::Cancelled;
        }
        match behaviour.outcome {
            Outcome::Success => TaskResult::Success,
            Outcome::Failure => TaskResult::Failure,
        }
    }

    /// Simulated work, with a heartbeat every poll interval so cancellation is noticed.
    async fn work(&mut self, duration: Duration) {
        let end = Instant::now() + duration;
        loop {
            let now = Instant::now();
            if self.cancelled || now >= end {
                return;
            }
            tokio::time::sleep((end - now).min(self.cfg.poll_interval)).await;
            if Instant::now() < end {
                self.heartbeat().await;
            }
        }
    }

    /// Periodic report: UpdateLog with buffered rows, then UpdateTask with the running state and
    /// unacknowledged outputs. Errors are logged and retried at the next heartbeat.
    async fn heartbeat(&mut self) {
        if let Err(err) = self.log.flush(self.client, false).await {
            tracing::warn!(error = %err, "UpdateLog failed");
        }
        let request = self.update_request(TaskResult::Unspecified, None);
        match self.client.update_task(&request).await {
            Ok(reply) => self.absorb(&reply),
            Err(err) => tracing::warn!(error = %err, kind = err.kind(), "UpdateTask failed"),
        }
    }

    fn update_request(
        &self,
        result: TaskResult,
        stopped_at: Option<Timestamp>,
    ) -> UpdateTaskRequest {
        let outputs = self
            .outputs
            .iter()
            .filter(|(k, _)| !self.acknowledged_outputs.contains(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        UpdateTaskRequest {
            state: Some(TaskState {
                id: self.reported_id,
                result: result as i32,
                started_at: Some(self.started_at),
                stopped_at,
                steps: self.steps.clone(),
            }),
            outputs,
        }
    }

    fn absorb(&mut self, reply: &UpdateTaskResponse) {
        self.acknowledged_outputs
            .extend(reply.sent_outputs.iter().cloned());
        let stop = match reply_result(reply) {
            TaskResult::Cancelled => true,
            TaskResult::Failure => self.cfg.forgejo_reporting,
            _ => false,
        };
        if stop && !self.cancelled {
            tracing::info!(task_id = self.reported_id, "forge cancelled the task");
            self.cancelled = true;
        }
    }

    /// `UpdateLog(no_more)` until every row is acknowledged. An archived log (AlreadyExists)
    /// ends the attempt without error: the forge will take no more rows anyway.
    async fn send_final_log(&mut self) -> Result<bool, ExecutorError> {
        let deadline = Instant::now() + self.cfg.give_up_after;
        loop {
            match self.log.flush(self.client, true).await {
                Ok(()) => return Ok(true),
                Err(ExecutorError::Rpc { source, .. })
                    if source.code() == Some(jr_forge::Code::AlreadyExists) =>
                {
                    tracing::warn!(error = %source, "log already archived");
                    return Ok(false);
                }
                Err(err) => self.retry_or_fail(err, deadline).await?,
            }
        }
    }

    /// Final `UpdateTask(result, stopped_at)` until every output is in `sent_outputs`.
    async fn send_final_state(
        &mut self,
        result: TaskResult,
    ) -> Result<UpdateTaskResponse, ExecutorError> {
        let deadline = Instant::now() + self.cfg.give_up_after;
        let stopped_at = Timestamp::from(SystemTime::now());
        loop {
            let request = self.update_request(result, Some(stopped_at));
            match self.client.update_task(&request).await {
                Ok(reply) => {
                    self.acknowledged_outputs
                        .extend(reply.sent_outputs.iter().cloned());
                    if self
                        .outputs
                        .keys()
                        .all(|k| self.acknowledged_outputs.contains(k))
                    {
                        return Ok(reply);
                    }
                    if Instant::now() + self.cfg.poll_interval >= deadline {
                        return Ok(reply);
                    }
                    tokio::time::sleep(self.cfg.poll_interval).await;
                }
                Err(source) => {
                    self.retry_or_fail(
                        ExecutorError::Rpc {
                            call: "UpdateTask",
                            source,
                        },
                        deadline,
                    )
                    .await?
                }
            }
        }
    }

    /// Waits before the next attempt, or returns the error if it is final or time is up.
    async fn retry_or_fail(
        &self,
        err: ExecutorError,
        deadline: Instant,
    ) -> Result<(), ExecutorError> {
        if !err.is_retryable() || Instant::now() + self.cfg.poll_interval >= deadline {
            return Err(err);
        }
        tracing::warn!(error = %err, "final report failed, retrying");
        tokio::time::sleep(self.cfg.poll_interval).await;
        Ok(())
    }
}

fn reply_result(reply: &UpdateTaskResponse) -> TaskResult {
    reply
        .state
        .as_ref()
        .and_then(|s| TaskResult::try_from(s.result).ok())
        .unwrap_or(TaskResult::Unspecified)
}
