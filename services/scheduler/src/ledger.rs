//! The facade's [`Ledger`] over JetStream. Lookups read the last message of the assignment's
//! subjects directly from the streams (no local index to rebuild after a restart); the
//! once-only facts are settled by the server (`Nats-Expected-Last-Subject-Sequence: 0`).

use jr_protocol::now_ms;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jr_bus::async_nats::jetstream::kv;
use jr_bus::warm::WarmBinding;
use jr_bus::{Bus, PublishOnce};
use jr_protocol::{
    AssignmentId, BackendName, Claimed, Envelope, ExecutorFinished, Kind, Message,
    STREAM_ASSIGNMENTS, STREAM_EVENTS, Terminal, subject,
};

use jr_facade::{AssignmentView, Ledger, LedgerError};
use jr_gitea_intake::Unclaimed;
use jr_seal::Sealer;

/// Facts that never change once seen are cached; everything else is read each time.
#[derive(Clone, Default)]
struct Sticky {
    claimed: bool,
    terminal: bool,
    /// The view of the attempt whose executor claimed the task, until the task is final. Once
    /// an assignment is claimed, everything in its view is fixed (backend, forge task, sealed
    /// task, the claiming attempt and its token hash) except `terminal`, which only ever turns
    /// true; so later calls of that executor need one read (is there a terminal yet?) instead
    /// of four or five. Dropped at the final result, so it holds running jobs only.
    claimed_view: Option<AssignmentView>,
    /// When the terminal subject was last read for `claimed_view`.
    terminal_checked: Option<Instant>,
}

/// How long a claimed assignment's "not terminal" stays believed without reading the stream
/// again. A terminal published here is known at once; one published elsewhere (fail-task,
/// another facade replica) is seen within this, and the forge, which keeps final states,
/// answers any report in between with the final state itself. A running job's reports (a
/// heartbeat or two a second) then cost one read a second instead of one each.
pub const TERMINAL_RECHECK: Duration = Duration::from_secs(1);

pub struct JetStreamLedger {
    bus: Bus,
    backends: Vec<BackendName>,
    /// Tasks waiting for a claim; a claim or terminal settles them.
    unclaimed: Arc<Unclaimed>,
    /// Tells the scheduler's own assignments from anything else stored on their subjects.
    sealer: Arc<Sealer>,
    sticky: Mutex<HashMap<AssignmentId, Sticky>>,
    /// Whether views carry the token hash workers publish (a facade without token keys checks
    /// tokens against it). A facade with the keys skips those reads.
    token_hashes: bool,
    /// Open `JR_WARM_<backend>` buckets, and the bindings read from them (a warm executor is
    /// bound once, so a binding never changes).
    warm_buckets: tokio::sync::Mutex<HashMap<BackendName, kv::Store>>,
    warm_bound: Mutex<HashMap<(BackendName, AssignmentId), WarmBinding>>,
    /// [`TERMINAL_RECHECK`] unless set otherwise.
    terminal_recheck: Duration,
}

impl JetStreamLedger {
    pub fn new(
        bus: Bus,
        backends: Vec<BackendName>,
        unclaimed: Arc<Unclaimed>,
        sealer: Arc<Sealer>,
    ) -> Self {
        Self {
            bus,
            backends,
            unclaimed,
            sealer,
            sticky: Mutex::new(HashMap::new()),
            token_hashes: true,
            warm_buckets: tokio::sync::Mutex::new(HashMap::new()),
            warm_bound: Mutex::new(HashMap::new()),
            terminal_recheck: TERMINAL_RECHECK,
        }
    }

    /// How long a claimed assignment's "not terminal" is believed without a read (default
    /// [`TERMINAL_RECHECK`]; zero reads at every call).
    pub fn terminal_recheck(mut self, every: Duration) -> Self {
        self.terminal_recheck = every;
        self
    }

