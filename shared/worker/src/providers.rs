//! Providers inside one backend: a [`Backend`] made of several backends of the same kind (Kubernetes
//! clusters or namespaces, OpenSandbox servers or pools), each with a weight, an optional
//! `max_runners` and a drain switch.
//!
//! Placement picks among the providers with room by weight ([`jr_placement::WeightedPicker`]).
//! A provider that answers "full" (429, quota) is skipped for its `retry_after` and the same
//! attempt goes to the next one at once; when none has room the create answers "full", which the
//! worker treats as back-pressure (the assignment waits, no attempt is spent). An attempt sticks
//! to the provider chosen for it until that provider created it or answered "full", so a create
//! retried after a timeout never makes a second workload elsewhere; it moves only when its
//! provider is unreachable.
//!
//! A provider is unreachable after [`FAILURES_BEFORE_UNREACHABLE`] failed calls in a row (list or
//! create). Its workloads are then reported as `Unknown` / `backend-unreachable` and kept in every
//! list for `unreachable_hold`; after that they are left out of the lists (the worker reports them
//! gone and the reconciler redispatches their jobs). A provider that answers again is reachable at
//! once; a workload it still runs after a write-off is then a stray of an old attempt, deleted
//! like any other. A provider that cannot be listed when the worker starts holds up the start for
//! at most `unreachable_hold` (its workloads cannot be told apart from ones that are gone).
//!
//! Workload references are `<provider>/<reference inside the provider>`, so a delete goes to the
//! provider that made the workload, also after a restart, and events name the provider.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::future::join_all;
pub use jr_config::ProviderTier as Tier;
use jr_placement::{
    BurstSetting, JobKey, ProtectedMatcher, ProviderView, TierChoice, Unreachable, WeightedPicker,
    choose_tier, unreachable_verdict,
};
use jr_protocol::{Reason, WorkloadPhase, now_ms};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec};

/// Failed calls in a row after which a provider counts as unreachable.
pub const FAILURES_BEFORE_UNREACHABLE: u32 = 3;
/// How long to wait before placing again when no provider has room (all drained, at their
/// `max_runners` or unreachable) and none gave a time.
const NO_ROOM_RETRY: Duration = Duration::from_secs(1);
/// How long a job waits before it is placed again when other jobs could be placed but it may
/// not (its tier is full while the burst tier, closed to it, has room).
const WAIT_RETRY: Duration = Duration::from_secs(2);

/// One provider of a backend.
pub struct Provider<B> {
    /// Unique within the backend; a DNS label.
    pub name: String,
    pub backend: B,
    pub weight: u32,
    pub max_runners: Option<usize>,
    /// Drained: nothing new is placed here; its running workloads finish and are deleted.
    pub disabled: bool,
    /// The burst tier takes work only as [`Burst`] allows.
    pub tier: Tier,
}

impl<B> Provider<B> {
    /// The provider `config` describes, served by `backend`.
    pub fn configured(config: &jr_config::ProviderConfig, backend: B) -> Self {
        Self {
            name: config.name.clone(),
            backend,
            weight: config.weight,
            max_runners: config.max_runners,
            disabled: config.disabled,
            tier: config.tier,
        }
    }
}

/// The burst tier's rules: the run-time switch (from the KV bucket `JR_PLACEMENT`, see
/// [`crate::burst`]) and the configured protected jobs and wait threshold.
pub struct Burst {
    setting: Mutex<BurstSetting>,
    protected: Vec<ProtectedMatcher>,
    after: Option<Duration>,
}

impl Burst {
    /// Switched off until [`Burst::set`] says otherwise.
    pub fn new(protected: Vec<ProtectedMatcher>, after: Option<Duration>) -> Self {
        Self {
            setting: Mutex::new(BurstSetting::OFF),
            protected,
            after,
        }
    }

    pub fn set(&self, setting: BurstSetting) {
        *self
            .setting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = setting;
    }

