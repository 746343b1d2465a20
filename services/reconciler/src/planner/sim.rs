//! Property tests: the planner's invariants on random histories, and a closed-loop simulation
//! (plan → execute commands → the world reacts → project → plan again) that must always end
//! with every assignment final and every workload released, driven once by the full plan of
//! each snapshot and once by the incremental planner (checked against the full plan at every
//! step, see `equivalence.rs`).

use std::collections::{BTreeMap, BTreeSet};

use jr_protocol::{Envelope, WorkloadPhase};
use jr_store::testkit::{Builder, random_history};
use jr_store::{AssignmentState, MemoryProjection, REASON_BACKEND_UNREACHABLE, Snapshot};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Checks what must hold for any plan of any snapshot.
fn check_plan(
    snapshot: &Snapshot,
    commands: &[PlannedCommand],
    cfg: &PlannerConfig,
) -> Result<(), String> {
    let ids: Vec<String> = commands.iter().map(PlannedCommand::id).collect();
    let unique: BTreeSet<&String> = ids.iter().collect();
    if unique.len() != ids.len() {
        return Err(format!("duplicate ids in {ids:?}"));
    }
    let replanned: Vec<String> = plan(snapshot, snapshot.taken_at, cfg)
        .iter()
        .map(PlannedCommand::id)
        .collect();
    if replanned != ids {
        return Err(format!("re-planning differs: {ids:?} vs {replanned:?}"));
    }
    for command in commands {
        let record = snapshot
            .assignments
            .iter()
            .find(|r| r.id == command.assignment_id())
            .ok_or_else(|| {
                format!(
                    "{} is about an assignment not in the snapshot",
                    command.id()
                )
            })?;
        match command {
            PlannedCommand::DeleteWorkload {
                backend,
                workload,
                attempt,
                ..
            } => {
                let w = record
                    .workloads
                    .get(&(backend.clone(), workload.clone()))
                    .ok_or_else(|| format!("{} names an unknown workload", command.id()))?;
                let claimed_here = record.claim.as_ref().is_some_and(|c| c.attempt == *attempt);
                let observed_healthy = w.observation.as_ref().is_none_or(|o| {
                    matches!(
                        o.phase,
                        WorkloadPhase::Pending
                            | WorkloadPhase::Running
                            | WorkloadPhase::Terminating
                    ) && o.reason.as_deref() != Some(REASON_BACKEND_UNREACHABLE)
                });
                if record.outcome().is_none()
                    && claimed_here
                    && observed_healthy
                    && !w.is_released()
                {
                    return Err(format!(
                        "{} deletes a claimed, healthy workload of a running task",
                        command.id()
                    ));
                }
            }
            PlannedCommand::Redispatch { next_attempt, .. } => {
                if *next_attempt > cfg.max_attempts {
                    return Err(format!("{} goes beyond max_attempts", command.id()));
                }
                if record.claim.is_some() || record.outcome().is_some() {
                    return Err(format!(
                        "{} redispatches a claimed or final task",
                        command.id()
                    ));
                }
            }
            PlannedCommand::FailTask { .. } => {
                if record.outcome().is_some() {
                    return Err(format!(
                        "{} fails a task that is already final",
                        command.id()
                    ));
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn plans_of_random_histories_keep_the_invariants(seed in any::<u64>(), count in 1usize..12, offset in 0u64..900_000) {
        let history = random_history(seed, count);
        let mut projection = MemoryProjection::new();
        for (stream, items) in history.streams() {
            projection.apply_batch(stream, items);
        }
        let last = history.events.iter().chain(&history.assignments).map(|(_, e)| e.occurred_at).max().unwrap_or(0);
        let now = last + offset;
        let cfg = PlannerConfig::default();
        let snapshot = projection.snapshot(now);
        let commands = plan(&snapshot, now, &cfg);
        if let Err(violation) = check_plan(&snapshot, &commands, &cfg) {
            prop_assert!(false, "{}", violation);
        }
    }

    #[test]
    fn closed_loop_always_ends_final_and_released(seed in any::<u64>(), count in 1usize..6) {
        if let Err(violation) = simulate(seed, count) {
            prop_assert!(false, "{}", violation);
        }
    }

    #[test]
    fn closed_loop_driven_by_the_incremental_planner_ends_final_and_released(seed in any::<u64>(), count in 1usize..6) {
        if let Err(violation) = simulate_incremental(seed, count) {
            prop_assert!(false, "{}", violation);
        }
    }
}

/// The rest of the system, simulated: workers, executors, the facade and the scheduler.
struct World {
    rng: StdRng,
    projection: MemoryProjection,
    seq: u64,
    now: u64,
    jobs: Vec<Builder>,
    published: BTreeSet<(usize, u32)>,
    created: BTreeSet<(usize, u32)>,
    /// Workloads that exist in the backend.
    existing: BTreeSet<(usize, u32)>,
    claimed: BTreeMap<usize, u32>,
    /// A final result was accepted by the forge (terminal or fail-task).
    finished: BTreeSet<usize>,
    chaos: bool,
    /// Everything emitted since the incremental planner last took the changes.
    emitted: Vec<Envelope>,
}

impl World {
    fn new(seed: u64, count: usize) -> Self {
        let mut world = World {
            rng: StdRng::seed_from_u64(seed),
            projection: MemoryProjection::new(),
            seq: 0,
            now: 1_700_000_000_000,
            jobs: (0..count)
                .map(|i| Builder::new(i as i64 + 1, if i % 2 == 0 { "pod" } else { "vm" }))
                .collect(),
            published: BTreeSet::new(),
            created: BTreeSet::new(),
            existing: BTreeSet::new(),
            claimed: BTreeMap::new(),
            finished: BTreeSet::new(),
            chaos: true,
            emitted: Vec::new(),
        };
        for index in 0..count {
            world.published.insert((index, 1));
            let envelope = world.jobs[index].assignment(1, world.now);
            world.emit(envelope);
        }
        world
    }

    fn all_final(&self) -> bool {
        self.jobs.iter().all(|b| {
            self.projection
                .record(b.id)
                .is_some_and(|r| r.state().is_finished())
        })
    }

    fn emit(&mut self, envelope: Envelope) {
        self.seq += 1;
        self.projection.apply(self.seq, &envelope);
        self.emitted.push(envelope);
    }

    fn execute(&mut self, command: &PlannedCommand) {
        let index = self
            .jobs
            .iter()
            .position(|b| b.id == command.assignment_id())
            .unwrap_or(usize::MAX);
        let Some(b) = self.jobs.get(index).cloned() else {
            return;
        };
        match command {
            PlannedCommand::DeleteWorkload { attempt, .. } => {
                // Deleting a missing workload succeeds too; the worker releases either way.
                self.existing.remove(&(index, *attempt));
                if self.rng.random_bool(0.5) {
                    self.emit(b.observed(*attempt, self.now, WorkloadPhase::Gone, None));
                }
                self.emit(b.released(*attempt, self.now));
            }
            PlannedCommand::Redispatch { next_attempt, .. } => {
                if self.published.insert((index, *next_attempt)) {
                    self.emit(b.assignment(*next_attempt, self.now));
                    self.emit(b.redispatched(next_attempt - 1, self.now, command.reason()));
                }
            }
            PlannedCommand::FailTask { attempt, .. } => {
                if self.finished.insert(index) {
                    self.emit(b.task_failed(*attempt, self.now, command.reason()));
                }
            }
        }
    }

    fn step_workloads(&mut self) {
        for index in 0..self.jobs.len() {
            let b = self.jobs[index].clone();
            let attempts: Vec<u32> = self
                .published
                .iter()
                .filter(|(i, _)| *i == index)
                .map(|(_, a)| *a)
                .collect();
            for attempt in attempts {
                let key = (index, attempt);
                if !self.created.contains(&key) {
                    if self.rng.random_bool(0.5) {
                        self.created.insert(key);
                        self.existing.insert(key);
                        self.emit(b.requested(attempt, self.now));
                        self.emit(b.created(attempt, self.now + 1));
                    }
                    continue;
                }
                if !self.existing.contains(&key) {
                    continue;
                }
                let roll: f64 = self.rng.random();
                let chaos = self.chaos;
                match self.claimed.get(&index).copied() {
                    _ if chaos && roll < 0.03 => {
                        self.emit(b.observed(
                            attempt,
                            self.now,
                            WorkloadPhase::Failed,
                            Some("evicted"),
                        ));
                    }
                    _ if chaos && roll < 0.05 => {
                        self.existing.remove(&key);
                        self.emit(b.observed(attempt, self.now, WorkloadPhase::Gone, None));
                    }
                    _ if chaos && roll < 0.07 => {
                        let reason = Some(REASON_BACKEND_UNREACHABLE);
                        self.emit(b.observed(attempt, self.now, WorkloadPhase::Unknown, reason));
                    }
                    _ if chaos && roll < 0.08 => {
                        // A late report of an old state.
                        let at = self.now.saturating_sub(20_000);
                        self.emit(b.observed(attempt, at, WorkloadPhase::Running, None));
                    }
                    None if !self.finished.contains(&index) && roll < 0.4 => {
                        self.claimed.insert(index, attempt);
                        self.emit(b.claimed(attempt, self.now));
                        self.emit(b.observed(attempt, self.now, WorkloadPhase::Running, None));
                    }
                    Some(c) if c == attempt && !self.finished.contains(&index) && roll < 0.3 => {
                        self.finished.insert(index);
                        let log_closed = self.rng.random_bool(0.5);
                        self.emit(b.terminal(attempt, self.now, log_closed));
                        if self.rng.random_bool(0.5) {
                            self.emit(b.executor_finished(attempt, self.now + 1));
                        }
                        if self.rng.random_bool(0.5) {
                            self.emit(b.observed(
                                attempt,
                                self.now + 2,
                                WorkloadPhase::Succeeded,
                                None,
                            ));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

fn simulate(seed: u64, count: usize) -> Result<(), String> {
    let cfg = PlannerConfig::default();
    let mut world = World::new(seed, count);
    for step in 0..5_000 {
        world.chaos = step < 300;
        let snapshot = world.projection.snapshot(world.now);
        if world.all_final() {
            return check_final(&world, &cfg);
        }
        let commands = plan(&snapshot, world.now, &cfg);
        check_plan(&snapshot, &commands, &cfg).map_err(|e| format!("step {step}: {e}"))?;
        for command in &commands {
            // Commands are sometimes delayed to a later round (the executor is slow).
            if world.rng.random_bool(0.8) {
                world.execute(command);
            }
        }
        world.step_workloads();
        world.now += world.rng.random_range(1_000..30_000);
    }
    Err("no quiescence after 5000 steps".into())
}

/// The same loop with the incremental planner: only what it hands out is executed, some of it
/// fails to publish (handed out again next cycle) and some is published but has no effect (a
/// worker died before acting: issued again a reissue period later).
fn simulate_incremental(seed: u64, count: usize) -> Result<(), String> {
    let cfg = PlannerConfig::default();
    let mut world = World::new(seed, count);
    let mut shadow = super::equivalence::Shadow::new(&cfg, std::time::Duration::from_secs(30));
    for step in 0..5_000 {
        world.chaos = step < 300;
        let emitted = std::mem::take(&mut world.emitted);
        shadow.update(super::equivalence::changed_records(
            &world.projection,
            &emitted,
        ));
        if world.all_final() {
            shadow
                .cycle(&world.projection, world.now)
                .map_err(|e| format!("step {step}: {e}"))?;
            if !shadow.planner.is_empty() || !shadow.planner.pending().is_empty() {
                return Err("finished records left in memory".into());
            }
            return check_final(&world, &cfg);
        }
        let handed = shadow
            .cycle(&world.projection, world.now)
            .map_err(|e| format!("step {step}: {e}"))?;
        let mut failed = Vec::new();
        for command in handed {
            let roll: f64 = world.rng.random();
            if roll < 0.1 {
                failed.push(command);
            } else if roll < 0.8 {
                world.execute(&command);
            }
        }
        shadow.publish_failed(failed);
        world.step_workloads();
        world.now += world.rng.random_range(1_000..30_000);
    }
    Err("no quiescence after 5000 steps".into())
}

fn check_final(world: &World, cfg: &PlannerConfig) -> Result<(), String> {
    for b in &world.jobs {
        let record = world.projection.record(b.id).ok_or("record missing")?;
        let state = record.state();
        if !matches!(state, AssignmentState::Completed | AssignmentState::Failed) {
            return Err(format!("{} ended {state:?}", b.id));
        }
        if let Some(w) = record.workloads.values().find(|w| !w.is_released()) {
            return Err(format!("{} left workload {} unreleased", b.id, w.workload));
        }
        if record.current_attempt() > cfg.max_attempts {
            return Err(format!(
                "{} reached attempt {}",
                b.id,
                record.current_attempt()
            ));
        }
    }
    if let Some((index, attempt)) = world.existing.iter().next() {
        return Err(format!(
            "workload of job {index} attempt {attempt} still exists in the backend"
        ));
    }
    let snapshot = world.projection.snapshot(world.now);
    let leftover = plan(&snapshot, world.now, cfg);
    if !leftover.is_empty() {
        return Err(format!("quiescent state still plans {leftover:?}"));
    }
    Ok(())
}