    /// Whether lookups read the token hash of the current attempt (default true).
    pub fn reading_token_hashes(mut self, read: bool) -> Self {
        self.token_hashes = read;
        self
    }

    /// Whether `view` has everything the facade needs to check its executor.
    fn checkable(&self, view: &AssignmentView) -> bool {
        !self.token_hashes || view.token_hash.is_some()
    }

    fn sticky(&self, id: AssignmentId) -> Sticky {
        self.sticky
            .lock()
            .ok()
            .and_then(|m| m.get(&id).cloned())
            .unwrap_or_default()
    }

    fn remember(&self, id: AssignmentId, update: impl FnOnce(&mut Sticky)) {
        if let Ok(mut m) = self.sticky.lock() {
            if m.len() > 100_000 {
                m.clear();
            }
            update(m.entry(id).or_default());
        }
    }

    async fn last(&self, stream: &str, subject: &str) -> Result<Option<Envelope>, LedgerError> {
        self.bus
            .last_on_subject(stream, subject)
            .await
            .map(|m| m.map(|(_, e)| e))
            .map_err(LedgerError::unavailable)
    }

    /// The scheduler's own latest assignment on `backend`'s subject for `id`. Anything else
    /// stored there last (garbage, a forgery) does not hide it: the subject's history is read
    /// for the latest message whose seal opens for its assignment and forge task.
    async fn genuine_assignment(
        &self,
        backend: &BackendName,
        id: AssignmentId,
    ) -> Result<Option<Envelope>, LedgerError> {
        let subject = subject::assignment(backend, id);
        match self.bus.last_on_subject(STREAM_ASSIGNMENTS, &subject).await {
            Ok(None) => return Ok(None),
            Ok(Some((_, e))) if jr_intake::ours::sealed_by(&self.sealer, &e).is_ok() => {
                return Ok(Some(e));
            }
            Ok(Some(_)) | Err(jr_bus::BusError::DecodeLast { .. }) => {
                tracing::warn!(assignment = %id, %subject, "the last message on the assignment subject is not the scheduler's; reading its history");
            }
            Err(e) => return Err(LedgerError::unavailable(e)),
        }
        let history = jr_intake::ours::history(&self.bus, &subject)
            .await
            .map_err(|e| LedgerError::unavailable(e.to_string()))?;
        Ok(history
            .into_iter()
            .rev()
            .find(|e| jr_intake::ours::sealed_by(&self.sealer, e).is_ok()))
    }

    async fn exists(
        &self,
        backend: &BackendName,
        id: AssignmentId,
        kind: Kind,
    ) -> Result<bool, LedgerError> {
        Ok(self
            .last(STREAM_EVENTS, &subject::event(backend, id, kind))
            .await?
            .is_some())
    }

