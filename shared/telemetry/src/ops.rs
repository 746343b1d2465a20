//! The ops endpoint of every service: `/healthz`, `/readyz`, `/metrics` (docs/operations.md).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::error::TelemetryError;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// Named readiness flags; the service is ready when every registered flag is true. Clones
/// share the flags.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    flags: Arc<RwLock<BTreeMap<String, bool>>>,
    /// What an operator should know that does not make the service unready (a backend whose
    /// work is not taken, say), by topic.
    details: Arc<RwLock<BTreeMap<String, String>>>,
}

impl Readiness {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares a check that starts out not ready.
    pub fn register(&self, name: &str) {
        self.flags
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.to_owned())
            .or_insert(false);
    }

    pub fn set(&self, name: &str, ready: bool) {
        self.flags
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned(), ready);
    }

    /// Sets (`Some`) or clears (`None`) the detail shown under `topic` in `/readyz`.
    pub fn set_detail(&self, topic: &str, detail: Option<String>) {
        let mut details = self.details.write().unwrap_or_else(PoisonError::into_inner);
        match detail {
            Some(text) => details.insert(topic.to_owned(), text),
            None => details.remove(topic),
        };
    }

    /// Every detail, by topic.
    pub fn details(&self) -> BTreeMap<String, String> {
        self.details
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Names of the checks that are not ready, sorted.
    pub fn not_ready(&self) -> Vec<String> {
        let flags = self.flags.read().unwrap_or_else(PoisonError::into_inner);
        flags
            .iter()
            .filter(|(_, ready)| !**ready)
            .map(|(name, _)| name.clone())
            .collect()
    }

    pub fn is_ready(&self) -> bool {
        self.not_ready().is_empty()
    }
}

#[derive(Clone)]
struct Ops {
    metrics: Arc<Metrics>,
    readiness: Readiness,
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(ops): State<Ops>) -> Response {
    let not_ready = ops.readiness.not_ready();
    let status = if not_ready.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "ready": not_ready.is_empty(),
        "not_ready": not_ready,
        "details": ops.readiness.details(),
    });
    (status, axum::Json(body)).into_response()
}

async fn metrics_text(State(ops): State<Ops>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ops.metrics.encode(),
    )
        .into_response()
}

/// The three ops routes, to serve alone ([`serve_ops`]) or merge into another router.
pub fn ops_router(metrics: Arc<Metrics>, readiness: Readiness) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(Ops { metrics, readiness })
}

/// A bound, not yet serving, ops endpoint (bind first to learn the port, e.g. with port 0).
pub struct OpsServer {
    listener: tokio::net::TcpListener,
}

impl OpsServer {
    pub async fn bind(listen: SocketAddr) -> Result<Self, TelemetryError> {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| TelemetryError::Bind {
                addr: listen,
                source,
            })?;
        Ok(Self { listener })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, TelemetryError> {
        self.listener.local_addr().map_err(TelemetryError::Serve)
    }

    /// Serves until `shutdown` triggers.
    pub async fn run(
        self,
        metrics: Arc<Metrics>,
        readiness: Readiness,
        shutdown: Shutdown,
    ) -> Result<(), TelemetryError> {
        axum::serve(self.listener, ops_router(metrics, readiness))
            .with_graceful_shutdown(shutdown.cancelled())
            .await
            .map_err(TelemetryError::Serve)
    }
}

/// Binds `listen` and serves `/healthz`, `/readyz` and `/metrics` until `shutdown` triggers.
pub async fn serve_ops(
    listen: SocketAddr,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    shutdown: Shutdown,
) -> Result<(), TelemetryError> {
    let server = OpsServer::bind(listen).await?;
    tracing::info!(addr = %server.local_addr()?, "ops endpoint listening");
    server.run(metrics, readiness, shutdown).await
}
