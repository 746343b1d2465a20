//! The RunnerService methods as executors see them, and the router that serves them.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::{StatusCode, header};
use jr_forge::proto::ping::v1::{PingRequest, PingResponse};
use jr_forge::proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, Result as ForgeResult,
    Runner, Task, UpdateJobSummaryRequest, UpdateJobSummaryResponse, UpdateLogRequest,
    UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use jr_forge::wire::{
    API_PREFIX, CONTENT_TYPE_JSON, PING_SERVICE, RUNNER_SERVICE, decode_request, encode_response,
    request_codec, rpc_path,
};
use jr_forge::{Code, ForgeError, connect_error_body};
use jr_protocol::{Terminal, TerminalSource};
use prost::Message;

use super::auth::{AuthFailure, Authenticated, Caller, ClientIdentity, Need};
use super::progress::{Admission, FinalAnswer, FollowUp, Progress};
use super::proxy::proxy;
use super::stats::bump;
use super::{AssignmentView, Facade, Ledger};

/// Largest RPC request body accepted (a big UpdateLog batch stays well below this).
/// How long a FetchTask for a not-yet-visible assignment is held, and how often it looks again.
const PENDING_HOLD: std::time::Duration = std::time::Duration::from_secs(3);
const PENDING_POLL: std::time::Duration = std::time::Duration::from_millis(200);
/// How long an idle warm executor's FetchTask is held (below act_runner's 5 s fetch timeout),
/// and how often it is looked at again without a wake-up.
const WARM_HOLD: std::time::Duration = std::time::Duration::from_secs(4);
const WARM_POLL: std::time::Duration = std::time::Duration::from_millis(500);
/// Ping is unauthenticated: its body is tiny.
const MAX_PING_BODY: usize = 64 * 1024;
/// `tasks_version` the facade reports; it never takes the fast path, so any non-zero value works.
const TASKS_VERSION: i64 = 1;

/// How long the facade keeps trying to record a final's `terminal` before it asks the
/// executor to retry (long enough for a JetStream stream leader to be elected).
const TERMINAL_RECORD_WAIT: std::time::Duration = std::time::Duration::from_secs(8);

/// The forge's result for a recorded terminal result.
fn forge_result(result: jr_protocol::TaskResult) -> ForgeResult {
    match result {
        jr_protocol::TaskResult::Success => ForgeResult::Success,
        jr_protocol::TaskResult::Failure => ForgeResult::Failure,
        jr_protocol::TaskResult::Cancelled => ForgeResult::Cancelled,
        jr_protocol::TaskResult::Skipped => ForgeResult::Skipped,
    }
}

/// A reply answered without the forge: the outputs the retried call carries were stored with
/// the final the forge accepted (it stores every output it is sent, the first value winning),
/// so they are reported sent as well.
fn with_sent_outputs(
    mut reply: UpdateTaskResponse,
    request: &UpdateTaskRequest,
) -> UpdateTaskResponse {
    for key in request.outputs.keys() {
        if !reply.sent_outputs.contains(key) {
            reply.sent_outputs.push(key.clone());
        }
    }
    reply
}

/// The facade's HTTP surface: the RunnerService and PingService paths, the proxied artifact and
/// cache paths, and 404 for everything else. [`super::serve`] adds the [`ClientIdentity`]
/// extension; without it every caller is anonymous (token mode only).
pub fn router<L: Ledger>(facade: Arc<Facade<L>>) -> Router {
    Router::new()
        .route(&rpc_path(PING_SERVICE, "Ping"), post(ping))
        .route(
            &format!("{API_PREFIX}/{RUNNER_SERVICE}/{{method}}"),
            post(runner_service::<L>),
        )
        .route(
            super::github::RUNNER_CONFIG_PATH,
            post(super::github::runner_config::<L>),
        )
        .fallback(proxy::<L>)
        .with_state(facade)
}

/// A Connect error answer: HTTP status and JSON body.
#[derive(Debug)]
pub(crate) struct RpcError {
    status: u16,
    body: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl std::fmt::Display) -> RpcError {
        RpcError {
            status: code.http_status(),
            body: connect_error_body(code, &message.to_string()),
        }
    }

    /// The forge's own error, passed through with its code and message.
    pub fn forge(err: &ForgeError) -> RpcError {
        let (status, body) = err.connect_reply();
        RpcError { status, body }
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, CONTENT_TYPE_JSON)],
            self.body,
        )
            .into_response()
    }
}