    async fn publish_once(
        &self,
        view: &AssignmentView,
        kind: Kind,
        envelope: Envelope,
    ) -> Result<bool, LedgerError> {
        match self
            .bus
            .publish_once(&subject::event(&view.backend, view.id, kind), &envelope)
            .await
        {
            Ok(PublishOnce::Published { .. } | PublishOnce::Duplicate { .. }) => Ok(true),
            Ok(PublishOnce::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(LedgerError::unavailable(e)),
        }
    }
}

impl JetStreamLedger {
    /// [`Ledger::lookup`]; without `progress`, `claimed` and `terminal` are not read (unless
    /// already known) and nothing is remembered.
    async fn view(
        &self,
        id: AssignmentId,
        progress: bool,
    ) -> Result<Option<AssignmentView>, LedgerError> {
        let sticky = self.sticky(id);
        if let Some(mut view) = sticky.claimed_view {
            view.claimed = true;
            if !progress {
                view.terminal = sticky.terminal;
                return Ok(Some(view));
            }
            let believed = sticky
                .terminal_checked
                .is_some_and(|at| at.elapsed() < self.terminal_recheck);
            view.terminal = sticky.terminal
                || (!believed && self.exists(&view.backend, id, Kind::Terminal).await?);
            if !view.terminal && !believed {
                self.remember(id, |s| s.terminal_checked = Some(Instant::now()));
            }
            if view.terminal {
                // The few calls after the final result read the subjects again; dropping the
                // view keeps the cache to running jobs (a sealed task can be large).
                self.remember(id, |s| {
                    s.terminal = true;
                    s.claimed_view = None;
                });
            }
            return Ok(Some(view));
        }
        for backend in &self.backends {
            let Some(envelope) = self.genuine_assignment(backend, id).await? else {
                continue;
            };
            let Message::Assignment(assignment) = envelope.message else {
                return Err(LedgerError::Invalid(format!(
                    "{} on an assignment subject",
                    envelope.kind()
                )));
            };
            let attempt = envelope.attempt;
            let mut token_hash = None;
            let hash_sources: &[Kind] = if self.token_hashes {
                &[Kind::WorkloadCreated, Kind::WorkloadRequested]
            } else {
                &[]
            };
            for &kind in hash_sources {
                if let Some(e) = self
                    .last(STREAM_EVENTS, &subject::event(backend, id, kind))
                    .await?
                    && e.attempt == attempt
                {
                    token_hash = match e.message {
                        Message::WorkloadCreated(c) => Some(c.token_hash),
                        Message::WorkloadRequested(r) => Some(r.token_hash),
                        _ => None,
                    };
                    break;
                }
            }
            let mut sticky = self.sticky(id);
            if !progress {
                return Ok(Some(AssignmentView {
                    id,
                    backend: backend.clone(),
                    attempt,
                    forge_task_id: assignment.forge_task_id,
                    sealed_task: assignment.sealed_task,
                    token_hash,
                    claimed: sticky.claimed,
                    terminal: sticky.terminal,
                    trace: envelope.trace.clone().map(Box::new),
                }));
            }
            // The attempt that claimed, when a claim exists.
            let mut claimed_attempt = None;
            if !sticky.claimed {
                claimed_attempt = self
                    .last(STREAM_EVENTS, &subject::event(backend, id, Kind::Claimed))
                    .await?
                    .map(|e| e.attempt);
                sticky.claimed = claimed_attempt.is_some();
            }
            if !sticky.terminal {
                sticky.terminal = self.exists(backend, id, Kind::Terminal).await?;
            }
            let (claimed, terminal) = (sticky.claimed, sticky.terminal);
            let view = AssignmentView {
                id,
                backend: backend.clone(),
                attempt,
                forge_task_id: assignment.forge_task_id,
                sealed_task: assignment.sealed_task,
                token_hash,
                claimed,
                terminal,
                trace: envelope.trace.clone().map(Box::new),
            };
            // Claimed by the current attempt with its token known: nothing but `terminal` can
            // change any more.
            let settled = claimed_attempt == Some(attempt) && self.checkable(&view) && !terminal;
            self.remember(id, |s| {
                s.claimed |= claimed;
                s.terminal |= terminal;
                if settled {
                    s.claimed_view = Some(view.clone());
                    s.terminal_checked = Some(Instant::now());
                }
            });
            return Ok(Some(view));
        }
        Ok(None)
    }
}

impl Ledger for JetStreamLedger {
    async fn lookup(&self, id: AssignmentId) -> Result<Option<AssignmentView>, LedgerError> {
        self.view(id, true).await
    }

    async fn terminal_of(&self, view: &AssignmentView) -> Result<Option<Terminal>, LedgerError> {
        let found = self
            .last(
                STREAM_EVENTS,
                &subject::event(&view.backend, view.id, Kind::Terminal),
            )
            .await?;
        Ok(found.and_then(|e| match e.message {
            jr_protocol::Message::Terminal(t) => Some(t),
            _ => None,
        }))
    }

