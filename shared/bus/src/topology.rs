//! Streams and durable consumers declared in code (docs/architecture.md, "Subjects and
//! streams"), applied idempotently.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use jr_protocol::{BackendName, STREAM_ASSIGNMENTS, STREAM_COMMANDS, STREAM_EVENTS, subject};

use crate::bus::Bus;
use crate::error::BusError;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);
const DUPLICATE_WINDOW: Duration = Duration::from_secs(10 * 60);
const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(60);
const WORKER_ACK_WAIT: Duration = Duration::from_secs(15);
/// The ack_wait of a worker's commands: a worker that dies holds the commands delivered to it
/// (and not yet acknowledged) this long before another replica gets them. Handlers keep theirs
/// alive with progress acks, so a slow delete call is not redelivered meanwhile.
const WORKER_COMMAND_ACK_WAIT: Duration = Duration::from_secs(4);

/// Where a new consumer starts. Only honoured when the consumer is first created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartFrom {
    /// Every message still in the stream.
    All,
    /// Only messages published after the consumer is created.
    New,
    /// The last message of every subject.
    LastPerSubject,
}

impl StartFrom {
    fn policy(self) -> consumer::DeliverPolicy {
        match self {
            StartFrom::All => consumer::DeliverPolicy::All,
            StartFrom::New => consumer::DeliverPolicy::New,
            StartFrom::LastPerSubject => consumer::DeliverPolicy::LastPerSubject,
        }
    }
}

/// One durable pull consumer with explicit acks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerSpec {
    pub stream: String,
    pub durable: String,
    /// One or more filters; several need nats-server ≥ 2.10.
    pub filter_subjects: Vec<String>,
    pub ack_wait: Duration,
    pub max_ack_pending: i64,
    /// Deliveries per message before the server gives up; `-1` = unlimited.
    pub max_deliver: i64,
    pub deliver_policy: StartFrom,
}

impl ConsumerSpec {
    /// A consumer with the defaults used across jetrunner (ack_wait 60 s, max_ack_pending 1000,
    /// unlimited deliveries, from the start of the stream).
    pub fn new(
        stream: impl Into<String>,
        durable: impl Into<String>,
        filter_subjects: Vec<String>,
    ) -> Self {
        Self {
            stream: stream.into(),
            durable: durable.into(),
            filter_subjects,
            ack_wait: DEFAULT_ACK_WAIT,
            max_ack_pending: 1000,
            max_deliver: -1,
            deliver_policy: StartFrom::All,
        }
    }

    /// `<backend>-worker` on JR_ASSIGNMENTS, filter `jr.assignment.<backend>.>`. A short
    /// ack_wait: a worker killed mid-create must not hold its assignment for long (running
    /// handlers keep theirs alive with progress acks).
    pub fn worker_assignments(backend: &BackendName) -> Self {
        Self {
            ack_wait: WORKER_ACK_WAIT,
            ..Self::new(
                STREAM_ASSIGNMENTS,
                format!("{backend}-worker"),
                vec![subject::assignments_of(backend)],
            )
        }
    }

    /// `<backend>-worker` on JR_COMMANDS, filter `jr.command.<backend>.>`.
    pub fn worker_commands(backend: &BackendName) -> Self {
        Self {
            ack_wait: WORKER_COMMAND_ACK_WAIT,
            ..Self::new(
                STREAM_COMMANDS,
                format!("{backend}-worker"),
                vec![subject::commands_for(backend.as_str())],
            )
        }
    }

    /// `scheduler` on JR_COMMANDS, filter `jr.command.scheduler.>`.
    pub fn scheduler_commands() -> Self {
        Self::new(
            STREAM_COMMANDS,
            "scheduler",
            vec![subject::commands_for(subject::SCHEDULER_TARGET)],
        )
    }

    /// `reconciler` on JR_ASSIGNMENTS, every assignment.
    pub fn reconciler_assignments() -> Self {
        Self::new(
            STREAM_ASSIGNMENTS,
            "reconciler",
            vec![subject::ASSIGNMENTS_ALL.to_owned()],
        )
    }

    /// `reconciler` on JR_EVENTS, every event.
    pub fn reconciler_events() -> Self {
        Self::new(
            STREAM_EVENTS,
            "reconciler",
            vec![subject::EVENTS_ALL.to_owned()],
        )
    }

    pub(crate) fn config(&self) -> consumer::pull::Config {
        // A single filter goes into `filter_subject`, which nats-server 2.9 understands too.
        let (filter_subject, filter_subjects) = match self.filter_subjects.as_slice() {
            [one] => (one.clone(), Vec::new()),
            many => (String::new(), many.to_vec()),
        };
        consumer::pull::Config {
            durable_name: Some(self.durable.clone()),
            filter_subject,
            filter_subjects,
            ack_policy: consumer::AckPolicy::Explicit,
            deliver_policy: self.deliver_policy.policy(),
            ack_wait: self.ack_wait,
            max_ack_pending: self.max_ack_pending,
            max_deliver: self.max_deliver,
            ..Default::default()
        }
    }
}

