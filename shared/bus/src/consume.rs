//! The consumer loop: pull, decode, run the handler inside a span whose parent is the message's
//! trace context, keep the message alive while the handler runs, apply its disposition.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures::StreamExt;
use jr_protocol::Envelope;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::bus::Bus;
use crate::error::BusError;
use crate::gate::{Gate, Permit};
use crate::metrics::BusMetrics;
use crate::retry::{Backoff, retry_transient};
use crate::topology::ConsumerSpec;
use crate::trace;

/// One decoded message handed to a handler.
#[derive(Debug)]
pub struct Delivery {
    pub envelope: Envelope,
    pub subject: String,
    pub stream_seq: u64,
    /// 1 on the first delivery, n on the n-th redelivery.
    pub delivered_count: u64,
    pub headers: HeaderMap,
    /// The gate's slot, when the consumer runs with a gate. Take it to keep the slot beyond
    /// the handler (it is freed when dropped).
    pub permit: Option<Permit>,
}

/// What to do with a message once its handler returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Done: acknowledged with a confirmed (double) ack.
    Ack,
    /// Try again later: redelivered after the delay (at once when `None`).
    Nak(Option<Duration>),
    /// Never redeliver; the reason is logged.
    Term(String),
}

impl Disposition {
    fn label(&self) -> &'static str {
        match self {
            Disposition::Ack => "ack",
            Disposition::Nak(_) => "nak",
            Disposition::Term(_) => "term",
        }
    }
}

/// How a consumer loop pulls and runs handlers.
#[derive(Clone)]
pub struct ConsumerOptions {
    /// Handlers running at once (at least 1).
    pub concurrency: usize,
    /// When set, permits are acquired before each pull ("pull only while a slot is free"), one
    /// per message the pull may bring; each permit travels with its [`Delivery`].
    pub gate: Option<Arc<dyn Gate>>,
    /// Gated mode: the most messages one pull asks for (at least 1). A pull asks for as many
    /// as the gate grants and handler slots are free, up to this.
    pub pull_batch: usize,
    /// Lifetime of one pull request at the server.
    pub pull_expires: Duration,
    /// Idle heartbeat of the long-lived pull (ungated mode): two missed ones (a consumer leader
    /// that died or stalls) and the pull is made again.
    pub heartbeat: Duration,
    /// How long in-flight handlers may finish after shutdown before they are abandoned (their
    /// messages are then redelivered after ack_wait).
    pub drain_timeout: Duration,
    /// `AckKind::Progress` period while a handler runs; default ack_wait / 3.
    pub progress_interval: Option<Duration>,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            concurrency: 1,
            gate: None,
            pull_batch: 1,
            pull_expires: Duration::from_secs(10),
            heartbeat: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(10),
            progress_interval: None,
        }
    }
}

impl ConsumerOptions {
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    pub fn gate(mut self, gate: Arc<dyn Gate>) -> Self {
        self.gate = Some(gate);
        self
    }

    pub fn pull_batch(mut self, pull_batch: usize) -> Self {
        self.pull_batch = pull_batch.max(1);
        self
    }

    pub fn pull_expires(mut self, pull_expires: Duration) -> Self {
        self.pull_expires = pull_expires;
        self
    }
}

/// Why the pull loop left its inner loop.
enum Exit {
    Shutdown,
    /// Re-create the consumer handle and pull again after a backoff.
    Restart,
}

struct Context<H> {
    name: String,
    handler: Arc<H>,
    metrics: Arc<BusMetrics>,
    progress: Duration,
}

impl<H> Clone for Context<H> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            handler: self.handler.clone(),
            metrics: self.metrics.clone(),
            progress: self.progress,
        }
    }
}

