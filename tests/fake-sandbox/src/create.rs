//! `POST /sandboxes`: schema validation (422 / 400 as the server gives them), then the create
//! itself, which blocks until the sandbox is Running like the Kubernetes runtime does.
#![expect(
    clippy::result_large_err,
    reason = "validation returns ready-made error responses; size does not matter here"
)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use time::OffsetDateTime;
use tokio::time::Instant;

use crate::server::AppState;
use crate::wire::{create_response_json, error, label_problem, validation, with_retry_after};
use crate::{CreatedSandbox, Entry, SandboxRun, SandboxSnapshot, SandboxState, Shared};

/// A create request after schema validation.
struct CreateRequest {
    pool: Option<String>,
    image: Option<String>,
    timeout: Option<u64>,
    metadata: BTreeMap<String, String>,
    env: BTreeMap<String, String>,
    entrypoint: Option<Vec<String>>,
}

fn present<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn string_map(
    body: &Map<String, Value>,
    key: &str,
    allow_null: bool,
) -> Result<BTreeMap<String, String>, Response> {
    let Some(value) = present(body, key) else {
        return Ok(BTreeMap::new());
    };
    let Some(object) = value.as_object() else {
        return Err(validation(
            "dict_type",
            &["body", key],
            "Input should be a valid dictionary",
            value.clone(),
            None,
        ));
    };
    let mut map = BTreeMap::new();
    for (k, v) in object {
        match v {
            Value::String(s) => {
                map.insert(k.clone(), s.clone());
            }
            Value::Null if allow_null => {}
            other => {
                return Err(validation(
                    "string_type",
                    &["body", key, k],
                    "Input should be a valid string",
                    other.clone(),
                    None,
                ));
            }
        }
    }
    Ok(map)
}

fn parse_create(body: &Bytes) -> Result<CreateRequest, Response> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        validation(
            "json_invalid",
            &["body"],
            "JSON decode error",
            json!({}),
            Some(json!({ "error": e.to_string() })),
        )
    })?;
    let Some(body) = value.as_object() else {
        return Err(validation(
            "model_attributes_type",
            &["body"],
            "Input should be a valid dictionary or object",
            value,
            None,
        ));
    };
    let timeout = match present(body, "timeout") {
        None => None,
        Some(t) => match t.as_u64() {
            Some(secs) if secs >= 60 => Some(secs),
            Some(_) => {
                return Err(validation(
                    "greater_than_equal",
                    &["body", "timeout"],
                    "Input should be greater than or equal to 60",
                    t.clone(),
                    Some(json!({ "ge": 60 })),
                ));
            }
            None if t.as_i64().is_some() => {
                return Err(validation(
                    "greater_than_equal",
                    &["body", "timeout"],
                    "Input should be greater than or equal to 60",
                    t.clone(),
                    Some(json!({ "ge": 60 })),
                ));
            }
            None => {
                return Err(validation(
                    "int_type",
                    &["body", "timeout"],
                    "Input should be a valid integer",
                    t.clone(),
                    None,
                ));
            }
        },
    };
    let metadata = string_map(body, "metadata", false)?;
    let env = string_map(body, "env", true)?;
    let extensions = string_map(body, "extensions", false)?;
    let entrypoint = match present(body, "entrypoint") {
        None => None,
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(validation(
                "too_short",
                &["body", "entrypoint"],
                "List should have at least 1 item after validation, not 0",
                json!([]),
                Some(json!({ "min_length": 1 })),
            ));
        }
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .map(|i| i.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    validation(
                        "string_type",
                        &["body", "entrypoint"],
                        "Input should be a valid string",
                        Value::Array(items.clone()),
                        None,
                    )
                })?,
        ),
        Some(other) => {
            return Err(validation(
                "list_type",
                &["body", "entrypoint"],
                "Input should be a valid list",
                other.clone(),
                None,
            ));
        }
    };
    let image = present(body, "image").map(|i| {
        i.get("uri")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    });
    let pool = extensions.get("poolRef").cloned();
    match &pool {
        Some(_) => {
            for forbidden in [
                "platform",
                "volumes",
                "networkPolicy",
                "credentialProxy",
                "lifecycle",
                "snapshotId",
            ] {
                if present(body, forbidden).is_some() {
                    return Err(error(
                        StatusCode::BAD_REQUEST,
                        "SANDBOX::INVALID_PARAMETER",
                        format!("{forbidden} is not supported together with extensions.poolRef"),
                    ));
                }
            }
        }
        None => {
            if image.is_some() == present(body, "snapshotId").is_some() {
                return Err(validation(
                    "value_error",
                    &["body"],
                    "Value error, Exactly one of image or snapshotId must be provided.",
                    Value::Object(body.clone()),
                    Some(json!({ "error": {} })),
                ));
            }
            if image.is_none() {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "SANDBOX::INVALID_PARAMETER",
                    "snapshots are not simulated",
                ));
            }
            if entrypoint.is_none() || present(body, "resourceLimits").is_none() {
                return Err(validation(
                    "value_error",
                    &["body"],
                    "Value error, entrypoint and resourceLimits are required with image.",
                    Value::Object(body.clone()),
                    Some(json!({ "error": {} })),
                ));
            }
        }
    }
    if env.contains_key("OPENSANDBOX_LIFECYCLE") {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "SANDBOX::INVALID_PARAMETER",
            "env key OPENSANDBOX_LIFECYCLE is reserved",
        ));
    }
    if let Some(problem) = metadata.iter().find_map(|(k, v)| label_problem(k, v)) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "SANDBOX::INVALID_METADATA_LABEL",
            problem,
        ));
    }
    Ok(CreateRequest {
        pool,
        image,
        timeout,
        metadata,
        env,
        entrypoint,
    })
}