/// Decodes a unary request, runs `handler`, encodes its reply or error.
async fn unary<Req, Resp, Fut>(
    content_type: Option<&str>,
    body: &[u8],
    handler: impl FnOnce(Req) -> Fut,
) -> Response
where
    Req: Message + Default,
    Resp: Message,
    Fut: Future<Output = Result<Resp, RpcError>>,
{
    let codec = match request_codec(content_type) {
        Ok(codec) => codec,
        Err(err) => return RpcError::forge(&err).into_response(),
    };
    let request = match decode_request::<Req>(content_type, body) {
        Ok(request) => request,
        Err(err) => return RpcError::forge(&err).into_response(),
    };
    match handler(request).await {
        Ok(reply) => (
            [(header::CONTENT_TYPE, codec.content_type())],
            encode_response(codec, &reply),
        )
            .into_response(),
        Err(err) => err.into_response(),
    }
}

async fn ping(request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_PING_BODY).await else {
        return RpcError::new(Code::InvalidArgument, "cannot read request body").into_response();
    };
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    unary(content_type, &body, |req: PingRequest| async move {
        Ok(PingResponse {
            data: format!("Hello, {}!", req.data),
        })
    })
    .await
}

async fn runner_service<L: Ledger>(
    State(facade): State<Arc<Facade<L>>>,
    Path(method): Path<String>,
    request: Request,
) -> Response {
    let f = &facade;
    match method.as_str() {
        "Register" => {
            bump(&f.counters.permission_denied);
            return RpcError::new(
                Code::PermissionDenied,
                "Register is not available on the jetrunner facade: executors use the \
                 per-assignment credentials they were started with",
            )
            .into_response();
        }
        "Declare" | "FetchTask" | "UpdateTask" | "UpdateLog" | "UpdateJobSummary" => {}
        _ => return StatusCode::NOT_FOUND.into_response(),
    }
    let (parts, body) = request.into_parts();
    let caller = Caller::from_request(&parts.headers, parts.extensions.get::<ClientIdentity>());
    // Authenticate from the headers before reading any body: a caller that is not an executor
    // of ours never makes the facade buffer (or wait for) a body.
    // Declare decides nothing on the task's progress: who is calling is all it needs.
    let need = if method == "Declare" {
        Need::Identity
    } else {
        Need::Progress
    };
    let mut auth = match f.authenticate(&caller, need).await {
        Err(refused @ AuthFailure::Refused(_)) => return auth_error(refused).into_response(),
        other => other,
    };
    // forgejo-runner's one-job mode gives up on its first empty FetchTask: while the
    // assignment is legitimately not visible yet, hold the call a little instead. A warm
    // executor's call is held until its worker binds it (woken by the worker's notice) or the
    // hold ends, so a job reaches it within milliseconds of the binding.
    if method == "FetchTask" {
        let start = std::time::Instant::now();
        let mut watched = None;
        loop {
            let (hold, wake) = match &auth {
                Ok(Authenticated::Pending) => (PENDING_HOLD, None),
                Ok(Authenticated::Warm { warm, .. }) => {
                    watched = Some(*warm);
                    (WARM_HOLD, Some(f.warm_wake(*warm)))
                }
                _ => break,
            };
            let Some(left) = (start + hold).checked_duration_since(std::time::Instant::now())
            else {
                break;
            };
            match wake {
                Some(wake) => {
                    let _ = tokio::time::timeout(left.min(WARM_POLL), wake.notified()).await;
                }
                None => tokio::time::sleep(left.min(PENDING_POLL)).await,
            }
            auth = f.authenticate(&caller, need).await;
        }
        if let Some(warm) = watched {
            f.warm_unwatch(warm);
        }
    }
    if let Ok(Authenticated::Ready { view, .. }) = &auth
        && !f.call_rate.admit(view.id, std::time::Instant::now())
    {
        bump(&f.counters.rate_limited);
        return RpcError::new(
            Code::ResourceExhausted,
            "too many calls for this assignment; slow down",
        )
        .into_response();
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let limits = f.settings.limits;
    let body = match tokio::time::timeout(
        limits.body_timeout,
        axum::body::to_bytes(body, limits.max_body_bytes),
    )
    .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => {
            return RpcError::new(
                Code::ResourceExhausted,
                format!(
                    "request body larger than facade.max_body_bytes ({} bytes) or broken; \
                     send UpdateLog in smaller batches",
                    limits.max_body_bytes
                ),
            )
            .into_response();
        }
        Err(_) => {
            bump(&f.counters.body_timeouts);
            return RpcError::new(
                Code::DeadlineExceeded,
                "request body not received within facade.body_timeout",
            )
            .into_response();
        }
    };
    // Each call of a known executor is a span of its job's trace (the claim and the final
    // result it publishes carry that context on).
    let span = tracing::info_span!(parent: None, "facade call", rpc = %method, assignment = tracing::field::Empty);
    if let Ok(Authenticated::Ready { view, .. }) = &auth {
        span.record("assignment", tracing::field::display(view.id));
        jr_bus::follow(&span, view.trace.as_deref());
    }
    let calls = async {
        match method.as_str() {
            "Declare" => {
                // Relay the forge's capabilities (newer runners read them from Declare).
                let capabilities = match &auth {
                    Ok(Authenticated::Ready { view, .. }) => f
                        .settings
                        .forges
                        .capabilities(&view.backend)
                        .and_then(|c| http::HeaderValue::from_str(&c).ok()),
                    _ => None,
                };
                let mut response =
                    unary(content_type, &body, |r| f.declare(&caller, auth, r)).await;
                if let Some(value) = capabilities
                    && response.status() == StatusCode::OK
                {
                    response
                        .headers_mut()
                        .insert(jr_forge::wire::HEADER_CAPABILITIES, value);
                }
                response
            }
            "FetchTask" => unary(content_type, &body, |r| f.fetch_task(auth, r)).await,
            "UpdateTask" => unary(content_type, &body, |r| f.update_task(auth, r)).await,
            "UpdateLog" => unary(content_type, &body, |r| f.update_log(auth, r)).await,
            _ => unary(content_type, &body, |r| f.update_job_summary(auth, r)).await,
        }
    };
    tracing::Instrument::instrument(calls, span).await
}