    pub fn setting(&self) -> BurstSetting {
        *self
            .setting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Providers drained at run time (the KV keys `drain.<backend>.<provider>` in `JR_PLACEMENT`,
/// see [`crate::burst`]), on top of the configured `disabled`.
#[derive(Debug, Default)]
pub struct Drains(Mutex<BTreeSet<String>>);

impl Drains {
    pub fn set(&self, provider: &str, drained: bool) {
        let mut set = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if drained {
            set.insert(provider.to_owned());
        } else {
            set.remove(provider);
        }
    }

    pub fn contains(&self, provider: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(provider)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabels {
    pub provider: String,
    pub tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// Placement metrics (prefix `worker_`): per provider and tier, and the burst switch.
#[derive(Debug, Default)]
pub struct PlacementMetrics {
    pub placed: Family<ProviderLabels, Counter>,
    pub full: Family<ProviderLabels, Counter>,
    pub used: Family<ProviderLabels, Gauge>,
    pub reachable: Family<ProviderLabels, Gauge>,
    /// The burst switch as applied: -1 off, else the percentage.
    pub burst_percent: Gauge,
    /// Switch values that could not be read and counted as off / 0 %.
    pub burst_switch_invalid: Counter,
    /// Jobs that found the default tier without room, by what happened (`burst`, or why not).
    pub tier_decisions: Family<ReasonLabels, Counter>,
}

impl PlacementMetrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("worker");
        r.register(
            "provider_placed",
            "Workloads created, by provider and tier",
            self.placed.clone(),
        );
        r.register(
            "provider_full",
            "Full answers (quota, 429), by provider and tier",
            self.full.clone(),
        );
        r.register(
            "provider_used",
            "Workloads a provider runs now, by provider and tier",
            self.used.clone(),
        );
        r.register(
            "provider_reachable",
            "1 while a provider answers, 0 while it is unreachable",
            self.reachable.clone(),
        );
        r.register(
            "burst_percent",
            "The burst switch in effect: -1 off, else the share of eligible jobs in percent",
            self.burst_percent.clone(),
        );
        r.register(
            "burst_switch_invalid",
            "Burst switch values that could not be read (counted as off)",
            self.burst_switch_invalid.clone(),
        );
        r.register(
            "tier_decisions",
            "Placements that found the default tier without room, by outcome",
            self.tier_decisions.clone(),
        );
    }
}

/// What one provider did since the start (for metrics and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProviderStats {
    pub name: String,
    /// Workloads created here.
    pub placed: u64,
    /// "Full" answers.
    pub full: u64,
    /// Workloads here now (created or listed and not gone), including ones being created.
    pub used: usize,
    pub reachable: bool,
    pub disabled: bool,
}

struct Known {
    provider: usize,
    observed: ObservedWorkload,
    since: Instant,
}

#[derive(Default)]
struct ProviderState {
    creating: usize,
    full_until: Option<Instant>,
    failures: u32,
    unreachable_since: Option<Instant>,
    unreachable_reported: bool,
    listed_once: bool,
    placed: u64,
    full: u64,
}

struct State {
    /// One picker per tier (a picker forgets the current weights of providers it is not shown).
    pickers: [WeightedPicker; 2],
    providers: Vec<ProviderState>,
    /// Our workloads by full reference.
    known: HashMap<String, Known>,
    /// Attempt workload name → provider it was sent to, until created there or refused as full.
    sticky: HashMap<String, usize>,
    /// Where `observe` delivers, once it runs (unreachable reports are sent through it).
    observer: Option<mpsc::Sender<ObservedWorkload>>,
}

/// A backend made of providers; see the module documentation.
pub struct Providers<B> {
    members: Vec<Provider<B>>,
    hold: Duration,
    state: Arc<Mutex<State>>,
    burst: Arc<Burst>,
    drains: Arc<Drains>,
    metrics: Arc<PlacementMetrics>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Every change to the state is a single assignment; a panic cannot leave it halfway.
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `<provider>/<inner>`.
pub fn provider_ref(provider: &str, inner: &str) -> String {
    format!("{provider}/{inner}")
}

impl<B: Backend> Providers<B> {
    /// `members` must be non-empty with unique names (configuration validation ensures both).
    pub fn new(members: Vec<Provider<B>>, unreachable_hold: Duration) -> Self {
        let providers = members.iter().map(|_| ProviderState::default()).collect();
        Self {
            members,
            hold: unreachable_hold,
            burst: Arc::new(Burst::new(Vec::new(), None)),
            drains: Arc::default(),
            metrics: Arc::default(),
            state: Arc::new(Mutex::new(State {
                pickers: [WeightedPicker::new(), WeightedPicker::new()],
                providers,
                known: HashMap::new(),
                sticky: HashMap::new(),
                observer: None,
            })),
        }
    }

    /// Uses `burst` for the burst tier's rules (default: off, nothing protected).
    pub fn with_burst(mut self, burst: Arc<Burst>) -> Self {
        self.burst = burst;
        self
    }

    pub fn burst(&self) -> Arc<Burst> {
        self.burst.clone()
    }

    /// The run-time drain switches of this backend's providers.
    pub fn drains(&self) -> Arc<Drains> {
        self.drains.clone()
    }

    /// The providers' names, in configuration order.
    pub fn names(&self) -> Vec<String> {
        self.members.iter().map(|m| m.name.clone()).collect()
    }

    fn is_disabled(&self, i: usize) -> bool {
        self.members[i].disabled || self.drains.contains(&self.members[i].name)
    }

    pub fn metrics(&self) -> Arc<PlacementMetrics> {
        self.metrics.clone()
    }

    fn labels(&self, i: usize) -> ProviderLabels {
        ProviderLabels {
            provider: self.members[i].name.clone(),
            tier: match self.members[i].tier {
                Tier::Default => "default",
                Tier::Burst => "burst",
            }
            .to_owned(),
        }
    }

    /// Refreshes the per-provider gauges.
    fn gauges(&self, state: &State) {
        for (i, used) in used_all(state).into_iter().enumerate() {
            let labels = self.labels(i);
            self.metrics.used.get_or_create(&labels).set(used as i64);
            self.metrics
                .reachable
                .get_or_create(&labels)
                .set(i64::from(state.providers[i].unreachable_since.is_none()));
        }
    }

    pub fn stats(&self) -> Vec<ProviderStats> {
        let state = lock(&self.state);
        let used = used_all(&state);
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| ProviderStats {
                name: m.name.clone(),
                placed: state.providers[i].placed,
                full: state.providers[i].full,
                used: used[i],
                reachable: state.providers[i].unreachable_since.is_none(),
                disabled: self.is_disabled(i),
            })
            .collect()
    }

    fn index(&self, reference: &str) -> Option<(usize, String)> {
        let (provider, inner) = reference.split_once('/')?;
        let i = self.members.iter().position(|m| m.name == provider)?;
        Some((i, inner.to_owned()))
    }

    /// The providers of `tier` as placement sees them.
    fn views(&self, state: &State, used: &[usize], tier: Tier) -> Vec<ProviderView> {
        self.members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.tier == tier)
            .map(|(i, m)| ProviderView {
                name: m.name.clone(),
                weight: m.weight,
                max_runners: m.max_runners,
                disabled: self.is_disabled(i),
                used: used[i],
                reachable: state.providers[i].unreachable_since.is_none(),
                full_until: state.providers[i].full_until,
            })
            .collect()
    }

    /// Which provider takes a new workload for `spec`: the default tier by weight when it has
    /// room; the burst tier when the switch, the protected jobs and the job's bucket allow it
    /// and the default tier has no room (or the job waited longer than `after`).
    fn place(
        &self,
        state: &mut State,
        spec: &WorkloadSpec,
        exclude: &BTreeSet<String>,
        now: Instant,
    ) -> Option<usize> {
        let has_room = |views: &[ProviderView]| {
            views
                .iter()
                .any(|v| v.has_room(now) && !exclude.contains(&v.name))
        };
        let used = used_all(state);
        let defaults = self.views(state, &used, Tier::Default);
        let bursts = self.views(state, &used, Tier::Burst);
        let default_room = has_room(&defaults);
        let tier = if bursts.is_empty() {
            Tier::Default
        } else {
            let job = JobKey {
                repository: spec.repository.clone(),
                workflow: spec.workflow.clone(),
                job: spec.job_name.clone(),
                labels: spec.labels.clone(),
            };
            let waited = Duration::from_millis(now_ms().saturating_sub(spec.fetched_at));
            let choice = choose_tier(
                &self.burst.setting(),
                &self.burst.protected,
                &job,
                !default_room,
                waited,
                self.burst.after,
            );
            let burst_room = has_room(&bursts);
            if !default_room || matches!(choice, TierChoice::Burst) {
                let outcome = match choice {
                    TierChoice::Burst if burst_room => "burst",
                    TierChoice::Burst => "burst_full",
                    TierChoice::Default(reason) => reason.kind(),
                };
                self.metrics
                    .tier_decisions
                    .get_or_create(&ReasonLabels {
                        reason: outcome.to_owned(),
                    })
                    .inc();
            }
            match choice {
                TierChoice::Burst if burst_room => Tier::Burst,
                _ => Tier::Default,
            }
        };
        let (views, picker) = match tier {
            Tier::Default => (defaults, &mut state.pickers[0]),
            Tier::Burst => (bursts, &mut state.pickers[1]),
        };
        picker
            .pick(&views, exclude, now)
            .and_then(|n| self.members.iter().position(|m| m.name == n))
    }

    /// A call to provider `i` succeeded: it is reachable.
    fn succeeded(&self, i: usize) {
        let mut state = lock(&self.state);
        let p = &mut state.providers[i];
        p.failures = 0;
        if p.unreachable_since.take().is_some() {
            tracing::info!(provider = %self.members[i].name, "provider reachable again");
        }
        p.unreachable_reported = false;
    }

    /// A call to provider `i` failed for a reason other than "full". Returns when it became
    /// unreachable, once it is.
    fn failed(&self, i: usize, now: Instant) -> Option<Instant> {
        let reports = {
            let mut state = lock(&self.state);
            let p = &mut state.providers[i];
            p.failures = p.failures.saturating_add(1);
            if p.failures >= FAILURES_BEFORE_UNREACHABLE && p.unreachable_since.is_none() {
                tracing::warn!(provider = %self.members[i].name, hold = ?self.hold, "provider unreachable; its workloads are held");
                p.unreachable_since = Some(now);
            }
            let since = p.unreachable_since;
            if since.is_some() && !p.unreachable_reported {
                p.unreachable_reported = true;
                let reports: Vec<_> = state
                    .known
                    .values()
                    .filter(|k| k.provider == i && k.observed.phase != WorkloadPhase::Gone)
                    .map(|k| unknown(&k.observed))
                    .collect();
                state.observer.clone().map(|tx| (tx, reports))
            } else {
                None
            }
        };
        if let Some((tx, reports)) = reports {
            for report in reports {
                // The observer is gone only at shutdown; a full channel drops the report, and
                // the next list carries the same phase.
                let _ = tx.try_send(report);
            }
        }
        lock(&self.state).providers[i].unreachable_since
    }
}

/// Workloads per provider (index order): those being created and those known and not gone.
fn used_all(state: &State) -> Vec<usize> {
    let mut used: Vec<usize> = state.providers.iter().map(|p| p.creating).collect();
    for k in state.known.values() {
        if k.observed.phase != WorkloadPhase::Gone
            && let Some(n) = used.get_mut(k.provider)
        {
            *n += 1;
        }
    }
    used
}

fn unknown(observed: &ObservedWorkload) -> ObservedWorkload {
    ObservedWorkload {
        phase: WorkloadPhase::Unknown,
        reason: Some(Reason::BackendUnreachable.to_string()),
        ..observed.clone()
    }
}

fn tag(provider: &str, mut observed: ObservedWorkload) -> ObservedWorkload {
    observed.workload = provider_ref(provider, &observed.workload);
    observed
}

impl<B: Backend> Backend for Providers<B> {
    async fn create(&self, spec: &WorkloadSpec) -> Result<String, BackendError> {
        let name = spec.name();
        let mut exclude = BTreeSet::new();
        let mut retry_after: Option<Duration> = None;
        loop {
            let now = Instant::now();
            let chosen = {
                let mut state = lock(&self.state);
                let sticky = state.sticky.get(&name).copied().filter(|&i| {
                    state.providers[i].unreachable_since.is_none()
                        && !exclude.contains(&self.members[i].name)
                });
                let chosen = match sticky {
                    Some(i) => Some(i),
                    None => self.place(&mut state, spec, &exclude, now),
                };
                if let Some(i) = chosen {
                    state.sticky.insert(name.clone(), i);
                    state.providers[i].creating += 1;
                }
                chosen
            };
            let Some(i) = chosen else {
                // Room left for other jobs (the burst tier is on and has room, but not for this
                // one): pause briefly, not for a full provider's back-off.
                let state = lock(&self.state);
                let used = used_all(&state);
                let mut tiers = vec![Tier::Default];
                if self.burst.setting().enabled {
                    tiers.push(Tier::Burst);
                }
                let room_for_others = tiers.into_iter().any(|tier| {
                    self.views(&state, &used, tier)
                        .iter()
                        .any(|v| v.has_room(now) && !exclude.contains(&v.name))
                });
                if room_for_others {
                    return Err(BackendError::Wait {
                        op: "place workload",
                        retry_after: WAIT_RETRY,
                    });
                }
                return Err(BackendError::Full {
                    op: "place workload",
                    retry_after: retry_after.unwrap_or(NO_ROOM_RETRY),
                });
            };
            let member = &self.members[i];
            let mut spec = spec.clone();
            spec.provider = Some(member.name.clone());
            let result = member.backend.create(&spec).await;
            lock(&self.state).providers[i].creating -= 1;
            match result {
                Ok(inner) => {
                    self.succeeded(i);
                    let reference = provider_ref(&member.name, &inner);
                    let mut state = lock(&self.state);
                    state.sticky.remove(&name);
                    state.providers[i].full_until = None;
                    state.providers[i].placed += 1;
                    self.metrics.placed.get_or_create(&self.labels(i)).inc();
                    state.known.entry(reference.clone()).or_insert(Known {
                        provider: i,
                        observed: ObservedWorkload {
                            workload: reference.clone(),
                            assignment_id: spec.assignment_id,
                            attempt: spec.attempt,
                            phase: WorkloadPhase::Pending,
                            reason: None,
                            worker: spec.worker_id.clone(),
                        },
                        since: Instant::now(),
                    });
                    self.gauges(&state);
                    return Ok(reference);
                }
                Err(BackendError::Full {
                    retry_after: after, ..
                }) => {
                    tracing::info!(provider = %member.name, retry_after = ?after, workload = %name, "provider full; trying the next");
                    let mut state = lock(&self.state);
                    state.sticky.remove(&name);
                    state.providers[i].full_until = Some(Instant::now() + after);
                    state.providers[i].full += 1;
                    self.metrics.full.get_or_create(&self.labels(i)).inc();
                    exclude.insert(member.name.clone());
                    retry_after = Some(retry_after.map_or(after, |r| r.min(after)));
                }
                Err(error @ BackendError::Transient { .. }) => {
                    if self.failed(i, now).is_some() {
                        // Unreachable: the attempt may move on the next try.
                        exclude.insert(member.name.clone());
                        lock(&self.state).sticky.remove(&name);
                    }
                    return Err(error);
                }
                Err(error @ BackendError::Wait { .. }) => {
                    lock(&self.state).sticky.remove(&name);
                    return Err(error);
                }
                Err(error @ BackendError::Permanent { .. }) => {
                    lock(&self.state).sticky.remove(&name);
                    return Err(error);
                }
            }
        }
    }

    async fn delete(&self, workload: &str) -> Result<(), BackendError> {
        match self.index(workload) {
            Some((i, inner)) => {
                let name = inner.clone();
                self.members[i].backend.delete(&inner).await?;
                lock(&self.state).sticky.remove(&name);
                Ok(())
            }
            // A reference from before providers were configured, or of a provider no longer
            // listed: every provider deletes it if it has it (a missing workload is success).
            None => {
                let inner = workload.split_once('/').map_or(workload, |(_, w)| w);
                for member in &self.members {
                    member.backend.delete(inner).await?;
                }
                Ok(())
            }
        }
    }

    async fn list(&self) -> Result<Vec<ObservedWorkload>, BackendError> {
        let started = Instant::now();
        let results = join_all(self.members.iter().map(|m| m.backend.list())).await;
        let mut all = Vec::new();
        for (i, result) in results.into_iter().enumerate() {
            let name = &self.members[i].name;
            match result {
                Ok(listed) => {
                    self.succeeded(i);
                    let listed: Vec<_> = listed.into_iter().map(|o| tag(name, o)).collect();
                    let mut state = lock(&self.state);
                    state.providers[i].listed_once = true;
                    let present: BTreeSet<&str> =
                        listed.iter().map(|o| o.workload.as_str()).collect();
                    state.known.retain(|reference, k| {
                        k.provider != i || k.since > started || present.contains(reference.as_str())
                    });
                    for o in &listed {
                        state.known.insert(
                            o.workload.clone(),
                            Known {
                                provider: i,
                                observed: o.clone(),
                                since: started,
                            },
                        );
                    }
                    all.extend(listed);
                }
                Err(error) => {
                    let since = self.failed(i, started).unwrap_or(started);
                    let listed_once = lock(&self.state).providers[i].listed_once;
                    match unreachable_verdict(since, Instant::now(), self.hold) {
                        Unreachable::Hold { remaining } if !listed_once => {
                            return Err(BackendError::Transient {
                                op: "list provider",
                                message: format!(
                                    "provider {name} cannot be listed ({error}); its workloads are unknown, start held for at most {remaining:?}"
                                ),
                                retry_after: None,
                            });
                        }
                        Unreachable::Hold { .. } => {
                            tracing::warn!(provider = %name, %error, "listing a provider failed; its workloads are held");
                            let state = lock(&self.state);
                            all.extend(
                                state
                                    .known
                                    .values()
                                    .filter(|k| k.provider == i)
                                    .map(|k| unknown(&k.observed)),
                            );
                        }
                        Unreachable::WriteOff => {
                            tracing::warn!(provider = %name, %error, "provider unreachable past the hold; its workloads are written off");
                            let mut state = lock(&self.state);
                            state.known.retain(|_, k| k.provider != i);
                            state.providers[i].listed_once = true;
                        }
                    }
                }
            }
        }
        self.gauges(&lock(&self.state));
        Ok(all)
    }

    async fn observe(
        &self,
        tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        lock(&self.state).observer = Some(tx.clone());
        let stop = CancellationToken::new();
        let watch_stop = {
            let stop = stop.clone();
            async move {
                shutdown.await;
                stop.cancel();
            }
        };
        let observers = self.members.iter().enumerate().map(|(i, member)| {
            let (member_tx, mut member_rx) = mpsc::channel::<ObservedWorkload>(256);
            let tx = tx.clone();
            let state = self.state.clone();
            let stop = stop.clone();
            let name = member.name.clone();
            let forward = async move {
                while let Some(observed) = member_rx.recv().await {
                    let observed = tag(&name, observed);
                    {
                        let mut state = lock(&state);
                        if observed.phase == WorkloadPhase::Gone {
                            state.known.remove(&observed.workload);
                        } else {
                            state.known.insert(
                                observed.workload.clone(),
                                Known {
                                    provider: i,
                                    observed: observed.clone(),
                                    since: Instant::now(),
                                },
                            );
                        }
                    }
                    if tx.send(observed).await.is_err() {
                        return;
                    }
                }
            };
            let watch = member.backend.observe(member_tx, stop.cancelled_owned());
            async move {
                futures::join!(watch, forward);
            }
        });
        futures::join!(watch_stop, join_all(observers));
        lock(&self.state).observer = None;
    }
}

#[cfg(test)]
pub(crate) mod tests;
