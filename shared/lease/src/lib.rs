//! What replicas of a jetrunner service agree on through one compare-and-set key (a JetStream
//! KV entry: a value and its revision), as pure functions: the caller reads the key, asks what
//! to write, and writes with "expected revision" so a concurrent writer makes the write fail.
//!
//! - [`Lease`]: one leader at a time (the scheduler replica that fetches for a forge
//!   registration, the reconciler that plans). Clocks may differ by up to
//!   [`Policy::max_skew_ms`] from true time; a holder acts only until
//!   [`Lease::acting_until`], a challenger takes over only from [`Lease::free_from`], and the
//!   two never overlap in real time (property-tested in `tests/properties.rs`).
//! - [`Slots`]: replicas of one worker backend share its capacity. Each holds a number of
//!   slots under a renewable holding; the sum never exceeds capacity. A replica that stopped
//!   renewing is taken over by the next replica that writes once it can no longer be creating
//!   by its own clock: its slots and the workloads they cover move in one write, so they stay
//!   counted until the new owner has adopted them.
//!
//! Times are unix milliseconds on the caller's own clock.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Timing of leases and holdings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// How long a write holds without renewal.
    pub ttl_ms: u64,
    /// Most any replica's clock may differ from true time.
    pub max_skew_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("ttl ({ttl_ms} ms) must exceed four times the clock skew ({max_skew_ms} ms)")]
    TtlTooShort { ttl_ms: u64, max_skew_ms: u64 },
}

impl Policy {
    /// A policy whose holder has a useful window: the TTL must exceed four times the skew
    /// (the holder stops `max_skew` early, a renewal is due at a third of the TTL).
    pub fn new(ttl_ms: u64, max_skew_ms: u64) -> Result<Self, PolicyError> {
        if ttl_ms <= max_skew_ms.saturating_mul(4) {
            return Err(PolicyError::TtlTooShort {
                ttl_ms,
                max_skew_ms,
            });
        }
        Ok(Self {
            ttl_ms,
            max_skew_ms,
        })
    }

    /// When a write stamped `at` is due for renewal.
    pub fn renew_at(&self, at: u64) -> u64 {
        at.saturating_add(self.ttl_ms / 3)
    }
}

/// The value of a lease key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The holder's identity; unique per running replica (e.g. host name and a random suffix).
    pub holder: String,
    /// The holder's clock when it sent this write (stamped before sending).
    pub renewed_at: u64,
    pub ttl_ms: u64,
    /// Grows by one at every change of holder: a fencing token for what the holder writes.
    pub term: u64,
}

impl Lease {
    /// Until when (holder's clock) the holder may act on this write. Every action must end
    /// before it; after it the holder acts only on a later successful renewal.
    pub fn acting_until(&self, policy: &Policy) -> u64 {
        self.renewed_at
            .saturating_add(self.ttl_ms)
            .saturating_sub(policy.max_skew_ms)
    }

    /// From when (anyone else's clock) the lease may be taken over if not renewed.
    pub fn free_from(&self, policy: &Policy) -> u64 {
        self.renewed_at
            .saturating_add(self.ttl_ms)
            .saturating_add(policy.max_skew_ms)
    }
}

/// What a replica does next about a lease key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseStep {
    /// Write `lease`, expecting the key at `revision` (`None`: the key must not exist). On
    /// success the writer holds it until [`Lease::acting_until`].
    Write { lease: Lease, revision: Option<u64> },
    /// Held by this replica and not due for renewal before `renew_at`.
    Hold { renew_at: u64 },
    /// Held by another replica; look again at `retry_at`.
    Wait { holder: String, retry_at: u64 },
}

/// The next step of replica `me` at `now`, given the key's current value and revision.
pub fn next_lease_step(
    me: &str,
    now: u64,
    current: Option<(&Lease, u64)>,
    policy: &Policy,
) -> LeaseStep {
    let fresh = |term| Lease {
        holder: me.to_owned(),
        renewed_at: now,
        ttl_ms: policy.ttl_ms,
        term,
    };
    match current {
        None => LeaseStep::Write {
            lease: fresh(1),
            revision: None,
        },
        Some((lease, revision)) if lease.holder == me => {
            let renew_at = policy.renew_at(lease.renewed_at);
            if now >= renew_at {
                LeaseStep::Write {
                    lease: fresh(lease.term),
                    revision: Some(revision),
                }
            } else {
                LeaseStep::Hold { renew_at }
            }
        }
        Some((lease, revision)) => {
            let free_from = lease.free_from(policy);
            if now >= free_from {
                LeaseStep::Write {
                    lease: fresh(lease.term.saturating_add(1)),
                    revision: Some(revision),
                }
            } else {
                LeaseStep::Wait {
                    holder: lease.holder.clone(),
                    retry_at: free_from,
                }
            }
        }
    }
}

