//! The worker's Prometheus metrics (docs/operations.md): slots used/total, dispatch latency and what
//! happened to assignments, commands and workloads.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: String,
}

#[derive(Debug)]
pub struct WorkerMetrics {
    pub slots_used: Gauge,
    pub slots_total: Gauge,
    /// Slots of the backend's capacity this replica holds in the shared record.
    pub slots_held: Gauge,
    /// Live replicas of this backend's worker (as this one last read the shared record).
    pub replicas: Gauge,
    /// Other replicas' workloads this one took over.
    pub takeovers: Counter,
    /// Workloads held beyond what this worker may fill (adopted at start, or above its share of
    /// the capacity after other replicas joined); no create happens until it is 0.
    pub debt: Gauge,
    pub created: Counter,
    pub create_errors: Family<ErrorLabels, Counter>,
    pub full_pauses: Counter,
    pub deleted: Counter,
    pub released: Counter,
    pub adopted: Counter,
    pub terminated_messages: Counter,
    /// Seconds from the forge fetch (assignment `fetched_at`) to workload created.
    pub dispatch_latency: Histogram,
    /// Warm executors started and not bound to a job.
    pub warm_idle: Gauge,
    /// Job workloads that started as warm executors.
    pub warm_bound: Gauge,
    /// Assignments bound to a warm executor instead of a create call.
    pub warm_binds: Counter,
    /// Idle warm executors retired for assignments that could not bind to them.
    pub warm_yields: Counter,
    /// Seconds from the forge fetch to the binding to a warm executor.
    pub warm_bind_latency: Histogram,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self {
            slots_used: Gauge::default(),
            slots_total: Gauge::default(),
            slots_held: Gauge::default(),
            replicas: Gauge::default(),
            takeovers: Counter::default(),
            debt: Gauge::default(),
            created: Counter::default(),
            create_errors: Family::default(),
            full_pauses: Counter::default(),
            deleted: Counter::default(),
            released: Counter::default(),
            adopted: Counter::default(),
            terminated_messages: Counter::default(),
            dispatch_latency: Histogram::new([
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
            warm_idle: Gauge::default(),
            warm_bound: Gauge::default(),
            warm_binds: Counter::default(),
            warm_yields: Counter::default(),
            warm_bind_latency: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        }
    }
}

impl WorkerMetrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("worker");
        r.register(
            "slots_used",
            "Capacity slots held by live workloads",
            self.slots_used.clone(),
        );
        r.register(
            "slots_total",
            "Capacity of this worker's backend",
            self.slots_total.clone(),
        );
        r.register(
            "slots_held",
            "Slots of the backend's capacity this replica holds (shared between replicas through KV)",
            self.slots_held.clone(),
        );
        r.register(
            "replicas",
            "Live replicas of this backend's worker, from the shared capacity record",
            self.replicas.clone(),
        );
        r.register(
            "takeovers",
            "Replicas (stopped or of an earlier process) whose workloads this one took over",
            self.takeovers.clone(),
        );
        r.register(
            "slot_debt",
            "Workloads held beyond what this worker may fill (adopted, or above its replica's share); pulling waits until it is 0",
            self.debt.clone(),
        );
        r.register(
            "workloads_created",
            "Workloads created (or found existing) for an assignment attempt",
            self.created.clone(),
        );
        r.register(
            "create_errors",
            "Workload creations that failed, by error kind",
            self.create_errors.clone(),
        );
        r.register(
            "full_pauses",
            "Times the backend said it was full and pulling paused",
            self.full_pauses.clone(),
        );
        r.register(
            "workloads_deleted",
            "delete-workload commands executed",
            self.deleted.clone(),
        );
        r.register(
            "workloads_released",
            "Workloads gone and their slots freed",
            self.released.clone(),
        );
        r.register(
            "workloads_adopted",
            "Workloads found on the backend and tracked without a delivery",
            self.adopted.clone(),
        );
        r.register(
            "messages_terminated",
            "Messages refused for good (wrong kind or backend)",
            self.terminated_messages.clone(),
        );
        r.register(
            "dispatch_latency_seconds",
            "Forge fetch to workload created",
            self.dispatch_latency.clone(),
        );
        r.register(
            "warm_idle",
            "Warm executors started and not bound to a job",
            self.warm_idle.clone(),
        );
        r.register(
            "warm_bound",
            "Job workloads that started as warm executors",
            self.warm_bound.clone(),
        );
        r.register(
            "warm_binds",
            "Assignments bound to a warm executor instead of a create call",
            self.warm_binds.clone(),
        );
        r.register(
            "warm_yields",
            "Idle warm executors retired so that an assignment that cannot bind to one gets its slot",
            self.warm_yields.clone(),
        );
        r.register(
            "warm_bind_latency_seconds",
            "Forge fetch to the binding to a warm executor",
            self.warm_bind_latency.clone(),
        );
    }
}