pub(crate) fn auth_error(failure: AuthFailure) -> RpcError {
    match failure {
        AuthFailure::Refused(reason) => RpcError::new(
            Code::Unauthenticated,
            format!(
                "unregistered runner: executor credentials refused ({})",
                reason.as_str()
            ),
        ),
        AuthFailure::Ledger(_) => {
            RpcError::new(Code::Unavailable, "assignment state unavailable; retry")
        }
    }
}

pub(crate) fn not_visible_yet() -> RpcError {
    RpcError::new(
        Code::Unavailable,
        "assignment not known to the facade yet; retry",
    )
}

impl<L: Ledger> Facade<L> {
    async fn declare(
        &self,
        caller: &Caller,
        auth: Result<Authenticated, AuthFailure>,
        request: DeclareRequest,
    ) -> Result<DeclareResponse, RpcError> {
        // Pending is fine, and so is a ledger hiccup: act_runner gives up on a failed Declare,
        // the assignment may simply not be visible yet, and Declare reveals nothing. Only a
        // definite refusal (wrong token or identity) fails it.
        match auth {
            Ok(_) | Err(AuthFailure::Ledger(_)) => {}
            Err(refused @ AuthFailure::Refused(_)) => return Err(auth_error(refused)),
        }
        let uuid = caller.uuid.clone().unwrap_or_default();
        Ok(DeclareResponse {
            runner: Some(Runner {
                name: format!("jetrunner-{uuid}"),
                uuid,
                version: request.version,
                labels: request.labels,
                ..Runner::default()
            }),
        })
    }