/// One replica's share of a backend's capacity, and the workloads it answers for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    pub slots: usize,
    /// The replica's clock at its last write of this holding.
    pub renewed_at: u64,
    pub ttl_ms: u64,
    /// Creators (replica names, as workloads are labelled) whose workloads this replica
    /// manages: its own name and those of replicas it took over.
    #[serde(default)]
    pub owns: BTreeSet<String>,
}

impl Holding {
    /// Until when (the holder's clock) the holder may use these slots without renewing.
    pub fn usable_until(&self, policy: &Policy) -> u64 {
        self.renewed_at
            .saturating_add(self.ttl_ms)
            .saturating_sub(policy.max_skew_ms)
    }

    /// From when (anyone else's clock) another replica may take the holding over.
    pub fn expires(&self, policy: &Policy) -> u64 {
        self.renewed_at
            .saturating_add(self.ttl_ms)
            .saturating_add(policy.max_skew_ms)
    }
}

/// The value of a backend's capacity key: who holds how many of its slots.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slots {
    pub held: BTreeMap<String, Holding>,
}

impl Slots {
    /// Slots held by anyone at `now`, counting holdings that have not expired (own included).
    pub fn in_use(&self, now: u64, policy: &Policy) -> usize {
        self.held
            .values()
            .filter(|h| now < h.expires(policy))
            .map(|h| h.slots)
            .sum()
    }

    /// `me`'s slots.
    pub fn of(&self, me: &str) -> usize {
        self.held.get(me).map_or(0, |h| h.slots)
    }

    /// An even share of `capacity` among the replicas holding at `now` (`me` counted even
    /// before its first write), rounded up.
    pub fn share(&self, me: &str, capacity: usize, now: u64, policy: &Policy) -> usize {
        let live = self
            .held
            .iter()
            .filter(|(name, h)| name.as_str() != me && now < h.expires(policy))
            .count()
            + 1;
        capacity.div_ceil(live)
    }
}

/// The part of a replica name before its last `_`: the configured worker id that every
/// process of one replica shares (the part after it is random per process start).
pub fn stable_name(name: &str) -> &str {
    name.rsplit_once('_').map_or(name, |(stable, _)| stable)
}

/// What replica `me` asks of the capacity key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotsRequest<'a> {
    pub me: &'a str,
    /// Slots wanted; at least those in use or reserved.
    pub want: usize,
    pub capacity: usize,
    pub now: u64,
    /// Whether a write of this process succeeded before: its holding must still be there.
    pub joined: bool,
    /// Creators whose workloads `want` counts (this process's own name and those it adopted
    /// after a write it saw succeed). A write may have taken others over without the caller
    /// hearing of it: those come back in `adopted` and their slots are kept.
    pub known: &'a BTreeSet<String>,
    /// Creators taken over earlier that have no workload left: no longer owned.
    pub done_with: &'a BTreeSet<String>,
}

/// The outcome of [`hold_slots`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotsStep {
    /// Write `record` with compare-and-set on the revision read. On success `me` holds `slots`
    /// and manages the workloads of the creators in its holding's `owns`; `adopted` are the
    /// creators taken over by this write (their workloads must be counted before the slots
    /// they came with are given back).
    Write {
        record: Slots,
        slots: usize,
        adopted: BTreeSet<String>,
    },
    /// This process's holding was taken over (it stopped renewing long enough, or another
    /// process runs under the same worker id): it must stop managing anything.
    Lost { by: Option<String> },
}

