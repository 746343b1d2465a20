//! What a GitHub runner workload asks the facade for: its attempt's JIT runner config, sealed
//! in the assignment so that only this executor, with its own credentials, can have it in the
//! clear (the config registers a runner with GitHub; nothing on the bus can).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use jr_forge::Code;

use super::auth::{AuthFailure, Authenticated, Caller, ClientIdentity, Need};
use super::rpc::{RpcError, auth_error, not_visible_yet};
use super::stats::bump;
use super::{Facade, Ledger};
use jr_seal::SealScope;

/// `POST` with the executor's credentials (as for the RunnerService); answers
/// `{"runner_name": …, "jit_config": …}`.
pub(crate) const RUNNER_CONFIG_PATH: &str = "/jetrunner/github/v1/runner-config";

pub(crate) async fn runner_config<L: Ledger>(
    State(facade): State<Arc<Facade<L>>>,
    request: Request,
) -> Response {
    let (parts, _) = request.into_parts();
    let caller = Caller::from_request(&parts.headers, parts.extensions.get::<ClientIdentity>());
    let view = match facade.authenticate(&caller, Need::Progress).await {
        Err(refused @ AuthFailure::Refused(_)) => return auth_error(refused).into_response(),
        Err(unavailable) => return auth_error(unavailable).into_response(),
        Ok(Authenticated::Pending) => return not_visible_yet().into_response(),
        Ok(Authenticated::Warm { .. }) => {
            return RpcError::new(
                Code::FailedPrecondition,
                "a warm executor has no runner config until it is bound",
            )
            .into_response();
        }
        Ok(Authenticated::Ready { view, executor }) => (view, executor),
    };
    let (view, executor) = view;
    if !facade.call_rate.admit(view.id, std::time::Instant::now()) {
        bump(&facade.counters.rate_limited);
        return RpcError::new(
            Code::ResourceExhausted,
            "too many calls for this assignment; slow down",
        )
        .into_response();
    }
    if view.terminal {
        return RpcError::new(Code::FailedPrecondition, "the job is over").into_response();
    }
    let opened = facade.settings.sealer.open(
        SealScope::new(view.id, &view.backend, view.forge_task_id),
        &view.sealed_task,
    );
    let task = match opened
        .map(|plain| serde_json::from_slice::<jr_protocol::RunnerRegistration>(&plain))
    {
        Ok(Ok(task)) => task,
        Ok(Err(_)) => {
            return RpcError::new(Code::NotFound, "not a GitHub assignment").into_response();
        }
        Err(err) => {
            tracing::error!(assignment = %view.id, error = %err, "cannot open sealed task");
            return RpcError::new(Code::Internal, "the assignment's task cannot be opened")
                .into_response();
        }
    };
    // The executor has its one-shot credential: the once-only claim, as a FetchTask that
    // hands out a Gitea task. A claim already there is this attempt's own (its executor asked
    // again after a lost answer); the reconciler's claim timeout stops at the first.
    if let Err(err) = facade.ledger.publish_claimed(&view, &executor).await {
        tracing::warn!(assignment = %view.id, error = %err, "publishing claimed failed; the executor asks again");
        return RpcError::new(Code::Unavailable, "the claim could not be recorded; retry")
            .into_response();
    }
    tracing::info!(assignment = %view.id, attempt = view.attempt, runner = %task.runner_name, "runner config handed out");
    let body = serde_json::json!({"runner_name": task.runner_name, "jit_config": task.jit_config});
    let mut response = (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response();
    // A secret: never kept by a cache on the way.
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
