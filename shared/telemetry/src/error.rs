/// Failures of the telemetry setup and the ops endpoint.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid log filter {filter:?}: {reason}")]
    Filter { filter: String, reason: String },
    #[error("building the OTLP exporter for {endpoint}: {reason}")]
    Exporter { endpoint: String, reason: String },
    #[error("installing the global tracing subscriber: {0}")]
    Subscriber(String),
    #[error("binding the ops endpoint on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving the ops endpoint: {0}")]
    Serve(#[source] std::io::Error),
}

impl TelemetryError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            TelemetryError::Filter { .. } => "filter",
            TelemetryError::Exporter { .. } => "exporter",
            TelemetryError::Subscriber(_) => "subscriber",
            TelemetryError::Bind { .. } => "bind",
            TelemetryError::Serve(_) => "serve",
        }
    }
}