    async fn fetch_task(
        &self,
        auth: Result<Authenticated, AuthFailure>,
        _request: FetchTaskRequest,
    ) -> Result<FetchTaskResponse, RpcError> {
        let no_task = FetchTaskResponse {
            task: None,
            tasks_version: TASKS_VERSION,
            additional_tasks: Vec::new(),
        };
        let (view, executor) = match auth.map_err(auth_error)? {
            Authenticated::Ready { view, executor } => (view, executor),
            Authenticated::Pending => {
                bump(&self.counters.fetches_pending);
                return Ok(no_task);
            }
            Authenticated::Warm { .. } => return Ok(no_task),
        };
        if view.terminal {
            return Ok(no_task);
        }
        if view.claimed {
            // The claim belongs to this attempt (redispatch happens only before a claim), and
            // only this attempt's executor holds its credentials. A runner in one-shot mode
            // asks again only if it never got its task: the reply was lost, or the facade that
            // answered was killed right after publishing `claimed`. So until a report shows the
            // executor has the task, it gets the same task again.
            let progress = self.progress_of(view.id);
            let mut progress = progress.lock().await;
            progress.sync(view.attempt, view.terminal);
            if !progress.reported {
                return Ok(FetchTaskResponse {
                    task: Some(self.open_task(&view)?),
                    tasks_version: TASKS_VERSION,
                    additional_tasks: Vec::new(),
                });
            }
            return Ok(no_task);
        }
        // Open the task before claiming, so a task that cannot be delivered is never claimed.
        let task = self.open_task(&view)?;
        // The forge may have ended the task while it waited (a user cancelled the run, a
        // reaper failed it): ask before handing it out, and withdraw it instead of starting a
        // job nobody wants. This heartbeat also keeps the task alive until the executor's own.
        match jr_forge::report::keepalive(&self.forge_of(&view)?, view.forge_task_id).await {
            Ok(None) => {}
            Ok(Some(result)) => {
                let terminal = Terminal {
                    forge_task_id: view.forge_task_id,
                    result,
                    source: TerminalSource::Withdrawn,
                    log_closed: true,
                    reason: Some(
                        "the forge ended the task before an executor claimed it".to_owned(),
                    ),
                };
                match self.ledger.publish_terminal(&view, terminal).await {
                    Ok(_) => {
                        tracing::info!(assignment = %view.id, ?result, "forge ended the task before the claim; withdrawn")
                    }
                    Err(err) => {
                        bump(&self.counters.ledger_errors);
                        tracing::warn!(assignment = %view.id, error = %err, "publishing the withdrawal failed");
                    }
                }
                return Ok(no_task);
            }
            Err(err) => {
                bump(&self.counters.forward_errors);
                tracing::warn!(assignment = %view.id, error = %err, "forge unreachable before the claim; the executor polls again");
                return Ok(no_task);
            }
        }
        // The ledger's once-only publish settles races between executors and facade replicas.
        match self.ledger.publish_claimed(&view, &executor).await {
            Ok(true) => {
                bump(&self.counters.claims_won);
                let progress = self.progress_of(view.id);
                let mut progress = progress.lock().await;
                progress.sync(view.attempt, view.terminal);
                progress.claimed_here = true;
                tracing::debug!(assignment = %view.id, attempt = view.attempt, forge_task_id = view.forge_task_id, %executor, "task claimed");
                Ok(FetchTaskResponse {
                    task: Some(task),
                    tasks_version: TASKS_VERSION,
                    additional_tasks: Vec::new(),
                })
            }
            Ok(false) => {
                bump(&self.counters.claims_lost);
                Ok(no_task)
            }
            Err(err) => {
                bump(&self.counters.ledger_errors);
                tracing::warn!(assignment = %view.id, error = %err, "publishing claimed failed");
                // Answer "no task": the executor polls again and the claim is retried.
                Ok(no_task)
            }
        }
    }

    fn open_task(&self, view: &AssignmentView) -> Result<Task, RpcError> {
        let plaintext = self
            .settings
            .sealer
            .open(
                jr_seal::SealScope::new(view.id, &view.backend, view.forge_task_id),
                &view.sealed_task,
            )
            .map_err(|err| {
                tracing::error!(assignment = %view.id, error = %err, "cannot open sealed task");
                RpcError::new(Code::Internal, "the assignment's task cannot be opened")
            })?;
        let task = Task::decode(plaintext.as_slice()).map_err(|err| {
            tracing::error!(assignment = %view.id, error = %err, "sealed task is not a Task");
            RpcError::new(Code::Internal, "the assignment's task is malformed")
        })?;
        if task.id != view.forge_task_id {
            tracing::error!(assignment = %view.id, task = task.id, expected = view.forge_task_id, "sealed task id mismatch");
            return Err(RpcError::new(
                Code::Internal,
                "the assignment's task is malformed",
            ));
        }
        Ok(task)
    }

