//! Tasks the scheduler fetched that no executor has claimed yet. For the forge such a task is
//! already running, and its zombie reaper fails it after a while without `UpdateTask` (Gitea:
//! 10 minutes). Every such task gets a heartbeat each `keepalive_interval`; when the reply says
//! the forge has already ended it (a user cancelled the run, a reaper failed it), the assignment
//! is withdrawn: a once-only `terminal` with source `withdrawn`, which workers and the reconciler
//! honour (no workload is created for it, one that exists is deleted).
//!
//! The set is rebuilt after a restart from JetStream: assignments published within the forge's
//! endless-task horizon that have neither `claimed` nor `terminal`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use jr_bus::async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use jr_bus::{Bus, PublishOnce};
use jr_protocol::{
    AssignmentId, BackendName, Envelope, Kind, Message, STREAM_ASSIGNMENTS, STREAM_EVENTS,
    TaskResult, Terminal, TerminalSource, subject,
};
use tokio_util::sync::CancellationToken;

use crate::forges::Forges;
use jr_forge::report::keepalive;

/// Retry delay for a heartbeat the forge did not answer.
const RETRY_FAILED_KEEPALIVE: Duration = Duration::from_secs(10);
/// How often the keepalive loop looks for due heartbeats.
const TICK: Duration = Duration::from_millis(500);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub forge_task_id: i64,
    pub backend: BackendName,
    pub attempt: u32,
    next_keepalive: Instant,
}

/// The fetched-but-unclaimed tasks, shared by the fetchers (insert), the facade (claimed or
/// terminal) and the keepalive loop.
#[derive(Debug)]
pub struct Unclaimed {
    interval: Duration,
    waiting: Mutex<HashMap<AssignmentId, Waiting>>,
}

impl Unclaimed {
    /// `forge.keepalive_interval`.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            waiting: Mutex::new(HashMap::new()),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<AssignmentId, Waiting>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A task was just fetched (or redispatched): its next heartbeat is one interval away.
    pub fn fetched(
        &self,
        id: AssignmentId,
        forge_task_id: i64,
        backend: BackendName,
        attempt: u32,
        now: Instant,
    ) {
        self.map().insert(
            id,
            Waiting {
                forge_task_id,
                backend,
                attempt,
                next_keepalive: now + self.interval,
            },
        );
    }

    /// The task was claimed, or became terminal: the executor (or nobody) keeps it alive now.
    pub fn settled(&self, id: AssignmentId) {
        self.map().remove(&id);
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// Heartbeats due at `now`.
    fn due(&self, now: Instant) -> Vec<(AssignmentId, Waiting)> {
        self.map()
            .iter()
            .filter(|(_, w)| w.next_keepalive <= now)
            .map(|(id, w)| (*id, w.clone()))
            .collect()
    }

    fn reschedule(&self, id: AssignmentId, at: Instant) {
        if let Some(w) = self.map().get_mut(&id) {
            w.next_keepalive = at;
        }
    }

    /// Rebuilds the set after a restart: every assignment published since `horizon` ago
    /// without `claimed` or `terminal`. Their heartbeats are due at once (nobody sent one while
    /// the scheduler was down).
    pub async fn rebuild(
        &self,
        bus: &Bus,
        backends: &[BackendName],
        horizon: Duration,
    ) -> anyhow::Result<usize> {
        let since = time::OffsetDateTime::now_utc() - horizon;
        let mut found: HashMap<AssignmentId, (i64, BackendName, u32)> = HashMap::new();
        let filters: Vec<String> = backends.iter().map(subject::assignments_of).collect();
        for (_, envelope) in replay(bus, STREAM_ASSIGNMENTS, filters, since).await? {
            // Only a task the forge handed out needs keeping alive (GitHub keeps its jobs).
            if let Message::Assignment(a) = &envelope.message
                && a.forge_kind().holds_forge_task()
            {
                found.insert(
                    envelope.assignment_id,
                    (a.forge_task_id, a.backend.clone(), envelope.attempt),
                );
            }
        }
        if found.is_empty() {
            return Ok(0);
        }
        let settled_filters = vec![
            format!("jr.event.*.*.{}", Kind::Claimed.as_str()),
            format!("jr.event.*.*.{}", Kind::Terminal.as_str()),
        ];
        for (_, envelope) in replay(bus, STREAM_EVENTS, settled_filters, since).await? {
            found.remove(&envelope.assignment_id);
        }
        let now = Instant::now();
        let mut map = self.map();
        for (id, (forge_task_id, backend, attempt)) in &found {
            map.insert(
                *id,
                Waiting {
                    forge_task_id: *forge_task_id,
                    backend: backend.clone(),
                    attempt: *attempt,
                    next_keepalive: now,
                },
            );
        }
        Ok(found.len())
    }
}

/// Every message on `filters` stored since `since`, read once with an ordered consumer.
async fn replay(
    bus: &Bus,
    stream: &str,
    filters: Vec<String>,
    since: time::OffsetDateTime,
) -> anyhow::Result<Vec<(String, Envelope)>> {
    let handle = bus.jetstream().get_stream(stream).await?;
    let mut consumer = handle
        .create_consumer(OrderedConfig {
            // Named: the scheduler's NATS user may not use the nameless create endpoint.
            name: Some(jr_bus::permissions::ordered_consumer_name("scheduler")),
            filter_subjects: filters,
            deliver_policy: DeliverPolicy::ByStartTime { start_time: since },
            ..Default::default()
        })
        .await?;
    let mut out = Vec::new();
    if consumer.info().await?.num_pending == 0 {
        return Ok(out);
    }
    let mut messages = consumer.messages().await?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(2), messages.next()).await;
        let Ok(Some(message)) = next else {
            // Nothing more within the timeout: the stream had nothing (left) to deliver.
            break;
        };
        let message = message?;
        let pending = message.info().map(|i| i.pending).unwrap_or(0);
        match jr_protocol::decode(&message.payload) {
            Ok(envelope) => out.push((message.subject.to_string(), envelope)),
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "skipping undecodable message")
            }
        }
        if pending == 0 {
            break;
        }
    }
    Ok(out)
}

