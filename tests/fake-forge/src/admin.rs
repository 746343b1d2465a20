//! JSON admin API under `/_fake/…` so the demo, the benchmark and other processes can drive
//! the fake (enqueue, cancel, faults, stats) without linking it.

use std::sync::Arc;

use axum::extract::{Path, State as AxumState};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::config::Behaviour;
use crate::faults::FaultConfig;
use crate::model::{JobId, JobSpec, ReapReport, Snapshot, Stats};
use crate::server::Shared;
use crate::state::State;

type Ctx = AxumState<Arc<Shared>>;

/// Body of `POST /_fake/jobs`: a `JobSpec` plus an optional `count` (default 1).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnqueueRequest {
    #[serde(flatten)]
    pub spec: JobSpec,
    #[serde(default)]
    pub count: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnqueueReply {
    pub job_ids: Vec<JobId>,
}

/// Reply of the cancel/rerun endpoints: whether anything changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangedReply {
    pub changed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenReply {
    pub token: String,
}

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/_fake/jobs", post(enqueue))
        .route("/_fake/jobs/{id}/cancel", post(cancel_job))
        .route("/_fake/jobs/{id}/rerun", post(rerun_job))
        .route("/_fake/tasks/{id}/cancel", post(cancel_task))
        .route("/_fake/stats", get(stats))
        .route("/_fake/snapshot", get(snapshot))
        .route(
            "/_fake/faults",
            get(get_faults).put(put_faults).post(put_faults),
        )
        .route(
            "/_fake/behaviour",
            get(get_behaviour).put(put_behaviour).post(put_behaviour),
        )
        .route("/_fake/registration-token", get(registration_token))
        .route("/_fake/registration-token/rotate", post(rotate_token))
        .route("/_fake/reap", post(reap))
}

async fn enqueue(AxumState(shared): Ctx, Json(req): Json<EnqueueRequest>) -> Json<EnqueueReply> {
    Json(EnqueueReply {
        job_ids: shared.enqueue(req.spec, req.count.unwrap_or(1)),
    })
}

async fn cancel_job(AxumState(shared): Ctx, Path(id): Path<u64>) -> Json<ChangedReply> {
    let now = shared.now();
    Json(ChangedReply {
        changed: shared.with_state(|s| s.cancel_job(JobId(id), now)),
    })
}

async fn rerun_job(AxumState(shared): Ctx, Path(id): Path<u64>) -> Json<ChangedReply> {
    let now = shared.now();
    Json(ChangedReply {
        changed: shared.with_state(|s| s.rerun(JobId(id), now)),
    })
}

async fn cancel_task(AxumState(shared): Ctx, Path(id): Path<i64>) -> Response {
    let now = shared.now();
    match shared.with_state(|s| s.has_task(id).then(|| s.cancel_task(id, now))) {
        Some(changed) => Json(ChangedReply { changed }).into_response(),
        None => (StatusCode::NOT_FOUND, format!("no task {id}")).into_response(),
    }
}

async fn stats(AxumState(shared): Ctx) -> Json<Stats> {
    Json(shared.read(State::stats))
}

async fn snapshot(AxumState(shared): Ctx) -> Json<Snapshot> {
    Json(shared.read(State::snapshot))
}

async fn get_faults(AxumState(shared): Ctx) -> Json<FaultConfig> {
    Json(shared.faults())
}

async fn put_faults(AxumState(shared): Ctx, Json(faults): Json<FaultConfig>) -> Json<FaultConfig> {
    shared.set_faults(faults);
    Json(shared.faults())
}

async fn get_behaviour(AxumState(shared): Ctx) -> Json<Behaviour> {
    Json(shared.read(|s| s.behaviour.clone()))
}

async fn put_behaviour(
    AxumState(shared): Ctx,
    Json(behaviour): Json<Behaviour>,
) -> Json<Behaviour> {
    shared.with_state(|s| s.behaviour = behaviour.clone());
    Json(behaviour)
}

async fn registration_token(AxumState(shared): Ctx) -> Json<TokenReply> {
    Json(TokenReply {
        token: shared.read(|s| s.registration_token().to_owned()),
    })
}

async fn rotate_token(AxumState(shared): Ctx) -> Json<TokenReply> {
    Json(TokenReply {
        token: shared.with_state(State::rotate_registration_token),
    })
}

async fn reap(AxumState(shared): Ctx) -> Json<ReapReport> {
    Json(shared.reap(shared.now()))
}