    /// Authentication plus the checks shared by UpdateTask and UpdateLog.
    async fn reporting_caller(
        &self,
        auth: Result<Authenticated, AuthFailure>,
        task_id: i64,
    ) -> Result<AssignmentView, RpcError> {
        let view = match auth.map_err(auth_error)? {
            Authenticated::Ready { view, .. } => view,
            Authenticated::Pending => return Err(not_visible_yet()),
            Authenticated::Warm { .. } => {
                bump(&self.counters.permission_denied);
                return Err(RpcError::new(
                    Code::PermissionDenied,
                    "this warm executor has no task to report on",
                ));
            }
        };
        if task_id != view.forge_task_id {
            bump(&self.counters.permission_denied);
            tracing::warn!(assignment = %view.id, task_id, "report for another task refused");
            return Err(RpcError::new(
                Code::PermissionDenied,
                format!("task {task_id} is not this executor's task"),
            ));
        }
        Ok(view)
    }

    fn not_claimed(&self) -> RpcError {
        bump(&self.counters.permission_denied);
        RpcError::new(
            Code::PermissionDenied,
            "this executor has not claimed its task",
        )
    }

    fn after_terminal(&self, why: &str) -> RpcError {
        bump(&self.counters.refused_after_terminal);
        RpcError::new(Code::FailedPrecondition, why)
    }

    /// The client of the runner that fetched this assignment's task.
    fn forge_of(&self, view: &AssignmentView) -> Result<jr_forge::ForgeClient, RpcError> {
        self.settings.forges.client(&view.backend).map_err(|why| match why {
            super::ForgeUnavailable::NotEstablished => {
                tracing::warn!(assignment = %view.id, backend = %view.backend, "this backend's forge registration is not established here yet; the executor retries");
                RpcError::new(Code::Unavailable, "the forge registration is not established yet; retry")
            }
            super::ForgeUnavailable::NotServed => {
                tracing::error!(assignment = %view.id, backend = %view.backend, "no forge registration for this backend");
                RpcError::new(Code::Unavailable, "no forge registration for this backend")
            }
        })
    }

    fn forge_failed(&self, err: &ForgeError) -> RpcError {
        bump(&self.counters.forward_errors);
        tracing::info!(error = %err, kind = err.kind(), "forge refused a forwarded report");
        if err.code() == Some(Code::Unauthenticated) {
            // It is jetrunner's runner credential the forge refused, not the executor's: an
            // executor told "unauthenticated" would give up; told "unavailable" it retries.
            tracing::error!(error = %err, "the forge refused jetrunner's runner credentials");
            return RpcError::new(
                Code::Unavailable,
                "the forge refused jetrunner's runner credentials; retry later",
            );
        }
        RpcError::forge(err)
    }

