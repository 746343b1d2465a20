//! How the planner reads a workload: usable, held (its backend cannot be reached and the hold
//! has not run out), or broken (failed, exited, gone, released, unknown for too long, or
//! unreachable beyond the hold). Also the planner's clock, which remembers when a plan may next
//! change, and backend health kept up to date record by record.

use std::collections::BTreeMap;
use std::ops::Bound;

use jr_protocol::{BackendName, Reason, WorkloadPhase};
use jr_store::{AssignmentRecord, Snapshot, WorkloadRecord};

use super::PlannerConfig;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Condition {
    /// The attempt has no workload yet (at most requested): it waits in JetStream or is starting.
    NotCreated,
    /// Existing and, as far as we know, able to run; `since` starts the claim timeout.
    Healthy { since: u64 },
    /// Its backend is unreachable and the hold has not expired: decide nothing yet.
    Held,
    /// It can no longer run the job.
    Broken { reason: String },
}

/// `now` for one plan, and the earliest later time at which one of the comparisons the plan made
/// turns. Every comparison is `now >= t` (once true it stays true), so the plan of an unchanged
/// record cannot change before [`Clock::wake`].
#[derive(Clone, Debug)]
pub(crate) struct Clock {
    now: u64,
    wake: Option<u64>,
}

impl Clock {
    pub fn new(now: u64) -> Self {
        Self { now, wake: None }
    }

    pub fn now(&self) -> u64 {
        self.now
    }

    /// `now >= t`; when not yet, `t` becomes a time the plan may change.
    pub fn reached(&mut self, t: u64) -> bool {
        if self.now >= t {
            return true;
        }
        self.wake_at(t);
        false
    }

    /// Remembers `t` as a time the plan may change.
    pub fn wake_at(&mut self, t: u64) {
        self.wake = Some(self.wake.map_or(t, |w| w.min(t)));
    }

    /// The earliest time a comparison made so far turns (`None`: none will).
    pub fn wake(&self) -> Option<u64> {
        self.wake
    }
}

/// Since when each backend has been unreachable (only unreachable backends are present).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct BackendHealth {
    unreachable_since: BTreeMap<Domain, u64>,
}

/// Where reachability is judged: a backend, or one provider of it. A provider's workload
/// reference is `<provider>/<name>`; an unreachable provider says nothing about the others.
pub(crate) type Domain = (BackendName, Option<String>);

/// The reachability domain of a workload.
pub(crate) fn domain(workload: &WorkloadRecord) -> Domain {
    let provider = workload
        .workload
        .split_once('/')
        .map(|(provider, _)| provider.to_owned());
    (workload.backend.clone(), provider)
}

impl BackendHealth {
    /// A backend is unreachable when its newest observations say `backend-unreachable` (newer
    /// than any other observation from it), or, with `backend_silence` set, when nothing was
    /// heard from it for that long while it still has live workloads.
    pub fn from_snapshot(snapshot: &Snapshot, now: u64, cfg: &PlannerConfig) -> Self {
        #[derive(Default)]
        struct Seen {
            reachable_at: Option<u64>,
            unreachable: Vec<(u64, u64)>, // (observed at, unreachable since)
            last_heard: u64,
            live: bool,
        }
        let mut seen: BTreeMap<Domain, Seen> = BTreeMap::new();
        for workload in snapshot
            .assignments
            .iter()
            .flat_map(|r| r.workloads.values())
        {
            let entry = seen.entry(domain(workload)).or_default();
            entry.live |= !workload.is_released();
            entry.last_heard = entry
                .last_heard
                .max(workload.created_at.unwrap_or(workload.first_seen));
            if let Some(o) = &workload.observation {
                entry.last_heard = entry.last_heard.max(o.at);
                if o.is_unreachable() {
                    entry
                        .unreachable
                        .push((o.at, o.unreachable_since.unwrap_or(o.at)));
                } else {
                    entry.reachable_at = Some(entry.reachable_at.map_or(o.at, |r| r.max(o.at)));
                }
            }
        }
        let mut unreachable_since = BTreeMap::new();
        for (backend, s) in seen {
            let reported = s
                .unreachable
                .iter()
                .filter(|(at, _)| s.reachable_at.is_none_or(|r| *at > r))
                .map(|(_, since)| *since)
                .min();
            let silent = cfg
                .backend_silence
                .map(|d| s.last_heard.saturating_add(millis(d)))
                .filter(|silent_from| s.live && now >= *silent_from);
            if let Some(since) = reported.into_iter().chain(silent).min() {
                unreachable_since.insert(backend, since);
            }
        }
        Self { unreachable_since }
    }

