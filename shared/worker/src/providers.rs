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
use jr_placement::{ProviderView, Unreachable, WeightedPicker, unreachable_verdict};
use jr_protocol::{Reason, WorkloadPhase};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec};

/// Failed calls in a row after which a provider counts as unreachable.
pub const FAILURES_BEFORE_UNREACHABLE: u32 = 3;
/// How long to wait before placing again when no provider has room (all drained, at their
/// `max_runners` or unreachable) and none gave a time.
const NO_ROOM_RETRY: Duration = Duration::from_secs(1);

/// One provider of a backend.
pub struct Provider<B> {
    /// Unique within the backend; a DNS label.
    pub name: String,
    pub backend: B,
    pub weight: u32,
    pub max_runners: Option<usize>,
    /// Drained: nothing new is placed here; its running workloads finish and are deleted.
    pub disabled: bool,
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
    picker: WeightedPicker,
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
            state: Arc::new(Mutex::new(State {
                picker: WeightedPicker::new(),
                providers,
                known: HashMap::new(),
                sticky: HashMap::new(),
                observer: None,
            })),
        }
    }

    pub fn stats(&self) -> Vec<ProviderStats> {
        let state = lock(&self.state);
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| ProviderStats {
                name: m.name.clone(),
                placed: state.providers[i].placed,
                full: state.providers[i].full,
                used: used(&state, i),
                reachable: state.providers[i].unreachable_since.is_none(),
                disabled: m.disabled,
            })
            .collect()
    }

    fn index(&self, reference: &str) -> Option<(usize, String)> {
        let (provider, inner) = reference.split_once('/')?;
        let i = self.members.iter().position(|m| m.name == provider)?;
        Some((i, inner.to_owned()))
    }

    fn views(&self, state: &State) -> Vec<ProviderView> {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| ProviderView {
                name: m.name.clone(),
                weight: m.weight,
                max_runners: m.max_runners,
                disabled: m.disabled,
                used: used(state, i),
                reachable: state.providers[i].unreachable_since.is_none(),
                full_until: state.providers[i].full_until,
            })
            .collect()
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

fn used(state: &State, i: usize) -> usize {
    state.providers[i].creating
        + state
            .known
            .values()
            .filter(|k| k.provider == i && k.observed.phase != WorkloadPhase::Gone)
            .count()
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
                    None => {
                        let views = self.views(&state);
                        state
                            .picker
                            .pick(&views, &exclude, now)
                            .and_then(|n| self.members.iter().position(|m| m.name == n))
                    }
                };
                if let Some(i) = chosen {
                    state.sticky.insert(name.clone(), i);
                    state.providers[i].creating += 1;
                }
                chosen
            };
            let Some(i) = chosen else {
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
                    state.known.entry(reference.clone()).or_insert(Known {
                        provider: i,
                        observed: ObservedWorkload {
                            workload: reference.clone(),
                            assignment_id: spec.assignment_id,
                            attempt: spec.attempt,
                            phase: WorkloadPhase::Pending,
                            reason: None,
                        },
                        since: Instant::now(),
                    });
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
mod tests;