    async fn update_task(
        &self,
        auth: Result<Authenticated, AuthFailure>,
        request: UpdateTaskRequest,
    ) -> Result<UpdateTaskResponse, RpcError> {
        let Some(state) = request.state.as_ref() else {
            return Err(RpcError::new(
                Code::InvalidArgument,
                "UpdateTask without state",
            ));
        };
        let requested = state.result;
        let view = self.reporting_caller(auth, state.id).await?;
        let progress = self.progress_of(view.id);
        // One report at a time per assignment, so the progress record follows the forge.
        let mut progress = progress.lock().await;
        progress.sync(view.attempt, view.terminal);
        if !(view.claimed || progress.claimed_here) {
            return Err(self.not_claimed());
        }
        // A final whose task already has its final result never reaches the forge again.
        match progress.final_answer(requested) {
            FinalAnswer::Undecided => {}
            FinalAnswer::Refuse(why) => return Err(self.after_terminal(why)),
            FinalAnswer::Accepted(reply) => {
                bump(&self.counters.finals_answered_here);
                if !progress.terminal {
                    self.record_terminal(
                        &view,
                        &mut progress,
                        requested,
                        reply.state.as_ref().map_or(0, |s| s.result),
                    )
                    .await?;
                }
                tracing::info!(assignment = %view.id, "retried final answered without the forge");
                return Ok(with_sent_outputs(reply, &request));
            }
            FinalAnswer::FromLedger => match self.ledger.terminal_of(&view).await {
                // The same result is answered with the recorded one; so is any result when the
                // task was cancelled (the forge's cancellation wins over the runner's result, and
                // the forge answers with it). Another result is refused.
                Ok(Some(terminal)) => {
                    let result = forge_result(terminal.result);
                    if result as i32 != requested && result != ForgeResult::Cancelled {
                        return Err(
                            self.after_terminal("task is already final with another result")
                        );
                    }
                    bump(&self.counters.finals_answered_here);
                    let reply = UpdateTaskResponse {
                        state: Some(jr_forge::proto::runner::v1::TaskState {
                            id: view.forge_task_id,
                            result: result as i32,
                            ..Default::default()
                        }),
                        sent_outputs: Vec::new(),
                    };
                    progress.accepted_final = Some((requested, reply.clone()));
                    progress.terminal_recorded(requested, terminal.log_closed);
                    tracing::info!(assignment = %view.id, "final answered from the ledger's terminal");
                    return Ok(with_sent_outputs(reply, &request));
                }
                Ok(None) => {}
                Err(err) => {
                    bump(&self.counters.ledger_errors);
                    tracing::warn!(assignment = %view.id, error = %err, "reading the terminal failed");
                    return Err(RpcError::new(
                        Code::Unavailable,
                        "reading the final state failed; retry",
                    ));
                }
            },
        }
        if let Admission::Refuse(why) = progress.admit_update_task(requested) {
            return Err(self.after_terminal(why));
        }
        if requested != ForgeResult::Unspecified as i32
            && !progress.terminal
            && !(progress.claimed_here || progress.reported)
            && let Some(reply) = self.final_at_forge(&view, &request).await?
        {
            // Another replica forwarded this final and stopped before its terminal was
            // recorded: the forge has it; it is recorded here and not sent a second time.
            bump(&self.counters.finals_found_at_forge);
            progress.reported = true;
            let replied = reply.state.as_ref().map_or(0, |s| s.result);
            progress.accepted_final = Some((requested, reply.clone()));
            self.record_terminal(&view, &mut progress, requested, replied)
                .await?;
            tracing::info!(assignment = %view.id, "final already accepted by the forge; recorded without forwarding it again");
            return Ok(with_sent_outputs(reply, &request));
        }
        bump(&self.counters.forwarded_calls);
        let reply = self
            .forge_of(&view)?
            .update_task(&request)
            .await
            .map_err(|err| self.forge_failed(&err))?;
        progress.reported = true;
        let replied = reply.state.as_ref().map_or(0, |s| s.result);
        if requested != ForgeResult::Unspecified as i32
            && jr_forge::report::final_result(replied).is_some()
            && !progress.terminal
        {
            // Kept before the terminal is recorded: a retry is answered from here.
            progress.accepted_final = Some((requested, reply.clone()));
            self.record_terminal(&view, &mut progress, requested, replied)
                .await?;
        }
        Ok(reply)
    }

    /// For a final arriving at a replica that has not served this attempt before (the one
    /// that did may have stopped between the forge accepting the final and the terminal being
    /// recorded): asks the forge with a heartbeat carrying the final's outputs, which changes
    /// nothing on a final task and answers with its result. The forge's reply when the task is
    /// final already; `None` when the final is still to be forwarded.
    async fn final_at_forge(
        &self,
        view: &AssignmentView,
        request: &UpdateTaskRequest,
    ) -> Result<Option<UpdateTaskResponse>, RpcError> {
        bump(&self.counters.forwarded_calls);
        let reply = jr_forge::report::heartbeat(
            &self.forge_of(view)?,
            view.forge_task_id,
            request.outputs.clone(),
        )
        .await
        .map_err(|err| self.forge_failed(&err))?;
        let replied = reply.state.as_ref().map_or(0, |s| s.result);
        Ok(jr_forge::report::final_result(replied).map(|_| reply))
    }

