//! Routes and handlers, mounted at `/` and `/v1` like the real server.
#![expect(
    clippy::result_large_err,
    reason = "validation returns ready-made error responses; size does not matter here"
)]

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::create::create;
use crate::wire::{error, parse_query, parse_query_strict, sandbox_json, timestamp, validation};
use crate::{Entry, ListRequest, Shared};

pub(crate) type AppState = State<Arc<Shared>>;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let api = Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(get_one).delete(delete_one))
        .route("/sandboxes/{id}/renew-expiration", post(renew))
        .route_layer(middleware::from_fn_with_state(shared.clone(), auth));
    Router::new()
        .merge(api.clone())
        .nest("/v1", api)
        .route(
            "/health",
            get(|| async { axum::Json(json!({ "status": "healthy" })) }),
        )
        .route(
            "/version",
            get(|| async { axum::Json(json!({ "version": "1.1.1" })) }),
        )
        .layer(middleware::from_fn_with_state(
            shared.clone(),
            faults_and_request_id,
        ))
        .with_state(shared)
}

async fn faults_and_request_id(State(shared): AppState, request: Request, next: Next) -> Response {
    let request_id = request
        .headers()
        .get("x-request-id")
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().simple().to_string())
                .unwrap_or(HeaderValue::from_static("0"))
        });
    let mut response = if shared.outage.load(Ordering::SeqCst) {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "GENERAL::SERVICE_UNAVAILABLE",
            "simulated outage",
        )
    } else if rand::random_range(0..1_000_000) < shared.error_rate_ppm.load(Ordering::SeqCst) {
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "KUBERNETES::API_ERROR",
            "simulated Kubernetes API error",
        )
    } else {
        next.run(request).await
    };
    response.headers_mut().insert("x-request-id", request_id);
    response
}

async fn auth(State(shared): AppState, request: Request, next: Next) -> Response {
    if let Some(expected) = &shared.config.api_key {
        match request.headers().get("open-sandbox-api-key") {
            None => {
                return error(
                    StatusCode::UNAUTHORIZED,
                    "MISSING_API_KEY",
                    "API key is required",
                );
            }
            Some(key) if key.as_bytes() != expected.as_bytes() => {
                return error(
                    StatusCode::UNAUTHORIZED,
                    "INVALID_API_KEY",
                    "API key is invalid",
                );
            }
            Some(_) => {}
        }
    }
    next.run(request).await
}

pub(crate) fn not_found(id: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "KUBERNETES::SANDBOX_NOT_FOUND",
        format!("sandbox {id} not found"),
    )
}

async fn get_one(State(shared): AppState, Path(id): Path<String>) -> Response {
    match shared.lock().sandboxes.get(&id) {
        Some(entry) => axum::Json(sandbox_json(&entry.sandbox)).into_response(),
        None => not_found(&id),
    }
}

async fn delete_one(State(shared): AppState, Path(id): Path<String>) -> Response {
    match shared.lock().sandboxes.get_mut(&id) {
        Some(entry) => {
            entry.stop(shared.config.stopping_for);
            StatusCode::NO_CONTENT.into_response()
        }
        None => not_found(&id),
    }
}

fn int_param(
    name: &str,
    raw: Option<&String>,
    default: u32,
    max: Option<u32>,
) -> Result<u32, Response> {
    let Some(raw) = raw else { return Ok(default) };
    let value: i64 = raw.parse().map_err(|_| {
        validation(
            "int_parsing",
            &["query", name],
            "Input should be a valid integer, unable to parse string as an integer",
            json!(raw),
            None,
        )
    })?;
    if value < 1 {
        return Err(validation(
            "greater_than_equal",
            &["query", name],
            "Input should be greater than or equal to 1",
            json!(raw),
            Some(json!({ "ge": 1 })),
        ));
    }
    if let Some(max) = max.filter(|max| value > i64::from(*max)) {
        return Err(validation(
            "less_than_equal",
            &["query", name],
            &format!("Input should be less than or equal to {max}"),
            json!(raw),
            Some(json!({ "le": max })),
        ));
    }
    u32::try_from(value).map_err(|_| {
        validation(
            "less_than_equal",
            &["query", name],
            "Input is too large",
            json!(raw),
            None,
        )
    })
}

