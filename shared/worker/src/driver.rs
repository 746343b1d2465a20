//! The thin driver around [`WorkerState`]: it turns consumer deliveries, backend observations
//! and timers into inputs, performs the effects the state returns (publishes, backend calls,
//! settling messages, ledger writes) and feeds their outcomes back. It decides nothing itself.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use jr_bus::{Bus, ConsumerSpec, Disposition, Topology};
use jr_protocol::{
    Assignment, BackendName, Envelope, Kind, Message, Released, TokenHash, WorkloadCreated,
    WorkloadObserved, WorkloadPhase, WorkloadRequested, msg_id, now_ms, subject,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec, workload_name};
use crate::error::WorkerError;
use crate::gate::{Outstanding, ToDriver};
use crate::lanes::{Confirmed, Lanes, Step};
use crate::ledger::Ledger;
use crate::metrics::{ErrorLabels, WorkerMetrics};
use crate::replicas::{RENEW_EVERY, Renewal, Replica, taken_over};
use crate::state::{
    AttemptKey, CreateAnswer, DeleteAnswer, DeliveryId, Effect, Event, Input, StateConfig,
    TicketId, WarmPolicy, WorkerState,
};
use jr_seal::TokenKey;

#[derive(Clone, Debug)]
pub struct WorkerSettings {
    pub backend: BackendName,
    pub capacity: usize,
    pub worker_id: String,
    pub facade_url: String,
    pub token_key: TokenKey,
    /// How often the backend is listed to catch changes a watch or poll missed.
    pub resync_interval: Duration,
    /// How long a workload found without a create of ours exists before it is announced.
    pub stray_grace: Duration,
    /// Publish `workload-requested` before each create (for a facade without the token key).
    pub publish_requested: bool,
    /// Warm executors (`[backend.<name>.warm]`); `None`: none.
    pub warm: Option<WarmSettings>,
}

/// What a worker needs to keep warm executors.
#[derive(Clone, Debug)]
pub struct WarmSettings {
    pub min_idle: usize,
    pub max_idle: usize,
    pub idle_timeout: Duration,
    pub max_age: Duration,
    /// Labels a warm executor declares (the backend's labels; its job is not known yet).
    pub labels: Vec<String>,
    /// The backend's longest job: a warm workload lives `2 × max_age + max_duration`.
    pub max_duration: Duration,
}

impl WorkerSettings {
    pub(crate) fn state_config(&self) -> StateConfig {
        let warm = self
            .warm
            .as_ref()
            .map(|w| WarmPolicy {
                min_idle: w.min_idle,
                max_idle: w.max_idle.max(w.min_idle),
                idle_timeout: w.idle_timeout,
                max_age: w.max_age,
                seed: rand::random(),
            })
            .unwrap_or_default();
        StateConfig {
            resync_every: self.resync_interval,
            stray_grace: self.stray_grace,
            warm,
            ..StateConfig::new(self.capacity)
        }
    }
}

/// How long the publish before an ack may take before the message is nak'd instead.
const REPUBLISH_DELAY: Duration = Duration::from_secs(2);

/// Everything an IO operation needs, cheap to clone into its task.
pub(crate) struct Io<B> {
    pub(crate) bus: Bus,
    pub(crate) backend: Arc<B>,
    pub(crate) settings: WorkerSettings,
    pub(crate) metrics: Arc<WorkerMetrics>,
    pub(crate) shutdown: CancellationToken,
    /// Each job's trace context, for the events and calls that continue it.
    pub(crate) traces: jr_bus::TraceBook,
    /// `JR_WARM_<backend>`: where bindings of warm executors are recorded for the facade.
    pub(crate) warm_bindings: Option<jr_bus::async_nats::jetstream::kv::Store>,
}

impl<B> Clone for Io<B> {
    fn clone(&self) -> Self {
        Self {
            bus: self.bus.clone(),
            backend: self.backend.clone(),
            settings: self.settings.clone(),
            metrics: self.metrics.clone(),
            shutdown: self.shutdown.clone(),
            traces: self.traces.clone(),
            warm_bindings: self.warm_bindings.clone(),
        }
    }
}

