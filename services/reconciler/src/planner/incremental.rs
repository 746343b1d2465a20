//! The planner as the reconciler runs it (docs/architecture.md, "Planner"): the unfinished
//! records in memory, kept up to date with what the projector commits, and each cycle a plan of
//! only the records that changed, the records whose deadline came and, when a backend's health
//! changed, every record with a workload on that backend.
//!
//! Planning one record gives its commands and the earliest time they could change without new
//! facts (a timeout running out, or the reissue period of a command it issued); a timer set
//! keyed by that time brings the record back. The union of the last plans of all records is at
//! every cycle what [`super::plan`] over the whole snapshot gives (the property tests in
//! `equivalence.rs` check that), but a cycle costs what changed, not what is in flight.
//!
//! A cycle returns only the commands to publish now: ones the record's previous plan did not
//! have, and ones issued a reissue period ago that are still wanted (their first delivery may
//! have had no lasting effect; see docs/architecture.md, "Executing commands").

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use jr_protocol::{AssignmentId, BackendName, Envelope};
use jr_store::{AssignmentRecord, AssignmentState};

use super::condition::{BackendHealth, BackendObservations, Domain, domain, millis};
use super::{PlannedCommand, PlannerConfig, plan_record};

/// One command of a record's last plan.
#[derive(Clone, Debug)]
struct Planned {
    command: PlannedCommand,
    /// When it was last handed out for publishing.
    issued_at: u64,
}

#[derive(Clone, Debug)]
struct Entry {
    record: AssignmentRecord,
    /// Key of this record in the timer set, if any.
    wake: Option<u64>,
    planned: Vec<Planned>,
}

/// The unfinished records and what was last planned for each; see the module documentation.
#[derive(Debug)]
pub struct IncrementalPlanner {
    cfg: PlannerConfig,
    reissue_after: u64,
    entries: HashMap<AssignmentId, Entry>,
    /// Records changed since their last plan (or whose commands were not published).
    dirty: HashSet<AssignmentId>,
    /// (time, record): plan the record again at that time.
    timers: BTreeSet<(u64, AssignmentId)>,
    observations: BackendObservations,
    /// The health the current plans were made with.
    health: BackendHealth,
    slots_used: BTreeMap<BackendName, u64>,
    queued: BTreeMap<BackendName, u64>,
    /// Per backend, how many pending records have waited since each time (unix ms).
    waiting_since: BTreeMap<BackendName, BTreeMap<u64, u64>>,
}

impl IncrementalPlanner {
    /// `reissue_after`: a command still wanted this long after it was issued is issued again.
    pub fn new(cfg: PlannerConfig, reissue_after: Duration) -> Self {
        Self {
            cfg,
            reissue_after: millis(reissue_after).max(1),
            entries: HashMap::new(),
            dirty: HashSet::new(),
            timers: BTreeSet::new(),
            observations: BackendObservations::default(),
            health: BackendHealth::default(),
            slots_used: BTreeMap::new(),
            queued: BTreeMap::new(),
            waiting_since: BTreeMap::new(),
        }
    }

    /// Replaces everything with `records` (a snapshot of the projection): all of them are planned
    /// at the next cycle, and every command they still need is issued again.
    pub fn load(&mut self, records: impl IntoIterator<Item = AssignmentRecord>) {
        *self = Self::new(self.cfg.clone(), Duration::from_millis(self.reissue_after));
        for record in records {
            self.update(record);
        }
    }

    /// Takes the committed version of a record: replaces the one in memory, or drops it when
    /// it is finished (the planner has nothing to do for finished records). It is planned at
    /// the next cycle.
    pub fn update(&mut self, record: AssignmentRecord) {
        let id = record.id;
        let mut planned = Vec::new();
        if let Some(old) = self.entries.remove(&id) {
            self.count(&old.record, false);
            if let Some(wake) = old.wake {
                self.timers.remove(&(wake, id));
            }
            planned = old.planned;
        }
        if record.state().is_finished() {
            self.dirty.remove(&id);
            return;
        }
        self.count(&record, true);
        self.entries.insert(
            id,
            Entry {
                record,
                wake: None,
                planned,
            },
        );
        self.dirty.insert(id);
    }

