//! The projector's copy of the records it wrote last, so that a batch reads from Postgres only
//! the assignments it has not seen (a job's messages arrive in several batches; without the
//! copy every batch read each of its records back from seven tables).
//!
//! The copy is trusted only while the database shows exactly the checkpoints this process
//! committed last, for every stream: any other writer (a second reconciler that took over, a
//! reset, a restore that lost commits) moves a checkpoint, and then the copy is dropped. A
//! record is kept as the database would return it (its rows encoded and decoded again), so a
//! batch folds over the same thing whether it came from the copy or from a load.
//!
//! Records are kept as their rows (the form the database holds, vectors cut to their length), a
//! few hundred bytes each, and decoded when a batch needs them: a record as a tree of maps takes
//! several kilobytes, and the copy must not grow the reconciler past its memory budget when
//! tens of thousands of jobs are in flight.

use std::collections::{BTreeMap, HashMap};

use jr_protocol::AssignmentId;

use crate::model::AssignmentRecord;
use crate::rows::{Rows, decode, encode};

/// Records kept at most (about 3 KiB each). Past it, finished records go first, then the ones
/// touched longest ago (a record read again later costs one load from the database, nothing
/// more). The scheduler publishes only what capacity can start soon, so the records that get
/// messages are those of running jobs and the few queued on the bus: thousands, not the backlog.
const CAPACITY: usize = 4_096;

#[derive(Debug)]
struct Entry {
    rows: Rows,
    finished: bool,
    /// When the record was last written here (a counter, not a clock).
    touched: u64,
}

#[derive(Debug, Default)]
pub(crate) struct RecordCache {
    /// Every stream's checkpoint as this process committed it last.
    checkpoints: BTreeMap<String, u64>,
    records: HashMap<AssignmentId, Entry>,
    ticks: u64,
    /// Records read from the database because they were not here (for tests and the bench).
    pub loaded: u64,
}

impl RecordCache {
    /// Keeps the records only if the database's checkpoints are the ones this process wrote.
    /// A stream at 0 (its row just made by the lock) counts as absent.
    pub fn validate(&mut self, stored: &BTreeMap<String, u64>) {
        let stored: BTreeMap<String, u64> = stored
            .iter()
            .filter(|(_, seq)| **seq > 0)
            .map(|(stream, seq)| (stream.clone(), *seq))
            .collect();
        if self.checkpoints != stored {
            if !self.records.is_empty() {
                tracing::info!(
                    kept = self.records.len(),
                    "projection checkpoints moved under the projector: its record copy is dropped"
                );
            }
            self.records.clear();
            self.checkpoints = stored;
        }
    }

    /// The record as the database would return it, if it is here.
    pub fn get(&self, id: &AssignmentId) -> Option<AssignmentRecord> {
        let entry = self.records.get(id)?;
        match decode(entry.rows.clone()) {
            Ok(mut decoded) if decoded.len() == 1 => decoded.pop(),
            _ => None,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// After a commit: `stream` is at `checkpoint` and `records` are as written.
    pub fn committed<'r>(
        &mut self,
        stream: &str,
        checkpoint: u64,
        records: impl IntoIterator<Item = &'r AssignmentRecord>,
    ) {
        if checkpoint > 0 {
            self.checkpoints.insert(stream.to_owned(), checkpoint);
        }
        for record in records {
            self.ticks += 1;
            let mut rows = encode(record);
            rows.shrink_to_fit();
            self.records.insert(
                record.id,
                Entry {
                    rows,
                    finished: record.state().is_finished(),
                    touched: self.ticks,
                },
            );
        }
        if self.records.len() > CAPACITY {
            self.evict(CAPACITY * 3 / 4);
        }
    }

    /// Cuts the copy down to `keep` records: finished ones first, then the least recently
    /// touched.
    fn evict(&mut self, keep: usize) {
        self.records.retain(|_, entry| !entry.finished);
        if self.records.len() > keep {
            let mut ages: Vec<u64> = self.records.values().map(|e| e.touched).collect();
            let cut = ages.len() - keep;
            let (_, oldest_kept, _) = ages.select_nth_unstable(cut);
            let oldest_kept = *oldest_kept;
            self.records.retain(|_, entry| entry.touched >= oldest_kept);
        }
    }

    /// Forget everything (an error left the database's state unknown).
    pub fn clear(&mut self) {
        self.records.clear();
        self.checkpoints.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(n: u128) -> AssignmentRecord {
        AssignmentRecord::new(AssignmentId(uuid::Uuid::from_u128(n)))
    }

    #[test]
    fn past_capacity_the_least_recently_written_records_go() {
        let mut cache = RecordCache::default();
        let first: Vec<AssignmentRecord> = (1..=CAPACITY as u128).map(record).collect();
        cache.committed("s", 1, first.iter());
        assert_eq!(cache.len(), CAPACITY);
        // Record 1 is written again: it is now the most recent.
        cache.committed("s", 2, [&record(1)]);
        cache.committed("s", 3, [&record(CAPACITY as u128 + 1)]);
        assert_eq!(cache.len(), CAPACITY * 3 / 4);
        assert!(
            cache.get(&record(1).id).is_some(),
            "rewritten record evicted"
        );
        assert!(cache.get(&record(CAPACITY as u128 + 1).id).is_some());
        assert!(cache.get(&record(2).id).is_none(), "oldest record kept");
        let last_kept = CAPACITY as u128;
        assert!(cache.get(&record(last_kept).id).is_some());
    }

    #[test]
    fn a_record_comes_back_as_written() {
        let mut cache = RecordCache::default();
        let r = record(7);
        cache.committed("s", 1, [&r]);
        assert_eq!(cache.get(&r.id), Some(r));
    }
}
