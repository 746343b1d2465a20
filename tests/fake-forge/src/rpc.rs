//! Connect unary handlers for `/api/actions/…`: decode, fault plan, auth, state
//! call, encode or render the error in the active style.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use jr_forge::proto::{ping::v1 as ping, runner::v1 as pb};
use prost::Message;

use crate::error::{Code, ConnectErrorBody, ErrorStyle, RpcError};
use crate::faults::{DropMode, FaultAction, Rpc};
use crate::server::Shared;
use crate::state::{FetchCall, State};

/// A withheld reply is released after this long at the latest (or at shutdown).
const HANG_LIMIT: Duration = Duration::from_secs(600);

type Ctx = AxumState<Arc<Shared>>;

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route(Rpc::Ping.path(), post(ping_rpc))
        .route(Rpc::Register.path(), post(register))
        .route(Rpc::Declare.path(), post(declare))
        .route(Rpc::FetchTask.path(), post(fetch_task))
        .route(Rpc::UpdateTask.path(), post(update_task))
        .route(Rpc::UpdateLog.path(), post(update_log))
}

async fn ping_rpc(AxumState(shared): Ctx, headers: HeaderMap, body: Bytes) -> Response {
    serve(
        &shared,
        Rpc::Ping,
        &headers,
        body,
        |_, _, req: ping::PingRequest, _| {
            Ok(ping::PingResponse {
                data: format!("Hello, {}!", req.data),
            })
        },
    )
    .await
}

async fn register(AxumState(shared): Ctx, headers: HeaderMap, body: Bytes) -> Response {
    serve(&shared, Rpc::Register, &headers, body, |s, _, req, now| {
        s.register(req, now)
    })
    .await
}

async fn declare(AxumState(shared): Ctx, headers: HeaderMap, body: Bytes) -> Response {
    let mut response = serve(
        &shared,
        Rpc::Declare,
        &headers,
        body,
        |s, caller, req, _| s.declare(caller, req),
    )
    .await;
    let capabilities = shared.read(|s| s.behaviour.capabilities.clone());
    if response.status() == StatusCode::OK
        && let Some(value) = capabilities.and_then(|c| HeaderValue::from_str(&c).ok())
    {
        response
            .headers_mut()
            .insert("x-gitea-actions-capabilities", value);
    }
    response
}

async fn fetch_task(AxumState(shared): Ctx, headers: HeaderMap, body: Bytes) -> Response {
    let uuid = header_str(&headers, "x-runner-uuid").to_owned();
    let key = headers
        .get("x-runner-request-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // The call counts as in flight from its arrival, latency included, as on a real server.
    let (seq, key_locked) = shared.with_state(|s| {
        let seq = s.fetch_begin(&uuid);
        let locked = key.as_deref().is_some_and(|k| !s.key_begin(&uuid, k));
        (seq, locked)
    });
    let call = FetchCall {
        seq,
        request_key: key.as_deref(),
        key_locked,
    };
    let response = serve(
        &shared,
        Rpc::FetchTask,
        &headers,
        body,
        |s, caller, req, now| s.fetch_task(caller, req, call, now),
    )
    .await;
    shared.with_state(|s| {
        s.fetch_end(&uuid, seq);
        if let Some(k) = key.as_deref()
            && !key_locked
        {
            s.key_end(&uuid, k);
        }
    });
    response
}

async fn update_task(AxumState(shared): Ctx, headers: HeaderMap, body: Bytes) -> Response {
    serve(
        &shared,
        Rpc::UpdateTask,
        &headers,
        body,
        |s, caller, req, now| s.update_task(caller, req, now),
    )
    .await
}

async fn update_log(AxumState(shared): Ctx, headers: HeaderMap, body: Bytes) -> Response {
    serve(
        &shared,
        Rpc::UpdateLog,
        &headers,
        body,
        |s, caller, req: pb::UpdateLogRequest, _| s.update_log(caller, req),
    )
    .await
}

fn is_proto(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| matches!(v.trim(), "application/proto" | "application/protobuf"))
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

fn error_response(status: StatusCode, body: &ConnectErrorBody) -> Response {
    let json = serde_json::to_vec(body).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], json).into_response()
}

fn injected_error(style: ErrorStyle) -> Response {
    let code = match style {
        ErrorStyle::Gitea => Code::Unknown,
        ErrorStyle::Forgejo => Code::Internal,
    };
    let body = ConnectErrorBody {
        code: code.as_str().to_owned(),
        message: "injected fault".to_owned(),
    };
    error_response(StatusCode::INTERNAL_SERVER_ERROR, &body)
}

async fn withhold(shared: &Shared, mode: DropMode) -> Response {
    match mode {
        DropMode::Hang => {
            tokio::select! {
                () = shared.shutdown.cancelled() => {}
                () = tokio::time::sleep(HANG_LIMIT) => {}
            }
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        DropMode::Abort => {
            // An erroring body makes hyper cut the connection, so the client never gets a message.
            let broken = futures::stream::once(async {
                Err::<Bytes, std::io::Error>(std::io::Error::other("dropped reply"))
            });
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/proto")],
                Body::from_stream(broken),
            )
                .into_response()
        }
    }
}

/// One unary call. The handler runs under the state lock together with auth, so an RPC is atomic.
async fn serve<Req, Resp>(
    shared: &Shared,
    rpc: Rpc,
    headers: &HeaderMap,
    body: Bytes,
    handle: impl FnOnce(&mut State, &str, Req, SystemTime) -> Result<Resp, RpcError>,
) -> Response
where
    Req: Message + Default,
    Resp: Message,
{
    if !is_proto(headers) {
        return (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "only application/proto is supported",
        )
            .into_response();
    }
    let plan = shared.fault_plan(rpc);
    if !plan.latency.is_zero() {
        tokio::time::sleep(plan.latency).await;
    }
    if plan.action == FaultAction::Error {
        let style = shared.with_state(|s| {
            s.faults.injected_errors += 1;
            s.behaviour.error_style
        });
        tracing::debug!(?rpc, "injected error");
        return injected_error(style);
    }
    let now = shared.now();
    let (outcome, style) = shared.with_state(|s| {
        let outcome = Req::decode(body)
            .map_err(|e| RpcError::invalid_argument(format!("decode request: {e}")))
            .and_then(|req| {
                let caller = match rpc {
                    Rpc::Ping | Rpc::Register => String::new(),
                    Rpc::Declare | Rpc::FetchTask | Rpc::UpdateTask | Rpc::UpdateLog => s
                        .authenticate(
                            header_str(headers, "x-runner-uuid"),
                            header_str(headers, "x-runner-token"),
                            rpc,
                            now,
                        )?,
                };
                handle(s, &caller, req, now)
            });
        if let FaultAction::Drop(_) = plan.action {
            s.faults.dropped_replies += 1;
        }
        (outcome, s.behaviour.error_style)
    });
    if let FaultAction::Drop(mode) = plan.action {
        tracing::debug!(?rpc, "reply dropped after processing");
        return withhold(shared, mode).await;
    }
    match outcome {
        Ok(reply) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/proto")],
            reply.encode_to_vec(),
        )
            .into_response(),
        Err(err) => {
            let (status, body) = err.render(style);
            error_response(status, &body)
        }
    }
}
