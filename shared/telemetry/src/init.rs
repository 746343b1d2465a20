//! The process-wide tracing subscriber: env-filter, JSON or human-readable logs, and optional
//! OTLP/HTTP trace export with the W3C trace-context propagator.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::TelemetryError;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line (production).
    #[default]
    Json,
    /// Human-readable lines (development).
    Pretty,
}

#[derive(Clone, Debug)]
pub struct TelemetryConfig {
    /// `service.name` of exported spans, e.g. `jetrunner-scheduler`.
    pub service_name: String,
    pub log_format: LogFormat,
    /// `tracing_subscriber::EnvFilter` directives, e.g. `info,jr_bus=debug`. A non-empty
    /// `RUST_LOG` replaces it.
    pub filter: String,
    /// OTLP/HTTP (protobuf) collector: a base URL (`http://collector:4318`) or the full
    /// traces URL (`…/v1/traces`). `None` disables export.
    pub otlp_endpoint: Option<String>,
}

impl TelemetryConfig {
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            log_format: LogFormat::Json,
            filter: "info".to_owned(),
            otlp_endpoint: None,
        }
    }
}

/// Keeps the trace exporter alive; flushes and shuts it down on [`TelemetryGuard::shutdown`]
/// or drop.
#[must_use = "dropping the guard shuts the trace exporter down"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

impl TelemetryGuard {
    /// Exports every finished span now. Blocks; from async code use [`Self::flush_async`].
    pub fn flush(&self) {
        if let Some(provider) = self.provider.clone() {
            // The blocking HTTP client must not run on an async worker thread.
            off_runtime(move || {
                if let Err(error) = provider.force_flush() {
                    tracing::warn!(%error, "flushing spans failed");
                }
            });
        }
    }

    pub async fn flush_async(&self) {
        if let Some(provider) = self.provider.clone() {
            let flushed = tokio::task::spawn_blocking(move || provider.force_flush()).await;
            if let Ok(Err(error)) = flushed {
                tracing::warn!(%error, "flushing spans failed");
            }
        }
    }

    /// Flushes and stops the exporter. Blocks for at most a few seconds.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// [`Self::shutdown`] without blocking an async worker thread.
    pub async fn shutdown_async(mut self) {
        if let Some(provider) = self.provider.take() {
            let _ =
                tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(FLUSH_TIMEOUT))
                    .await;
        }
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take() {
            off_runtime(move || {
                if let Err(error) = provider.shutdown_with_timeout(FLUSH_TIMEOUT) {
                    tracing::warn!(%error, "stopping the span exporter failed");
                }
            });
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `work` on a plain thread when called from inside a Tokio runtime (the OTLP exporter's
/// blocking client panics on runtime threads), else right here.
fn off_runtime(work: impl FnOnce() + Send + 'static) {
    if tokio::runtime::Handle::try_current().is_ok() {
        let joined = std::thread::Builder::new()
            .name("otel-flush".into())
            .spawn(work)
            .map(|handle| handle.join());
        if !matches!(joined, Ok(Ok(()))) {
            tracing::warn!("the span flush thread failed");
        }
    } else {
        work();
    }
}

fn traces_url(endpoint: &str) -> String {
    let endpoint = endpoint.trim_end_matches('/');
    if endpoint.ends_with("/v1/traces") {
        endpoint.to_owned()
    } else {
        format!("{endpoint}/v1/traces")
    }
}

fn tracer_provider(
    service_name: &str,
    endpoint: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    // reqwest is built with `rustls-no-provider`; the exporter's client panics without one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = traces_url(endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.clone())
        .build()
        .map_err(|e| TelemetryError::Exporter {
            endpoint: url,
            reason: e.to_string(),
        })?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service_name.to_owned())
                .build(),
        )
        .build())
}

fn env_filter(configured: &str) -> Result<EnvFilter, TelemetryError> {
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let directives = from_env.unwrap_or_else(|| configured.to_owned());
    EnvFilter::try_new(&directives).map_err(|e| TelemetryError::Filter {
        filter: directives,
        reason: e.to_string(),
    })
}

/// Installs the global subscriber and, with an OTLP endpoint, the trace exporter. Also sets the
/// W3C TraceContext propagator globally. Call once, early in `main`.
pub fn init(config: TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    let filter = env_filter(&config.filter)?;
    let provider = match &config.otlp_endpoint {
        Some(endpoint) => Some(tracer_provider(&config.service_name, endpoint)?),
        None => None,
    };
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let otel_layer = provider.as_ref().map(|provider| {
        opentelemetry::global::set_tracer_provider(provider.clone());
        tracing_opentelemetry::layer().with_tracer(provider.tracer(config.service_name.clone()))
    });
    let (json, pretty) = match config.log_format {
        LogFormat::Json => (
            Some(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_span_list(false),
            ),
            None,
        ),
        LogFormat::Pretty => (None, Some(tracing_subscriber::fmt::layer())),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(otel_layer)
        .with(json)
        .with(pretty)
        .try_init()
        .map_err(|e| TelemetryError::Subscriber(e.to_string()))?;
    Ok(TelemetryGuard { provider })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn otlp_endpoint_gets_the_traces_path_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }

    #[test]
    fn a_bad_filter_is_refused_with_its_text() {
        // RUST_LOG is not set by the test harness; if it is, the configured filter is unused.
        if std::env::var_os("RUST_LOG").is_some() {
            return;
        }
        let error = env_filter("info,[[[").expect_err("invalid");
        assert_eq!(error.kind(), "filter");
    }
}
