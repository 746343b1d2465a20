//! The reconciler's Prometheus metrics: commands issued by kind (redispatches and lost
//! workloads among them), projection progress per stream, queue depth and slots per backend.

use std::sync::Arc;
use std::sync::atomic::Ordering;

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
}

impl ReconcilerMetrics {
    pub fn register(
        self: &Arc<Self>,
        registry: &mut Registry,
        projectors: Vec<(&'static str, Arc<ProjectorState>)>,
    ) {
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

impl Collector for ProjectionCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let c = ConstCounter::new(0u64);
        {
            let mut applied = encoder.encode_descriptor(
                "projection_applied",
                "Messages applied to the projection",
                None,
                c.metric_type(),
            )?;
            for (stream, s) in &self.projectors {
                let labels = [("stream", *stream)];
                ConstCounter::new(s.applied.load(Ordering::Relaxed))
                    .encode(applied.encode_family(&labels)?)?;
            }
        }
        {
            let g = ConstGauge::new(0i64);
            let mut checkpoint = encoder.encode_descriptor(
                "projection_checkpoint",
                "Last stream sequence applied",
                None,
                g.metric_type(),
            )?;
            for (stream, s) in &self.projectors {
                let labels = [("stream", *stream)];
                ConstGauge::new(s.checkpoint.load(Ordering::Relaxed) as i64)
                    .encode(checkpoint.encode_family(&labels)?)?;
            }
        }
        {
            let mut quarantined = encoder.encode_descriptor(
                "projection_quarantined",
                "Messages the projection could not apply, recorded in the quarantine table and skipped",
                None,
                c.metric_type(),
            )?;
            for (stream, s) in &self.projectors {
                let labels = [("stream", *stream)];
                ConstCounter::new(s.quarantined.load(Ordering::Relaxed))
                    .encode(quarantined.encode_family(&labels)?)?;
            }
        }
        {
            let g = ConstGauge::new(0i64);
            let mut pending = encoder.encode_descriptor(
                "projection_pending",
                "Messages the stream holds that the projection has not read yet",
                None,
                g.metric_type(),
            )?;
            for (stream, s) in &self.projectors {
                let labels = [("stream", *stream)];
                ConstGauge::new(
                    i64::try_from(s.pending.load(Ordering::Relaxed)).unwrap_or(i64::MAX),
                )
                .encode(pending.encode_family(&labels)?)?;
            }
        }
        {
            let g = ConstGauge::new(0f64);
            let mut lag = encoder.encode_descriptor(
                "projection_lag_seconds",
                "Age of the oldest stream message not yet in the projection (an upper bound; 0 when caught up)",
                None,
                g.metric_type(),
            )?;
            let now = jr_protocol::now_ms();
            for (stream, s) in &self.projectors {
                let labels = [("stream", *stream)];
                ConstGauge::new(s.lag_ms(now) as f64 / 1000.0)
                    .encode(lag.encode_family(&labels)?)?;
            }
        }
        let mut errors = encoder.encode_descriptor(
            "projection_store_errors",
            "Failed projection transactions",
            None,
            c.metric_type(),
        )?;
        for (stream, s) in &self.projectors {
            let labels = [("stream", *stream)];
            ConstCounter::new(s.store_errors.load(Ordering::Relaxed))
                .encode(errors.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
