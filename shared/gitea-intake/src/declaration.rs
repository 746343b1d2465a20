//! Which labels a shared registration declares to the forge (pure decisions).
//!
//! The forge hands a runner only jobs whose `runs-on` labels are all among the runner's declared
//! labels, and `Declare` replaces them at once. A registration that serves several backends
//! therefore declares only labels that lead to a backend taking work: a backend that is full or
//! has no live worker has its labels withdrawn and the others keep fetching, so one backend's
//! trouble never stalls another's work. A label several backends share stays declared only
//! while every job the forge could hand out with it routes to a backend taking work.
//!
//! The rule, for the set `open` of backends taking work: start from every label of an open
//! backend; a set of labels `S` the forge may hand out (non-empty, within what is declared)
//! goes to `route(S)`, which must be open. Only a label set some closed backend declares in
//! full can route to a closed backend, so those sets (subsets of the declared labels of each
//! closed backend) are checked exhaustively, smallest first, and the labels of the first bad
//! one are withdrawn, until none is left. A closed backend sharing more than
//! [`EXHAUSTIVE_LABELS`] labels with what is declared has all of them withdrawn instead.
//!
//! The room of a shared registration is then the smallest room among the backends a declared
//! label set can route to ([`reachable`]), and the forge's backlog for the others waits there.
//!
//! [`Declarer`] adds the timing: withdrawing is immediate (until it is done the registration
//! fetches nothing), declaring labels again waits for the backend to have room for at least
//! half its lookahead (hysteresis) and for [`Declarer::min_interval`] since the last Declare,
//! and the desired labels are declared again every [`Declarer::reapply_every`] even when
//! unchanged (a scheduler replica starting declares every label).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use jr_protocol::BackendName;

pub use jr_intake::pacing::Condition;
use jr_intake::routing::Router;

/// Label sets of a closed backend are enumerated up to this many shared labels.
pub const EXHAUSTIVE_LABELS: usize = 12;

/// What routing says about label sets: the backends with the labels each declares, and where a
/// job with given `runs-on` labels goes.
pub trait Routes {
    fn backend_labels(&self) -> Vec<(BackendName, Vec<String>)>;
    fn route_of(&self, labels: &[String]) -> Option<BackendName>;
}

impl Routes for Router {
    fn backend_labels(&self) -> Vec<(BackendName, Vec<String>)> {
        self.backends().to_vec()
    }

    fn route_of(&self, labels: &[String]) -> Option<BackendName> {
        self.route(labels).ok()
    }
}

/// Every non-empty subset of `items` (at most [`EXHAUSTIVE_LABELS`] of them), smallest first.
fn subsets(items: &[String]) -> Vec<Vec<String>> {
    let n = items.len().min(EXHAUSTIVE_LABELS);
    let mut all: Vec<Vec<String>> = (1_u32..(1 << n))
        .map(|mask| {
            (0..n)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| items[i].clone())
                .collect()
        })
        .collect();
    all.sort_by_key(Vec::len);
    all
}

/// The labels to declare when the backends in `open` take work (sorted).
pub fn labels_to_declare(routes: &impl Routes, open: &BTreeSet<BackendName>) -> Vec<String> {
    let backends = routes.backend_labels();
    let mut declared: BTreeSet<String> = backends
        .iter()
        .filter(|(b, _)| open.contains(b))
        .flat_map(|(_, labels)| labels.iter().cloned())
        .collect();
    'search: loop {
        for (closed, labels) in backends.iter().filter(|(b, _)| !open.contains(b)) {
            let shared: Vec<String> = labels
                .iter()
                .filter(|l| declared.contains(*l))
                .cloned()
                .collect();
            if shared.is_empty() {
                continue;
            }
            if shared.len() > EXHAUSTIVE_LABELS {
                tracing::debug!(%closed, labels = shared.len(), "too many shared labels to check one by one: all withdrawn");
                for l in &shared {
                    declared.remove(l);
                }
                continue 'search;
            }
            for set in subsets(&shared) {
                let goes_to_closed = routes.route_of(&set).is_none_or(|b| !open.contains(&b));
                if goes_to_closed {
                    for l in &set {
                        declared.remove(l);
                    }
                    continue 'search;
                }
            }
        }
        break;
    }
    declared.into_iter().collect()
}

/// The backends a job the forge may hand out under `declared` can route to: `route(S)` for the
/// non-empty label sets `S` within `declared`. A backend sharing more than
/// [`EXHAUSTIVE_LABELS`] labels with `declared` counts as reachable.
pub fn reachable(routes: &impl Routes, declared: &[String]) -> BTreeSet<BackendName> {
    let mut out = BTreeSet::new();
    for (backend, labels) in routes.backend_labels() {
        let shared: Vec<String> = labels
            .iter()
            .filter(|l| declared.contains(l))
            .cloned()
            .collect();
        if shared.is_empty() {
            continue;
        }
        if shared.len() > EXHAUSTIVE_LABELS
            || subsets(&shared)
                .iter()
                .any(|s| routes.route_of(s).as_ref() == Some(&backend))
        {
            out.insert(backend);
        }
    }
    out
}