impl<B: Backend> Io<B> {
    fn token_hash(&self, key: AttemptKey) -> TokenHash {
        self.settings
            .token_key
            .token_hash(key.assignment, key.attempt)
    }

    /// The subject and envelope of an event.
    pub(crate) fn envelope(&self, event: &Event) -> (String, Envelope) {
        let backend = self.settings.backend.clone();
        let (key, kind, id, message) = match event {
            Event::Created {
                key,
                workload,
                warm,
            } => (
                *key,
                Kind::WorkloadCreated,
                msg_id::workload_created(key.assignment, key.attempt),
                Message::WorkloadCreated(WorkloadCreated {
                    backend,
                    workload: workload.clone(),
                    // The token its executor holds: a warm executor's own.
                    token_hash: match warm {
                        Some(warm) => self.token_hash(AttemptKey::new(*warm, 0)),
                        None => self.token_hash(*key),
                    },
                    worker_id: self.settings.worker_id.clone(),
                    warm: *warm,
                }),
            ),
            Event::Observed {
                key,
                workload,
                phase,
                reason,
            } => (
                *key,
                Kind::WorkloadObserved,
                msg_id::workload_observed(
                    key.assignment,
                    key.attempt,
                    workload,
                    *phase,
                    reason.as_deref(),
                ),
                Message::WorkloadObserved(WorkloadObserved {
                    backend,
                    workload: workload.clone(),
                    phase: *phase,
                    reason: reason.clone(),
                }),
            ),
            Event::Released { key, workload } => (
                *key,
                Kind::Released,
                msg_id::released(key.assignment, key.attempt, workload),
                Message::Released(Released {
                    backend,
                    workload: workload.clone(),
                }),
            ),
        };
        let subject = subject::event(&self.settings.backend, key.assignment, kind);
        let envelope = Envelope::new(id, now_ms(), key.assignment, key.attempt, message);
        (subject, envelope)
    }

    /// Records a warm executor's binding for the facade (before `workload-created` is
    /// published) and wakes a facade waiting for it.
    async fn record_binding(&self, warm: jr_protocol::AssignmentId, key: AttemptKey) -> bool {
        let Some(store) = &self.warm_bindings else {
            tracing::error!(%warm, %key, "a warm executor was bound without a binding bucket");
            return false;
        };
        let binding = jr_bus::warm::WarmBinding {
            assignment: key.assignment,
            attempt: key.attempt,
        };
        if let Err(error) = store.put(warm.to_string(), binding.encode().into()).await {
            tracing::warn!(%warm, %key, %error, "could not record a warm executor's binding");
            return false;
        }
        let wake = jr_bus::warm::wake_subject(&self.settings.backend, warm);
        if let Err(error) = self.bus.client().publish(wake, Default::default()).await {
            // The facade looks again on its own; the binding is recorded.
            tracing::debug!(%warm, %error, "warm wake-up not sent");
        }
        true
    }

    /// Publishes `event`, retrying through outages until `stop`.
    pub(crate) async fn publish(&self, event: &Event, stop: &CancellationToken) -> bool {
        if let Event::Created {
            key,
            warm: Some(warm),
            ..
        } = event
            && !self.record_binding(*warm, *key).await
        {
            return false;
        }
        let (subject, envelope) = self.envelope(event);
        let span = tracing::info_span!(
            parent: None,
            "worker event",
            kind = envelope.kind().as_str(),
            assignment = %envelope.assignment_id,
            attempt = envelope.attempt,
        );
        jr_bus::follow(&span, self.traces.get(envelope.assignment_id).as_ref());
        let published = tracing::Instrument::instrument(
            self.bus.publish_retrying(&subject, &envelope, stop),
            span,
        )
        .await;
        match published {
            Ok(_) => {
                if matches!(event, Event::Released { .. }) {
                    self.metrics.released.inc();
                    self.traces.forget(envelope.assignment_id);
                }
                true
            }
            Err(error) => {
                tracing::warn!(%subject, %error, "event not published");
                false
            }
        }
    }

