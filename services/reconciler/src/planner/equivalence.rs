//! The incremental planner against the reference: for random histories fed in random batches
//! at random times (and in the closed-loop simulation, see `sim.rs`), every cycle of
//! [`IncrementalPlanner`] is checked against [`plan`] over the whole snapshot at that time:
//!
//! - the commands of all records' last plans are exactly the full plan's commands (records it
//!   did not plan this cycle are unchanged and not due, so their plans still hold);
//! - what it hands out for publishing is part of the full plan (never a command the full plan
//!   would not give);
//! - every command of the full plan was handed out at or before this cycle and at most a reissue
//!   period ago (so nothing is issued late, and a command still wanted is issued again each
//!   period);
//! - a command whose publishing failed is handed out again at the next cycle if still wanted;
//! - with no new facts, nothing changes before the time `next_wake` announced (the reconciler
//!   sleeps until then);
//! - the backend health kept incrementally is the one computed from the snapshot.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use jr_protocol::Envelope;
use jr_store::testkit::random_history;
use jr_store::{AssignmentRecord, MemoryProjection};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::condition::BackendHealth;
use super::*;

/// The incremental planner with a record of what it issued, checked cycle by cycle.
pub(super) struct Shadow {
    pub planner: IncrementalPlanner,
    cfg: PlannerConfig,
    reissue_after: u64,
    /// Command id → last time it was handed out and published.
    issued: BTreeMap<String, u64>,
    /// Handed out at the last cycle but not published.
    failed: Vec<PlannedCommand>,
    /// `issued` before the last cycle, for the commands it handed out.
    previously: BTreeMap<String, Option<u64>>,
    /// The full plan and `next_wake` of the last cycle, while nothing was handed over since.
    quiet: Option<(Vec<PlannedCommand>, Option<u64>)>,
    pub cycles: usize,
    pub handed_out: usize,
}

impl Shadow {
    pub fn new(cfg: &PlannerConfig, reissue_after: Duration) -> Self {
        Self {
            planner: IncrementalPlanner::new(cfg.clone(), reissue_after),
            cfg: cfg.clone(),
            reissue_after: millis(reissue_after),
            issued: BTreeMap::new(),
            failed: Vec::new(),
            previously: BTreeMap::new(),
            quiet: None,
            cycles: 0,
            handed_out: 0,
        }
    }

    /// Hands the committed versions of changed records over, as the projector does.
    pub fn update(&mut self, records: impl IntoIterator<Item = AssignmentRecord>) {
        for record in records {
            self.planner.update(record);
            self.quiet = None;
        }
    }

    /// Replaces the planner's records, as a reload from the store does.
    pub fn load(&mut self, records: Vec<AssignmentRecord>) {
        self.planner.load(records);
        self.quiet = None;
    }

    /// One cycle at `now` over `projection` (whose changes were handed over); returns what the
    /// incremental planner hands out, or what went wrong.
    pub fn cycle(
        &mut self,
        projection: &MemoryProjection,
        now: u64,
    ) -> Result<Vec<PlannedCommand>, String> {
        self.cycles += 1;
        let snapshot = projection.snapshot(now);
        let full = plan(&snapshot, now, &self.cfg);
        let health = BackendHealth::from_snapshot(&snapshot, now, &self.cfg);
        if self.planner.health_at(now) != health {
            return Err(format!(
                "at {now}: health {:?} kept, {health:?} from the snapshot",
                self.planner.health_at(now)
            ));
        }
        if self.planner.len() != snapshot.assignments.len() {
            return Err(format!(
                "at {now}: {} records in memory, {} unfinished",
                self.planner.len(),
                snapshot.assignments.len()
            ));
        }
        let handed = self.planner.plan(now);
        self.handed_out += handed.len();
        if let Some((before, wake)) = self.quiet.take()
            && wake.is_none_or(|w| now < w)
            && (before != full || !handed.is_empty())
        {
            return Err(format!(
                "at {now}: the plan changed without new facts before the announced wake {wake:?}"
            ));
        }
        let ids: BTreeSet<String> = handed.iter().map(PlannedCommand::id).collect();
        if ids.len() != handed.len() {
            return Err(format!("at {now}: duplicate ids handed out {handed:?}"));
        }
        for command in &handed {
            if !full.contains(command) {
                return Err(format!(
                    "at {now}: handed out {command:?}, which the full plan does not have"
                ));
            }
        }
        let pending = self.planner.pending();
        if pending != full {
            return Err(format!(
                "at {now}: last plans {:?} differ from the full plan {:?}",
                pending.iter().map(PlannedCommand::id).collect::<Vec<_>>(),
                full.iter().map(PlannedCommand::id).collect::<Vec<_>>()
            ));
        }
        for command in std::mem::take(&mut self.failed) {
            if full.iter().any(|c| c.id() == command.id()) && !ids.contains(&command.id()) {
                return Err(format!(
                    "at {now}: {} failed to publish and is not handed out again",
                    command.id()
                ));
            }
        }
        self.previously.clear();
        for id in &ids {
            self.previously
                .insert(id.clone(), self.issued.insert(id.clone(), now));
        }
        for command in &full {
            let id = command.id();
            match self.issued.get(&id) {
                None => return Err(format!("at {now}: {id} of the full plan was never issued")),
                Some(at) if now >= at + self.reissue_after => {
                    return Err(format!(
                        "at {now}: {id} still wanted, last issued at {at}, not issued again"
                    ));
                }
                Some(_) => {}
            }
        }
        self.quiet = Some((full, self.planner.next_wake(now)));
        Ok(handed)
    }