impl Bus {
    /// Runs `handler` over the durable consumer `spec` (declared with create-or-update) until
    /// `shutdown` fires. Pull failures (NATS down, consumer deleted) are retried with backoff;
    /// only a non-transient declaration error ends the loop with `Err`. After shutdown, running
    /// handlers get `opts.drain_timeout` to finish; unfinished ones are abandoned unacked.
    pub async fn run_consumer<H, Fut>(
        &self,
        spec: &ConsumerSpec,
        handler: H,
        opts: ConsumerOptions,
        shutdown: CancellationToken,
    ) -> Result<(), BusError>
    where
        H: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Disposition> + Send + 'static,
    {
        let slots = Arc::new(Semaphore::new(opts.concurrency.max(1)));
        let mut tasks: JoinSet<()> = JoinSet::new();
        let mut backoff = crate::bus::nats_backoff();
        let handler = Arc::new(handler);
        let name = format!("{}/{}", spec.stream, spec.durable);
        let result = loop {
            let consumer =
                match retry_transient("declare consumer", &shutdown, || self.ensure_consumer(spec))
                    .await
                {
                    Ok(consumer) => consumer,
                    Err(BusError::ShutDown) => break Ok(()),
                    Err(error) => break Err(error),
                };
            let ack_wait = match consumer.cached_info().config.ack_wait {
                d if d.is_zero() => Duration::from_secs(30),
                d => d,
            };
            let ctx = Context {
                name: name.clone(),
                handler: handler.clone(),
                metrics: self.metrics.clone(),
                progress: opts.progress_interval.unwrap_or(ack_wait / 3),
            };
            let exit = match &opts.gate {
                None => {
                    pull_stream(
                        &consumer,
                        &ctx,
                        &opts,
                        &slots,
                        &mut tasks,
                        &mut backoff,
                        &shutdown,
                    )
                    .await
                }
                Some(gate) => {
                    pull_gated(
                        &consumer,
                        self.connections.subscribe(),
                        &ctx,
                        &opts,
                        gate.as_ref(),
                        &slots,
                        &mut tasks,
                        &mut backoff,
                        &shutdown,
                    )
                    .await
                }
            };
            match exit {
                Exit::Shutdown => break Ok(()),
                Exit::Restart => {
                    BusMetrics::count(&self.metrics.pull_errors, vec![("consumer", name.clone())]);
                    let delay = backoff.next_delay();
                    tokio::select! {
                        () = shutdown.cancelled() => break Ok(()),
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        };
        drain(&name, tasks, opts.drain_timeout).await;
        result
    }
}

async fn drain(name: &str, mut tasks: JoinSet<()>, timeout: Duration) {
    let all_done = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(timeout, all_done).await.is_err() {
        tracing::warn!(consumer = %name, abandoned = tasks.len(), "handlers did not finish in time");
        tasks.abort_all();
    }
}

fn reap(name: &str, tasks: &mut JoinSet<()>) {
    while let Some(done) = tasks.try_join_next() {
        if let Err(error) = done {
            // The message stays unacked and is redelivered after ack_wait.
            tracing::error!(consumer = %name, %error, "message handler panicked");
        }
    }
}

/// Ungated: one long-lived pull stream; a handler slot is taken before the next message is read.
async fn pull_stream<H, Fut>(
    consumer: &PullConsumer,
    ctx: &Context<H>,
    opts: &ConsumerOptions,
    slots: &Arc<Semaphore>,
    tasks: &mut JoinSet<()>,
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
) -> Exit
where
    H: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send + 'static,
{
    let messages = consumer
        .stream()
        .max_messages_per_batch(opts.concurrency.max(1))
        .heartbeat(opts.heartbeat)
        .expires(opts.pull_expires)
        .messages();
    let mut messages = tokio::select! {
        () = shutdown.cancelled() => return Exit::Shutdown,
        messages = messages => match messages {
            Ok(messages) => messages,
            Err(error) => {
                tracing::warn!(consumer = %ctx.name, %error, "could not start pulling");
                return Exit::Restart;
            }
        },
    };
    loop {
        reap(&ctx.name, tasks);
        let Some(slot) = handler_slot(slots, shutdown).await else {
            return Exit::Shutdown;
        };
        let next = tokio::select! {
            () = shutdown.cancelled() => return Exit::Shutdown,
            next = messages.next() => next,
        };
        match next {
            Some(Ok(message)) => {
                backoff.reset();
                dispatch(message, None, slot, ctx, tasks).await;
            }
            Some(Err(error)) => {
                tracing::warn!(consumer = %ctx.name, %error, "pull failed, pulling again");
                return Exit::Restart;
            }
            None => return Exit::Restart,
        }
    }
}

/// The longest a gated pull request lives: one request has no heartbeat, so this (plus the
/// margin) bounds how long a request held by a consumer leader that died goes unnoticed, and
/// with it how long after a new consumer leader is elected a gated consumer pulls again. Idle,
/// it costs one small request per consumer this often.
const GATED_PULL_EXPIRES: std::time::Duration = std::time::Duration::from_secs(2);

/// How long past a pull request's expiry a gated pull waits before it asks again.
const PULL_EXPIRY_MARGIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Gated: gate permits and handler slots (up to `pull_batch`, at least one of each), then a pull
/// of one message per permit. Permits left when a pull ends are given back, also when it
/// brought nothing: the gate's owner counts them as reserved (a worker keeps their slots from
/// everything else, warm executors included), so an idle consumer must not sit on them; the
/// next pull takes them again, sized by what the gate grants then.
#[allow(
    clippy::too_many_arguments,
    reason = "private plumbing of the consumer loop"
)]
async fn pull_gated<H, Fut>(
    consumer: &PullConsumer,
    mut connections: watch::Receiver<u64>,
    ctx: &Context<H>,
    opts: &ConsumerOptions,
    gate: &dyn Gate,
    slots: &Arc<Semaphore>,
    tasks: &mut JoinSet<()>,
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
) -> Exit
where
    H: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send + 'static,
{
    loop {
        reap(&ctx.name, tasks);
        let Some(slot) = handler_slot(slots, shutdown).await else {
            return Exit::Shutdown;
        };
        let mut permits = tokio::select! {
            () = shutdown.cancelled() => return Exit::Shutdown,
            permits = gate.acquire_many(opts.pull_batch.max(1)) => permits,
        };
        // One handler slot per permit; permits beyond the free slots are given back now.
        let mut handler_slots = vec![slot];
        while handler_slots.len() < permits.len() {
            match slots.clone().try_acquire_owned() {
                Ok(slot) => handler_slots.push(slot),
                Err(_) => break,
            }
        }
        permits.truncate(handler_slots.len());
        'pull: loop {
            reap(&ctx.name, tasks);
            let expires = opts.pull_expires.min(GATED_PULL_EXPIRES);
            let batch = consumer
                .batch()
                .max_messages(permits.len())
                .expires(expires)
                .messages();
            let mut batch = tokio::select! {
                () = shutdown.cancelled() => return Exit::Shutdown,
                batch = batch => match batch {
                    Ok(batch) => batch,
                    Err(error) => {
                        tracing::warn!(consumer = %ctx.name, %error, "pull request failed");
                        return Exit::Restart;
                    }
                },
            };
            let mut brought = 0_usize;
            // The server ends the request at its expiry; past that (and a margin) nothing will
            // come: the server holding it is gone (a consumer leader that was killed or stalled
            // while this client stays connected elsewhere), so ask again.
            let forgotten = tokio::time::sleep(expires + PULL_EXPIRY_MARGIN);
            tokio::pin!(forgotten);
            loop {
                let next = tokio::select! {
                    () = shutdown.cancelled() => return Exit::Shutdown,
                    next = batch.next() => next,
                    () = &mut forgotten => {
                        tracing::debug!(consumer = %ctx.name, "pull request outlived its expiry; pulling again");
                        continue 'pull;
                    }
                    // A reconnection loses the pull request at the server; ask again at once
                    // (with the permits still held) rather than waiting for its expiry.
                    Ok(()) = connections.changed() => continue 'pull,
                };
                match next {
                    Some(Ok(message)) => {
                        let (Some(permit), Some(slot)) = (permits.pop(), handler_slots.pop())
                        else {
                            // More messages than asked for cannot come; should one, it stays
                            // unacked and is redelivered after ack_wait.
                            tracing::warn!(consumer = %ctx.name, "a pull brought more messages than it asked for");
                            break 'pull;
                        };
                        brought += 1;
                        backoff.reset();
                        dispatch(message, Some(permit), slot, ctx, tasks).await;
                        if permits.is_empty() {
                            break 'pull;
                        }
                    }
                    Some(Err(error)) => {
                        tracing::warn!(consumer = %ctx.name, %error, "pull failed, pulling again");
                        return Exit::Restart;
                    }
                    // The pull request ended (expired, or fewer messages were waiting): the
                    // permits go back, and the next pull asks the gate again.
                    None => {
                        if brought == 0 {
                            tracing::trace!(consumer = %ctx.name, "empty pull; permits given back");
                        }
                        break 'pull;
                    }
                }
            }
        }
    }
}