    /// Publishes `workload-requested`; an answer for the create when that failed.
    async fn publish_requested(&self, key: AttemptKey) -> Option<CreateAnswer> {
        let requested = Envelope::new(
            msg_id::workload_requested(key.assignment, key.attempt),
            now_ms(),
            key.assignment,
            key.attempt,
            Message::WorkloadRequested(WorkloadRequested {
                backend: self.settings.backend.clone(),
                workload: workload_name(key.assignment, key.attempt),
                token_hash: self.token_hash(key),
                worker_id: self.settings.worker_id.clone(),
            }),
        );
        let subject = subject::event(
            &self.settings.backend,
            key.assignment,
            Kind::WorkloadRequested,
        );
        if let Err(error) = self.bus.publish(&subject, &requested).await {
            tracing::warn!(%key, %error, "cannot publish workload-requested");
            return Some(CreateAnswer::Transient {
                retry_after: Some(REPUBLISH_DELAY),
            });
        }
        None
    }

    fn spec(&self, a: &Assignment, key: AttemptKey) -> WorkloadSpec {
        WorkloadSpec {
            assignment_id: key.assignment,
            attempt: key.attempt,
            backend: self.settings.backend.clone(),
            provider: a.provider.clone(),
            labels: a.labels.clone(),
            max_duration: Duration::from_secs(a.remaining_secs(now_ms()).max(60)),
            worker_id: self.settings.worker_id.clone(),
            facade_url: self.settings.facade_url.clone(),
            executor_token: self.settings.token_key.token(key.assignment, key.attempt),
            repository: a.repository.clone(),
            workflow: a.workflow.clone().unwrap_or_default(),
            job_name: a.job_name.clone(),
            fetched_at: a.fetched_at,
            forge_env: a.forge_kind().executor_forge_env(),
        }
    }

    /// The spec of warm executor `warm`: attempt 0 of its warm identity, the backend's labels,
    /// a lifetime covering its idle time and the longest job.
    fn warm_spec(&self, warm: jr_protocol::AssignmentId) -> Option<WorkloadSpec> {
        let w = self.settings.warm.as_ref()?;
        Some(WorkloadSpec {
            assignment_id: warm,
            attempt: 0,
            backend: self.settings.backend.clone(),
            provider: None,
            labels: w.labels.clone(),
            max_duration: w.max_age * 2 + w.max_duration,
            worker_id: self.settings.worker_id.clone(),
            facade_url: self.settings.facade_url.clone(),
            executor_token: self.settings.token_key.token(warm, 0),
            repository: String::new(),
            workflow: String::new(),
            job_name: "warm".to_owned(),
            fetched_at: now_ms(),
            forge_env: None,
        })
    }

    /// The create call, after `workload-requested` when asked for (the token hash is durable
    /// before anything can present the token, for a facade that checks hashes).
    async fn create(self, spec: WorkloadSpec) -> CreateAnswer {
        let key = AttemptKey::new(spec.assignment_id, spec.attempt);
        let span = tracing::info_span!(
            parent: None,
            "create workload",
            assignment = %key.assignment,
            attempt = key.attempt,
            backend = %self.settings.backend,
        );
        jr_bus::follow(&span, self.traces.get(key.assignment).as_ref());
        tracing::Instrument::instrument(self.create_traced(spec, key), span).await
    }

    async fn create_traced(self, spec: WorkloadSpec, key: AttemptKey) -> CreateAnswer {
        // A warm executor's identity is nobody's assignment: nothing about it is published.
        if self.settings.publish_requested
            && spec.attempt > 0
            && let Some(answer) = self.publish_requested(key).await
        {
            return answer;
        }
        match self.backend.create(&spec).await {
            Ok(workload) => {
                self.metrics.created.inc();
                CreateAnswer::Created(workload)
            }
            Err(error) => {
                self.metrics
                    .create_errors
                    .get_or_create(&ErrorLabels {
                        kind: error.kind().to_owned(),
                    })
                    .inc();
                tracing::info!(%key, %error, "create did not succeed");
                match error {
                    BackendError::Full { retry_after, .. } => {
                        self.metrics.full_pauses.inc();
                        CreateAnswer::Full { retry_after }
                    }
                    BackendError::Wait { retry_after, .. } => CreateAnswer::Wait { retry_after },
                    BackendError::Transient { retry_after, .. } => {
                        CreateAnswer::Transient { retry_after }
                    }
                    BackendError::Permanent { message, .. } => CreateAnswer::Refused { message },
                }
            }
        }
    }