    /// Publishing `commands` (handed out by the last cycle) failed.
    pub fn publish_failed(&mut self, commands: Vec<PlannedCommand>) {
        for command in &commands {
            let id = command.id();
            match self.previously.remove(&id).flatten() {
                Some(at) => self.issued.insert(id, at),
                None => self.issued.remove(&id),
            };
        }
        if !commands.is_empty() {
            self.quiet = None;
        }
        self.planner.not_issued(&commands);
        self.failed = commands;
    }
}

/// Planner timeouts drawn at random, small enough that they run out within a history.
fn random_config(rng: &mut StdRng) -> PlannerConfig {
    let secs = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_secs(rng.random_range(lo..hi));
    PlannerConfig {
        claim_timeout: secs(rng, 1, 150),
        terminal_grace: secs(rng, 1, 60),
        lost_timeout: secs(rng, 1, 90),
        unreachable_hold: secs(rng, 1, 400),
        orphan_grace: secs(rng, 1, 200),
        backend_silence: rng.random_bool(0.5).then(|| secs(rng, 1, 600)),
        max_attempts: rng.random_range(1..=4),
    }
}

/// Feeds a random history in random batches of either stream, at random times, and checks every
/// cycle; some handed-out commands fail to publish.
fn replay_history(seed: u64, count: usize) -> Result<(usize, usize), String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let history = random_history(seed, count);
    let cfg = random_config(&mut rng);
    let reissue = Duration::from_secs(rng.random_range(1..60));
    let mut shadow = Shadow::new(&cfg, reissue);
    let mut projection = MemoryProjection::new();
    let streams = history.streams();
    let mut positions = [0usize; 2];
    let mut now = streams
        .iter()
        .flat_map(|(_, items)| items.iter().map(|(_, e)| e.occurred_at))
        .min()
        .unwrap_or(0);
    // Every deadline is an event's time plus a configured duration, or a cycle's time plus the
    // reissue period: cycles are often placed exactly on (or just before) the next of those, so
    // that a wake-up even 1 ms late is seen.
    let durations: Vec<u64> = [
        cfg.claim_timeout,
        cfg.terminal_grace,
        cfg.lost_timeout,
        cfg.unreachable_hold,
        cfg.orphan_grace,
    ]
    .into_iter()
    .chain(cfg.backend_silence)
    .map(millis)
    .collect();
    let mut deadlines: BTreeSet<u64> = BTreeSet::new();
    let mut reissues: BTreeSet<u64> = BTreeSet::new();
    // Sometimes the assignments stream lags far behind the events stream (orphans for a while).
    let assignments_lag = rng.random_bool(0.3);
    // Feed everything, then visit the remaining deadlines one by one.
    for _ in 0..1_000 {
        let left = positions
            .iter()
            .zip(&streams)
            .any(|(p, (_, items))| *p < items.len());
        let next_deadline = deadlines.range(now + 1..).next().copied();
        if !left && next_deadline.is_none() {
            break;
        }
        let next_deadline = next_deadline
            .into_iter()
            .chain(reissues.range(now + 1..).next().copied())
            .min();
        let events_left = positions[1] < streams[1].1.len();
        for _ in 0..rng.random_range(0..3) {
            let which = if assignments_lag && events_left {
                1
            } else {
                rng.random_range(0..2)
            };
            let (stream, items) = streams[which];
            let start = positions[which];
            let end = (start + rng.random_range(1..=8)).min(items.len());
            // Re-sent items are skipped, as a redelivering consumer's would be.
            let from = start.saturating_sub(rng.random_range(0..3));
            for (_, e) in &items[from..end] {
                for d in &durations {
                    deadlines.insert(e.occurred_at + d);
                    // An unreachable hold may start at the end of a silence.
                    deadlines.insert(e.occurred_at + d + millis(cfg.unreachable_hold));
                }
            }
            let applied = projection.apply_batch_returning(stream, &items[from..end]);
            shadow.update(applied.records);
            positions[which] = end;
        }
        if rng.random_bool(0.05) {
            // A reload from the store: everything planned again, everything issued again.
            shadow.load(projection.snapshot(now).assignments);
        }
        now = match (rng.random_range(0..200u32), next_deadline) {
            (0..=9, _) => now,
            (10..=39, _) | (_, None) => now + rng.random_range(1..2_000),
            (40, _) => now + rng.random_range(1..100_000),
            (41..=89, Some(t)) => (t - 1).max(now),
            (_, Some(t)) => t,
        };
        let handed = shadow
            .cycle(&projection, now)
            .map_err(|e| format!("seed {seed}: {e}"))?;
        if !handed.is_empty() {
            reissues.insert(now + millis(reissue));
        }
        let failed: Vec<PlannedCommand> = handed
            .into_iter()
            .filter(|_| rng.random_bool(0.15))
            .collect();
        shadow.publish_failed(failed);
    }
    Ok((shadow.cycles, shadow.handed_out))
}

