//! The projector's copy of the records it wrote last, so that a batch reads from Postgres only
//! the assignments it has not seen (a job's messages arrive in several batches; without the
//! copy every batch read each of its records back from seven tables).
//!
//! The copy is trusted only while the database shows exactly the checkpoints this process
//! committed last, for every stream: any other writer (a second reconciler that took over, a
//! reset, a restore that lost commits) moves a checkpoint, and then the copy is dropped. A
//! record is kept as the database would return it (its rows encoded and decoded again), so a
//! batch folds over the same thing whether it came from the copy or from a load.

use std::collections::{BTreeMap, HashMap};

use jr_protocol::AssignmentId;

use crate::model::AssignmentRecord;
use crate::rows::{decode, encode};

/// Records kept at most; past it the finished ones go first, then all.
const CAPACITY: usize = 20_000;

#[derive(Debug, Default)]
pub(crate) struct RecordCache {
    /// Every stream's checkpoint as this process committed it last.
    checkpoints: BTreeMap<String, u64>,
    records: HashMap<AssignmentId, AssignmentRecord>,
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

    pub fn get(&self, id: &AssignmentId) -> Option<&AssignmentRecord> {
        self.records.get(id)
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
            match decode(encode(record)) {
                Ok(mut decoded) if decoded.len() == 1 => {
                    if let Some(stored) = decoded.pop() {
                        self.records.insert(record.id, stored);
                    }
                }
                // Cannot happen for a record that was just written; read it next time.
                _ => {
                    self.records.remove(&record.id);
                }
            }
        }
        if self.records.len() > CAPACITY {
            self.records.retain(|_, r| !r.state().is_finished());
            if self.records.len() > CAPACITY / 2 {
                self.records.clear();
            }
        }
    }

    /// Forget everything (an error left the database's state unknown).
    pub fn clear(&mut self) {
        self.records.clear();
        self.checkpoints.clear();
    }
}