    async fn delete(self, workload: String) -> DeleteAnswer {
        match self.backend.delete(&workload).await {
            Ok(()) => {
                self.metrics.deleted.inc();
                DeleteAnswer::Deleted
            }
            Err(BackendError::Permanent { message, .. }) => DeleteAnswer::Refused { message },
            Err(BackendError::Transient { retry_after, .. }) => {
                DeleteAnswer::Transient { retry_after }
            }
            Err(
                BackendError::Full { retry_after, .. } | BackendError::Wait { retry_after, .. },
            ) => DeleteAnswer::Transient {
                retry_after: Some(retry_after),
            },
        }
    }
}

/// The state machine with the bookkeeping needed to perform its effects.
pub(crate) struct Driver<B> {
    pub(crate) io: Io<B>,
    pub(crate) state: WorkerState,
    pub(crate) ledger: Ledger,
    pub(crate) outstanding: Outstanding,
    waiters: VecDeque<oneshot::Sender<Vec<TicketId>>>,
    replies: HashMap<DeliveryId, oneshot::Sender<Disposition>>,
    assignments: HashMap<DeliveryId, Assignment>,
    ops: JoinSet<Input>,
    /// Where publishes and ledger writes wait for their acknowledgements, in order per workload.
    lanes: Lanes,
    /// Deliveries whose events a lane stored (or could not).
    confirmed: mpsc::UnboundedReceiver<Confirmed>,
    /// This process's part in sharing the backend's capacity with other replicas.
    pub(crate) replica: Replica,
    /// Workloads other replicas manage (name → creator, and since when known), so a
    /// `delete-workload` for one is carried out without touching this replica's state.
    foreign: HashMap<String, (String, Instant)>,
    /// Creators taken over, and when (a listing started earlier cannot tell they are done).
    adopted_at: HashMap<String, Instant>,
    /// Creators taken over whose workloads are not adopted yet (the listing failed).
    pending: BTreeSet<String>,
    /// Creators taken over that a later listing showed without workloads.
    done_with: BTreeSet<String>,
    /// Why this process stopped managing anything: its holding was taken over.
    pub(crate) lost: Option<String>,
    last_renew_warning: Option<Instant>,
    /// Live replicas of the backend as last told to the state.
    pub(crate) replicas: usize,
}

impl<B: Backend> Driver<B> {
    pub(crate) fn new(
        io: Io<B>,
        ledger: Ledger,
        outstanding: Outstanding,
        replica: Replica,
    ) -> Self {
        // Nothing is filled before the first holding is written.
        let state = WorkerState::new(StateConfig {
            capacity: 0,
            ..io.settings.state_config()
        });
        let (confirmed_tx, confirmed) = mpsc::unbounded_channel();
        let lanes = Lanes::start(&io, ledger.store().clone(), confirmed_tx);
        Self {
            lanes,
            confirmed,
            io,
            state,
            ledger,
            outstanding,
            waiters: VecDeque::new(),
            replies: HashMap::new(),
            assignments: HashMap::new(),
            ops: JoinSet::new(),
            replica,
            foreign: HashMap::new(),
            adopted_at: HashMap::new(),
            pending: BTreeSet::new(),
            done_with: BTreeSet::new(),
            lost: None,
            last_renew_warning: None,
            replicas: 1,
        }
    }

    /// Whether this process manages the workloads labelled `creator` now.
    fn manages(&self, creator: &str) -> bool {
        self.replica.manages(creator) && !self.pending.contains(creator)
    }