/// What replica `me` writes to hold `want` slots: as many as are free, never more than `want`
/// plus the slots it takes over. Holdings of others that expired, and those of an earlier
/// process of the same replica (same [`stable_name`]), are taken over: their slots and the
/// creators they own move to `me` in the same write, so the workloads they answer for stay
/// counted while the new owner adopts them. Asking for fewer than it holds gives the rest back.
pub fn hold_slots(record: &Slots, req: &SlotsRequest<'_>, policy: &Policy) -> SlotsStep {
    let me = req.me;
    if req.joined {
        let by = record
            .held
            .iter()
            .find(|(name, h)| name.as_str() != me && h.owns.contains(me))
            .map(|(name, _)| name.clone());
        if by.is_some() || !record.held.contains_key(me) {
            return SlotsStep::Lost { by };
        }
    }
    let mut next = Slots::default();
    let mut adopted = BTreeSet::new();
    let mut transferred = 0usize;
    let mut mine = record.held.get(me).cloned();
    for (name, h) in &record.held {
        if name == me {
            continue;
        }
        let earlier_self = stable_name(name) == stable_name(me);
        if earlier_self || req.now >= h.expires(policy) {
            adopted.extend(h.owns.iter().cloned());
            adopted.insert(name.clone());
            transferred += h.slots;
        } else {
            next.held.insert(name.clone(), h.clone());
        }
    }
    let others: usize = next.held.values().map(|h| h.slots).sum();
    let (mut owns, held) = mine.take().map(|h| (h.owns, h.slots)).unwrap_or_default();
    // Taken over by an earlier write whose answer never came: still to be counted, so none of
    // the slots held now is given back.
    let unheard: Vec<String> = owns
        .iter()
        .filter(|c| c.as_str() != me && !req.known.contains(*c))
        .cloned()
        .collect();
    let want = if unheard.is_empty() {
        req.want
    } else {
        req.want.max(held)
    };
    adopted.extend(unheard);
    let slots = want
        .saturating_add(transferred)
        .min(req.capacity.saturating_sub(others));
    owns.retain(|c| c == me || !req.done_with.contains(c));
    owns.extend(adopted.iter().cloned());
    owns.insert(me.to_owned());
    next.held.insert(
        me.to_owned(),
        Holding {
            slots,
            renewed_at: req.now,
            ttl_ms: policy.ttl_ms,
            owns,
        },
    );
    SlotsStep::Write {
        record: next,
        slots,
        adopted,
    }
}

