//! Message sessions, the long-polled queue and acquiring jobs.

#![allow(
    clippy::result_large_err,
    reason = "a check that fails returns the HTTP answer itself; its size does not matter in a fake"
)]

use super::handlers::{St, scale_set_json};
use super::*;

pub(super) fn session_json(set: &ScaleSet, session: &Session, world: &World) -> Value {
    json!({
        "sessionId": session.id,
        "ownerName": session.owner,
        "runnerScaleSet": scale_set_json(set, world),
        "messageQueueUrl": format!("{{base}}/actions-service/_apis/runtime/runnerscalesets/{}/messages?sessionId={}", set.id, session.id),
        "messageQueueAccessToken": session.queue_token,
        "statistics": world.statistics(set.id),
    })
}

pub(super) async fn create_session(
    State(s): St,
    Path(id): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let response = create_session_now(&s, id, &q, &headers, &body);
    with_base(response, &s.base).await
}

pub(super) fn create_session_now(
    s: &Shared,
    id: i64,
    q: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    if let Err(r) = s.admitted(Route::CreateSession, headers, q) {
        return r;
    }
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let owner = request
        .get("ownerName")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let mut world = lock(&s.world);
    let response = match world.scale_sets.get(&id).map(|set| set.session.is_some()) {
        None => exception(
            StatusCode::NOT_FOUND,
            "RunnerScaleSetNotFoundException",
            "no such scale set",
        ),
        Some(true) => exception(
            StatusCode::CONFLICT,
            "RunnerScaleSetSessionConflictException",
            &format!("The actions runner scaleset {id} already has an active session."),
        ),
        Some(false) if owner.is_empty() => exception(
            StatusCode::BAD_REQUEST,
            "ArgumentException",
            "ownerName is required",
        ),
        Some(false) => {
            let session = Session {
                id: uuid::Uuid::new_v4().to_string(),
                owner,
                queue_token: jwt(unix_now() + 3600),
            };
            if let Some(set) = world.scale_sets.get_mut(&id) {
                set.session = Some(session);
            }
            let set = world.scale_sets.get(&id).cloned();
            match set.as_ref().and_then(|set| {
                set.session
                    .as_ref()
                    .map(|sess| session_json(set, sess, &world))
            }) {
                Some(body) => json_reply(StatusCode::OK, &body),
                None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            }
        }
    };
    drop(world);
    s.record(Route::CreateSession, response)
}

/// Fills the `{base}` placeholder of a JSON answer with the server's address.
pub(super) async fn with_base(response: Response, base: &str) -> Response {
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let text = String::from_utf8_lossy(&bytes).replace("{base}", base);
    Response::from_parts(parts, axum::body::Body::from(text))
}

pub(super) fn session_matches(world: &World, id: i64, sid: &str) -> Result<(), Response> {
    match world.scale_sets.get(&id) {
        None => Err(exception(
            StatusCode::NOT_FOUND,
            "RunnerScaleSetNotFoundException",
            "no such scale set",
        )),
        Some(set) if set.session.as_ref().is_some_and(|s| s.id == sid) => Ok(()),
        Some(_) => Err(exception(
            StatusCode::BAD_REQUEST,
            "RunnerScaleSetSessionExpiredException",
            &format!("The session identifier {sid} is not valid."),
        )),
    }
}

pub(super) async fn refresh_session(
    State(s): St,
    Path((id, sid)): Path<(i64, String)>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    let response = refresh_session_now(&s, id, &sid, &q, &headers);
    with_base(response, &s.base).await
}