async fn list(State(shared): AppState, RawQuery(query): RawQuery) -> Response {
    let params = parse_query(query.as_deref().unwrap_or_default());
    let last = |name: &str| params.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v);
    let states: Vec<String> = params
        .iter()
        .filter(|(k, _)| k == "state")
        .map(|(_, v)| v.to_ascii_lowercase())
        .collect();
    let metadata = match last("metadata").map(|m| parse_query_strict(m)).transpose() {
        Ok(filter) => filter.unwrap_or_default(),
        Err(problem) => return error(StatusCode::BAD_REQUEST, "INVALID_METADATA_FORMAT", problem),
    };
    let (page, page_size) = match (
        int_param("page", last("page"), 1, None),
        int_param("pageSize", last("pageSize"), 20, Some(200)),
    ) {
        (Ok(page), Ok(size)) => (page, size),
        (Err(response), _) | (_, Err(response)) => return response,
    };
    let mut state = shared.lock();
    state.list_requests.push(ListRequest {
        page,
        page_size,
        metadata: metadata.clone(),
        states: states.clone(),
    });
    let mut matching: Vec<&Entry> = state
        .sandboxes
        .values()
        .filter(|e| {
            states.is_empty() || states.contains(&e.sandbox.state.as_str().to_ascii_lowercase())
        })
        .filter(|e| {
            metadata
                .iter()
                .all(|(k, v)| e.sandbox.metadata.get(k) == Some(v))
        })
        .collect();
    // createdAt descending (second precision, as the CR reports it), ties in a stable order.
    matching.sort_by_key(|e| std::cmp::Reverse((e.sandbox.created_at.unix_timestamp(), e.seq)));
    let total = matching.len();
    let size = page_size as usize;
    let total_pages = total.div_ceil(size);
    let items: Vec<Value> = matching
        .iter()
        .skip((page as usize - 1).saturating_mul(size))
        .take(size)
        .map(|e| sandbox_json(&e.sandbox))
        .collect();
    axum::Json(json!({
        "items": items,
        "pagination": {
            "page": page, "pageSize": page_size, "totalItems": total, "totalPages": total_pages,
            "hasNextPage": (page as usize) < total_pages,
        }
    }))
    .into_response()
}

async fn renew(State(shared): AppState, Path(id): Path<String>, body: Bytes) -> Response {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => {
            return validation(
                "json_invalid",
                &["body"],
                "JSON decode error",
                json!({}),
                Some(json!({ "error": e.to_string() })),
            );
        }
    };
    if let Some(extra) = value
        .as_object()
        .and_then(|o| o.keys().find(|k| *k != "expiresAt"))
    {
        return validation(
            "extra_forbidden",
            &["body", extra],
            "Extra inputs are not permitted",
            value[extra].clone(),
            None,
        );
    }
    let Some(raw) = value.get("expiresAt").and_then(Value::as_str) else {
        return validation(
            "missing",
            &["body", "expiresAt"],
            "Field required",
            value,
            None,
        );
    };
    let Ok(requested) = OffsetDateTime::parse(raw, &Rfc3339) else {
        return validation(
            "datetime_from_date_parsing",
            &["body", "expiresAt"],
            "Input should be a valid datetime",
            json!(raw),
            None,
        );
    };
    let now = OffsetDateTime::now_utc();
    let mut state = shared.lock();
    let Some(entry) = state.sandboxes.get_mut(&id) else {
        return not_found(&id);
    };
    if entry.sandbox.expires_at.is_none() {
        return error(
            StatusCode::CONFLICT,
            "KUBERNETES::INVALID_STATE",
            "sandbox has no expiration to renew",
        );
    }
    if requested <= now {
        return error(
            StatusCode::BAD_REQUEST,
            "DOCKER::INVALID_EXPIRATION",
            "new expiration must be in the future",
        );
    }
    let granted = shared
        .config
        .max_timeout
        .map_or(requested, |max| requested.min(now + max));
    entry.sandbox.expires_at = Some(granted);
    axum::Json(json!({ "expiresAt": timestamp(granted) })).into_response()
}
