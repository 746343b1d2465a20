//! The worker core's error type.

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("bus: {0}")]
    Bus(#[from] jr_bus::BusError),
    /// The worker's own ledger (a JetStream key-value bucket) could not be opened or read.
    #[error("ledger {bucket}: {message}")]
    Ledger { bucket: String, message: String },
}

impl WorkerError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkerError::Bus(_) => "bus",
            WorkerError::Ledger { .. } => "ledger",
        }
    }
}
