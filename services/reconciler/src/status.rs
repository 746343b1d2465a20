//! Read-only status API (JSON) and a small status page over the projection.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use jr_bus::Bus;
use jr_protocol::{AssignmentId, STREAM_ASSIGNMENTS};
use jr_store::Store;
use serde::Serialize;

#[derive(Clone)]
pub struct StatusState {
    pub store: Store,
    pub bus: Bus,
    /// Backend name → capacity.
    pub capacity: BTreeMap<String, usize>,
    /// Backend name → its providers' slots (`max_runners`, else the backend's capacity).
    pub provider_capacity: BTreeMap<String, BTreeMap<String, usize>>,
}

#[derive(Serialize)]
struct BackendStatus {
    name: String,
    capacity: usize,
    slots_used: u64,
    /// Assignments waiting in JetStream for a free slot (the worker consumer's pending count).
    queue_depth: Option<u64>,
    states: BTreeMap<String, u64>,
    /// Slots held per provider (backends with providers).
    providers: BTreeMap<String, u64>,
    /// Slots each provider may hold (`max_runners`, else the backend's capacity).
    provider_capacity: BTreeMap<String, usize>,
    /// Seconds the longest-waiting assignment (no workload yet) has waited since its forge
    /// fetch; absent when nothing waits.
    oldest_wait_secs: Option<f64>,
}

pub fn router(state: Arc<StatusState>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/assignments/{id}", get(timeline))
        .route("/api/quarantine", get(quarantine))
        .with_state(state)
}

fn internal(e: impl std::fmt::Display) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(serde_json::json!({ "error": e.to_string() })),
    )
        .into_response()
}

async fn status(State(s): State<Arc<StatusState>>) -> Response {
    let counts = match s.store.state_counts().await {
        Ok(c) => c,
        Err(e) => return internal(e),
    };
    let slots = match s.store.slots_used().await {
        Ok(c) => c,
        Err(e) => return internal(e),
    };
    let by_provider = match s.store.slots_by_provider().await {
        Ok(rows) => rows,
        Err(e) => return internal(e),
    };
    let oldest = match s.store.oldest_waiting().await {
        Ok(rows) => rows,
        Err(e) => return internal(e),
    };
    let now = jr_protocol::now_ms();
    let mut backends = Vec::new();
    for (name, capacity) in &s.capacity {
        let queue_depth = s
            .bus
            .consumer_info(STREAM_ASSIGNMENTS, &format!("{name}-worker"))
            .await
            .ok()
            .map(|c| c.num_pending);
        let states = counts
            .iter()
            .filter(|c| c.backend.as_deref() == Some(name.as_str()))
            .map(|c| (c.state.as_str().to_owned(), c.count))
            .collect();
        let slots_used = slots
            .iter()
            .find(|u| &u.backend == name)
            .map_or(0, |u| u.used);
        let providers = by_provider
            .iter()
            .filter(|(backend, ..)| backend == name)
            .map(|(_, provider, used)| (provider.clone(), *used))
            .collect();
        let oldest_wait_secs = oldest
            .iter()
            .find(|(backend, _)| backend == name)
            .map(|(_, since)| now.saturating_sub(*since) as f64 / 1000.0);
        let provider_capacity = s.provider_capacity.get(name).cloned().unwrap_or_default();
        // Every configured provider is listed, holding nothing or not.
        let mut providers: BTreeMap<String, u64> = providers;
        for provider in provider_capacity.keys() {
            providers.entry(provider.clone()).or_insert(0);
        }
        backends.push(BackendStatus {
            name: name.clone(),
            capacity: *capacity,
            slots_used,
            queue_depth,
            states,
            providers,
            provider_capacity,
            oldest_wait_secs,
        });
    }
    let quarantined = match s.store.quarantine_count().await {
        Ok(n) => n,
        Err(e) => return internal(e),
    };
    let burst = burst_switch(&s.bus).await;
    Json(serde_json::json!({ "backends": backends, "quarantined": quarantined, "burst": burst }))
        .into_response()
}

/// The burst switch as set in the KV bucket `JR_PLACEMENT` and what workers make of it.
async fn burst_switch(bus: &jr_bus::Bus) -> serde_json::Value {
    let raw = match bus
        .jetstream()
        .get_key_value(jr_bus::permissions::PLACEMENT_BUCKET)
        .await
    {
        Ok(store) => store
            .get("burst")
            .await
            .ok()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned()),
        Err(_) => None,
    };
    let (setting, warning) = match &raw {
        Some(text) => jr_placement::parse_burst(text),
        None => (jr_placement::BurstSetting::OFF, None),
    };
    serde_json::json!({
        "value": raw,
        "enabled": setting.enabled,
        "percent": setting.percent,
        "invalid": warning.is_some(),
    })
}

/// Most recent quarantined messages shown (newest first).
const QUARANTINE_SHOWN: u32 = 100;

/// Messages the projection skipped: total count and the most recent entries.
async fn quarantine(State(s): State<Arc<StatusState>>) -> Response {
    let count = match s.store.quarantine_count().await {
        Ok(n) => n,
        Err(e) => return internal(e),
    };
    match s.store.quarantined(QUARANTINE_SHOWN).await {
        Ok(recent) => Json(serde_json::json!({ "count": count, "recent": recent })).into_response(),
        Err(e) => internal(e),
    }
}

async fn timeline(State(s): State<Arc<StatusState>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<AssignmentId>() else {
        return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({ "error": "not an assignment id" })),
        )
            .into_response();
    };
    match s.store.timeline(id).await {
        Ok(Some(entries)) => {
            Json(serde_json::json!({ "assignment": id.to_string(), "timeline": entries }))
                .into_response()
        }
        Ok(None) => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({ "error": "unknown assignment" })),
        )
            .into_response(),
        Err(e) => internal(e),
    }
}

async fn page() -> Html<&'static str> {
    Html(include_str!("status.html"))
}
