//! The reconciler's Prometheus metrics: commands issued by kind (redispatches and lost
//! workloads among them), projection progress per stream, queue depth and slots per backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use crate::projector::ProjectorState;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    pub backend: String,
}

#[derive(Debug, Default)]
pub struct ReconcilerMetrics {
    /// delete-workload, redispatch, fail-task (a fail-task is a lost workload).
    pub commands: Family<KindLabel, Counter>,
    /// Assignments waiting in JetStream for a slot, per backend.
    pub queue_depth: Family<BackendLabel, Gauge>,
    /// Slots held per backend according to the projection.
    pub slots_used: Family<BackendLabel, Gauge>,
    /// How long the longest-waiting pending assignment has waited since its fetch, seconds
    /// (0 when nothing waits).
    pub oldest_wait: Family<BackendLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// 1 while this replica holds the reconciler lease (projects and plans), else 0.
    pub leader: Gauge,
}

impl ReconcilerMetrics {
    pub fn register(
        self: &Arc<Self>,
        registry: &mut Registry,
        projectors: Vec<(&'static str, Arc<ProjectorState>)>,
    ) {
        registry.register(
            "reconciler_leader",
            "1 while this replica holds the reconciler lease (projects and plans), 0 on a standby",
            self.leader.clone(),
        );
        registry.register(
            "reconciler_commands",
            "Commands issued, by kind",
            self.commands.clone(),
        );
        registry.register(
            "queue_depth",
            "Assignments waiting for a free slot, per backend",
            self.queue_depth.clone(),
        );
        registry.register(
            "slots_used",
            "Capacity slots in use per backend (projection)",
            self.slots_used.clone(),
        );
        registry.register(
            "oldest_wait_seconds",
            "How long the longest-waiting assignment (no workload yet) has waited since its forge fetch, per backend",
            self.oldest_wait.clone(),
        );
        registry.register_collector(Box::new(ProjectionCollector { projectors }));
    }
}

#[derive(Debug)]
struct ProjectionCollector {
    projectors: Vec<(&'static str, Arc<ProjectorState>)>,
}

impl ProjectionCollector {
    /// One family `name` with a `stream` label: `value` of each projector.
    fn per_stream<M: EncodeMetric>(
        &self,
        encoder: &mut DescriptorEncoder,
        name: &str,
        help: &str,
        value: impl Fn(&ProjectorState) -> M,
    ) -> Result<(), std::fmt::Error> {
        let metrics: Vec<(&str, M)> = self
            .projectors
            .iter()
            .map(|(stream, state)| (*stream, value(state)))
            .collect();
        let Some(kind) = metrics.first().map(|(_, m)| m.metric_type()) else {
            return Ok(());
        };
        let mut family = encoder.encode_descriptor(name, help, None, kind)?;
        for (stream, metric) in metrics {
            metric.encode(family.encode_family(&[("stream", stream)])?)?;
        }
        Ok(())
    }
}

impl Collector for ProjectionCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let count = |n: &AtomicU64| ConstCounter::new(n.load(Ordering::Relaxed));
        let gauge = |n: &AtomicU64| {
            ConstGauge::new(i64::try_from(n.load(Ordering::Relaxed)).unwrap_or(i64::MAX))
        };
        let e = &mut encoder;
        self.per_stream(
            e,
            "projection_applied",
            "Messages applied to the projection",
            |s| count(&s.applied),
        )?;
        self.per_stream(
            e,
            "projection_checkpoint",
            "Last stream sequence applied",
            |s| gauge(&s.checkpoint),
        )?;
        self.per_stream(
            e,
            "projection_quarantined",
            "Messages the projection could not apply, recorded in the quarantine table and skipped",
            |s| count(&s.quarantined),
        )?;
        self.per_stream(
            e,
            "projection_pending",
            "Messages the stream holds that the projection has not read yet",
            |s| gauge(&s.pending),
        )?;
        let now = jr_protocol::now_ms();
        self.per_stream(
            e,
            "projection_lag_seconds",
            "Age of the oldest stream message not yet in the projection (an upper bound; 0 when caught up)",
            |s| ConstGauge::new(s.lag_ms(now) as f64 / 1000.0),
        )?;
        self.per_stream(
            e,
            "projection_store_errors",
            "Failed projection transactions",
            |s| count(&s.store_errors),
        )
    }
}
