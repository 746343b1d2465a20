//! Calls jetrunner makes to the forge on its own account rather than for an executor: a final
//! failure (a task no backend can run, or one whose workload was lost), and the heartbeat of a
//! task no executor runs yet. Shared by the facade and the Gitea/Forgejo intake.

use crate::proto::runner::v1::Result as ForgeResult;
use crate::proto::runner::v1::{
    LogRow, TaskState, UpdateLogRequest, UpdateTaskRequest, UpdateTaskResponse,
};
use crate::{Code, ForgeClient, ForgeError};

fn now_timestamp() -> prost_types::Timestamp {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    prost_types::Timestamp {
        seconds: now.as_secs() as i64,
        nanos: now.subsec_nanos() as i32,
    }
}

/// Appends `lines` to the task's log, closes it, and reports `FAILURE`. Returns the result the
/// forge holds afterwards (a task that was already final keeps its result).
pub async fn report_failure(
    forge: &ForgeClient,
    task_id: i64,
    lines: &[String],
) -> Result<ForgeResult, ForgeError> {
    // An empty UpdateLog returns how many rows the forge already stored, so the lines are
    // appended after them instead of being dropped as an overlap.
    let ack = forge
        .update_log(&UpdateLogRequest {
            task_id,
            index: 0,
            rows: vec![],
            no_more: false,
        })
        .await?
        .ack_index;
    let rows = lines
        .iter()
        .map(|l| LogRow {
            time: Some(now_timestamp()),
            content: format!("jetrunner: {l}"),
        })
        .collect();
    match forge
        .update_log(&UpdateLogRequest {
            task_id,
            index: ack,
            rows,
            no_more: true,
        })
        .await
    {
        Ok(_) => {}
        // The log is already archived (the task ended on the forge's side): nothing to add.
        Err(e) if e.code() == Some(Code::AlreadyExists) => {}
        Err(e) => return Err(e),
    }
    let reply = forge
        .update_task(&UpdateTaskRequest {
            state: Some(TaskState {
                id: task_id,
                result: ForgeResult::Failure as i32,
                started_at: None,
                stopped_at: Some(now_timestamp()),
                steps: vec![],
            }),
            outputs: Default::default(),
        })
        .await?;
    Ok(reply
        .state
        .map(|s| s.result())
        .unwrap_or(ForgeResult::Failure))
}

/// A heartbeat for a task no executor runs yet: `UpdateTask` without a result, which keeps the
/// forge's zombie reaper away. Returns the final result the forge holds if it already ended the
/// task (cancelled by a user, failed by a reaper), `None` while it is still running.
pub async fn keepalive(
    forge: &ForgeClient,
    task_id: i64,
) -> Result<Option<jr_protocol::TaskResult>, ForgeError> {
    let reply = heartbeat(forge, task_id, Default::default()).await?;
    Ok(reply.state.and_then(|s| final_result(s.result)))
}

/// `UpdateTask` without a result, carrying `outputs`: a forge changes nothing on a task that is
/// final already (outputs aside, which it stores whenever sent, the first value winning) and
/// answers with its result for the task and the outputs it holds.
pub async fn heartbeat(
    forge: &ForgeClient,
    task_id: i64,
    outputs: std::collections::BTreeMap<String, String>,
) -> Result<UpdateTaskResponse, ForgeError> {
    forge
        .update_task(&UpdateTaskRequest {
            state: Some(TaskState {
                id: task_id,
                result: ForgeResult::Unspecified as i32,
                started_at: None,
                stopped_at: None,
                steps: vec![],
            }),
            outputs,
        })
        .await
}

/// The final result a forge `result` field names; `None` while it is unspecified (the task is
/// still running).
pub fn final_result(result: i32) -> Option<jr_protocol::TaskResult> {
    use jr_protocol::TaskResult;
    match ForgeResult::try_from(result).ok()? {
        ForgeResult::Unspecified => None,
        ForgeResult::Success => Some(TaskResult::Success),
        ForgeResult::Failure => Some(TaskResult::Failure),
        ForgeResult::Cancelled => Some(TaskResult::Cancelled),
        ForgeResult::Skipped => Some(TaskResult::Skipped),
    }
}
