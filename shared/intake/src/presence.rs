//! What pacing reads about each backend from the bus: the assignments waiting for its worker
//! (the worker consumer's pending count) and whether a worker replica lives (a holding in
//! the `slots` record of `JR_WORKLOADS_<backend>`, renewed every second by each replica).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use jr_bus::async_nats::jetstream::kv;
use jr_bus::{Bus, ConsumerSpec};
use jr_protocol::{BackendName, STREAM_ASSIGNMENTS, now_ms};

use crate::pacing::{BackendRoom, Worker, worker_lives};

/// A worker's liveness is read again after this long (it changes on the scale of seconds;
/// the pending count is read at every decision).
const LIVENESS_TTL: Duration = Duration::from_millis(500);

/// Cached handles and readings of the workers' capacity records.
#[derive(Debug, Default)]
pub struct WorkerPresence {
    stores: tokio::sync::Mutex<BTreeMap<BackendName, kv::Store>>,
    seen: std::sync::Mutex<BTreeMap<BackendName, (Instant, Worker)>>,
}

impl WorkerPresence {
    /// Whether a worker of `backend` lives now.
    pub async fn worker(&self, bus: &Bus, backend: &BackendName) -> Worker {
        if let Some((at, worker)) = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(backend)
            .copied()
            && at.elapsed() < LIVENESS_TTL
        {
            return worker;
        }
        let worker = self.read(bus, backend).await;
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(backend.clone(), (Instant::now(), worker));
        worker
    }

    async fn read(&self, bus: &Bus, backend: &BackendName) -> Worker {
        let mut stores = self.stores.lock().await;
        if !stores.contains_key(backend) {
            let bucket = jr_bus::permissions::worker_bucket(backend);
            match bus.jetstream().get_key_value(&bucket).await {
                Ok(store) => {
                    stores.insert(backend.clone(), store);
                }
                Err(e)
                    if e.kind()
                        == jr_bus::async_nats::jetstream::context::KeyValueErrorKind::GetBucket =>
                {
                    // No worker of this backend ever started here.
                    tracing::debug!(%backend, error = %e, "no worker bucket");
                    return Worker::Gone;
                }
                Err(e) => {
                    tracing::debug!(%backend, error = %e, "worker bucket not readable");
                    return Worker::Unknown;
                }
            }
        }
        let Some(store) = stores.get(backend) else {
            return Worker::Unknown;
        };
        match store.get(jr_bus::permissions::WORKER_SLOTS_KEY).await {
            Ok(None) => Worker::Gone,
            Ok(Some(bytes)) => match serde_json::from_slice::<jr_lease::Slots>(&bytes) {
                Ok(slots) if worker_lives(&slots, now_ms()) => Worker::Live,
                Ok(_) => Worker::Gone,
                Err(e) => {
                    tracing::warn!(%backend, error = %e, "the workers' capacity record is not readable");
                    Worker::Unknown
                }
            },
            Err(e) => {
                tracing::debug!(%backend, error = %e, "reading the workers' capacity record failed");
                // The handle may be stale (NATS restarted with a fresh store): open it again.
                stores.remove(backend);
                Worker::Unknown
            }
        }
    }
}

/// The pending count of `backend`'s worker consumer; `None` when it cannot be read.
pub async fn waiting(bus: &Bus, backend: &BackendName) -> Option<u64> {
    let durable = ConsumerSpec::worker_assignments(backend).durable;
    match bus.consumer_info(STREAM_ASSIGNMENTS, &durable).await {
        Ok(counts) => Some(counts.num_pending),
        Err(e) => {
            tracing::debug!(%backend, error = %e, "worker consumer not readable; no room");
            None
        }
    }
}

/// One backend's reading.
#[derive(Clone, Copy, Debug)]
pub struct Reading {
    pub room: BackendRoom,
    pub worker: Worker,
}
