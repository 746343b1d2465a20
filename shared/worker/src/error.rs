//! The worker core's error type.

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("bus: {0}")]
    Bus(#[from] jr_bus::BusError),
    /// The worker's own ledger (a JetStream key-value bucket) could not be opened or read.
    #[error("ledger {bucket}: {message}")]
    Ledger { bucket: String, message: String },
    /// Another process took this replica's holding of the capacity over (it could not renew
    /// in time, or two processes run with one worker_id): it stopped managing anything.
    #[error(
        "replica {replica}: holding taken over by {by}; restart it (with a worker_id of its own)"
    )]
    Lost { replica: String, by: String },
}

impl WorkerError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkerError::Bus(_) => "bus",
            WorkerError::Ledger { .. } => "ledger",
            WorkerError::Lost { .. } => "lost",
        }
    }
}
