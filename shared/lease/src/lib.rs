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
//!   slots under a renewable holding; the sum never exceeds capacity, and the slots of a
//!   replica that stopped renewing return to the pool only once it can no longer be using them
//!   by its own clock.
//!
//! Times are unix milliseconds on the caller's own clock.

use std::collections::BTreeMap;

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

/// One replica's share of a backend's capacity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holding {
    pub slots: usize,
    /// The replica's clock at its last write of this holding.
    pub renewed_at: u64,
    pub ttl_ms: u64,
}

impl Holding {
    /// Until when (the holder's clock) the holder may use these slots without renewing.
    pub fn usable_until(&self, policy: &Policy) -> u64 {
        self.renewed_at
            .saturating_add(self.ttl_ms)
            .saturating_sub(policy.max_skew_ms)
    }

    /// From when (anyone else's clock) the slots return to the pool if not renewed.
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
}

/// What replica `me` writes (with compare-and-set on the revision it read) to hold `want`
/// slots of `capacity` at `now`: as many as are free, never more than `want`, renewing its
/// holding. Expired holdings of others are dropped. Returns the record to write and the number
/// of slots `me` then holds. Asking for fewer than it holds gives the rest back.
pub fn hold_slots(
    record: &Slots,
    me: &str,
    want: usize,
    capacity: usize,
    now: u64,
    policy: &Policy,
) -> (Slots, usize) {
    let mut next = Slots {
        held: record
            .held
            .iter()
            .filter(|(name, h)| name.as_str() == me || now < h.expires(policy))
            .map(|(name, h)| (name.clone(), h.clone()))
            .collect(),
    };
    let others: usize = next
        .held
        .iter()
        .filter(|(name, _)| name.as_str() != me)
        .map(|(_, h)| h.slots)
        .sum();
    let granted = want.min(capacity.saturating_sub(others));
    if granted == 0 {
        next.held.remove(me);
    } else {
        next.held.insert(
            me.to_owned(),
            Holding {
                slots: granted,
                renewed_at: now,
                ttl_ms: policy.ttl_ms,
            },
        );
    }
    (next, granted)
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

    #[test]
    fn slots_are_granted_up_to_what_others_leave_and_expired_holdings_return() {
        let p = policy();
        let (record, a) = hold_slots(&Slots::default(), "a", 6, 10, 0, &p);
        assert_eq!(a, 6);
        let (record, b) = hold_slots(&record, "b", 6, 10, 100, &p);
        assert_eq!(b, 4, "only what a leaves");
        assert_eq!(record.in_use(100, &p), 10);
        // a gives two back; b asks again and gets them.
        let (record, a) = hold_slots(&record, "a", 4, 10, 200, &p);
        assert_eq!(a, 4);
        let (record, b) = hold_slots(&record, "b", 6, 10, 300, &p);
        assert_eq!(b, 6);
        // a stops renewing: its 4 slots come back only once expired by b's clock.
        let (still, b) = hold_slots(&record, "b", 10, 10, 200 + 10_000 + 499, &p);
        assert_eq!(b, 6, "a's holding has not expired yet");
        assert_eq!(still.of("a"), 4);
        let (freed, b) = hold_slots(&record, "b", 10, 10, 200 + 10_000 + 500, &p);
        assert_eq!((b, freed.of("a")), (10, 0));
        // Asking for nothing removes the holding.
        let (empty, b) = hold_slots(&freed, "b", 0, 10, 20_000, &p);
        assert_eq!((b, empty.held.len()), (0, 0));
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
