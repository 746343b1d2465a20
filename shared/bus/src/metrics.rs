use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Label set: a few low-cardinality `(name, value)` pairs.
pub type Labels = Vec<(&'static str, String)>;

/// Counters kept by every [`crate::Bus`]. They always count; register them into the service's
/// registry once to have them exported.
#[derive(Debug, Default)]
pub struct BusMetrics {
    /// `jr_bus_published_total{kind, outcome}`: outcome = published | duplicate | already-exists.
    pub published: Family<Labels, Counter>,
    /// `jr_bus_publish_errors_total{failure}`.
    pub publish_errors: Family<Labels, Counter>,
    /// `jr_bus_dispositions_total{consumer, disposition}`: disposition = ack | nak | term.
    pub dispositions: Family<Labels, Counter>,
    /// `jr_bus_undecodable_total{consumer, reason}`: messages termed because they did not decode.
    pub undecodable: Family<Labels, Counter>,
    /// `jr_bus_pull_errors_total{consumer}`: pull loop errors that led to a re-pull.
    pub pull_errors: Family<Labels, Counter>,
    /// `jr_bus_server_errors_total{kind}`: errors the NATS server reported on this connection;
    /// kind = permissions (a subject this service's NATS user may not use) | authorization |
    /// other.
    pub server_errors: Family<Labels, Counter>,
}

impl BusMetrics {
    pub fn register(&self, registry: &mut Registry) {
        let registry = registry.sub_registry_with_prefix("jr_bus");
        registry.register(
            "published",
            "Messages published, by kind and outcome",
            self.published.clone(),
        );
        registry.register(
            "publish_errors",
            "Failed publish attempts, by failure class",
            self.publish_errors.clone(),
        );
        registry.register(
            "dispositions",
            "Consumed messages by consumer and disposition",
            self.dispositions.clone(),
        );
        registry.register(
            "undecodable",
            "Messages terminated because they did not decode",
            self.undecodable.clone(),
        );
        registry.register(
            "pull_errors",
            "Pull loop errors that led to a re-pull",
            self.pull_errors.clone(),
        );
        registry.register(
            "server_errors",
            "Errors the NATS server reported (permission violations included)",
            self.server_errors.clone(),
        );
    }

    pub(crate) fn count(family: &Family<Labels, Counter>, labels: Labels) {
        family.get_or_create(&labels).inc();
    }

    /// Current value of one counter (tests, status pages).
    pub fn value(family: &Family<Labels, Counter>, labels: &[(&'static str, &str)]) -> u64 {
        let labels: Labels = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        family.get(&labels).map(|c| c.get()).unwrap_or(0)
    }
}
