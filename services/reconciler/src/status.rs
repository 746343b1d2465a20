//! Read-only status API (JSON) and a small status page over the projection, plus what each
//! intake (forge registration) of the scheduler reports in `JR_INTAKES`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use jr_bus::Bus;
use jr_bus::intake::IntakeStatus;
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
    /// The scheduler's forge registrations (`shared`, or one per backend): the keys read in
    /// `JR_INTAKES`.
    pub registrations: Vec<String>,
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
    /// Providers drained at run time (`jr provider drain`): nothing new is placed there.
    drained: Vec<String>,
    /// Seconds the longest-waiting assignment (no workload yet) has waited since its forge
    /// fetch; absent when nothing waits.
    oldest_wait_secs: Option<f64>,
}

/// A record a live scheduler would have rewritten by now: missing three refreshes in a row is
/// no hiccup, the scheduler that wrote it stopped (or lost its registration's lease and no
/// replica took over), so its figures are old.
const STALE_AFTER: Duration = jr_bus::intake::REFRESH_EVERY.saturating_mul(3);

/// How long the status API waits for `JR_INTAKES`: the page polls every second, and a NATS
/// that does not answer must not hold up the figures from Postgres.
const INTAKES_TIMEOUT: Duration = Duration::from_secs(3);

/// An intake record as the status API gives it.
#[derive(Serialize)]
struct IntakeView {
    #[serde(flatten)]
    record: IntakeStatus,
    stale: bool,
}

fn is_stale(updated_at_ms: u64, now_ms: u64) -> bool {
    u128::from(now_ms.saturating_sub(updated_at_ms)) > STALE_AFTER.as_millis()
}

/// The `intakes` field of `/api/status`, or `intakes_error` when `JR_INTAKES` cannot be read:
/// the rest of the status does not depend on it.
async fn intakes(
    bus: &Bus,
    registrations: &[String],
    now_ms: u64,
) -> (&'static str, serde_json::Value) {
    let read = tokio::time::timeout(INTAKES_TIMEOUT, jr_bus::intake::read(bus, registrations));
    match read.await {
        Ok(Ok(records)) => {
            let views: Vec<IntakeView> = records
                .into_iter()
                .map(|record| IntakeView {
                    stale: is_stale(record.updated_at_ms, now_ms),
                    record,
                })
                .collect();
            ("intakes", serde_json::json!(views))
        }
        Ok(Err(e)) => ("intakes_error", jr_telemetry::error_chain(&e).into()),
        Err(_) => (
            "intakes_error",
            format!(
                "key-value bucket {}: no answer within {INTAKES_TIMEOUT:?}",
                jr_bus::intake::BUCKET
            )
            .into(),
        ),
    }
}

pub fn router(state: Arc<StatusState>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/assignments", get(crate::jobs_api::jobs))
        .route("/api/history", get(crate::jobs_api::history))
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
    let drains = drained_providers(&s.bus, &s.provider_capacity).await;
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
        let drained = drains
            .iter()
            .filter(|(backend, _)| backend == name)
            .map(|(_, provider)| provider.clone())
            .collect();
        backends.push(BackendStatus {
            name: name.clone(),
            capacity: *capacity,
            slots_used,
            queue_depth,
            states,
            providers,
            provider_capacity,
            drained,
            oldest_wait_secs,
        });
    }
    let quarantined = match s.store.quarantine_count().await {
        Ok(n) => n,
        Err(e) => return internal(e),
    };
    let burst = burst_switch(&s.bus).await;
    let (intakes_key, intakes) = intakes(&s.bus, &s.registrations, jr_protocol::now_ms()).await;
    let mut body =
        serde_json::json!({ "backends": backends, "quarantined": quarantined, "burst": burst });
    body[intakes_key] = intakes;
    Json(body).into_response()
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

