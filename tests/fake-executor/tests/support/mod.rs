//! A minimal RunnerService stand-in for the fake executor's tests: it authenticates, follows
//! Gitea's UpdateLog/UpdateTask rules, and records every call for ordering assertions.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use jr_forge::proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, Result as TaskResult,
    StepState, Task, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest,
    UpdateTaskResponse,
};
use jr_forge::{Code, connect_error_body};
use prost::Message;

pub const UUID: &str = "0191d5a0-0000-7000-8000-000000000001";
pub const TOKEN: &str = "per-attempt-secret";
pub const TASK_ID: i64 = 41;
pub const TASKS_VERSION: i64 = 7;

#[derive(Default)]
pub struct Knobs {
    pub declare_failures: usize,
    pub empty_fetches: usize,
    pub no_task: bool,
    /// The task is cancelled server-side once this many UpdateTask calls were received.
    pub cancel_after_updates: Option<usize>,
    /// The task is failed server-side (a reaper) once this many UpdateTask calls were received.
    pub fail_after_updates: Option<usize>,
    /// Store at most this many rows per UpdateLog (forces the client to resend the rest).
    pub max_rows_per_call: Option<usize>,
    /// Answer `unavailable` to every UpdateLog without `no_more` (rows pile up client-side).
    pub logs_unavailable_until_no_more: bool,
    /// The first final UpdateTask does not store outputs (forces a resend).
    pub drop_outputs_of_first_final: bool,
}

#[derive(Debug, Clone)]
pub enum Call {
    Declare,
    Fetch {
        tasks_version: i64,
    },
    Log {
        index: i64,
        rows: Vec<String>,
        no_more: bool,
    },
    Update {
        result: TaskResult,
        stopped_at: bool,
        steps: Vec<StepState>,
        outputs: BTreeMap<String, String>,
    },
}

#[derive(Default)]
pub struct Recorded {
    pub calls: Vec<Call>,
    pub declares: usize,
    /// Labels of the last Declare.
    pub declared_labels: Vec<String>,
    pub fetches: usize,
    pub task_given: bool,
    pub log: Vec<String>,
    pub archived: bool,
    pub gaps: usize,
    pub outputs: BTreeMap<String, String>,
    pub result: Option<TaskResult>,
    pub updates: usize,
    pub finals: usize,
}

pub struct Facade {
    pub knobs: Knobs,
    pub task: Task,
    pub recorded: Mutex<Recorded>,
}

pub type Shared = Arc<Facade>;

fn connect_error(code: Code, message: &str) -> Response {
    let status = StatusCode::from_u16(code.http_status()).expect("status");
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        connect_error_body(code, message),
    )
        .into_response()
}

fn reply(message: &impl Message) -> Response {
    (
        [(header::CONTENT_TYPE, "application/proto")],
        message.encode_to_vec(),
    )
        .into_response()
}

fn authenticated(headers: &HeaderMap) -> bool {
    headers.get("x-runner-uuid").is_some_and(|v| v == UUID)
        && headers.get("x-runner-token").is_some_and(|v| v == TOKEN)
}

async fn declare(State(f): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    if !authenticated(&headers) {
        return connect_error(Code::Unauthenticated, "unregistered runner");
    }
    let request = DeclareRequest::decode(body).expect("DeclareRequest");
    let mut r = f.recorded.lock().expect("lock");
    r.calls.push(Call::Declare);
    r.declared_labels = request.labels;
    r.declares += 1;
    if r.declares <= f.knobs.declare_failures {
        return connect_error(Code::Unavailable, "not ready");
    }
    reply(&DeclareResponse::default())
}

async fn fetch_task(State(f): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    if !authenticated(&headers) {
        return connect_error(Code::Unauthenticated, "unregistered runner");
    }
    let request = FetchTaskRequest::decode(body).expect("FetchTaskRequest");
    let mut r = f.recorded.lock().expect("lock");
    r.calls.push(Call::Fetch {
        tasks_version: request.tasks_version,
    });
    r.fetches += 1;
    let give = !f.knobs.no_task && r.fetches > f.knobs.empty_fetches && !r.task_given;
    r.task_given |= give;
    reply(&FetchTaskResponse {
        task: give.then(|| f.task.clone()),
        tasks_version: TASKS_VERSION,
        ..FetchTaskResponse::default()
    })
}