    /// Records the `terminal` of a final the forge accepted, trying again for a while when the
    /// ledger does not answer (a stream leader being elected), so the executor seldom has to
    /// retry. When it still fails, the executor is asked to retry; its retry is answered from
    /// the accepted final kept in `progress`, never forwarded again.
    async fn record_terminal(
        &self,
        view: &AssignmentView,
        progress: &mut Progress,
        requested: i32,
        replied: i32,
    ) -> Result<(), RpcError> {
        let FollowUp::Terminal { result, log_closed } =
            progress.after_update_task(requested, replied)
        else {
            return Ok(());
        };
        let terminal = Terminal {
            forge_task_id: view.forge_task_id,
            result,
            source: TerminalSource::Executor,
            log_closed,
            reason: None,
        };
        let deadline = tokio::time::Instant::now() + TERMINAL_RECORD_WAIT;
        let mut pause = std::time::Duration::from_millis(100);
        loop {
            match self.ledger.publish_terminal(view, terminal.clone()).await {
                Ok(created) => {
                    if created {
                        bump(&self.counters.terminals_published);
                    }
                    progress.terminal_recorded(requested, log_closed);
                    tracing::debug!(assignment = %view.id, ?result, log_closed, created, "task terminal");
                    return Ok(());
                }
                Err(err) => {
                    bump(&self.counters.ledger_errors);
                    if tokio::time::Instant::now() + pause > deadline {
                        tracing::warn!(assignment = %view.id, error = %err, "publishing terminal failed; the executor retries and its retry is answered here");
                        return Err(RpcError::new(
                            Code::Unavailable,
                            "recording the final state failed; retry",
                        ));
                    }
                    tracing::info!(assignment = %view.id, error = %err, retry_in = ?pause, "publishing terminal failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(2));
                }
            }
        }
    }

    /// Forgejo's job summary: checked like the other reports, forwarded unchanged.
    async fn update_job_summary(
        &self,
        auth: Result<Authenticated, AuthFailure>,
        request: UpdateJobSummaryRequest,
    ) -> Result<UpdateJobSummaryResponse, RpcError> {
        let view = self.reporting_caller(auth, request.task_id).await?;
        bump(&self.counters.forwarded_calls);
        self.forge_of(&view)?
            .call(
                jr_forge::wire::RUNNER_SERVICE,
                "UpdateJobSummary",
                &request,
                true,
            )
            .await
            .map_err(|err| self.forge_failed(&err))
    }

    async fn update_log(
        &self,
        auth: Result<Authenticated, AuthFailure>,
        request: UpdateLogRequest,
    ) -> Result<UpdateLogResponse, RpcError> {
        let view = self.reporting_caller(auth, request.task_id).await?;
        let progress = self.progress_of(view.id);
        let mut progress = progress.lock().await;
        progress.sync(view.attempt, view.terminal);
        if !(view.claimed || progress.claimed_here) {
            return Err(self.not_claimed());
        }
        let rows = request.rows.len();
        if let Admission::Refuse(why) = progress.admit_update_log(request.index, rows) {
            return Err(self.after_terminal(why));
        }
        bump(&self.counters.forwarded_calls);
        let reply = self
            .forge_of(&view)?
            .update_log(&request)
            .await
            .map_err(|err| self.forge_failed(&err))?;
        progress.reported = true;
        if progress.after_update_log(request.index, rows, request.no_more, reply.ack_index)
            == FollowUp::ExecutorFinished
        {
            match self.ledger.publish_executor_finished(&view).await {
                Ok(()) => {
                    bump(&self.counters.executor_finished_published);
                    progress.finish_reported = true;
                    tracing::debug!(assignment = %view.id, "executor finished reporting");
                }
                Err(err) => {
                    bump(&self.counters.ledger_errors);
                    tracing::warn!(assignment = %view.id, error = %err, "publishing executor-finished failed");
                    return Err(RpcError::new(
                        Code::Unavailable,
                        "recording the closed log failed; retry",
                    ));
                }
            }
        }
        Ok(reply)
    }
}

/// A body-less 404 (what Gitea answers for unknown paths).
pub(crate) fn not_found() -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}