    /// Since when the backend (or provider) of `workload` is unreachable, if it is.
    pub fn unreachable_since(&self, workload: &WorkloadRecord) -> Option<u64> {
        self.unreachable_since.get(&domain(workload)).copied()
    }

    /// Domains whose value differs between `self` and `other`.
    pub fn changed<'a>(&'a self, other: &'a BackendHealth) -> Vec<&'a Domain> {
        let mut out: Vec<&Domain> = self
            .unreachable_since
            .keys()
            .chain(other.unreachable_since.keys())
            .filter(|b| self.unreachable_since.get(*b) != other.unreachable_since.get(*b))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// A multiset of values, for maxima and minima that must survive removals.
#[derive(Clone, Debug)]
struct Counted<K: Ord>(BTreeMap<K, usize>);

impl<K: Ord> Default for Counted<K> {
    fn default() -> Self {
        Self(BTreeMap::new())
    }
}

impl<K: Ord> Counted<K> {
    fn change(&mut self, key: K, add: bool) {
        if add {
            *self.0.entry(key).or_default() += 1;
        } else if let Some(n) = self.0.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&key);
            }
        }
    }

    fn max(&self) -> Option<&K> {
        self.0.keys().next_back()
    }
}

/// What [`BackendHealth::from_snapshot`] reads about one backend, over the workloads of the
/// records added and not removed.
#[derive(Clone, Debug, Default)]
struct Heard {
    workloads: usize,
    live: usize,
    /// Per workload: the latest of its creation (or first sighting) and its observation.
    heard: Counted<u64>,
    /// Times of observations that do not say `backend-unreachable`.
    reachable: Counted<u64>,
    /// (observed at, unreachable since) of observations that do.
    unreachable: Counted<(u64, u64)>,
}

/// [`BackendHealth`] kept up to date as records come and go: `add` every record the snapshot
/// would hold, `remove` it before it changes or leaves, and [`BackendObservations::health`] is
/// what `BackendHealth::from_snapshot` says about those records.
#[derive(Clone, Debug, Default)]
pub(crate) struct BackendObservations {
    backends: BTreeMap<Domain, Heard>,
}

impl BackendObservations {
    pub fn add(&mut self, record: &AssignmentRecord) {
        self.change(record, true);
    }

    pub fn remove(&mut self, record: &AssignmentRecord) {
        self.change(record, false);
    }

    fn change(&mut self, record: &AssignmentRecord, add: bool) {
        for workload in record.workloads.values() {
            let key = domain(workload);
            let entry = self.backends.entry(key.clone()).or_default();
            let live = usize::from(!workload.is_released());
            if add {
                entry.workloads += 1;
                entry.live += live;
            } else {
                entry.workloads = entry.workloads.saturating_sub(1);
                entry.live = entry.live.saturating_sub(live);
            }
            let mut heard = workload.created_at.unwrap_or(workload.first_seen);
            if let Some(o) = &workload.observation {
                heard = heard.max(o.at);
                if o.is_unreachable() {
                    let since = o.unreachable_since.unwrap_or(o.at);
                    entry.unreachable.change((o.at, since), add);
                } else {
                    entry.reachable.change(o.at, add);
                }
            }
            entry.heard.change(heard, add);
            if entry.workloads == 0 {
                self.backends.remove(&key);
            }
        }
    }