pub(super) fn refresh_session_now(
    s: &Shared,
    id: i64,
    sid: &str,
    q: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Response {
    if let Some(r) = s.fault(Route::RefreshSession) {
        if r.status() == StatusCode::NOT_FOUND {
            // Evicted: the session is gone on the service's side too.
            if let Some(set) = lock(&s.world).scale_sets.get_mut(&id) {
                set.session = None;
            }
        }
        return s.record(Route::RefreshSession, r);
    }
    if let Err(r) = s.admin_ok(headers, q) {
        return s.record(Route::RefreshSession, r);
    }
    let mut world = lock(&s.world);
    let response = match session_matches(&world, id, sid) {
        Err(r) => r,
        Ok(()) => {
            if let Some(session) = world
                .scale_sets
                .get_mut(&id)
                .and_then(|set| set.session.as_mut())
            {
                session.queue_token = jwt(unix_now() + 3600);
            }
            let set = world.scale_sets.get(&id).cloned();
            match set.as_ref().and_then(|set| {
                set.session
                    .as_ref()
                    .map(|sess| session_json(set, sess, &world))
            }) {
                Some(body) => json_reply(StatusCode::OK, &body),
                None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            }
        }
    };
    drop(world);
    s.record(Route::RefreshSession, response)
}

pub(super) async fn delete_session(
    State(s): St,
    Path((id, sid)): Path<(i64, String)>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = s.admitted(Route::DeleteSession, &headers, &q) {
        return r;
    }
    let mut world = lock(&s.world);
    let response = match session_matches(&world, id, &sid) {
        Err(r) => r,
        Ok(()) => {
            if let Some(set) = world.scale_sets.get_mut(&id) {
                set.session = None;
            }
            StatusCode::NO_CONTENT.into_response()
        }
    };
    drop(world);
    s.changed.notify_waiters();
    s.record(Route::DeleteSession, response)
}

pub(super) async fn get_message(
    State(s): St,
    Path(id): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = s.fault(Route::GetMessage) {
        return s.record(Route::GetMessage, r);
    }
    if let Err(r) = s.queue_ok(&headers, id) {
        return s.record(Route::GetMessage, r);
    }
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !accept.contains("api-version=6.0-preview") {
        return s.record(
            Route::GetMessage,
            exception(
                StatusCode::BAD_REQUEST,
                "VssInvalidApiVersionException",
                "Accept must carry api-version=6.0-preview",
            ),
        );
    }
    if q.get("sessionId")
        .is_none_or(|sid| session_matches(&lock(&s.world), id, sid).is_err())
    {
        return s.record(
            Route::GetMessage,
            exception(
                StatusCode::BAD_REQUEST,
                "RunnerScaleSetSessionExpiredException",
                "session not valid",
            ),
        );
    }
    let last: i64 = q
        .get("lastMessageId")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    let capacity: Option<u64> = headers
        .get("x-scalesetmaxcapacity")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    {
        let mut world = lock(&s.world);
        if let Some(set) = world.scale_sets.get_mut(&id) {
            set.max_capacity = capacity;
        }
        // More capacity may let queued jobs be assigned.
        world.route_queued();
    }
    let hold = *lock(&s.poll_hold);
    let deadline = tokio::time::Instant::now() + hold;
    loop {
        let waiting = s.changed.notified();
        let found = {
            let mut world = lock(&s.world);
            world
                .next_message(id, last)
                .map(|m| (m, world.statistics(id)))
        };
        if let Some((message, statistics)) = found {
            let body = json!({
                "messageId": message.id,
                "messageType": "RunnerScaleSetJobMessages",
                "body": Value::Array(message.body).to_string(),
                "statistics": statistics,
            });
            return s.record(Route::GetMessage, json_reply(StatusCode::OK, &body));
        }
        if tokio::time::timeout_at(deadline, waiting).await.is_err() {
            return s.record(Route::GetMessage, StatusCode::ACCEPTED.into_response());
        }
        // The session may have gone while the poll was held.
        if s.queue_ok(&headers, id).is_err() {
            return s.record(
                Route::GetMessage,
                exception(
                    StatusCode::UNAUTHORIZED,
                    "VssUnauthorizedException",
                    "queue token invalid or expired",
                ),
            );
        }
    }
}

pub(super) async fn delete_message(
    State(s): St,
    Path((id, mid)): Path<(i64, i64)>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = s.fault(Route::DeleteMessage) {
        return s.record(Route::DeleteMessage, r);
    }
    if let Err(r) = s.queue_ok(&headers, id) {
        return s.record(Route::DeleteMessage, r);
    }
    let deleted = lock(&s.world).delete_message(id, mid);
    let response = if deleted {
        StatusCode::NO_CONTENT.into_response()
    } else {
        exception(
            StatusCode::NOT_FOUND,
            "MessageNotFoundException",
            "no such message",
        )
    };
    s.record(Route::DeleteMessage, response)
}

pub(super) async fn acquire_jobs(
    State(s): St,
    Path(id): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(r) = s.fault(Route::AcquireJobs) {
        return s.record(Route::AcquireJobs, r);
    }
    if q.get("api-version").map(String::as_str) != Some("6.0-preview") {
        return s.record(
            Route::AcquireJobs,
            exception(
                StatusCode::BAD_REQUEST,
                "VssInvalidApiVersionException",
                "api-version=6.0-preview is required",
            ),
        );
    }
    if let Err(r) = s.queue_ok(&headers, id) {
        return s.record(Route::AcquireJobs, r);
    }
    let Ok(ids) = serde_json::from_slice::<Vec<i64>>(&body) else {
        return s.record(
            Route::AcquireJobs,
            exception(
                StatusCode::BAD_REQUEST,
                "ArgumentException",
                "body must be an array of runner request ids",
            ),
        );
    };
    let granted = lock(&s.world).acquire(id, &ids);
    s.changed.notify_waiters();
    s.record(
        Route::AcquireJobs,
        json_reply(
            StatusCode::OK,
            &json!({"count": granted.len(), "value": granted}),
        ),
    )
}
