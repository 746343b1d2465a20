//! The projector: the single writer of the Postgres projection. It reads each stream in order
//! with an ordered consumer that starts right after the stream's checkpoint in the projection,
//! and applies what it reads in batches, one transaction per batch (checkpoint included), so a
//! crash or a Postgres outage never skips or doubles anything.
//!
//! It never trusts its own idea of how far the projection got: before each batch (and whenever
//! it is idle) it compares the stored checkpoint with the last one it committed. A Postgres that
//! lost acknowledged commits (crash with `synchronous_commit = off`, failover to an asynchronous
//! replica, restore from backup) shows a lower checkpoint; the projector then starts again from
//! the stored checkpoint instead of applying the next batch over a gap.
//!
//! Poison never stops it: a message that cannot be decoded (or is refused at decode) goes to
//! the store as a rejected item, and the store quarantines it, and any message the database
//! refuses, in the same transaction that moves the checkpoint past it. Only errors that can pass
//! (Postgres unreachable, a lock timeout, ...) make it retry the same batch.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use jr_bus::Bus;
use jr_store::{Store, StreamMessage};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Progress of one stream's projection (for readiness and metrics).
#[derive(Debug, Default)]
pub struct ProjectorState {
    pub applied: AtomicU64,
    /// Messages recorded in the quarantine table and skipped by this process.
    pub quarantined: AtomicU64,
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
        let started = std::time::Instant::now();
        match project(&bus, &store, stream, max_batch, &state, &applied, &shutdown).await {
            Ok(()) => return,
            Err(e) => {
                state.caught_up.store(false, Ordering::Release);
                if started.elapsed() > Duration::from_secs(30) {
                    delay = Duration::from_millis(200);
                }
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

async fn checkpoint_with_retry(
    store: &Store,
    stream: &str,
    state: &ProjectorState,
    shutdown: &CancellationToken,
) -> Option<u64> {
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
    let Some(checkpoint) = checkpoint_with_retry(store, stream, state, shutdown).await else {
        return Ok(());
    };
    state.checkpoint.store(checkpoint, Ordering::Release);
    // The last checkpoint this run committed (or found): what the store must still say.
    let mut expected = checkpoint;
    let js = bus.jetstream();
    let handle = js.get_stream(stream).await?;
    let consumer = handle
        .create_consumer(OrderedConfig {
            // Named: the reconciler's NATS user may not use the nameless create endpoint.
            name: Some(jr_bus::permissions::ordered_consumer_name("reconciler")),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: checkpoint + 1,
            },
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    loop {
        // Take what is there now, up to a batch; wait briefly for the first message only.
        let mut batch: Vec<StreamMessage> = Vec::new();
        let first = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = tokio::time::timeout(Duration::from_millis(250), messages.next()) => m,
        };
        let mut next = match first {
            Err(_elapsed) => {
                // Idle: caught up, provided the store still has everything we committed.
                match store.checkpoint(stream).await {
                    Ok(stored) => {
                        check_continuity(stream, stored, expected)?;
                        state.caught_up.store(true, Ordering::Release);
                    }
                    Err(e) => {
                        state.store_errors.fetch_add(1, Ordering::Relaxed);
                        state.caught_up.store(false, Ordering::Release);
                        tracing::warn!(stream, error = %e, "cannot read checkpoint");
                    }
                }
                continue;
            }
            Ok(None) => anyhow::bail!("ordered consumer ended"),
            Ok(Some(m)) => Some(m),
        };
        while let Some(item) = next.take() {
            let message = item?;
            let seq = message
                .info()
                .map_err(|e| anyhow::anyhow!("message info: {e}"))?
                .stream_sequence;
            let content = jr_protocol::decode(&message.payload).map_err(|e| {
                tracing::warn!(stream, seq, subject = %message.subject, error = %e, "undecodable message; it will be quarantined");
                e.to_string()
            });
            batch.push(StreamMessage {
                seq,
                subject: message.subject.to_string(),
                size: message.payload.len(),
                content,
            });
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
            // The batch continues the stored checkpoint only if the store kept every commit.
            let result = match store.checkpoint(stream).await {
                Ok(stored) => {
                    check_continuity(stream, stored, expected)?;
                    store.apply_messages(stream, &batch).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(stats) => {
                    expected = stats.checkpoint;
                    state
                        .applied
                        .fetch_add(stats.applied as u64, Ordering::Relaxed);
                    if stats.quarantined > 0 {
                        state
                            .quarantined
                            .fetch_add(stats.quarantined as u64, Ordering::Relaxed);
                        tracing::warn!(
                            stream,
                            quarantined = stats.quarantined,
                            checkpoint = stats.checkpoint,
                            "messages quarantined and skipped"
                        );
                    }
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

/// `Err` (restart from the stored checkpoint) unless the store's checkpoint is the one this run
/// last committed: lower means Postgres lost acknowledged commits, higher means another writer.
fn check_continuity(stream: &str, stored: u64, expected: u64) -> anyhow::Result<()> {
    if stored != expected {
        anyhow::bail!(
            "{stream}: stored checkpoint is {stored}, this projector committed up to {expected} \
             (the database lost commits or another projector writes); replaying from {stored}"
        );
    }
    Ok(())
}

use futures::FutureExt as _;