pub(crate) async fn create(State(shared): AppState, body: Bytes) -> Response {
    let request = match parse_create(&body) {
        Ok(request) => request,
        Err(response) => return response,
    };
    // Like the real server, a create goes on when the client hangs up; the handler only waits.
    match tokio::spawn(create_flow(shared, request)).await {
        Ok(response) => response,
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "GENERAL::UNKNOWN_ERROR",
            e.to_string(),
        ),
    }
}

async fn create_flow(shared: Arc<Shared>, request: CreateRequest) -> Response {
    let config = &shared.config;
    let now = OffsetDateTime::now_utc();
    let pool = match request.pool.as_deref() {
        None => None,
        Some("*") => shared.lock().pools.keys().next().cloned(),
        Some(pool) if shared.lock().pools.contains_key(pool) => Some(pool.to_owned()),
        Some(pool) => {
            return error(
                StatusCode::NOT_FOUND,
                "KUBERNETES::POOL_NOT_FOUND",
                format!("pool {pool} not found"),
            );
        }
    };
    let ttl = request.timeout.map(|secs| {
        let ttl = Duration::from_secs(secs);
        config.max_timeout.map_or(ttl, |max| ttl.min(max))
    });
    let id = uuid::Uuid::new_v4().to_string();
    let mut env = request.env.clone();
    env.insert("OPENSANDBOX_ID".to_owned(), id.clone());
    {
        let mut state = shared.lock();
        if config
            .quota
            .is_some_and(|quota| state.sandboxes.len() >= quota)
        {
            return error(
                StatusCode::FORBIDDEN,
                "KUBERNETES::QUOTA_EXCEEDED",
                "exceeded quota: batchsandboxes",
            );
        }
        state.seq += 1;
        let seq = state.seq;
        state.created.push(CreatedSandbox {
            id: id.clone(),
            pool: pool.clone(),
            metadata: request.metadata.clone(),
            env: env.clone(),
            allocated: false,
        });
        let sandbox = SandboxSnapshot {
            id: id.clone(),
            pool: pool.clone(),
            image: request.image.clone(),
            state: SandboxState::Pending,
            reason: if pool.is_some() {
                "POOL_CAPACITY_EXHAUSTED"
            } else {
                "BATCHSANDBOX_PENDING"
            }
            .to_owned(),
            message: None,
            created_at: now,
            last_transition_at: now,
            expires_at: ttl.map(|ttl| now + ttl),
            metadata: request.metadata.clone(),
            env: env.clone(),
            entrypoint: request.entrypoint.clone(),
        };
        state.sandboxes.insert(
            id.clone(),
            Entry {
                sandbox,
                seq,
                allocated: false,
                remove_at: None,
                run: None,
            },
        );
        state.note_held();
    }

    // The CR exists (Pending) while it waits for a pool slot.
    if let Some(pool) = &pool {
        let deadline = Instant::now() + config.pool_acquisition_timeout;
        loop {
            let freed = shared.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match try_allocate(&shared, &id, pool) {
                Allocation::Done => break,
                Allocation::Vanished => return deleted_during_create(&id),
                Allocation::Full => {}
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                if let Some(entry) = shared.lock().sandboxes.get_mut(&id) {
                    entry.stop(config.stopping_for);
                }
                let retry_after = config.pool_acquisition_timeout.as_secs_f64().ceil();
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "a small positive number of seconds"
                )]
                let retry_after = retry_after as u64;
                return with_retry_after(
                    error(
                        StatusCode::TOO_MANY_REQUESTS,
                        "KUBERNETES::POOL_CAPACITY_EXHAUSTED",
                        format!("pool {pool} has no idle sandbox within {retry_after} s"),
                    ),
                    retry_after,
                );
            }
        }
    } else {
        let mut state = shared.lock();
        if let Some(entry) = state.sandboxes.get_mut(&id) {
            entry.allocated = true;
        }
        state.note_held();
    }

    tokio::time::sleep(config.ready_after).await;
    let ready_timeout = shared
        .ready_timeouts
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    let created = {
        let mut state = shared.lock();
        let Some(entry) = state.sandboxes.get_mut(&id) else {
            return deleted_during_create(&id);
        };
        if ready_timeout {
            entry.stop(config.stopping_for);
            return error(
                StatusCode::GATEWAY_TIMEOUT,
                "KUBERNETES::POD_READY_TIMEOUT",
                format!("sandbox {id} was not ready in time"),
            );
        }
        if entry.sandbox.state != SandboxState::Pending {
            return deleted_during_create(&id);
        }
        entry.transition(SandboxState::Running, "POD_READY_WITH_IP");
        entry.sandbox.clone()
    };
    if let Some(runner) = &config.runner {
        // Started outside the lock: the callback may call back into the fake.
        let run = SandboxRun {
            id: id.clone(),
            env: env.clone(),
            metadata: request.metadata.clone(),
        };
        let handle = tokio::spawn(runner(run)).abort_handle();
        match shared.lock().sandboxes.get_mut(&id) {
            Some(entry) if entry.sandbox.state == SandboxState::Running => entry.run = Some(handle),
            _ => handle.abort(),
        }
    }

    let delay = shared.create_reply_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    (
        StatusCode::ACCEPTED,
        axum::Json(create_response_json(&created)),
    )
        .into_response()
}

enum Allocation {
    Done,
    Full,
    Vanished,
}

fn try_allocate(shared: &Shared, id: &str, pool: &str) -> Allocation {
    let mut state = shared.lock();
    let capacity = state.pools.get(pool).copied().unwrap_or(0);
    let used = state.allocated_in(pool);
    let Some(entry) = state.sandboxes.get_mut(id) else {
        return Allocation::Vanished;
    };
    if entry.sandbox.state != SandboxState::Pending {
        return Allocation::Vanished;
    }
    if used >= capacity {
        return Allocation::Full;
    }
    entry.allocated = true;
    entry.sandbox.reason = "POD_SCHEDULED".to_owned();
    let live = state.allocated_total();
    state.max_live = state.max_live.max(live);
    state.note_held();
    if let Some(record) = state.created.iter_mut().rev().find(|c| c.id == id) {
        record.allocated = true;
    }
    Allocation::Done
}

fn deleted_during_create(id: &str) -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "KUBERNETES::API_ERROR",
        format!("sandbox {id} was deleted during create"),
    )
}