    /// Keeps what belongs to another replica away from the state machine (and notes it for
    /// routing deletes); a full listing also tells which taken-over creators are done.
    fn admit(&mut self, input: Input) -> Option<Input> {
        match input {
            // A workload the state tracks stays its own whatever its label (a create may find
            // the attempt's workload another replica made before it stopped).
            Input::Observed(o)
                if !self.manages(&o.worker)
                    && !self.state.workloads().contains_key(&o.workload) =>
            {
                if o.phase == WorkloadPhase::Gone {
                    self.foreign.remove(&o.workload);
                } else {
                    self.foreign
                        .insert(o.workload.clone(), (o.worker.clone(), Instant::now()));
                }
                None
            }
            Input::Listed { started, listed } => {
                let present: BTreeSet<&str> = listed.iter().map(|o| o.worker.as_str()).collect();
                self.done_with = self
                    .replica
                    .adopted()
                    .filter(|c| {
                        !present.contains(c.as_str())
                            && self.adopted_at.get(*c).is_some_and(|at| *at < started)
                    })
                    .cloned()
                    .collect();
                let (mine, theirs): (Vec<_>, Vec<_>) = listed.into_iter().partition(|o| {
                    self.manages(&o.worker) || self.state.workloads().contains_key(&o.workload)
                });
                let listed_foreign: BTreeSet<&str> =
                    theirs.iter().map(|o| o.workload.as_str()).collect();
                // Gone from a listing that started after it was seen: gone.
                self.foreign.retain(|name, (_, seen)| {
                    listed_foreign.contains(name.as_str()) || *seen >= started
                });
                for o in &theirs {
                    self.foreign
                        .entry(o.workload.clone())
                        .or_insert_with(|| (o.worker.clone(), started));
                }
                Some(Input::Listed {
                    started,
                    listed: mine,
                })
            }
            other => Some(other),
        }
    }

    /// Renews this process's holding of the backend's capacity: gives back what it does not
    /// need beyond an even share (after it stopped using it), takes over replicas that
    /// stopped, and lets the state fill what it holds.
    pub(crate) async fn renew(&mut self) {
        // Nothing is fed while the write is in flight, so what is in use cannot grow meanwhile,
        // and the state fills the new holding only once it is written. Pull tickets are not
        // counted: a delivery beyond the state's capacity is sent back, so a busy replica gives
        // back what it holds beyond an even share as its workloads end.
        let in_use = self.state.used();
        match self.replica.renew(in_use, &self.done_with).await {
            Renewal::Held { slots, adopted } => {
                self.last_renew_warning = None;
                if !adopted.is_empty() {
                    self.io.metrics.takeovers.inc_by(adopted.len() as u64);
                    let now = Instant::now();
                    for c in &adopted {
                        self.adopted_at.insert(c.clone(), now);
                    }
                    self.pending.extend(adopted);
                }
                if !self.pending.is_empty() {
                    self.take_over().await;
                }
                // New work only up to an even share: every replica holds at least its share,
                // so a replica that holds more (it was alone, or took another over) gives the
                // rest back as its workloads end instead of refilling it. Until taken-over
                // workloads are counted, nothing new is filled.
                let fill = if self.pending.is_empty() {
                    slots.min(self.replica.share())
                } else {
                    slots.min(self.state.used() + self.state.reserved())
                };
                self.feed(Input::Capacity(fill)).await;
                let replicas = self.replica.replicas();
                if replicas != self.replicas {
                    self.replicas = replicas;
                    self.feed(Input::Replicas(replicas)).await;
                }
                self.io.metrics.slots_held.set(slots as i64);
                self.io.metrics.replicas.set(replicas as i64);
            }
            Renewal::Failed(error) => {
                let now = Instant::now();
                if self
                    .last_renew_warning
                    .is_none_or(|at| now.duration_since(at) > Duration::from_secs(30))
                {
                    tracing::warn!(%error, "cannot renew this replica's share of the capacity");
                    self.last_renew_warning = Some(now);
                }
                if !self.replica.usable() && self.state.capacity() > 0 {
                    tracing::warn!(
                        "share of the capacity expired: creating nothing until it is renewed"
                    );
                    self.feed(Input::Capacity(0)).await;
                }
            }
            Renewal::Lost { by } => {
                let by = by.unwrap_or_else(|| "another process".to_owned());
                tracing::error!(
                    replica = %self.replica.name,
                    %by,
                    "this replica's holding was taken over (it could not renew in time, or another process runs with the same worker_id); stopping"
                );
                self.feed(Input::Capacity(0)).await;
                self.lost = Some(by);
                self.io.shutdown.cancel();
            }
        }
    }

