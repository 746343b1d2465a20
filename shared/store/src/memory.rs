//! The projection held in memory: the same fold as the Postgres store, without IO. Used by
//! planner tests and simulations, and as the reference the SQL projection is tested against.

use std::collections::BTreeMap;

use jr_protocol::{AssignmentId, Envelope};

use crate::model::{AssignmentRecord, Snapshot};

/// What one `apply_batch` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ApplyStats {
    /// Items applied (sequence above the checkpoint).
    pub applied: usize,
    /// Items skipped because the checkpoint already covered them (replays, duplicates, items out
    /// of order within the batch).
    pub skipped: usize,
    /// Assignments whose records were written.
    pub touched: usize,
    /// Items recorded in the quarantine instead of applied (undecodable or refused by the
    /// database); they count towards the checkpoint like applied ones.
    pub quarantined: usize,
    /// The stream's checkpoint after the batch.
    pub checkpoint: u64,
}

/// What applying a batch did, and the records it changed (as written), sorted by id.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Applied {
    pub stats: ApplyStats,
    /// Every record a message of the batch changed, after the batch. Finished ones included:
    /// a copy of the unfinished records drops them.
    pub records: Vec<AssignmentRecord>,
}

/// The whole projection in memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryProjection {
    records: BTreeMap<AssignmentId, AssignmentRecord>,
    checkpoints: BTreeMap<String, u64>,
}

impl MemoryProjection {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies `events` in order as one stream named `events`, sequence = position + 1.
    pub fn from_events(events: &[Envelope]) -> Self {
        let mut projection = Self::new();
        let items: Vec<(u64, Envelope)> = events
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, e)| (i as u64 + 1, e))
            .collect();
        projection.apply_batch("events", &items);
        projection
    }

    /// Same contract as `Store::apply_batch`: items at or below the stream's checkpoint are
    /// skipped, the rest applied in order, the checkpoint advanced.
    pub fn apply_batch(&mut self, stream: &str, items: &[(u64, Envelope)]) -> ApplyStats {
        let mut checkpoint = self.checkpoint(stream);
        let mut stats = ApplyStats::default();
        let mut touched = std::collections::BTreeSet::new();
        for (seq, envelope) in items {
            if *seq <= checkpoint {
                stats.skipped += 1;
                continue;
            }
            checkpoint = *seq;
            self.apply(*seq, envelope);
            touched.insert(envelope.assignment_id);
            stats.applied += 1;
        }
        self.checkpoints.insert(stream.to_owned(), checkpoint);
        stats.touched = touched.len();
        stats.checkpoint = checkpoint;
        stats
    }

    /// [`MemoryProjection::apply_batch`], also returning the records the batch changed (what
    /// `Store::apply_batch_returning` returns for the same batch).
    pub fn apply_batch_returning(&mut self, stream: &str, items: &[(u64, Envelope)]) -> Applied {
        let mut before: BTreeMap<AssignmentId, Option<AssignmentRecord>> = BTreeMap::new();
        let mut checkpoint = self.checkpoint(stream);
        for (seq, envelope) in items {
            if *seq > checkpoint {
                checkpoint = *seq;
                let id = envelope.assignment_id;
                before
                    .entry(id)
                    .or_insert_with(|| self.records.get(&id).cloned());
            }
        }
        let stats = self.apply_batch(stream, items);
        let records = before
            .into_iter()
            .filter_map(|(id, old)| {
                let new = self.records.get(&id)?;
                (old.as_ref() != Some(new)).then(|| new.clone())
            })
            .collect();
        Applied { stats, records }
    }

    /// Applies one message without any checkpoint bookkeeping.
    pub fn apply(&mut self, seq: u64, envelope: &Envelope) {
        self.records
            .entry(envelope.assignment_id)
            .or_insert_with(|| AssignmentRecord::new(envelope.assignment_id))
            .apply(seq, envelope);
    }

    pub fn checkpoint(&self, stream: &str) -> u64 {
        self.checkpoints.get(stream).copied().unwrap_or(0)
    }

    pub fn record(&self, id: AssignmentId) -> Option<&AssignmentRecord> {
        self.records.get(&id)
    }

    /// Every record, finished or not, sorted by id.
    pub fn records(&self) -> impl Iterator<Item = &AssignmentRecord> {
        self.records.values()
    }

    /// What `Store::snapshot` returns for the same history.
    pub fn snapshot(&self, now_ms: u64) -> Snapshot {
        Snapshot {
            taken_at: now_ms,
            assignments: self
                .records
                .values()
                .filter(|r| !r.state().is_finished())
                .cloned()
                .collect(),
        }
    }
}

impl Snapshot {
    /// The snapshot a projection of exactly these events (one stream, in this order) yields.
    pub fn from_events(events: &[Envelope], now_ms: u64) -> Self {
        MemoryProjection::from_events(events).snapshot(now_ms)
    }
}