/// What a replica that stops cleanly writes: its holding marked expired, so another replica
/// takes over its workloads (and the slots they hold) at its next write instead of after the
/// TTL. The stopping replica must have stopped creating before.
pub fn release_slots(record: &Slots, me: &str) -> Option<Slots> {
    let mut next = record.clone();
    let h = next.held.get_mut(me)?;
    h.renewed_at = 0;
    h.ttl_ms = 0;
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy::new(10_000, 500).expect("valid")
    }

    #[test]
    fn a_policy_needs_room_for_the_skew() {
        assert_eq!(
            Policy::new(2_000, 500),
            Err(PolicyError::TtlTooShort {
                ttl_ms: 2_000,
                max_skew_ms: 500
            })
        );
        assert!(Policy::new(2_001, 500).is_ok());
    }

    #[test]
    fn an_empty_key_is_created_then_renewed_then_taken_over_only_when_free() {
        let p = policy();
        let LeaseStep::Write { lease, revision } = next_lease_step("a", 1_000, None, &p) else {
            panic!("an empty key is written");
        };
        assert_eq!(
            (revision, lease.term, lease.holder.as_str()),
            (None, 1, "a")
        );
        assert_eq!(lease.acting_until(&p), 1_000 + 10_000 - 500);
        // The holder renews from a third of the TTL on.
        assert_eq!(
            next_lease_step("a", 2_000, Some((&lease, 7)), &p),
            LeaseStep::Hold {
                renew_at: 1_000 + 3_333
            }
        );
        assert!(matches!(
            next_lease_step("a", 4_333, Some((&lease, 7)), &p),
            LeaseStep::Write { revision: Some(7), ref lease } if lease.term == 1 && lease.renewed_at == 4_333
        ));
        // Another waits until the lease is free by any clock, then takes the next term.
        assert_eq!(
            next_lease_step("b", 11_000, Some((&lease, 7)), &p),
            LeaseStep::Wait {
                holder: "a".into(),
                retry_at: 11_500
            }
        );
        assert!(matches!(
            next_lease_step("b", 11_500, Some((&lease, 7)), &p),
            LeaseStep::Write { revision: Some(7), ref lease } if lease.term == 2 && lease.holder == "b"
        ));
    }

    /// The replica whose holding owns `creator`, if any.
    fn owner_of<'a>(record: &'a Slots, creator: &str) -> Option<&'a str> {
        record
            .held
            .iter()
            .find(|(_, h)| h.owns.contains(creator))
            .map(|(name, _)| name.as_str())
    }

    /// A write of `me` wanting `want` of 10 slots at `now`; panics on `Lost`.
    fn write(
        record: &Slots,
        me: &str,
        want: usize,
        now: u64,
        joined: bool,
    ) -> (Slots, usize, BTreeSet<String>) {
        let none = BTreeSet::new();
        let req = SlotsRequest {
            me,
            want,
            capacity: 10,
            now,
            joined,
            known: &none,
            done_with: &none,
        };
        match hold_slots(record, &req, &policy()) {
            SlotsStep::Write {
                record,
                slots,
                adopted,
            } => (record, slots, adopted),
            SlotsStep::Lost { by } => panic!("{me} lost its holding to {by:?}"),
        }
    }

    #[test]
    fn slots_are_granted_up_to_what_others_leave_and_expired_holdings_move_with_their_workloads() {
        let p = policy();
        let (record, a, _) = write(&Slots::default(), "w1_a", 6, 0, false);
        assert_eq!(a, 6);
        let (record, b, _) = write(&record, "w2_b", 6, 100, false);
        assert_eq!(b, 4, "only what a leaves");
        assert_eq!(record.in_use(100, &p), 10);
        assert_eq!(record.share("w2_b", 10, 100, &p), 5);
        // a gives two back; b asks again and gets them.
        let (record, a, _) = write(&record, "w1_a", 4, 200, true);
        assert_eq!(a, 4);
        let (record, b, _) = write(&record, "w2_b", 6, 300, true);
        assert_eq!(b, 6);
        // a stops renewing: b takes it over only once it expired by b's clock, slots included
        // (its workloads still exist), and manages what a made.
        let (still, b, adopted) = write(&record, "w2_b", 6, 200 + 10_000 + 499, true);
        assert_eq!((b, still.of("w1_a")), (6, 4));
        assert!(adopted.is_empty());
        let (taken, b, adopted) = write(&record, "w2_b", 6, 200 + 10_000 + 500, true);
        assert_eq!((b, taken.held.len()), (10, 1));
        assert_eq!(adopted, BTreeSet::from(["w1_a".to_owned()]));
        assert_eq!(owner_of(&taken, "w1_a"), Some("w2_b"));
        // The process of a that comes back finds itself taken over.
        let none = BTreeSet::new();
        let req = SlotsRequest {
            me: "w1_a",
            want: 4,
            capacity: 10,
            now: 11_000,
            joined: true,
            known: &none,
            done_with: &none,
        };
        assert_eq!(
            hold_slots(&taken, &req, &p),
            SlotsStep::Lost {
                by: Some("w2_b".into())
            }
        );
        // Once a's workloads are gone, b stops owning it and gives the slots back.
        let done = BTreeSet::from(["w1_a".to_owned()]);
        let taken_owns = taken.held["w2_b"].owns.clone();
        let req = SlotsRequest {
            me: "w2_b",
            want: 6,
            capacity: 10,
            now: 11_000,
            joined: true,
            known: &taken_owns,
            done_with: &done,
        };
        let SlotsStep::Write { record, slots, .. } = hold_slots(&taken, &req, &p) else {
            panic!("b holds");
        };
        assert_eq!((slots, owner_of(&record, "w1_a")), (6, None));
    }

    #[test]
    fn a_restarted_process_takes_over_its_earlier_self_at_once() {
        let (record, _, _) = write(&Slots::default(), "pod-worker_1", 3, 0, false);
        let (record, _, _) = write(&record, "other_9", 3, 0, false);
        let (record, slots, adopted) = write(&record, "pod-worker_2", 1, 1_000, false);
        assert_eq!(slots, 4, "the earlier process's slots come along");
        assert_eq!(adopted, BTreeSet::from(["pod-worker_1".to_owned()]));
        assert_eq!(owner_of(&record, "pod-worker_1"), Some("pod-worker_2"));
        assert_eq!(
            record.of("other_9"),
            3,
            "a live replica of another worker id stays"
        );
        // A clean stop hands over at once.
        let released = release_slots(&record, "pod-worker_2").expect("held");
        let (record, _, adopted) = write(&released, "other_9", 3, 2_000, true);
        assert_eq!(
            adopted,
            BTreeSet::from(["pod-worker_1".to_owned(), "pod-worker_2".to_owned()])
        );
        assert_eq!(record.of("other_9"), 7);
    }

    #[test]
    fn records_round_trip_as_json() {
        let lease = Lease {
            holder: "scheduler-1".into(),
            renewed_at: 5,
            ttl_ms: 10_000,
            term: 3,
        };
        let text = serde_json::to_string(&lease).expect("encode");
        assert_eq!(serde_json::from_str::<Lease>(&text).expect("decode"), lease);
    }
}
