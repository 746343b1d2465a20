//! `/_fake/…`: what an `actions/runner` started with a JIT config does (start, poll, finish),
//! and queuing or cancelling jobs, over HTTP for executors and tools in other processes.

use serde::Deserialize;

use super::*;

pub(super) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/_fake/runner/start", post(start))
        .route("/_fake/runner/{id}/poll", post(poll))
        .route("/_fake/runner/{id}/finish", post(finish))
        .route("/_fake/jobs", post(enqueue))
        .route("/_fake/jobs/{id}", get(job))
        .route("/_fake/jobs/{id}/cancel", post(cancel))
}

type St = State<Arc<Shared>>;

fn conflict(why: &str) -> Response {
    json_reply(StatusCode::CONFLICT, &json!({"message": why}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Start {
    jitconfig: String,
}

async fn start(State(s): St, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Start>(&body) else {
        return json_reply(
            StatusCode::BAD_REQUEST,
            &json!({"message": "body must be {\"jitconfig\": \"…\"}"}),
        );
    };
    match s.handle().start_runner(&request.jitconfig) {
        Ok((runner, job)) => json_reply(StatusCode::OK, &json!({"runner": runner, "job": job})),
        Err(why) => conflict(why),
    }
}

async fn poll(State(s): St, Path(id): Path<i64>) -> Response {
    json_reply(StatusCode::OK, &json!({"job": s.handle().poll_runner(id)}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Finish {
    result: String,
}

async fn finish(State(s): St, Path(id): Path<i64>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Finish>(&body) else {
        return json_reply(
            StatusCode::BAD_REQUEST,
            &json!({"message": "body must be {\"result\": \"…\"}"}),
        );
    };
    match s.handle().finish_runner(id, &request.result) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(why) => conflict(why),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Enqueue {
    #[serde(default = "acme")]
    owner: String,
    #[serde(default = "app")]
    repository: String,
    #[serde(default = "ci")]
    workflow_file: String,
    #[serde(default = "main")]
    git_ref: String,
    #[serde(default = "push")]
    event_name: String,
    labels: Vec<String>,
    #[serde(default = "build")]
    display_name: String,
    #[serde(default)]
    from_fork: bool,
}

fn acme() -> String {
    "acme".into()
}
fn app() -> String {
    "app".into()
}
fn ci() -> String {
    "ci.yml".into()
}
fn main() -> String {
    "refs/heads/main".into()
}
fn push() -> String {
    "push".into()
}
fn build() -> String {
    "build".into()
}

async fn enqueue(State(s): St, body: Bytes) -> Response {
    let request = match serde_json::from_slice::<Enqueue>(&body) {
        Ok(request) if !request.labels.is_empty() => request,
        Ok(_) => {
            return json_reply(
                StatusCode::BAD_REQUEST,
                &json!({"message": "labels must not be empty"}),
            );
        }
        Err(e) => return json_reply(StatusCode::BAD_REQUEST, &json!({"message": e.to_string()})),
    };
    let id = s.handle().enqueue(JobSpec {
        owner: request.owner,
        repository: request.repository,
        workflow_file: request.workflow_file,
        git_ref: request.git_ref,
        event_name: request.event_name,
        labels: request.labels,
        display_name: request.display_name,
        from_fork: request.from_fork,
    });
    json_reply(StatusCode::CREATED, &json!({"runner_request_id": id}))
}

async fn job(State(s): St, Path(id): Path<i64>) -> Response {
    match s.handle().job(id) {
        None => json_reply(StatusCode::NOT_FOUND, &json!({"message": "no such job"})),
        Some(job) => {
            let state = match job.state {
                JobState::Queued => json!({"state": "queued"}),
                JobState::Available { scale_set } => {
                    json!({"state": "available", "scale_set": scale_set})
                }
                JobState::Assigned { scale_set } => {
                    json!({"state": "assigned", "scale_set": scale_set})
                }
                JobState::Running { scale_set, runner } => {
                    json!({"state": "running", "scale_set": scale_set, "runner": runner})
                }
                JobState::Completed { result } => json!({"state": "completed", "result": result}),
            };
            json_reply(StatusCode::OK, &state)
        }
    }
}

async fn cancel(State(s): St, Path(id): Path<i64>) -> Response {
    if s.handle().job(id).is_none() {
        return json_reply(StatusCode::NOT_FOUND, &json!({"message": "no such job"}));
    }
    s.handle().cancel(id);
    StatusCode::NO_CONTENT.into_response()
}