/// Publishes the once-only `terminal` that withdraws an assignment the forge already ended.
pub async fn withdraw(
    bus: &Bus,
    id: AssignmentId,
    waiting: &Waiting,
    result: TaskResult,
) -> Result<bool, jr_bus::BusError> {
    let outcome = jr_intake::ours::publish_terminal(
        bus,
        &waiting.backend,
        id,
        waiting.attempt,
        "withdrawn",
        Terminal {
            forge_task_id: waiting.forge_task_id,
            result,
            source: TerminalSource::Withdrawn,
            log_closed: true,
            reason: Some("the forge ended the task before an executor claimed it".to_owned()),
        },
    )
    .await?;
    Ok(matches!(
        outcome,
        PublishOnce::Published { .. } | PublishOnce::Duplicate { .. }
    ))
}

/// Whether the bus already holds the assignment's `claimed` or `terminal`. A read failure
/// counts as not settled (one heartbeat too many is harmless).
async fn settled_on_bus(bus: &Bus, id: AssignmentId, waiting: &Waiting) -> bool {
    for kind in [Kind::Claimed, Kind::Terminal] {
        match bus
            .last_on_subject(STREAM_EVENTS, &subject::event(&waiting.backend, id, kind))
            .await
        {
            Ok(Some((_, envelope)))
                if envelope.attempt >= waiting.attempt || kind == Kind::Terminal =>
            {
                return true;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(assignment = %id, error = %e, "cannot read whether the task was claimed")
            }
        }
    }
    false
}

/// Sends due heartbeats until shutdown.
pub async fn run_keepalive(
    unclaimed: Arc<Unclaimed>,
    forges: Forges,
    bus: Bus,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(TICK) => {}
        }
        for (id, waiting) in unclaimed.due(Instant::now()) {
            let Some(client) = forges.client(&waiting.backend) else {
                unclaimed.settled(id);
                continue;
            };
            // Another scheduler replica's facade may have served the claim (or the result).
            if settled_on_bus(&bus, id, &waiting).await {
                unclaimed.settled(id);
                continue;
            }
            match keepalive(&client, waiting.forge_task_id).await {
                Ok(None) => unclaimed.reschedule(id, Instant::now() + unclaimed.interval),
                Ok(Some(result)) => match withdraw(&bus, id, &waiting, result).await {
                    Ok(won) => {
                        unclaimed.settled(id);
                        tracing::info!(assignment = %id, task = waiting.forge_task_id, ?result, won, "forge ended a waiting task; assignment withdrawn");
                    }
                    Err(e) => {
                        tracing::warn!(assignment = %id, error = %e, "cannot withdraw; retrying");
                        unclaimed.reschedule(id, Instant::now() + RETRY_FAILED_KEEPALIVE);
                    }
                },
                Err(e) => {
                    tracing::warn!(assignment = %id, task = waiting.forge_task_id, error = %e, "keepalive failed; retrying");
                    unclaimed.reschedule(
                        id,
                        Instant::now() + RETRY_FAILED_KEEPALIVE.min(unclaimed.interval),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend() -> BackendName {
        BackendName::new("pod".to_owned()).expect("valid name")
    }

    #[test]
    fn heartbeats_fall_due_one_interval_after_the_fetch_and_stop_once_settled() {
        let u = Unclaimed::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let (a, b) = (
            AssignmentId::for_task("f", 1),
            AssignmentId::for_task("f", 2),
        );
        u.fetched(a, 1, backend(), 1, t0);
        u.fetched(b, 2, backend(), 1, t0 + Duration::from_secs(30));
        assert!(u.due(t0 + Duration::from_secs(59)).is_empty());
        let due: Vec<_> = u
            .due(t0 + Duration::from_secs(60))
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(due, vec![a]);
        u.reschedule(a, t0 + Duration::from_secs(120));
        u.settled(b);
        assert!(u.due(t0 + Duration::from_secs(119)).is_empty());
        assert_eq!(u.len(), 1);
    }
}
