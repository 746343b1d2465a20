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
//!
//! After each commit it hands the records the batch changed, as committed, to the planner's
//! copy of the projection through the [`Feed`], in commit order. When it starts over from the
//! stored checkpoint (its view of what was committed may be wrong), it asks for that copy to be
//! loaded again from Postgres.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use jr_bus::{Backoff, Bus};
use jr_store::{AssignmentRecord, Store, StoreError, StreamMessage};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// From the projectors to the planner: the records each committed batch changed, in the order
/// the batches were committed, and whether the planner's copy must be loaded again.
#[derive(Debug)]
pub struct Feed {
    /// Held from a batch's apply until its records are handed over, and while the copy is
    /// loaded, so the hand-over order is the commit order and a load sees every earlier commit.
    order: tokio::sync::Mutex<()>,
    pending: Mutex<Pending>,
    applied: Notify,
    /// The jobs' trace contexts, from their assignments as projected, for the commands the
    /// planner issues about them.
    pub traces: jr_bus::TraceBook,
}

#[derive(Debug, Default)]
struct Pending {
    records: Vec<AssignmentRecord>,
    reload: bool,
}

impl Default for Feed {
    fn default() -> Self {
        Self::new()
    }
}

impl Feed {
    /// A feed whose copy must be loaded first.
    pub fn new() -> Self {
        Self {
            order: tokio::sync::Mutex::new(()),
            pending: Mutex::new(Pending {
                records: Vec::new(),
                reload: true,
            }),
            applied: Notify::new(),
            traces: jr_bus::TraceBook::default(),
        }
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies a batch with `apply` and hands over the records it changed.
    pub async fn commit<F>(&self, apply: F) -> Result<jr_store::ApplyStats, StoreError>
    where
        F: Future<Output = Result<jr_store::Applied, StoreError>>,
    {
        let _order = self.order.lock().await;
        let applied = apply.await?;
        self.pending().records.extend(applied.records);
        self.applied.notify_one();
        Ok(applied.stats)
    }

    /// What was handed over may be wrong or incomplete: load the copy again.
    pub fn invalidate(&self) {
        self.pending().reload = true;
    }

    /// Whether the copy must be loaded again.
    pub fn needs_reload(&self) -> bool {
        self.pending().reload
    }

    /// Records handed over since the last call, in commit order.
    pub fn take(&self) -> Vec<AssignmentRecord> {
        std::mem::take(&mut self.pending().records)
    }

    /// Loads the copy with `load` while no batch commits; what was handed over before is
    /// dropped (the load has it). On failure the copy still needs loading.
    pub async fn reload<F, T>(&self, load: F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let _order = self.order.lock().await;
        {
            let mut pending = self.pending();
            pending.records.clear();
            pending.reload = false;
        }
        let result = load.await;
        if result.is_err() {
            self.invalidate();
        }
        result
    }

    /// Resolves after the next committed batch.
    pub async fn applied(&self) {
        self.applied.notified().await;
    }
}

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
    /// Messages after the last one read that the stream still holds for the projector.
    pub pending: AtomicU64,
    /// Unix ms: the stream time of the oldest message not yet committed to the projection, as
    /// far as the projector knows (an upper bound of its age); 0 when caught up.
    pub behind_since: AtomicU64,
}

impl ProjectorState {
    /// How far behind the stream the projection is, in ms at `now` (0 when caught up).
    pub fn lag_ms(&self, now: u64) -> u64 {
        match self.behind_since.load(Ordering::Acquire) {
            0 => 0,
            since => now.saturating_sub(since),
        }
    }
}

/// Unix ms of a message's stream time.
fn stream_ms(info: &async_nats::jetstream::message::Info<'_>) -> u64 {
    u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0)
}

/// Projects `stream` until shutdown, handing each committed batch's records to `feed`. A batch
/// is what arrives within `linger` of its first message, up to `max_batch` messages.
#[expect(
    clippy::too_many_arguments,
    reason = "the projector's whole context, passed once"
)]
pub async fn run(
    bus: Bus,
    store: Store,
    stream: &'static str,
    max_batch: usize,
    linger: Duration,
    state: Arc<ProjectorState>,
    feed: Arc<Feed>,
    shutdown: CancellationToken,
) {
    let mut backoff = jr_bus::nats_backoff();
    while !shutdown.is_cancelled() {
        let started = std::time::Instant::now();
        match project(
            &bus, &store, stream, max_batch, linger, &state, &feed, &shutdown,
        )
        .await
        {
            Ok(()) => return,
            Err(e) => {
                state.caught_up.store(false, Ordering::Release);
                // A commit whose outcome this run did not see (or one Postgres lost) may be
                // missing from, or wrongly in, the planner's copy.
                feed.invalidate();
                if started.elapsed() > Duration::from_secs(30) {
                    backoff.reset();
                }
                tracing::warn!(stream, error = %e, "projector interrupted; resuming from the checkpoint");
            }
        }
        if !backoff.pause(&shutdown).await {
            return;
        }
    }
}