/// UpdateLog with Gitea's ack rules.
async fn update_log(State(f): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    if !authenticated(&headers) {
        return connect_error(Code::Unauthenticated, "unregistered runner");
    }
    let request = UpdateLogRequest::decode(body).expect("UpdateLogRequest");
    if request.task_id != TASK_ID {
        return connect_error(Code::PermissionDenied, "not your task");
    }
    if f.knobs.logs_unavailable_until_no_more && !request.no_more {
        return connect_error(Code::Unavailable, "log storage busy");
    }
    let mut r = f.recorded.lock().expect("lock");
    let rows: Vec<String> = request.rows.iter().map(|row| row.content.clone()).collect();
    r.calls.push(Call::Log {
        index: request.index,
        rows: rows.clone(),
        no_more: request.no_more,
    });
    let ack = i64::try_from(r.log.len()).expect("len");
    let count = i64::try_from(rows.len()).expect("len");
    if request.index > ack {
        r.gaps += 1;
    }
    if rows.is_empty() || request.index > ack || request.index + count <= ack {
        return reply(&UpdateLogResponse { ack_index: ack });
    }
    if r.archived {
        return connect_error(Code::AlreadyExists, "log file has been archived");
    }
    let fresh = &rows[usize::try_from(ack - request.index).expect("non-negative")..];
    let take = f
        .knobs
        .max_rows_per_call
        .unwrap_or(usize::MAX)
        .min(fresh.len());
    r.log.extend_from_slice(&fresh[..take]);
    if request.no_more && take == fresh.len() {
        r.archived = true;
    }
    reply(&UpdateLogResponse {
        ack_index: i64::try_from(r.log.len()).expect("len"),
    })
}

/// UpdateTask with sticky final states and first-write-wins outputs, as Gitea does.
async fn update_task(State(f): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    if !authenticated(&headers) {
        return connect_error(Code::Unauthenticated, "unregistered runner");
    }
    let request = UpdateTaskRequest::decode(body).expect("UpdateTaskRequest");
    let state = request.state.unwrap_or_default();
    if state.id != TASK_ID {
        return connect_error(Code::PermissionDenied, "not your task");
    }
    let result = TaskResult::try_from(state.result).expect("known result");
    let mut r = f.recorded.lock().expect("lock");
    r.calls.push(Call::Update {
        result,
        stopped_at: state.stopped_at.is_some(),
        steps: state.steps.clone(),
        outputs: request.outputs.clone(),
    });
    r.updates += 1;
    if f.knobs.cancel_after_updates.is_some_and(|n| r.updates >= n) && r.result.is_none() {
        r.result = Some(TaskResult::Cancelled);
    }
    if f.knobs.fail_after_updates.is_some_and(|n| r.updates >= n) && r.result.is_none() {
        r.result = Some(TaskResult::Failure);
    }
    let is_final = result != TaskResult::Unspecified;
    if is_final {
        r.finals += 1;
        if r.result.is_none() {
            r.result = Some(result);
        }
    }
    let drop_outputs = is_final && r.finals == 1 && f.knobs.drop_outputs_of_first_final;
    if !drop_outputs {
        for (k, v) in request.outputs {
            r.outputs.entry(k).or_insert(v);
        }
    }
    reply(&UpdateTaskResponse {
        state: Some(TaskState {
            id: TASK_ID,
            result: r.result.unwrap_or(TaskResult::Unspecified) as i32,
            ..Default::default()
        }),
        sent_outputs: r.outputs.keys().cloned().collect(),
    })
}

pub async fn start(knobs: Knobs, vars: &[(&str, &str)]) -> (Shared, String) {
    let task = Task {
        id: TASK_ID,
        vars: vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    let facade = Arc::new(Facade {
        knobs,
        task,
        recorded: Mutex::default(),
    });
    let service = "/api/actions/runner.v1.RunnerService";
    let router = Router::new()
        .route(&format!("{service}/Declare"), post(declare))
        .route(&format!("{service}/FetchTask"), post(fetch_task))
        .route(&format!("{service}/UpdateLog"), post(update_log))
        .route(&format!("{service}/UpdateTask"), post(update_task))
        .with_state(facade.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    (facade, format!("http://{addr}"))
}