/// Decodes one message and starts its handler; undecodable messages are termed here.
async fn dispatch<H, Fut>(
    message: jetstream::Message,
    permit: Option<Permit>,
    slot: OwnedSemaphorePermit,
    ctx: &Context<H>,
    tasks: &mut JoinSet<()>,
) where
    H: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send + 'static,
{
    let (stream_seq, delivered_count) = match message.info() {
        Ok(info) => (
            info.stream_sequence,
            u64::try_from(info.delivered).unwrap_or(0),
        ),
        Err(_) => (0, 0),
    };
    let subject = message.subject.to_string();
    let envelope = match jr_protocol::decode(&message.payload) {
        Ok(envelope) => envelope,
        Err(error) => {
            tracing::warn!(consumer = %ctx.name, %subject, stream_seq, %error,
                "undecodable message, terminating it");
            BusMetrics::count(
                &ctx.metrics.undecodable,
                vec![
                    ("consumer", ctx.name.clone()),
                    ("reason", error.kind().to_owned()),
                ],
            );
            settle(
                &message,
                Disposition::Term(format!("undecodable: {error}")),
                ctx,
            )
            .await;
            return;
        }
    };
    tracing::debug!(consumer = %ctx.name, %subject, stream_seq, delivered_count, id = %envelope.id,
        "dispatching message");
    let parent = trace::extract_context(message.headers.as_ref(), envelope.trace.as_ref());
    let span = tracing::info_span!(
        "consume",
        consumer = %ctx.name,
        %subject,
        kind = envelope.kind().as_str(),
        assignment = %envelope.assignment_id,
        attempt = envelope.attempt,
        stream_seq,
        delivered_count,
    );
    // Fails only when no OpenTelemetry layer is installed; the span is then just a log span.
    let _ = span.set_parent(parent);
    let delivery = Delivery {
        envelope,
        subject,
        stream_seq,
        delivered_count,
        headers: message.headers.clone().unwrap_or_default(),
        permit,
    };
    let ctx = ctx.clone();
    let run = async move {
        let handled = (ctx.handler)(delivery);
        tokio::pin!(handled);
        let period = ctx.progress.max(Duration::from_millis(100));
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let disposition = loop {
            tokio::select! {
                disposition = &mut handled => break disposition,
                _ = progress.tick() => {
                    if let Err(error) = message.ack_with(AckKind::Progress).await {
                        tracing::warn!(%error, "could not extend the ack deadline");
                    }
                }
            }
        };
        settle(&message, disposition, &ctx).await;
        drop(slot);
    };
    tasks.spawn(run.instrument(span));
}

async fn settle<H>(message: &jetstream::Message, disposition: Disposition, ctx: &Context<H>) {
    BusMetrics::count(
        &ctx.metrics.dispositions,
        vec![
            ("consumer", ctx.name.clone()),
            ("disposition", disposition.label().to_owned()),
        ],
    );
    let result = match &disposition {
        Disposition::Ack => message.double_ack().await,
        Disposition::Nak(delay) => message.ack_with(AckKind::Nak(*delay)).await,
        Disposition::Term(reason) => {
            tracing::warn!(consumer = %ctx.name, subject = %message.subject, %reason, "message terminated");
            message.ack_with(AckKind::Term).await
        }
    };
    if let Err(error) = result {
        // Without a confirmed ack the server redelivers after ack_wait; handlers are idempotent.
        tracing::warn!(consumer = %ctx.name, %error, disposition = disposition.label(),
            "could not settle message; it will be redelivered");
    }
}

/// A free handler slot, or `None` once shutdown fires (or the slots are closed).
async fn handler_slot(
    slots: &Arc<Semaphore>,
    shutdown: &CancellationToken,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    tokio::select! {
        () = shutdown.cancelled() => None,
        slot = slots.clone().acquire_owned() => slot.ok(),
    }
}