    /// Commands handed out by [`IncrementalPlanner::plan`] that could not be published: they
    /// are handed out again at the next cycle if still wanted.
    pub fn not_issued(&mut self, commands: &[PlannedCommand]) {
        for command in commands {
            let id = command.assignment_id();
            if let Some(entry) = self.entries.get_mut(&id) {
                let key = command.id();
                entry.planned.retain(|p| p.command.id() != key);
                self.dirty.insert(id);
            }
        }
    }

    /// One cycle at `now` (unix ms, never earlier than the previous cycle's): plans the records
    /// that changed, whose timer is due, or whose backend's health changed, and returns the
    /// commands to publish now, sorted by id.
    pub fn plan(&mut self, now: u64) -> Vec<PlannedCommand> {
        let health = self.observations.health(now, &self.cfg);
        if health != self.health {
            let changed: BTreeSet<Domain> =
                health.changed(&self.health).into_iter().cloned().collect();
            for (id, entry) in &self.entries {
                if entry
                    .record
                    .workloads
                    .values()
                    .any(|w| changed.contains(&domain(w)))
                {
                    self.dirty.insert(*id);
                }
            }
            self.health = health;
        }
        while let Some(&(at, id)) = self.timers.first()
            && at <= now
        {
            self.timers.pop_first();
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.wake = None;
            }
            self.dirty.insert(id);
        }
        let mut out = Vec::new();
        for id in std::mem::take(&mut self.dirty) {
            let Some(entry) = self.entries.get_mut(&id) else {
                continue;
            };
            if let Some(wake) = entry.wake.take() {
                self.timers.remove(&(wake, id));
            }
            let (commands, mut wake) = plan_record(&entry.record, &self.health, now, &self.cfg);
            let mut planned = Vec::with_capacity(commands.len());
            for command in commands {
                let key = command.id();
                let issued_at = entry
                    .planned
                    .iter()
                    .find(|p| p.command.id() == key)
                    .map(|p| p.issued_at)
                    .filter(|at| now < at.saturating_add(self.reissue_after));
                let issued_at = match issued_at {
                    Some(at) => at,
                    None => {
                        out.push(command.clone());
                        now
                    }
                };
                let reissue = issued_at.saturating_add(self.reissue_after);
                wake = Some(wake.map_or(reissue, |w| w.min(reissue)));
                planned.push(Planned { command, issued_at });
            }
            entry.planned = planned;
            entry.wake = wake;
            if let Some(wake) = wake {
                self.timers.insert((wake, id));
            }
        }
        out.sort_by_key(PlannedCommand::id);
        out
    }

    /// The earliest time after `now` at which a cycle has something to do without new records:
    /// a record's timer or a backend falling silent.
    pub fn next_wake(&self, now: u64) -> Option<u64> {
        let timer = self.timers.first().map(|(at, _)| *at);
        let health = self.observations.next_change(now, &self.cfg);
        timer.into_iter().chain(health).min()
    }

    /// Every command of the records' last plans (what [`super::plan`] over the same records
    /// gives at the last cycle), sorted by id.
    pub fn pending(&self) -> Vec<PlannedCommand> {
        let mut out: Vec<PlannedCommand> = self
            .entries
            .values()
            .flat_map(|e| e.planned.iter().map(|p| p.command.clone()))
            .collect();
        out.sort_by_key(PlannedCommand::id);
        out
    }

    pub fn record(&self, id: AssignmentId) -> Option<&AssignmentRecord> {
        self.entries.get(&id).map(|e| &e.record)
    }

    /// Unfinished records in memory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Capacity slots held per backend: attempts whose workload was created and not released
    /// (what `Store::slots_used` counts; finished records hold none).
    pub fn slots_used(&self, backend: &BackendName) -> u64 {
        self.slots_used.get(backend).copied().unwrap_or(0)
    }

    /// Assignments waiting for a slot per backend (state `pending`).
    pub fn queued(&self, backend: &BackendName) -> u64 {
        self.queued.get(backend).copied().unwrap_or(0)
    }

    /// Since when (unix ms) the longest-waiting pending assignment of `backend` has waited:
    /// from the forge fetch of its job (a redispatched job keeps waiting from there).
    pub fn oldest_waiting(&self, backend: &BackendName) -> Option<u64> {
        self.waiting_since
            .get(backend)
            .and_then(|m| m.keys().next().copied())
    }

    /// What the backends' health is at `now` by the records in memory.
    #[cfg(test)]
    pub(crate) fn health_at(&self, now: u64) -> BackendHealth {
        self.observations.health(now, &self.cfg)
    }

    fn count(&mut self, record: &AssignmentRecord, add: bool) {
        fn change(map: &mut BTreeMap<BackendName, u64>, backend: &BackendName, add: bool) {
            if add {
                *map.entry(backend.clone()).or_default() += 1;
            } else if let Some(n) = map.get_mut(backend) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(backend);
                }
            }
        }
        if add {
            self.observations.add(record);
        } else {
            self.observations.remove(record);
        }
        for attempt in record.attempts.values() {
            if let Some(backend) = &attempt.backend
                && record.attempt_holds_slot(attempt.attempt)
            {
                change(&mut self.slots_used, backend, add);
            }
        }
        if record.state() == AssignmentState::Pending
            && let Some(backend) = record.backend()
        {
            change(&mut self.queued, backend, add);
            let since = record
                .info
                .as_ref()
                .map(|i| i.fetched_at)
                .or_else(|| {
                    record
                        .attempts
                        .values()
                        .filter_map(|a| a.published_at)
                        .min()
                })
                .unwrap_or(record.updated_at);
            let times = self.waiting_since.entry(backend.clone()).or_default();
            if add {
                *times.entry(since).or_default() += 1;
            } else if let Some(n) = times.get_mut(&since) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    times.remove(&since);
                }
                if times.is_empty() {
                    self.waiting_since.remove(backend);
                }
            }
        }
    }
}