    async fn identify(&self, id: AssignmentId) -> Result<Option<AssignmentView>, LedgerError> {
        self.view(id, false).await
    }

    async fn publish_claimed(
        &self,
        view: &AssignmentView,
        executor: &str,
    ) -> Result<bool, LedgerError> {
        // A unique id per call: two facade replicas racing must not look like one re-send.
        let envelope = Envelope::new(
            format!(
                "claimed:{}:{}:{}",
                view.id,
                view.attempt,
                uuid::Uuid::new_v4()
            ),
            now_ms(),
            view.id,
            view.attempt,
            Message::Claimed(Claimed {
                forge_task_id: view.forge_task_id,
                executor: executor.to_owned(),
            }),
        );
        let won = self.publish_once(view, Kind::Claimed, envelope).await?;
        self.remember(view.id, |s| {
            s.claimed = true;
            // This executor's attempt won the claim: its view is settled (see `Sticky`).
            if won && self.checkable(view) {
                s.claimed_view = Some(AssignmentView {
                    claimed: true,
                    ..view.clone()
                });
                // The lookup that led to this claim read the terminal subject.
                s.terminal_checked = Some(Instant::now());
            }
        });
        self.unclaimed.settled(view.id);
        Ok(won)
    }

    async fn publish_terminal(
        &self,
        view: &AssignmentView,
        terminal: Terminal,
    ) -> Result<bool, LedgerError> {
        let envelope = jr_intake::ours::terminal(view.id, view.attempt, "executor", terminal);
        let won = self.publish_once(view, Kind::Terminal, envelope).await?;
        self.remember(view.id, |s| {
            s.terminal = true;
            s.claimed_view = None;
        });
        self.unclaimed.settled(view.id);
        Ok(won)
    }

    async fn warm_binding(
        &self,
        backend: &BackendName,
        warm: AssignmentId,
    ) -> Result<Option<WarmBinding>, LedgerError> {
        let cached = self
            .warm_bound
            .lock()
            .ok()
            .and_then(|m| m.get(&(backend.clone(), warm)).copied());
        if cached.is_some() {
            return Ok(cached);
        }
        let store = {
            let mut buckets = self.warm_buckets.lock().await;
            match buckets.get(backend) {
                Some(store) => store.clone(),
                None => {
                    let bucket = jr_bus::warm::bucket(backend);
                    match self.bus.jetstream().get_key_value(&bucket).await {
                        Ok(store) => {
                            buckets.insert(backend.clone(), store.clone());
                            store
                        }
                        // Missing (no worker of that backend kept warm executors yet) or
                        // not reachable: the executor waits and asks again.
                        Err(e) => {
                            tracing::debug!(%backend, error = %e, "warm binding bucket not open");
                            return Ok(None);
                        }
                    }
                }
            }
        };
        let value = store
            .get(warm.to_string())
            .await
            .map_err(LedgerError::unavailable)?;
        let Some(value) = value else {
            return Ok(None);
        };
        let Some(binding) = WarmBinding::decode(&value) else {
            tracing::warn!(%warm, %backend, "a warm binding that does not decode; ignored");
            return Ok(None);
        };
        if let Ok(mut bound) = self.warm_bound.lock() {
            if bound.len() > 100_000 {
                bound.clear();
            }
            bound.insert((backend.clone(), warm), binding);
        }
        Ok(Some(binding))
    }

    async fn publish_executor_finished(&self, view: &AssignmentView) -> Result<(), LedgerError> {
        let envelope = Envelope::new(
            format!("executor-finished:{}", view.id),
            now_ms(),
            view.id,
            view.attempt,
            Message::ExecutorFinished(ExecutorFinished {
                forge_task_id: view.forge_task_id,
            }),
        );
        self.bus
            .publish(
                &subject::event(&view.backend, view.id, Kind::ExecutorFinished),
                &envelope,
            )
            .await
            .map(|_| ())
            .map_err(LedgerError::unavailable)
    }
}
