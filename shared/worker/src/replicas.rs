//! Replicas of one backend's worker share its capacity through one key (`slots`) in the
//! worker bucket `JR_WORKLOADS_<backend>`, on the pure rules of `jr_lease::hold_slots`: each
//! process holds some slots under a renewable holding and manages the workloads of the
//! creators its holding owns (its own, and those of replicas it took over). The sum of the
//! holdings never exceeds capacity, and a replica that stops renewing is taken over — slots and
//! workloads in one write — once it can no longer be creating by its own clock.
//!
//! A process's name is `<worker_id>_<8 hex digits>`, random per start; workloads carry it as
//! their worker label. A restarted process of the same `worker_id` takes over its earlier self
//! at once; a replica that finds its holding taken over stops (see [`Renewal::Lost`]).

use std::collections::BTreeSet;
use std::time::Duration;

use jr_bus::async_nats::jetstream::kv;
use jr_lease::{Policy, Slots, SlotsRequest, SlotsStep, hold_slots, release_slots, stable_name};
use jr_protocol::now_ms;

use crate::backend::ObservedWorkload;
use crate::ledger::{Entry, SLOTS_KEY};

/// How long a holding lasts without renewal, and the clock skew allowed between replicas.
pub const HOLDING_TTL: Duration = Duration::from_secs(6);
pub const MAX_SKEW: Duration = Duration::from_millis(500);
/// How often a replica renews its holding (and looks for replicas to take over).
pub const RENEW_EVERY: Duration = Duration::from_secs(1);
/// How long one read-and-write of the key may take before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) fn policy() -> Policy {
    Policy::new(HOLDING_TTL.as_millis() as u64, MAX_SKEW.as_millis() as u64)
        .expect("the TTL exceeds four times the skew")
}

/// This process's name: the configured worker id and a random suffix.
pub fn replica_name(worker_id: &str) -> String {
    format!("{worker_id}_{:08x}", rand::random::<u32>())
}

/// What a process takes over: the listed workloads and the ledger entries of the creators
/// `of` accepts (an entry written without an owner counts as the bare `worker_id`'s, `bare`).
pub(crate) fn taken_over(
    listed: Vec<ObservedWorkload>,
    entries: Vec<Entry>,
    bare: &str,
    of: impl Fn(&str) -> bool,
) -> (Vec<ObservedWorkload>, Vec<Entry>) {
    let listed = listed.into_iter().filter(|o| of(&o.worker)).collect();
    let entries = entries
        .into_iter()
        .filter(|e| of(e.owner.as_deref().unwrap_or(bare)))
        .collect();
    (listed, entries)
}

/// The outcome of one renewal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Written: this process holds `slots` and now also manages the workloads of `adopted`.
    Held {
        slots: usize,
        adopted: BTreeSet<String>,
    },
    /// The key could not be read or written (it is tried again at the next renewal).
    Failed(String),
    /// Another process took this one's holding over: it must stop managing anything.
    Lost { by: Option<String> },
}

/// One process's view of the shared capacity key.
pub(crate) struct Replica {
    pub(crate) name: String,
    store: kv::Store,
    policy: Policy,
    capacity: usize,
    joined: bool,
    /// Creators whose workloads this process manages (its own name included).
    owns: BTreeSet<String>,
    /// The record as last read or written.
    record: Slots,
    /// Until when (unix ms, own clock) the slots of the last successful write may be used.
    usable_until: u64,
}

impl Replica {
    pub(crate) fn new(name: String, store: kv::Store, capacity: usize) -> Self {
        let owns = BTreeSet::from([name.clone()]);
        Self {
            name,
            store,
            policy: policy(),
            capacity,
            joined: false,
            owns,
            record: Slots::default(),
            usable_until: 0,
        }
    }

    /// Whether this process manages the workloads labelled `creator`: its own, those of the
    /// replicas it took over, and those labelled with the bare worker id (made before
    /// processes had names).
    pub(crate) fn manages(&self, creator: &str) -> bool {
        self.owns.contains(creator) || creator == self.bare()
    }

    /// The configured worker id this process runs under.
    pub(crate) fn bare(&self) -> &str {
        stable_name(&self.name)
    }

    /// The creators taken over from other processes (not this one's own name).
    pub(crate) fn adopted(&self) -> impl Iterator<Item = &String> {
        self.owns.iter().filter(|c| **c != self.name)
    }

    /// Whether the slots of the last successful write may still be used.
    pub(crate) fn usable(&self) -> bool {
        now_ms() < self.usable_until
    }

    /// An even share of the capacity among the live replicas of the last record written.
    pub(crate) fn share(&self) -> usize {
        self.record
            .share(&self.name, self.capacity, now_ms(), &self.policy)
    }

    /// Live replicas in the last record read (this one included).
    pub(crate) fn replicas(&self) -> usize {
        let now = now_ms();
        self.record
            .held
            .iter()
            .filter(|(name, h)| **name == self.name || now < h.expires(&self.policy))
            .count()
            .max(1)
    }

