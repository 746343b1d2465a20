//! Observability and process plumbing shared by every jetrunner service: the tracing subscriber
//! with optional OTLP export, shutdown on signals, named tasks, the metrics registry and the
//! `/healthz` `/readyz` `/metrics` endpoint.
//!
//! A service `main` typically does:
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use jr_telemetry::*;
//! let guard = init(TelemetryConfig::new("jetrunner-scheduler"))?;
//! let shutdown = Shutdown::new();
//! let (metrics, readiness) = (Arc::new(Metrics::with_prefix("jr")), Readiness::new());
//! let mut tasks = TaskSet::new(shutdown.clone());
//! tasks.spawn("signals", shutdown.clone().trigger_on_signal());
//! tasks.spawn("ops", serve_ops("0.0.0.0:9090".parse()?, metrics, readiness, shutdown.clone()));
//! shutdown.cancelled().await;
//! let report = tasks.join_all(std::time::Duration::from_secs(20)).await;
//! guard.shutdown_async().await;
//! # let _ = report; Ok(()) }
//! ```

mod chain;
mod error;
mod init;
mod metrics;
mod ops;
mod shutdown;
mod tasks;

pub use chain::error_chain;
pub use error::TelemetryError;
pub use init::{LogFormat, TelemetryConfig, TelemetryGuard, init};
pub use metrics::Metrics;
pub use ops::{OpsServer, Readiness, ops_router, serve_ops};
pub use prometheus_client;
pub use shutdown::{Shutdown, shutdown_signal};
pub use tasks::{JoinReport, TaskExit, TaskSet};
pub use tokio_util::sync::CancellationToken;
