//! The JetStream bus of jetrunner (docs/architecture.md): the three streams and the durable consumers
//! declared in code, publishing envelopes with readable headers, dedupe ids, once-only facts and
//! W3C trace context, and a consumer loop that decodes, gates, traces and settles every message.
//!
//! ```no_run
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), jr_bus::BusError> {
//! use jr_bus::{Bus, ConsumerOptions, ConsumerSpec, Disposition, Topology};
//! let backend = jr_protocol::BackendName::new("pod").expect("valid");
//! let bus = Bus::connect("nats://127.0.0.1:4222", "pod-worker", None).await?;
//! let spec = ConsumerSpec::worker_assignments(&backend);
//! bus.ensure_topology(&Topology::new().consumer(spec.clone())).await?;
//! bus.run_consumer(&spec, |delivery| async move {
//!     tracing::info!(id = %delivery.envelope.id, "got it");
//!     Disposition::Ack
//! }, ConsumerOptions::default(), shutdown).await
//! # }
//! ```

mod bus;
mod consume;
mod error;
mod gate;
pub mod intake;
pub mod lease;
mod metrics;
pub mod permissions;
mod publish;
mod retry;
mod topology;
mod trace;
pub mod warm;

#[cfg(feature = "testing")]
pub mod testing;

pub use async_nats;
pub use bus::{Bus, CALL_TIMEOUT, Credentials, PING_INTERVAL, nats_backoff, server_urls};
pub use consume::{ConsumerOptions, Delivery, Disposition};
pub use error::{BusError, PublishFailure};
pub use gate::{Gate, Permit, SemaphoreGate};
pub use metrics::{BusMetrics, Labels};
pub use publish::{PublishOnce, PublishOutcome};
pub use retry::{Backoff, retry_transient};
pub use tokio_util::sync::CancellationToken;
pub use topology::{ConsumerCounts, ConsumerSpec, StartFrom, StreamLimit, StreamLimits, Topology};
pub use trace::{TraceBook, current_trace_context, extract_context, follow};
