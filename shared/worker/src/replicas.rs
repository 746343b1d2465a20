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

/// Whether process `me`, owning `owns`, manages the workloads labelled `creator` by `record` at
/// `now` (see [`Replica::manages`]).
fn manages(
    me: &str,
    owns: &BTreeSet<String>,
    record: &Slots,
    creator: &str,
    now: u64,
    policy: &Policy,
) -> bool {
    if owns.contains(creator) {
        return true;
    }
    if is_process_name(creator) {
        // Another process's, or taken over by another.
        return false;
    }
    if creator == stable_name(me) {
        return true;
    }
    // No process name: made by a worker from before processes had names, or by something
    // else entirely (an orphan the reconciler must hear of). The replica of that worker id
    // manages it if one lives, else the live replica first by name.
    let live: Vec<&String> = record
        .held
        .iter()
        .filter(|(name, h)| name.as_str() == me || now < h.expires(policy))
        .map(|(name, _)| name)
        .collect();
    if live.iter().any(|name| stable_name(name) == creator) {
        return false;
    }
    live.first().is_none_or(|first| first.as_str() == me)
}

/// Whether `creator` is a process name (`<worker_id>_<8 hex digits>`).
pub(crate) fn is_process_name(creator: &str) -> bool {
    creator.rsplit_once('_').is_some_and(|(id, suffix)| {
        !id.is_empty() && suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit())
    })
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
    /// replicas it took over, those labelled with its bare worker id (made before processes
    /// had names), and those without a process name of a worker id no live replica has (no
    /// label at all, say) if it is the live replica first by name.
    pub(crate) fn manages(&self, creator: &str) -> bool {
        manages(
            &self.name,
            &self.owns,
            &self.record,
            creator,
            now_ms(),
            &self.policy,
        )
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
    fn workloads_without_a_process_name_go_to_their_worker_id_or_the_first_live_replica() {
        let p = policy();
        let holding = |owns: &[&str]| jr_lease::Holding {
            slots: 1,
            renewed_at: 1_000,
            ttl_ms: p.ttl_ms,
            owns: owns.iter().map(|s| s.to_string()).collect(),
        };
        let record = Slots {
            held: [
                (
                    "a-worker_00000001".to_owned(),
                    holding(&["a-worker_00000001", "c-worker_00000003"]),
                ),
                (
                    "b-worker_00000002".to_owned(),
                    holding(&["b-worker_00000002"]),
                ),
            ]
            .into(),
        };
        let owns = |me: &str| record.held[me].owns.clone();
        let check = |me: &str, creator: &str| manages(me, &owns(me), &record, creator, 2_000, &p);
        // Process names: only their owner.
        assert!(check("a-worker_00000001", "c-worker_00000003"));
        assert!(!check("b-worker_00000002", "c-worker_00000003"));
        assert!(!check("a-worker_00000001", "b-worker_00000002"));
        // A bare worker id: the replica of that id.
        assert!(check("b-worker_00000002", "b-worker"));
        assert!(!check("a-worker_00000001", "b-worker"));
        // No label, or a worker id no live replica has: the first live replica by name.
        for orphan in ["", "old-worker"] {
            assert!(check("a-worker_00000001", orphan));
            assert!(!check("b-worker_00000002", orphan));
        }
        // Once a's holding expired, b is the first live one.
        let later = 1_000 + p.ttl_ms + p.max_skew_ms;
        assert!(manages(
            "b-worker_00000002",
            &owns("b-worker_00000002"),
            &record,
            "",
            later,
            &p
        ));
    }

    #[test]
    fn replica_names_carry_the_worker_id_and_a_random_part() {
        let a = replica_name("pod-worker");
        let b = replica_name("pod-worker");
        assert_ne!(a, b);
        assert_eq!(stable_name(&a), "pod-worker");
        assert_eq!(a.len(), "pod-worker".len() + 9);
        assert!(policy().ttl_ms > 4 * policy().max_skew_ms);
        assert!(is_process_name(&a));
        for bare in ["pod-worker", "", "pod_worker", "x_1234567"] {
            assert!(!is_process_name(bare), "{bare}");
        }
    }
}