async fn checkpoint_with_retry(
    store: &Store,
    stream: &str,
    state: &ProjectorState,
    shutdown: &CancellationToken,
) -> Option<u64> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        match store.checkpoint(stream).await {
            Ok(seq) => return Some(seq),
            Err(e) => {
                state.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(stream, error = %e, "cannot read checkpoint; retrying");
            }
        }
        if !backoff.pause(shutdown).await {
            return None;
        }
    }
}

#[expect(
    clippy::too_many_arguments,
    reason = "the projector's whole context, passed once"
)]
async fn project(
    bus: &Bus,
    store: &Store,
    stream: &'static str,
    max_batch: usize,
    linger: Duration,
    state: &ProjectorState,
    feed: &Feed,
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
    let mut handle = handle;
    // Idle while the stream holds more than was committed: since when, and when it was last
    // looked at (see `STALLED_AFTER`).
    let mut ahead_since: Option<tokio::time::Instant> = None;
    let mut looked = tokio::time::Instant::now();
    loop {
        // Take what is there now, up to a batch; wait briefly for the first message only.
        let mut batch: Vec<StreamMessage> = Vec::new();
        let first = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = tokio::time::timeout(Duration::from_millis(250), messages.next()) => m,
        };
        let mut next = match first {
            Err(_elapsed) => {
                // An ordered consumer lives on the stream leader: when that server dies or
                // stalls, it may go quiet without an error. Idle while the stream holds more
                // than was committed, for long enough, means that: start again.
                if looked.elapsed() >= STALL_LOOK {
                    looked = tokio::time::Instant::now();
                    let last = handle.info().await.map(|i| i.state.last_sequence).ok();
                    match last {
                        Some(last) if last > expected => {
                            let since = *ahead_since.get_or_insert(looked);
                            if since.elapsed() >= STALLED_AFTER {
                                anyhow::bail!(
                                    "ordered consumer on {stream} delivers nothing at {expected} while the stream holds {last}"
                                );
                            }
                        }
                        Some(_) => ahead_since = None,
                        None => {}
                    }
                }
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
            Ok(Some(m)) => {
                ahead_since = None;
                Some(m)
            }
        };
        let until = tokio::time::Instant::now() + linger;
        let mut last_read = (0u64, 0u64); // (stream time, pending after it)
        while let Some(item) = next.take() {
            let message = item?;
            let info = message
                .info()
                .map_err(|e| anyhow::anyhow!("message info: {e}"))?;
            let seq = info.stream_sequence;
            last_read = (stream_ms(&info), info.pending);
            if batch.is_empty() && state.behind_since.load(Ordering::Acquire) == 0 {
                state
                    .behind_since
                    .store(last_read.0.max(1), Ordering::Release);
            }
            let content = jr_protocol::decode(&message.payload).map_err(|e| {
                tracing::warn!(stream, seq, subject = %message.subject, error = %e, "undecodable message; it will be quarantined");
                e.to_string()
            });
            if let Ok(envelope) = &content
                && matches!(envelope.message, jr_protocol::Message::Assignment(_))
            {
                feed.traces
                    .remember(envelope.assignment_id, envelope.trace.clone());
            }
            batch.push(StreamMessage {
                seq,
                subject: message.subject.to_string(),
                size: message.payload.len(),
                content,
            });
            if batch.len() >= max_batch {
                break;
            }
            // More already buffered, or arriving within the linger? Take it.
            if let Some(Some(m)) = messages.next().now_or_never() {
                next = Some(m);
            } else if let Ok(Some(m)) = tokio::time::timeout_at(until, messages.next()).await {
                next = Some(m);
            }
        }
        if batch.is_empty() {
            continue;
        }
        let mut backoff = jr_bus::nats_backoff();
        loop {
            // The batch continues the stored checkpoint only if the store kept every commit.
            let result = match store.checkpoint(stream).await {
                Ok(stored) => {
                    check_continuity(stream, stored, expected)?;
                    feed.commit(store.apply_messages_returning(stream, &batch))
                        .await
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
                    let (last_time, pending) = last_read;
                    state.pending.store(pending, Ordering::Release);
                    // Still behind: what comes next is no older than the last committed.
                    let behind = if pending == 0 { 0 } else { last_time.max(1) };
                    state.behind_since.store(behind, Ordering::Release);
                    break;
                }
                Err(e) => {
                    state.store_errors.fetch_add(1, Ordering::Relaxed);
                    state.caught_up.store(false, Ordering::Release);
                    tracing::warn!(stream, error = %e, "cannot apply batch; retrying the same batch");
                    if !backoff.pause(shutdown).await {
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// How often an idle projector compares the stream's last sequence with its checkpoint.
const STALL_LOOK: Duration = Duration::from_secs(1);
/// Idle this long with the stream ahead of the checkpoint: the ordered consumer is gone.
const STALLED_AFTER: Duration = Duration::from_secs(3);

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