/// Size limits of one stream. When a limit is reached the stream refuses new messages
/// (`DiscardPolicy::New`): the publisher gets an error and retries, nothing stored is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimit {
    pub max_messages: i64,
    pub max_bytes: i64,
}

/// Limits of the three streams (`nats.streams.*` in the config).
///
/// All three discard **new** messages when full, never old ones:
/// - `JR_ASSIGNMENTS`: an old assignment may still wait for a slot; dropping it would lose a
///   job the forge considers taken. Refusing the publish is backpressure instead: a fetcher does
///   not fetch again until its assignment has a PubAck, so jobs wait at the forge.
/// - `JR_EVENTS`: `claimed` and `terminal` are once-only because the server checks that their
///   subject is empty; dropping them would let a second claim or result through, and the
///   projection might not have read them yet. Workers and the facade retry their publishes.
/// - `JR_COMMANDS`: a dropped command may have had no effect yet; the reconciler reissues
///   refused commands on its next plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamLimits {
    pub assignments: StreamLimit,
    pub events: StreamLimit,
    pub commands: StreamLimit,
}

const GIB: i64 = 1 << 30;
const MIB: i64 = 1 << 20;

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            assignments: StreamLimit {
                max_messages: 1_000_000,
                max_bytes: 2 * GIB,
            },
            events: StreamLimit {
                max_messages: 10_000_000,
                max_bytes: 4 * GIB,
            },
            commands: StreamLimit {
                max_messages: 100_000,
                max_bytes: 256 * MIB,
            },
        }
    }
}

/// Everything one service declares: the three streams and its own consumers.
#[derive(Clone, Debug)]
pub struct Topology {
    pub replicas: usize,
    pub consumers: Vec<ConsumerSpec>,
    /// Stream limits from the configuration. With `Some`, the streams are created or updated
    /// to them. With `None` (a service that does not own stream settings), missing streams are
    /// created with the default limits and existing ones are left as they are, so such a
    /// service never resets limits an operator configured.
    pub limits: Option<StreamLimits>,
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            replicas: 1,
            consumers: Vec::new(),
            limits: None,
        }
    }
}

impl Topology {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stream replicas (R3 in a cluster).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    pub fn consumer(mut self, spec: ConsumerSpec) -> Self {
        self.consumers.push(spec);
        self
    }

    /// Create or update the streams with these limits (see [`Topology::limits`]).
    pub fn stream_limits(mut self, limits: StreamLimits) -> Self {
        self.limits = Some(limits);
        self
    }

    /// The stream configurations: assignments and events kept by age, commands as a work queue.
    pub fn streams(&self) -> Vec<stream::Config> {
        let limits = self.limits.unwrap_or_default();
        let base = |name: &str, subjects: &str, limit: StreamLimit| stream::Config {
            name: name.to_owned(),
            subjects: vec![subjects.to_owned()],
            storage: stream::StorageType::File,
            num_replicas: self.replicas,
            duplicate_window: DUPLICATE_WINDOW,
            // Leader-served last-by-subject reads stay available; direct gets are a bonus.
            allow_direct: true,
            max_messages: limit.max_messages,
            max_bytes: limit.max_bytes,
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        };
        vec![
            stream::Config {
                retention: stream::RetentionPolicy::Limits,
                max_age: 7 * DAY,
                ..base(
                    STREAM_ASSIGNMENTS,
                    subject::ASSIGNMENTS_ALL,
                    limits.assignments,
                )
            },
            stream::Config {
                retention: stream::RetentionPolicy::Limits,
                max_age: 30 * DAY,
                ..base(STREAM_EVENTS, subject::EVENTS_ALL, limits.events)
            },
            stream::Config {
                retention: stream::RetentionPolicy::WorkQueue,
                ..base(STREAM_COMMANDS, subject::COMMANDS_ALL, limits.commands)
            },
        ]
    }
}

fn stream_error_is_transient(kind: &jetstream::context::CreateStreamErrorKind) -> bool {
    use jetstream::context::CreateStreamErrorKind as K;
    match kind {
        K::JetStreamUnavailable | K::TimedOut | K::Response | K::ResponseParse | K::NotFound => {
            true
        }
        // A cluster electing its meta leader or missing a peer answers with these until it
        // has formed again (at start, after a node loss).
        // Another service created the stream between this one's lookup and its create (with
        // other limits): the next try finds it.
        K::JetStream(e) if e.error_code() == jetstream::ErrorCode::STREAM_NAME_EXIST => true,
        K::JetStream(e) => cluster_forming(e),
        K::EmptyStreamName | K::InvalidStreamName | K::DomainAndExternalSet => false,
    }
}