    async fn read(&self) -> Result<(Slots, Option<u64>), String> {
        let entry = self
            .store
            .entry(SLOTS_KEY)
            .await
            .map_err(|e| e.to_string())?;
        let Some(entry) = entry else {
            return Ok((Slots::default(), None));
        };
        if entry.operation != kv::Operation::Put {
            return Ok((Slots::default(), Some(entry.revision)));
        }
        match serde_json::from_slice::<Slots>(&entry.value) {
            Ok(slots) => Ok((slots, Some(entry.revision))),
            Err(e) => {
                // Nothing can be trusted from it; rewritten with this replica's holding (other
                // replicas write theirs again at their next renewal).
                tracing::warn!(error = %e, "the shared capacity record is unreadable; replacing it");
                Ok((Slots::default(), Some(entry.revision)))
            }
        }
    }

    async fn write(&self, record: &Slots, revision: Option<u64>) -> Result<u64, String> {
        let value = serde_json::to_vec(record).map_err(|e| e.to_string())?;
        match revision {
            None => self
                .store
                .create(SLOTS_KEY, value.into())
                .await
                .map_err(|e| e.to_string()),
            Some(r) => self
                .store
                .update(SLOTS_KEY, value.into(), r)
                .await
                .map_err(|e| e.to_string()),
        }
    }

    /// Reads the key and writes this process's holding: the `in_use` slots (tracked workloads
    /// and create calls), or an even share of the capacity among the live replicas if that is
    /// more; creators in `done_with` (taken over earlier, no workload left) are dropped.
    pub(crate) async fn renew(&mut self, in_use: usize, done_with: &BTreeSet<String>) -> Renewal {
        let attempt = async {
            let (record, revision) = self.read().await?;
            let now = now_ms();
            let want = in_use.max(record.share(&self.name, self.capacity, now, &self.policy));
            let req = SlotsRequest {
                me: &self.name,
                want,
                capacity: self.capacity,
                now,
                joined: self.joined,
                known: &self.owns,
                done_with,
            };
            match hold_slots(&record, &req, &self.policy) {
                SlotsStep::Lost { by } => Ok(Err(by)),
                SlotsStep::Write {
                    record,
                    slots,
                    adopted,
                } => {
                    self.write(&record, revision).await?;
                    Ok(Ok((record, slots, adopted, now)))
                }
            }
        };
        let outcome = match tokio::time::timeout(CALL_TIMEOUT, attempt).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
        };
        match outcome {
            Err(e) => Renewal::Failed(e),
            Ok(Err(by)) => Renewal::Lost { by },
            Ok(Ok((record, slots, adopted, _at))) => {
                let mine = record.held.get(&self.name);
                self.owns = mine.map(|h| h.owns.clone()).unwrap_or_default();
                self.owns.insert(self.name.clone());
                self.usable_until = mine.map_or(0, |h| h.usable_until(&self.policy));
                self.record = record;
                self.joined = true;
                Renewal::Held { slots, adopted }
            }
        }
    }

    /// On a clean stop: marks this process's holding expired, so another replica takes over
    /// its workloads at its next renewal instead of after the TTL.
    pub(crate) async fn release(&self) {
        let Ok((record, revision)) = self.read().await else {
            return;
        };
        let Some(next) = release_slots(&record, &self.name) else {
            return;
        };
        if let Err(error) = self.write(&next, revision).await {
            tracing::warn!(%error, "could not hand the holding over at stop");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::AttemptKey;
    use jr_protocol::{AssignmentId, WorkloadPhase};

    fn workload(name: &str, worker: &str) -> ObservedWorkload {
        ObservedWorkload {
            workload: name.to_owned(),
            assignment_id: AssignmentId::for_task("https://f", 1),
            attempt: 1,
            phase: WorkloadPhase::Running,
            reason: None,
            worker: worker.to_owned(),
        }
    }

    fn entry(owner: Option<&str>, name: &str) -> Entry {
        Entry {
            owner: owner.map(str::to_owned),
            key: AttemptKey::new(AssignmentId::for_task("https://f", 1), 1),
            workload: name.to_owned(),
        }
    }

    #[test]
    fn a_takeover_keeps_to_the_creators_taken_over_and_old_entries_go_to_the_bare_id() {
        let listed = vec![
            workload("a", "pod-worker_1"),
            workload("b", "pod-worker-b_2"),
            workload("c", "pod-worker"),
        ];
        let entries = vec![
            entry(Some("pod-worker_1"), "a"),
            entry(Some("pod-worker-b_2"), "b"),
            entry(None, "c"),
        ];
        let of = |c: &str| c == "pod-worker_1" || c == "pod-worker";
        let (listed, entries) = taken_over(listed, entries, "pod-worker", of);
        let names =
            |l: &[ObservedWorkload]| l.iter().map(|o| o.workload.clone()).collect::<Vec<_>>();
        assert_eq!(names(&listed), ["a", "c"]);
        assert_eq!(
            entries
                .iter()
                .map(|e| e.workload.as_str())
                .collect::<Vec<_>>(),
            ["a", "c"]
        );
        // Another worker id does not get the entries written without an owner.
        let (_, entries) = taken_over(vec![], vec![entry(None, "c")], "vm-worker", |c| {
            c == "vm-worker_9"
        });
        assert!(entries.is_empty());
    }

    #[test]
    fn replica_names_carry_the_worker_id_and_a_random_part() {
        let a = replica_name("pod-worker");
        let b = replica_name("pod-worker");
        assert_ne!(a, b);
        assert_eq!(stable_name(&a), "pod-worker");
        assert_eq!(a.len(), "pod-worker".len() + 9);
        assert!(policy().ttl_ms > 4 * policy().max_skew_ms);
    }
}