/// `(backend, provider)` of every configured provider whose run-time drain switch
/// (`JR_PLACEMENT`) drains it, read as the workers read it: one bucket, read once a request and
/// within [`INTAKES_TIMEOUT`] (a NATS that does not answer leaves the list empty rather than
/// holding up the figures from Postgres).
async fn drained_providers(
    bus: &jr_bus::Bus,
    providers: &BTreeMap<String, BTreeMap<String, usize>>,
) -> Vec<(String, String)> {
    let read = async {
        let store = bus
            .jetstream()
            .get_key_value(jr_bus::permissions::PLACEMENT_BUCKET)
            .await
            .ok()?;
        let mut drained = Vec::new();
        for (backend, names) in providers {
            for provider in names.keys() {
                let value = store
                    .get(jr_placement::drain_key(backend, provider))
                    .await
                    .ok()
                    .flatten();
                if jr_placement::interpret_drain(value.as_deref()).0 {
                    drained.push((backend.clone(), provider.clone()));
                }
            }
        }
        Some(drained)
    };
    tokio::time::timeout(INTAKES_TIMEOUT, read)
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use jr_bus::intake::{BackendIntake, Blocked};
    use jr_bus::testing::NatsServer;
    use sqlx::Connection as _;

    const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

    /// A database of its own on the local Postgres (127.0.0.1:5432, trust), dropped at the end.
    struct TestDb {
        name: String,
        store: Store,
    }

    impl TestDb {
        async fn new() -> anyhow::Result<Self> {
            let name = format!("jr_status_test_{}", uuid::Uuid::new_v4().simple());
            let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut admin)
                .await?;
            admin.close().await?;
            let store =
                Store::connect(&format!("postgres://postgres@127.0.0.1:5432/{name}")).await?;
            store.migrate().await?;
            Ok(Self { name, store })
        }
    }

    impl Drop for TestDb {
        fn drop(&mut self) {
            let name = self.name.clone();
            // The test's runtime may be shutting down: the drop runs on a runtime of its own.
            let cleanup = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async {
                    let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
                    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut admin)
                        .await?;
                    anyhow::Ok(())
                })
            });
            let _ = cleanup.join();
        }
    }

    fn record(registration: &str, updated_at_ms: u64) -> IntakeStatus {
        IntakeStatus {
            registration: registration.to_owned(),
            forge: "gitea".to_owned(),
            layout: "shared".to_owned(),
            declared_labels: vec!["vm".to_owned()],
            fetching: true,
            backends: vec![
                BackendIntake {
                    backend: "pod".to_owned(),
                    blocked: Some(Blocked::NoWorker),
                    room: Some(0),
                    waiting: Some(3),
                    declared: false,
                    since_ms: updated_at_ms - 5_000,
                },
                BackendIntake {
                    backend: "vm".to_owned(),
                    blocked: None,
                    room: Some(2),
                    waiting: Some(0),
                    declared: true,
                    since_ms: updated_at_ms - 9_000,
                },
            ],
            replica: "scheduler_1".to_owned(),
            updated_at_ms,
            error: None,
        }
    }

    async fn status_json(state: &Arc<StatusState>) -> anyhow::Result<serde_json::Value> {
        let response = status(State(state.clone())).await;
        let code = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await?;
        let body: serde_json::Value = serde_json::from_slice(&bytes)?;
        anyhow::ensure!(code == StatusCode::OK, "{code}: {body}");
        Ok(body)
    }

    #[test]
    fn a_record_is_stale_after_three_missed_refreshes() {
        let now = 1_000_000;
        let refresh = jr_bus::intake::REFRESH_EVERY.as_millis() as u64;
        assert!(!is_stale(now, now));
        assert!(
            !is_stale(now - 3 * refresh, now),
            "three periods is still live"
        );
        assert!(is_stale(now - 3 * refresh - 1, now));
        // A writer whose clock is ahead is not stale.
        assert!(!is_stale(now + 60_000, now));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_status_api_gives_the_intakes_and_survives_an_unreadable_bucket()
    -> anyhow::Result<()> {
        let mut nats = NatsServer::start().await?;
        let bus = Bus::connect(&nats.url(), "status-test", None).await?;
        let db = TestDb::new().await?;
        let state = Arc::new(StatusState {
            store: db.store.clone(),
            bus: bus.clone(),
            capacity: BTreeMap::from([("pod".to_owned(), 2)]),
            provider_capacity: BTreeMap::new(),
            registrations: vec!["shared".to_owned(), "vm".to_owned()],
        });

        // No scheduler ran yet: no bucket, no records, no error.
        let body = status_json(&state).await?;
        assert_eq!(body["intakes"], serde_json::json!([]), "{body}");
        assert!(body.get("intakes_error").is_none(), "{body}");

        let now = jr_protocol::now_ms();
        let stopped = now - STALE_AFTER.as_millis() as u64 - 1_000;
        let kv = jr_bus::intake::open_or_create(&bus).await?;
        kv.put("shared", record("shared", now).encode().into())
            .await?;
        kv.put("vm", record("vm", stopped).encode().into()).await?;
        // Not a registration of this configuration: not shown.
        kv.put("pod", record("pod", now).encode().into()).await?;
        let body = status_json(&state).await?;
        let records = body["intakes"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("no intakes in {body}"))?;
        let names: Vec<&str> = records
            .iter()
            .filter_map(|i| i["registration"].as_str())
            .collect();
        assert_eq!(names, ["shared", "vm"], "{body}");
        assert_eq!(records[0]["stale"], false, "{body}");
        assert_eq!(records[1]["stale"], true, "{body}");
        assert_eq!(records[0]["backends"][0]["blocked"], "no-worker", "{body}");
        assert_eq!(
            records[0]["backends"][1]["blocked"],
            serde_json::Value::Null
        );
        assert_eq!(records[0]["declared_labels"], serde_json::json!(["vm"]));
        assert_eq!(records[0]["updated_at_ms"], now, "{body}");

        // Something that is not a key-value bucket under the bucket's name: the error, with its
        // source, instead of the intakes, and the rest of the status as ever.
        bus.jetstream()
            .delete_key_value(jr_bus::intake::BUCKET)
            .await?;
        bus.jetstream()
            .create_stream(async_nats::jetstream::stream::Config {
                name: format!("KV_{}", jr_bus::intake::BUCKET),
                subjects: vec![format!("$KV.{}.>", jr_bus::intake::BUCKET)],
                ..Default::default()
            })
            .await?;
        let body = status_json(&state).await?;
        assert!(body.get("intakes").is_none(), "{body}");
        let error = body["intakes_error"].as_str().unwrap_or_default();
        assert!(
            error.contains("JR_INTAKES") && error.contains("invalid Key Value Store name"),
            "{body}"
        );
        assert_eq!(body["backends"][0]["name"], "pod", "{body}");
        assert_eq!(body["backends"][0]["capacity"], 2, "{body}");

        // NATS gone: the intakes' answer does not wait past its bound, and says so.
        nats.kill();
        let started = std::time::Instant::now();
        let (key, value) = intakes(&bus, &state.registrations, now).await;
        assert!(
            started.elapsed() < INTAKES_TIMEOUT + Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(key, "intakes_error", "{value}");
        Ok(())
    }
}
