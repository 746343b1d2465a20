//! The projector: the single writer of the Postgres projection. It reads each stream in order
//! with an ordered consumer that starts right after the stream's checkpoint in the projection,
//! and applies what it reads in batches, one transaction per batch (checkpoint included), so a
//! crash or a Postgres outage never skips or doubles anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use jr_bus::Bus;
use jr_protocol::Envelope;
use jr_store::Store;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Progress of one stream's projection (for readiness and metrics).
#[derive(Debug, Default)]
pub struct ProjectorState {
    pub applied: AtomicU64,
    pub skipped_undecodable: AtomicU64,
    pub checkpoint: AtomicU64,
    /// The last fetch found nothing more: the projection has caught up with the stream.
    pub caught_up: AtomicBool,
    pub store_errors: AtomicU64,
}

/// Projects `stream` until shutdown; `applied` is notified after every applied batch.
pub async fn run(
    bus: Bus,
    store: Store,
    stream: &'static str,
    max_batch: usize,
    state: Arc<ProjectorState>,
    applied: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let mut delay = Duration::from_millis(200);
    while !shutdown.is_cancelled() {
        match project(&bus, &store, stream, max_batch, &state, &applied, &shutdown).await {
            Ok(()) => return,
            Err(e) => {
                state.caught_up.store(false, Ordering::Release);
                tracing::warn!(stream, error = %e, retry_in = ?delay, "projector interrupted; resuming from the checkpoint");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

async fn checkpoint_with_retry(store: &Store, stream: &str, state: &ProjectorState, shutdown: &CancellationToken) -> Option<u64> {
    let mut delay = Duration::from_millis(200);
    loop {
        match store.checkpoint(stream).await {
            Ok(seq) => return Some(seq),
            Err(e) => {
                state.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(stream, error = %e, "cannot read checkpoint; retrying");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

async fn project(
    bus: &Bus,
    store: &Store,
    stream: &'static str,
    max_batch: usize,
    state: &ProjectorState,
    applied: &Notify,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let Some(checkpoint) = checkpoint_with_retry(store, stream, state, shutdown).await else { return Ok(()) };
    state.checkpoint.store(checkpoint, Ordering::Release);
    let js = bus.jetstream();
    let handle = js.get_stream(stream).await?;
    let consumer = handle
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: checkpoint + 1 },
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    loop {
        // Take what is there now, up to a batch; wait briefly for the first message only.
        let mut batch: Vec<(u64, Envelope)> = Vec::new();
        let first = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = tokio::time::timeout(Duration::from_millis(250), messages.next()) => m,
        };
        let mut next = match first {
            Err(_elapsed) => {
                state.caught_up.store(true, Ordering::Release);
                continue;
            }
            Ok(None) => anyhow::bail!("ordered consumer ended"),
            Ok(Some(m)) => Some(m),
        };
        while let Some(item) = next.take() {
            let message = item?;
            let seq = message.info().map_err(|e| anyhow::anyhow!("message info: {e}"))?.stream_sequence;
            match jr_protocol::decode(&message.payload) {
                Ok(envelope) => batch.push((seq, envelope)),
                Err(e) => {
                    state.skipped_undecodable.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(stream, seq, error = %e, "undecodable message skipped by the projection");
                }
            }
            if batch.len() >= max_batch {
                break;
            }
            // More already buffered? Take it without waiting.
            if let Some(Some(m)) = messages.next().now_or_never() {
                next = Some(m);
            }
        }
        if batch.is_empty() {
            continue;
        }
        let mut delay = Duration::from_millis(100);
        loop {
            match store.apply_batch(stream, &batch).await {
                Ok(stats) => {
                    state.applied.fetch_add(stats.applied as u64, Ordering::Relaxed);
                    state.checkpoint.store(stats.checkpoint, Ordering::Release);
                    break;
                }
                Err(e) => {
                    state.store_errors.fetch_add(1, Ordering::Relaxed);
                    state.caught_up.store(false, Ordering::Release);
                    tracing::warn!(stream, error = %e, "cannot apply batch; retrying the same batch");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
        applied.notify_one();
    }
}

use futures::FutureExt as _;