fn consumer_error_is_transient(kind: &jetstream::stream::ConsumerErrorKind) -> bool {
    use jetstream::stream::ConsumerErrorKind as K;
    match kind {
        K::TimedOut | K::Request | K::Other => true,
        K::JetStream(e) => cluster_forming(e),
        K::InvalidConsumerType | K::InvalidName => false,
    }
}

/// JetStream errors of a cluster that has no quorum or meta leader for the moment.
fn cluster_forming(error: &jetstream::Error) -> bool {
    use jetstream::ErrorCode as C;
    matches!(
        error.error_code(),
        C::CLUSTER_NOT_AVAILABLE
            | C::CLUSTER_NO_PEERS
            | C::CLUSTER_INCOMPLETE
            | C::RAFT_GENERAL
            | C::INSUFFICIENT_RESOURCES
    )
}

impl Bus {
    /// Creates or updates the streams and this service's consumers. Safe to call at every start
    /// and from several replicas at once.
    pub async fn ensure_topology(&self, topology: &Topology) -> Result<(), BusError> {
        for config in topology.streams() {
            let name = config.name.clone();
            let declared = if topology.limits.is_some() {
                self.js.create_or_update_stream(config).await.map(|_| ())
            } else {
                self.js.get_or_create_stream(config).await.map(|_| ())
            };
            declared.map_err(|e| BusError::DeclareStream {
                stream: name.clone(),
                transient: stream_error_is_transient(&e.kind()),
                source: Box::new(e),
            })?;
            tracing::debug!(stream = %name, "stream declared");
        }
        for spec in &topology.consumers {
            self.ensure_consumer(spec).await?;
        }
        Ok(())
    }

    /// [`Bus::ensure_topology`] retried through transient failures (NATS not reachable yet, a
    /// cluster without a meta leader, request timeouts while leaders move) until it succeeds,
    /// fails for good, or `shutdown` fires.
    pub async fn ensure_topology_retrying(
        &self,
        topology: &Topology,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<(), BusError> {
        crate::retry::retry_transient("declaring streams and consumers", shutdown, || {
            self.ensure_topology(topology)
        })
        .await
    }

    /// Creates or updates one durable consumer and returns a handle to it.
    pub async fn ensure_consumer(
        &self,
        spec: &ConsumerSpec,
    ) -> Result<consumer::PullConsumer, BusError> {
        let declare_error = |e: jetstream::stream::ConsumerError| BusError::DeclareConsumer {
            stream: spec.stream.clone(),
            durable: spec.durable.clone(),
            transient: consumer_error_is_transient(&e.kind()),
            source: Box::new(e),
        };
        let stream = self
            .js
            .get_stream_no_info(&spec.stream)
            .await
            .map_err(|e| BusError::DeclareConsumer {
                stream: spec.stream.clone(),
                durable: spec.durable.clone(),
                transient: true,
                source: Box::new(e),
            })?;
        let consumer = stream
            .create_consumer(spec.config())
            .await
            .map_err(declare_error)?;
        tracing::debug!(stream = %spec.stream, durable = %spec.durable, "consumer declared");
        Ok(consumer)
    }

    /// Pending counters of a durable consumer (metrics and status pages).
    pub async fn consumer_info(
        &self,
        stream: &str,
        durable: &str,
    ) -> Result<ConsumerCounts, BusError> {
        let error = |e: Box<dyn std::error::Error + Send + Sync>| BusError::ConsumerInfo {
            stream: stream.to_owned(),
            durable: durable.to_owned(),
            source: e,
        };
        let handle = self
            .js
            .get_stream_no_info(stream)
            .await
            .map_err(|e| error(Box::new(e)))?;
        let info = handle
            .consumer_info(durable)
            .await
            .map_err(|e| error(Box::new(e)))?;
        Ok(ConsumerCounts {
            num_pending: info.num_pending,
            num_ack_pending: info.num_ack_pending as u64,
            num_redelivered: info.num_redelivered as u64,
            num_waiting: info.num_waiting as u64,
            ack_floor_stream_seq: info.ack_floor.stream_sequence,
            delivered_stream_seq: info.delivered.stream_sequence,
        })
    }
}

/// Consumer counters (docs/operations.md explains each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsumerCounts {
    /// Matching messages not yet delivered (the queue depth).
    pub num_pending: u64,
    /// Delivered but not yet acked or termed.
    pub num_ack_pending: u64,
    pub num_redelivered: u64,
    /// Open pull requests.
    pub num_waiting: u64,
    pub ack_floor_stream_seq: u64,
    pub delivered_stream_seq: u64,
}