/// Folds `items` into the records in memory (a new record for an id it does not hold) and hands
/// them over as [`IncrementalPlanner::update`] would get them from the store. For benchmarks and
/// tests that start from a complete state: the reconciler itself takes the folded records from
/// the store, which also holds the finished records memory dropped.
pub fn fold_into(planner: &mut IncrementalPlanner, items: &[(u64, Envelope)]) {
    let mut changed: BTreeMap<AssignmentId, AssignmentRecord> = BTreeMap::new();
    for (seq, envelope) in items {
        let id = envelope.assignment_id;
        changed
            .entry(id)
            .or_insert_with(|| {
                planner
                    .record(id)
                    .cloned()
                    .unwrap_or_else(|| AssignmentRecord::new(id))
            })
            .apply(*seq, envelope);
    }
    for record in changed.into_values() {
        planner.update(record);
    }
}

/// The benchmark's plan cycle: for each `(now, batch)`, fold the batch into the planner's
/// records and plan; returns the time each cycle took.
pub fn time_plan_cycles(
    planner: &mut IncrementalPlanner,
    cycles: impl IntoIterator<Item = (u64, Vec<(u64, Envelope)>)>,
) -> Vec<Duration> {
    cycles
        .into_iter()
        .map(|(now, batch)| {
            let started = Instant::now();
            fold_into(planner, &batch);
            std::hint::black_box(planner.plan(now));
            started.elapsed()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use jr_protocol::WorkloadPhase;
    use jr_store::MemoryProjection;
    use jr_store::testkit::Builder;

    use super::*;
    use crate::planner::plan;

    const SEC: u64 = 1_000;

    fn planner() -> IncrementalPlanner {
        IncrementalPlanner::new(PlannerConfig::default(), Duration::from_secs(30))
    }

    fn ids(commands: &[PlannedCommand]) -> Vec<String> {
        commands.iter().map(PlannedCommand::id).collect()
    }

    #[test]
    fn a_claim_timeout_wakes_the_record_without_any_new_fact() {
        let b = Builder::new(1, "pod");
        let mut p = planner();
        fold_into(
            &mut p,
            &[(1, b.assignment(1, SEC)), (2, b.created(1, 2 * SEC))],
        );
        assert!(p.plan(3 * SEC).is_empty());
        // Claim timeout (120 s) after creation at 2 s.
        assert_eq!(p.next_wake(3 * SEC), Some(122 * SEC));
        assert!(p.plan(121 * SEC).is_empty());
        let commands = p.plan(122 * SEC);
        assert_eq!(
            ids(&commands),
            [
                format!("delete:{}:1:{}", b.id, b.workload(1)),
                format!("redispatch:{}:2", b.id),
            ]
        );
        // Issued once per reissue period while still wanted.
        assert!(p.plan(130 * SEC).is_empty());
        assert_eq!(p.next_wake(130 * SEC), Some(152 * SEC));
        assert_eq!(p.plan(152 * SEC).len(), 2);
        assert_eq!(p.pending().len(), 2);
    }

    #[test]
    fn unpublished_commands_are_handed_out_again_at_the_next_cycle() {
        let b = Builder::new(1, "pod");
        let mut p = planner();
        fold_into(
            &mut p,
            &[
                (1, b.assignment(1, SEC)),
                (2, b.created(1, 2 * SEC)),
                (3, b.observed(1, 3 * SEC, WorkloadPhase::Failed, None)),
            ],
        );
        let first = p.plan(4 * SEC);
        assert_eq!(first.len(), 2);
        assert!(p.plan(5 * SEC).is_empty());
        p.not_issued(&first[..1]);
        assert_eq!(ids(&p.plan(6 * SEC)), ids(&first[..1]));
    }

    #[test]
    fn finished_records_leave_memory_and_gauges_follow() {
        let b = Builder::new(1, "pod");
        let waiting = Builder::new(2, "pod");
        let mut p = planner();
        fold_into(
            &mut p,
            &[
                (1, b.assignment(1, SEC)),
                (2, b.created(1, 2 * SEC)),
                (3, b.claimed(1, 3 * SEC)),
                (4, waiting.assignment(1, SEC)),
            ],
        );
        assert_eq!(p.len(), 2);
        assert_eq!(p.slots_used(&b.backend), 1);
        assert_eq!(p.queued(&b.backend), 1);
        fold_into(&mut p, &[(5, b.terminal(1, 4 * SEC, true))]);
        assert_eq!(
            ids(&p.plan(4 * SEC)).len(),
            1,
            "delete the finished task's pod"
        );
        fold_into(&mut p, &[(6, b.released(1, 5 * SEC))]);
        assert_eq!(p.len(), 1);
        assert_eq!(p.slots_used(&b.backend), 0);
        assert!(p.plan(5 * SEC).is_empty());
        assert!(p.pending().is_empty());
    }

    #[test]
    fn the_oldest_wait_follows_the_pending_records() {
        let first = Builder::new(1, "pod");
        let second = Builder::new(2, "pod");
        let vm = Builder::new(3, "vm");
        let mut p = planner();
        fold_into(
            &mut p,
            &[
                (1, first.assignment(1, 10 * SEC)),
                (2, second.assignment(1, 20 * SEC)),
            ],
        );
        // The builder's fetch is 5 ms before the assignment.
        assert_eq!(p.oldest_waiting(&first.backend), Some(10 * SEC - 5));
        assert_eq!(p.oldest_waiting(&vm.backend), None);
        fold_into(&mut p, &[(3, first.created(1, 21 * SEC))]);
        assert_eq!(p.oldest_waiting(&first.backend), Some(20 * SEC - 5));
        // A redispatched job waits from its fetch again, not from the new attempt.
        fold_into(
            &mut p,
            &[
                (4, second.created(1, 22 * SEC)),
                (5, second.observed(1, 23 * SEC, WorkloadPhase::Failed, None)),
                (6, second.redispatched(1, 24 * SEC, "workload-failed")),
                // The scheduler republishes the assignment as fetched (its fetch time kept).
                (7, second.assignment(2, 20 * SEC)),
            ],
        );
        assert_eq!(p.queued(&second.backend), 1);
        assert_eq!(p.oldest_waiting(&second.backend), Some(20 * SEC - 5));
        fold_into(&mut p, &[(8, second.created(2, 25 * SEC))]);
        assert_eq!(p.oldest_waiting(&second.backend), None);
    }

    #[test]
    fn an_unreachable_report_replans_every_record_of_that_backend() {
        let reporting = Builder::new(1, "pod");
        let quiet = Builder::new(2, "pod");
        let mut p = planner();
        fold_into(
            &mut p,
            &[
                (1, quiet.assignment(1, SEC)),
                (2, quiet.created(1, 2 * SEC)),
                (3, reporting.assignment(1, SEC)),
                (4, reporting.created(1, 2 * SEC)),
                (5, reporting.claimed(1, 3 * SEC)),
            ],
        );
        assert!(p.plan(3 * SEC).is_empty());
        fold_into(
            &mut p,
            &[(
                6,
                reporting.observed(
                    1,
                    10 * SEC,
                    WorkloadPhase::Unknown,
                    Some(jr_store::REASON_BACKEND_UNREACHABLE),
                ),
            )],
        );
        assert!(p.plan(10 * SEC).is_empty());
        // The quiet record is held now: its claim timeout (122 s) is no deadline any more, the
        // hold's end is (310 s).
        assert!(p.plan(200 * SEC).is_empty());
        assert_eq!(p.next_wake(200 * SEC), Some(310 * SEC));
        assert_eq!(p.plan(310 * SEC).len(), 3);
    }

    #[test]
    fn the_benchmark_cycle_keeps_the_plans_of_the_full_snapshot() {
        let now = 1_700_000_000_000;
        let jobs: Vec<Builder> = (0..200)
            .map(|i| Builder::new(i, if i % 3 == 2 { "vm" } else { "pod" }))
            .collect();
        let mut seq = 0;
        let mut number = |e: Envelope| {
            seq += 1;
            (seq, e)
        };
        let mut items = Vec::new();
        for (i, b) in jobs.iter().enumerate() {
            let t = now - 1_000 * (i as u64 % 200);
            items.push(number(b.assignment(1, t)));
            if i % 2 == 1 {
                items.push(number(b.created(1, t + 5)));
            }
        }
        let mut memory = MemoryProjection::new();
        memory.apply_batch("all", &items);
        let mut p = planner();
        p.load(memory.snapshot(now).assignments);
        p.plan(now);
        let cycles: Vec<(u64, Vec<(u64, Envelope)>)> = (1..=20u64)
            .map(|k| {
                let at = now + k * 10 * SEC;
                let batch = jobs
                    .iter()
                    .skip((k as usize * 10) % jobs.len())
                    .take(10)
                    .map(|b| number(b.observed(1, at, WorkloadPhase::Running, None)))
                    .collect();
                (at, batch)
            })
            .collect();
        let all: Vec<(u64, Envelope)> = cycles.iter().flat_map(|(_, b)| b.clone()).collect();
        let times = time_plan_cycles(&mut p, cycles);
        assert_eq!(times.len(), 20);
        memory.apply_batch("all", &all);
        let end = now + 200 * SEC;
        let expected = plan(&memory.snapshot(end), end, &PlannerConfig::default());
        assert!(!expected.is_empty());
        assert_eq!(p.pending(), expected);
        let open = memory.snapshot(end).assignments;
        assert_eq!(p.len(), open.len());
        assert!(open.iter().all(|r| p.record(r.id) == Some(r)));
    }
}