    /// The health of every backend at `now` (same rules as `BackendHealth::from_snapshot`).
    pub fn health(&self, now: u64, cfg: &PlannerConfig) -> BackendHealth {
        let mut unreachable_since = BTreeMap::new();
        for (backend, h) in &self.backends {
            let after = match h.reachable.max() {
                Some(r) => Bound::Excluded((*r, u64::MAX)),
                None => Bound::Unbounded,
            };
            let reported = h
                .unreachable
                .0
                .range((after, Bound::Unbounded))
                .map(|((_, since), _)| *since)
                .min();
            let silent = self
                .silent_from(h, cfg)
                .filter(|silent_from| now >= *silent_from);
            if let Some(since) = reported.into_iter().chain(silent).min() {
                unreachable_since.insert(backend.clone(), since);
            }
        }
        BackendHealth { unreachable_since }
    }

    /// The next time after `now` at which a backend's health changes without new records: when
    /// one with live workloads has been silent for `backend_silence`.
    pub fn next_change(&self, now: u64, cfg: &PlannerConfig) -> Option<u64> {
        self.backends
            .values()
            .filter_map(|h| self.silent_from(h, cfg))
            .filter(|t| *t > now)
            .min()
    }

    fn silent_from(&self, h: &Heard, cfg: &PlannerConfig) -> Option<u64> {
        let silence = cfg.backend_silence?;
        if h.live == 0 {
            return None;
        }
        let last_heard = h.heard.max().copied().unwrap_or(0);
        Some(last_heard.saturating_add(millis(silence)))
    }
}

pub(crate) fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The condition of an attempt's own workload.
pub(crate) fn attempt_condition(
    record: &AssignmentRecord,
    attempt: u32,
    health: &BackendHealth,
    clock: &mut Clock,
    cfg: &PlannerConfig,
) -> Condition {
    match record.attempt_workload(attempt) {
        Some(workload) => workload_condition(workload, health, clock, cfg),
        None => Condition::NotCreated,
    }
}

pub(crate) fn workload_condition(
    workload: &WorkloadRecord,
    health: &BackendHealth,
    clock: &mut Clock,
    cfg: &PlannerConfig,
) -> Condition {
    let broken = |reason: String| Condition::Broken { reason };
    if workload.is_released() {
        return broken(Reason::WorkloadReleased.to_string());
    }
    let observation = workload.observation.as_ref();
    if let Some(o) = observation {
        let detail = |base: Reason| match &o.reason {
            Some(r) if !o.is_unreachable() => base.with_detail(r),
            _ => base.to_string(),
        };
        match o.phase {
            WorkloadPhase::Failed => return broken(detail(Reason::WorkloadFailed)),
            WorkloadPhase::Succeeded => return broken(detail(Reason::WorkloadExited)),
            WorkloadPhase::Gone => return broken(detail(Reason::WorkloadGone)),
            WorkloadPhase::Pending
            | WorkloadPhase::Running
            | WorkloadPhase::Terminating
            | WorkloadPhase::Unknown => {}
        }
    }
    let own = observation
        .filter(|o| o.is_unreachable())
        .map(|o| o.unreachable_since.unwrap_or(o.at));
    let backend = health.unreachable_since(workload);
    if let Some(since) = own.into_iter().chain(backend).min() {
        return if clock.reached(since.saturating_add(millis(cfg.unreachable_hold))) {
            broken(Reason::BackendUnreachable.to_string())
        } else {
            Condition::Held
        };
    }
    if let Some(o) = observation.filter(|o| o.phase == WorkloadPhase::Unknown)
        && clock.reached(o.at.saturating_add(millis(cfg.lost_timeout)))
    {
        return broken(Reason::WorkloadUnknown.to_string());
    }
    Condition::Healthy {
        since: workload.created_at.unwrap_or(workload.first_seen),
    }
}
