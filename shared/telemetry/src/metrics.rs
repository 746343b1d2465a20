//! A shared Prometheus registry (prometheus-client, OpenMetrics text).

use std::sync::{Mutex, MutexGuard, PoisonError};

use prometheus_client::registry::{Metric, Registry};

/// The metrics of one service. Crates register their counters, gauges and histograms once at
/// start; `/metrics` encodes the registry on every scrape.
#[derive(Debug, Default)]
pub struct Metrics {
    registry: Mutex<Registry>,
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// All metric names get `<prefix>_` (e.g. `jr`).
    pub fn with_prefix(prefix: &str) -> Self {
        Self {
            registry: Mutex::new(Registry::with_prefix(prefix)),
        }
    }

    /// Registers one metric. Keep a clone of `metric` to update it; clones share the value.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry().register(name, help, metric);
    }

    /// Direct access, e.g. for `sub_registry_with_prefix` or a crate's own `register(&mut Registry)`.
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while registering leaves a usable registry; keep serving it.
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry());
        text
    }
}