    /// Adopts the workloads of the creators taken over: what the backend lists of them and
    /// what their processes remembered. Tried again at the next renewal if it fails.
    async fn take_over(&mut self) {
        let listed = match self.io.backend.list().await {
            Ok(listed) => listed,
            Err(error) => {
                tracing::warn!(%error, "listing for a takeover failed; trying again");
                return;
            }
        };
        let entries = match self.ledger.all().await {
            Ok(entries) => entries,
            Err(error) => {
                tracing::warn!(%error, "reading the ledger for a takeover failed; trying again");
                return;
            }
        };
        let pending = std::mem::take(&mut self.pending);
        let (listed, entries) = taken_over(listed, entries, self.replica.bare(), |c| {
            pending.contains(c)
        });
        tracing::info!(
            creators = ?pending,
            listed = listed.len(),
            remembered = entries.len(),
            "taking over the workloads of replicas that stopped"
        );
        for o in &listed {
            self.foreign.remove(&o.workload);
        }
        self.io.metrics.adopted.inc_by(listed.len() as u64);
        self.ledger.adopt(&entries);
        let remembered = entries.into_iter().map(|e| (e.key, e.workload)).collect();
        self.feed(Input::Adopted { listed, remembered }).await;
    }

    /// The workload of a `delete-workload` that another replica manages.
    fn foreign_delete(&self, input: &Input) -> Option<String> {
        match input {
            Input::DeleteRequested { workload, .. } => self
                .foreign
                .get(workload)
                .filter(|(creator, _)| !self.manages(creator))
                .map(|_| workload.clone()),
            _ => None,
        }
    }

    /// Deletes another replica's workload for it (replicas pull the same commands, and a
    /// command sent back to the stream comes back to the same puller): the backend call is
    /// the same whoever makes it, and the replica that manages the workload reports it
    /// `released` when it sees it gone (a replica taking a stopped one over does the same at
    /// adoption). Nothing here touches this replica's state.
    fn delete_for_owner(&self, workload: String, reply: oneshot::Sender<Disposition>) {
        let io = self.io.clone();
        tokio::spawn(async move {
            let disposition = match io.delete(workload.clone()).await {
                DeleteAnswer::Deleted => Disposition::Ack,
                DeleteAnswer::Transient { retry_after } => {
                    Disposition::Nak(Some(retry_after.unwrap_or(Duration::from_secs(1))))
                }
                DeleteAnswer::Refused { message } => {
                    Disposition::Term(format!("delete refused: {message}"))
                }
            };
            tracing::debug!(%workload, ?disposition, "deleted another replica's workload for it");
            let _ = reply.send(disposition);
        });
    }