/// A Declare the fetch loop should send now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Declare {
    pub labels: Vec<String>,
}

/// One step of a shared registration's fetch loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Send this Declare before fetching (then report with [`Declarer::declared`]).
    pub declare: Option<Declare>,
    /// How many tasks may be fetched now under what the forge has declared.
    pub room: usize,
}

/// The label declarations of one shared registration over time.
#[derive(Clone, Debug)]
pub struct Declarer {
    /// What the forge has (sorted).
    declared: Vec<String>,
    /// Backends a declared label set can route to (cached with `declared`).
    reaches: BTreeSet<BackendName>,
    /// Backends whose labels are wanted (with hysteresis).
    open: BTreeSet<BackendName>,
    last_declare: Option<Instant>,
    /// After a failed Declare, none is tried before this.
    retry_at: Option<Instant>,
    /// Declares failed in a row (the retry interval doubles with each, up to 32 ×).
    failures: u32,
    pub min_interval: Duration,
    pub reapply_every: Duration,
}

impl Declarer {
    /// A registration whose runner declared `declared` at start (every label).
    pub fn new(routes: &impl Routes, declared: Vec<String>) -> Self {
        let mut declared = declared;
        declared.sort();
        declared.dedup();
        let reaches = reachable(routes, &declared);
        let open = reaches.clone();
        Self {
            declared,
            reaches,
            open,
            last_declare: None,
            retry_at: None,
            failures: 0,
            min_interval: Duration::from_millis(500),
            reapply_every: Duration::from_secs(15),
        }
    }

    pub fn declared_labels(&self) -> &[String] {
        &self.declared
    }

    /// Whether `backend`'s labels lead jobs to it under what is declared now.
    pub fn reaches(&self, backend: &BackendName) -> bool {
        self.reaches.contains(backend)
    }

    /// The forge accepted a Declare of `labels` at `now`.
    pub fn declared(&mut self, routes: &impl Routes, labels: Vec<String>, now: Instant) {
        self.retry_at = None;
        self.failures = 0;
        self.reaches = reachable(routes, &labels);
        self.declared = labels;
        self.last_declare = Some(now);
    }

    /// A Declare failed at `now`: the forge keeps what it had; try again after the interval.
    pub fn failed(&mut self, now: Instant) {
        self.retry_at = Some(now + self.min_interval * 2_u32.pow(self.failures.min(5)));
        self.failures = self.failures.saturating_add(1);
    }

    /// Decides from the backends' conditions at `now`.
    pub fn step(
        &mut self,
        routes: &impl Routes,
        conditions: &BTreeMap<BackendName, Condition>,
        now: Instant,
    ) -> Step {
        for (backend, condition) in conditions {
            let open = match *condition {
                Condition::Blocked(_) | Condition::Room { room: 0, .. } => false,
                // Hysteresis: a backend that was closed opens again only with room for half
                // its lookahead, so a busy backend does not flip its labels at every job.
                Condition::Room { room, lookahead } => {
                    self.open.contains(backend) || room >= lookahead.div_ceil(2).max(1)
                }
            };
            if open {
                self.open.insert(backend.clone());
            } else {
                self.open.remove(backend);
            }
        }
        let wanted = labels_to_declare(routes, &self.open);
        let since = self.last_declare.map(|t| now.saturating_duration_since(t));
        let declare = if self.retry_at.is_some_and(|at| now < at) {
            None
        } else if wanted == self.declared {
            since
                .is_none_or(|s| s >= self.reapply_every)
                .then(|| wanted.clone())
        } else {
            // Withdraw at once what is no longer wanted; add only after the interval.
            let kept: Vec<String> = self
                .declared
                .iter()
                .filter(|l| wanted.contains(l))
                .cloned()
                .collect();
            let may_add = since.is_none_or(|s| s >= self.min_interval);
            if may_add {
                Some(wanted)
            } else if kept != self.declared {
                Some(kept)
            } else {
                None
            }
        };
        Step {
            declare: declare.map(|labels| Declare { labels }),
            room: self.room(conditions),
        }
    }

    /// The smallest room among the backends the declared labels reach; none reached: none.
    pub fn room(&self, conditions: &BTreeMap<BackendName, Condition>) -> usize {
        self.reaches
            .iter()
            .map(|b| conditions.get(b).map_or(0, |c| c.room()))
            .min()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests;