/// Cases per property: `JR_PROPTEST_CASES` (default 64).
fn cases() -> u32 {
    std::env::var("JR_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn incremental_plans_match_full_plans_on_random_histories(seed in any::<u64>(), count in 1usize..12) {
        if let Err(violation) = replay_history(seed, count) {
            prop_assert!(false, "{}", violation);
        }
    }
}

#[test]
fn random_histories_exercise_the_incremental_planner() {
    // Not vacuous: over a few seeds, plenty of cycles and commands.
    let (mut cycles, mut handed) = (0, 0);
    for seed in 0..8 {
        let (c, h) = replay_history(seed, 10).unwrap_or_else(|e| panic!("{e}"));
        cycles += c;
        handed += h;
    }
    eprintln!("{cycles} cycles, {handed} commands handed out");
    assert!(
        cycles > 500 && handed > 100,
        "{cycles} cycles, {handed} commands"
    );
}

#[test]
fn health_kept_record_by_record_matches_the_snapshot_after_removals() {
    let history = random_history(5, 30);
    let mut projection = MemoryProjection::new();
    let cfg = PlannerConfig {
        backend_silence: Some(Duration::from_secs(30)),
        ..PlannerConfig::default()
    };
    let mut planner = IncrementalPlanner::new(cfg.clone(), Duration::from_secs(30));
    for (stream, items) in history.streams() {
        for chunk in items.chunks(3) {
            planner_update(
                &mut planner,
                projection.apply_batch_returning(stream, chunk).records,
            );
            let last = chunk.iter().map(|(_, e)| e.occurred_at).max().unwrap_or(0);
            for now in [last, last + 29_999, last + 30_000, last + 600_000] {
                let snapshot = projection.snapshot(now);
                assert_eq!(
                    planner.health_at(now),
                    BackendHealth::from_snapshot(&snapshot, now, &cfg),
                    "at {now}"
                );
            }
        }
    }
}

fn planner_update(planner: &mut IncrementalPlanner, records: Vec<AssignmentRecord>) {
    for record in records {
        planner.update(record);
    }
}

/// Used by the simulation: the records `envelopes` touched, as the projection now holds them.
pub(super) fn changed_records(
    projection: &MemoryProjection,
    envelopes: &[Envelope],
) -> Vec<AssignmentRecord> {
    let ids: BTreeSet<_> = envelopes.iter().map(|e| e.assignment_id).collect();
    ids.into_iter()
        .filter_map(|id| projection.record(id).cloned())
        .collect()
}