    /// Runs until shutdown: every message, observation, operation outcome and tick becomes an
    /// input of the state machine.
    pub(crate) async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<ToDriver>,
        mut observations: mpsc::Receiver<ObservedWorkload>,
        report: impl Fn(bool),
    ) -> Option<String> {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut renew = tokio::time::interval(RENEW_EVERY);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        renew.reset();
        let shutdown = self.io.shutdown.clone();
        loop {
            let input = tokio::select! {
                () = shutdown.cancelled() => break,
                Some(message) = rx.recv() => match message {
                    ToDriver::PullWanted { max, reply } => {
                        self.waiters.push_back(reply);
                        Input::PullWanted { max }
                    }
                    ToDriver::Input(input) => input,
                    ToDriver::Assignment { input, assignment, reply } => {
                        if let Input::Delivered { delivery, .. } = &input {
                            self.replies.insert(*delivery, reply);
                            self.assignments.insert(*delivery, *assignment);
                        }
                        input
                    }
                    ToDriver::Command { input, reply } => {
                        if let Some(workload) = self.foreign_delete(&input) {
                            self.delete_for_owner(workload, reply);
                            continue;
                        }
                        if let Input::DeleteRequested { delivery, .. } = &input {
                            self.replies.insert(*delivery, reply);
                        }
                        input
                    }
                },
                Some(done) = self.confirmed.recv() => {
                    self.on_confirmed(done);
                    continue;
                }
                _ = renew.tick() => {
                    self.renew().await;
                    continue;
                }
                Some(observed) = observations.recv() => Input::Observed(observed),
                Some(done) = self.ops.join_next(), if !self.ops.is_empty() => match done {
                    Ok(input) => input,
                    Err(error) => {
                        tracing::error!(%error, "a backend operation panicked");
                        continue;
                    }
                },
                _ = tick.tick() => Input::Tick,
            };
            self.feed(input).await;
            self.io.metrics.slots_used.set(self.state.used() as i64);
            self.io
                .metrics
                .warm_idle
                .set(self.state.warm_idle_count() as i64);
            self.io
                .metrics
                .warm_bound
                .set(self.state.warm_bound_count() as i64);
            let binds = self.state.warm_binds();
            self.io
                .metrics
                .warm_binds
                .inc_by(binds.saturating_sub(self.io.metrics.warm_binds.get()));
            let yields = self.state.warm_yields();
            self.io
                .metrics
                .warm_yields
                .inc_by(yields.saturating_sub(self.io.metrics.warm_yields.get()));
            self.io.metrics.debt.set(self.state.debt() as i64);
            report(self.state.is_ready());
        }
        report(false);
        if self.lost.is_none() {
            // A clean stop: let the backend calls in flight answer (their outcomes are
            // published), then hand the holding over so another replica takes over at once.
            let drain = async {
                while let Some(done) = self.ops.join_next().await {
                    if let Ok(input) = done {
                        self.feed(input).await;
                    }
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(5), drain).await;
            self.feed(Input::Capacity(0)).await;
            // What the lanes hold is published before the holding goes, and the deliveries it
            // confirms are acknowledged (a consumer still listening takes the answer).
            self.lanes.drain(Duration::from_secs(5)).await;
            while let Ok(done) = self.confirmed.try_recv() {
                self.on_confirmed(done);
            }
            self.replica.release().await;
        }
        self.lost
    }

    /// Feeds one input and everything its effects produce.
    pub(crate) async fn feed(&mut self, input: Input) {
        let Some(input) = self.admit(input) else {
            return;
        };
        let mut queue = VecDeque::from([input]);
        while let Some(input) = queue.pop_front() {
            let now = Instant::now();
            for effect in self.state.on(input, now) {
                self.perform(effect, &mut queue).await;
            }
        }
    }

    async fn perform(&mut self, effect: Effect, queue: &mut VecDeque<Input>) {
        match effect {
            Effect::GrantPull(tickets) => {
                for ticket in &tickets {
                    self.outstanding.insert(*ticket);
                }
                let mut tickets = tickets;
                loop {
                    match self.waiters.pop_front() {
                        Some(waiter) => match waiter.send(tickets) {
                            Ok(()) => break,
                            // That pull is gone: the next waiting one takes the tickets.
                            Err(back) => tickets = back,
                        },
                        None => {
                            for ticket in tickets {
                                self.outstanding.remove(ticket);
                                queue.push_back(Input::TicketDropped(ticket));
                            }
                            break;
                        }
                    }
                }
            }
            Effect::Create { delivery, key } => {
                let Some(assignment) = self.assignments.get(&delivery) else {
                    tracing::error!(%key, "create asked for a delivery the driver does not hold");
                    return;
                };
                let io = self.io.clone();
                let spec = io.spec(assignment, key);
                self.ops.spawn(async move {
                    let answer = io.create(spec).await;
                    Input::CreateAnswered {
                        delivery,
                        key,
                        answer,
                    }
                });
            }
            Effect::CreateWarm { warm } => {
                let io = self.io.clone();
                let Some(spec) = io.warm_spec(warm) else {
                    tracing::error!(%warm, "warm executor asked for without warm settings");
                    return;
                };
                self.ops.spawn(async move {
                    let answer = io.create(spec).await;
                    Input::WarmCreateAnswered { warm, answer }
                });
            }
            Effect::DeleteWarm { workload } => {
                let io = self.io.clone();
                self.ops.spawn(async move {
                    let answer = io.clone().delete(workload.clone()).await;
                    Input::WarmDeleteAnswered { workload, answer }
                });
            }
            Effect::Delete {
                delivery,
                key,
                workload,
            } => {
                let io = self.io.clone();
                self.ops.spawn(async move {
                    let answer = io.clone().delete(workload.clone()).await;
                    Input::DeleteAnswered {
                        delivery,
                        key,
                        workload,
                        answer,
                    }
                });
            }
            Effect::List => {
                let backend = self.io.backend.clone();
                self.ops.spawn(async move {
                    let started = Instant::now();
                    match backend.list().await {
                        Ok(listed) => Input::Listed { started, listed },
                        Err(error) => {
                            tracing::warn!(%error, "listing workloads failed");
                            Input::ListFailed
                        }
                    }
                });
            }
            Effect::Publish(event) => self.lanes.publish(event).await,
            Effect::Confirm { delivery, events } => self.lanes.confirm(delivery, events).await,
            Effect::Settle {
                delivery,
                disposition,
            } => self.settle(delivery, disposition),
            Effect::Remember { key, workload } => {
                if let Some(name) = self.ledger.remember_key(key, &workload) {
                    self.lanes.push(&workload, Step::Remember(name)).await;
                }
            }
            Effect::Forget { key, workload } => {
                let names = self.ledger.forget_keys(key, &workload);
                self.lanes.push(&workload, Step::Forget(names)).await;
            }
        }
    }

    /// A lane stored a delivery's events (acknowledge it) or could not (send it back).
    fn on_confirmed(&mut self, done: Confirmed) {
        if done.published
            && let Some(warm) = done.warm
            && let Some(assignment) = self.assignments.get(&done.delivery)
        {
            let seconds = now_ms().saturating_sub(assignment.fetched_at) as f64 / 1000.0;
            if warm {
                self.io.metrics.warm_bind_latency.observe(seconds);
            } else {
                self.io.metrics.dispatch_latency.observe(seconds);
            }
        }
        let disposition = if done.published {
            Disposition::Ack
        } else {
            Disposition::Nak(Some(REPUBLISH_DELAY))
        };
        self.settle(done.delivery, disposition);
    }

    fn settle(&mut self, delivery: DeliveryId, disposition: Disposition) {
        self.assignments.remove(&delivery);
        if let Some(reply) = self.replies.remove(&delivery) {
            // The handler may have given up (shutdown); the message is then redelivered.
            let _ = reply.send(disposition);
        }
    }
}

/// Delivery ids for handlers.
#[derive(Clone, Default)]
pub(crate) struct DeliveryIds(Arc<AtomicU64>);

impl DeliveryIds {
    pub(crate) fn next(&self) -> DeliveryId {
        DeliveryId(self.0.fetch_add(1, Ordering::Relaxed))
    }
}

/// A worker: the driver plus its consumers and observer.
pub struct Worker<B: Backend> {
    pub(crate) bus: Bus,
    pub(crate) backend: Arc<B>,
    pub(crate) settings: WorkerSettings,
    pub metrics: Arc<WorkerMetrics>,
}

impl<B: Backend> Worker<B> {
    pub fn new(bus: Bus, backend: B, settings: WorkerSettings) -> Self {
        Self {
            bus,
            backend: Arc::new(backend),
            settings,
            metrics: Arc::new(WorkerMetrics::default()),
        }
    }

    pub fn topology(backend: &BackendName) -> (ConsumerSpec, ConsumerSpec) {
        (
            ConsumerSpec::worker_assignments(backend),
            ConsumerSpec::worker_commands(backend),
        )
    }

    pub(crate) async fn ensure_topology(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<(), WorkerError> {
        let (assignments, commands) = Self::topology(&self.settings.backend);
        let topology = Topology::new()
            .replicas(self.bus.replicas())
            .consumer(assignments)
            .consumer(commands);
        self.bus
            .ensure_topology_retrying(&topology, shutdown)
            .await?;
        Ok(())
    }
}
