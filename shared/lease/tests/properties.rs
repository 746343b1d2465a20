//! Replicas with skewed clocks, a compare-and-set key with slow, lost and unacknowledged
//! writes, and random timing: never two lease holders acting at the same real time, never more
//! slots in use than capacity.

use std::collections::{BTreeMap, BTreeSet};

use jr_lease::{
    Lease, LeaseStep, Policy, Slots, SlotsRequest, SlotsStep, hold_slots, next_lease_step,
};
use proptest::prelude::*;

/// A small deterministic generator for the schedule (the seed comes from proptest).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The key: its value and revision (0: absent).
struct Key<V> {
    value: Option<V>,
    revision: u64,
}

impl<V: Clone> Key<V> {
    fn read(&self) -> Option<(V, u64)> {
        self.value.clone().map(|v| (v, self.revision))
    }
    /// Compare-and-set: `expected` None means "must not exist".
    fn write(&mut self, value: V, expected: Option<u64>) -> bool {
        let matches = match expected {
            None => self.value.is_none(),
            Some(revision) => self.value.is_some() && self.revision == revision,
        };
        if matches {
            self.value = Some(value);
            self.revision += 1;
        }
        matches
    }
}

#[derive(Clone, Copy, Debug)]
struct Faults {
    read_fails: u64,
    write_lost: u64,
    ack_lost: u64,
    max_delay: u64,
}

fn faults() -> impl Strategy<Value = Faults> {
    (0u64..30, 0u64..30, 0u64..30, 0u64..3_000).prop_map(
        |(read_fails, write_lost, ack_lost, max_delay)| Faults {
            read_fails,
            write_lost,
            ack_lost,
            max_delay,
        },
    )
}

/// Events in real time: a replica's tick, a write reaching the key, an answer reaching a replica.
enum Event<V> {
    Tick(usize),
    Apply {
        replica: usize,
        value: V,
        expected: Option<u64>,
        ack: bool,
    },
    Acked {
        replica: usize,
        value: V,
    },
}

/// A write reaching the key: applied if its expected revision still holds; its answer reaches
/// the replica later unless lost. Whether the replica will hear of its success.
#[expect(clippy::too_many_arguments, reason = "one event's whole context")]
fn apply<V: Clone>(
    key: &mut Key<V>,
    rng: &mut Rng,
    f: Faults,
    now: u64,
    replica: usize,
    value: V,
    expected: Option<u64>,
    ack: bool,
    queue: &mut Vec<(u64, u64, Event<V>)>,
) -> bool {
    if key.write(value.clone(), expected) && ack {
        let at = now + rng.below(f.max_delay + 1);
        queue.push((at, 0, Event::Acked { replica, value }));
        return true;
    }
    false
}

/// Runs `horizon` ms of real time; `on` handles each event and may schedule more.
fn run<V>(
    rng: &mut Rng,
    replicas: usize,
    horizon: u64,
    mut on: impl FnMut(&mut Rng, u64, Event<V>, &mut Vec<(u64, u64, Event<V>)>),
) {
    let mut queue: Vec<(u64, u64, Event<V>)> = Vec::new();
    let mut order = 0u64;
    for replica in 0..replicas {
        let mut t = rng.below(1_000);
        while t < horizon {
            queue.push((t, order, Event::Tick(replica)));
            order += 1;
            t += 50 + rng.below(3_000);
        }
    }
    while !queue.is_empty() {
        let (i, _) = queue
            .iter()
            .enumerate()
            .min_by_key(|(_, (t, o, _))| (*t, *o))
            .expect("not empty");
        let (now, _, event) = queue.swap_remove(i);
        let mut added = Vec::new();
        on(rng, now, event, &mut added);
        for (t, _, e) in added {
            order += 1;
            queue.push((t, order, e));
        }
    }
}

proptest! {
    // 256 cases, or PROPTEST_CASES.
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn two_lease_holders_never_act_at_the_same_real_time(
        seed in 1u64..u64::MAX,
        skews in proptest::collection::vec(-500i64..=500, 3),
        f in faults(),
    ) {
        let policy = Policy::new(6_000, 500).expect("policy");
        let mut rng = Rng(seed);
        let mut key: Key<Lease> = Key { value: None, revision: 0 };
        // Real-time intervals in which each replica acts.
        let mut acting: Vec<(usize, u64, u64)> = Vec::new();
        let local = |replica: usize, t: u64| t.saturating_add_signed(skews[replica]);
        let real = |replica: usize, local_t: u64| local_t.saturating_add_signed(-skews[replica]);
        run(&mut rng, 3, 60_000, |rng, now, event, queue| match event {
            Event::Tick(replica) => {
                if rng.chance(f.read_fails) {
                    return;
                }
                let current = key.read();
                let step = next_lease_step(
                    &format!("r{replica}"),
                    local(replica, now),
                    current.as_ref().map(|(l, r)| (l, *r)),
                    &policy,
                );
                if let LeaseStep::Write { lease, revision } = step
                    && !rng.chance(f.write_lost)
                {
                    let at = now + rng.below(f.max_delay + 1);
                    let ack = !rng.chance(f.ack_lost);
                    queue.push((at, 0, Event::Apply { replica, value: lease, expected: revision, ack }));
                }
            }
            Event::Apply { replica, value, expected, ack } => {
                apply(&mut key, rng, f, now, replica, value, expected, ack, queue);
            }
            Event::Acked { replica, value } => {
                let end = real(replica, value.acting_until(&policy));
                if now < end {
                    acting.push((replica, now, end));
                }
            }
        });
        for (i, a) in acting.iter().enumerate() {
            for b in &acting[i + 1..] {
                if a.0 != b.0 {
                    prop_assert!(
                        a.2 <= b.1 || b.2 <= a.1,
                        "r{} acts {}..{} while r{} acts {}..{}",
                        a.0, a.1, a.2, b.0, b.1, b.2
                    );
                }
            }
        }
        if f.read_fails == 0 && f.write_lost == 0 && f.ack_lost == 0 {
            prop_assert!(!acting.is_empty(), "no replica ever led");
        }
    }

    /// Workloads outlive the replica that made them: the model counts them per creator, each
    /// live replica makes workloads only within slots it may still use and ends only those it
    /// manages, replicas die (kill -9) and come back as a new process of the same worker id,
    /// and a replica that finds itself taken over stops. At no moment do the workloads that
    /// exist exceed capacity.
    #[test]
    fn workloads_never_exceed_capacity_while_replicas_die_and_take_over(
        seed in 1u64..u64::MAX,
        skews in proptest::collection::vec(-500i64..=500, 3),
        f in faults(),
        capacity in 1usize..20,
    ) {
        let policy = Policy::new(6_000, 500).expect("policy");
        let mut rng = Rng(seed);
        let mut key: Key<Slots> = Key { value: None, revision: 0 };
        // Workloads that exist, by creator.
        let mut work: BTreeMap<String, usize> = BTreeMap::new();
        let mut replicas: Vec<Replica> = (0..3).map(|r| Replica::new(r, 0)).collect();
        let mut worst = 0usize;
        let local = |replica: usize, t: u64| t.saturating_add_signed(skews[replica]);
        let real = |replica: usize, local_t: u64| local_t.saturating_add_signed(-skews[replica]);
        run(&mut rng, 3, 60_000, |rng, now, event, queue| {
            match event {
                Event::Tick(r) => {
                    let rep = &mut replicas[r];
                    if !rep.alive {
                        // Back as a new process of the same worker id.
                        if rng.chance(30) {
                            *rep = Replica::new(r, rep.generation + 1);
                        }
                        return;
                    }
                    if rng.chance(3) {
                        rep.alive = false;
                        return;
                    }
                    let managed: usize = rep.owns.iter().map(|c| work.get(c).copied().unwrap_or(0)).sum();
                    // Make or end workloads within what may be used now.
                    if now < rep.usable_until && rng.chance(50) {
                        let room = rep.slots.saturating_sub(managed);
                        let n = rng.below(room as u64 + 1) as usize;
                        *work.entry(rep.name.clone()).or_default() += n;
                    } else if let Some(c) = rep.owns.iter().find(|c| work.get(*c).copied().unwrap_or(0) > 0).cloned() {
                        *work.get_mut(&c).expect("has work") -= 1;
                    }
                    if rep.in_flight || rng.chance(f.read_fails) {
                        return;
                    }
                    let managed: usize = rep.owns.iter().map(|c| work.get(c).copied().unwrap_or(0)).sum();
                    let (record, revision) = key.read().map_or((Slots::default(), None), |(s, v)| (s, Some(v)));
                    let want = managed.max(rng.below(capacity as u64 + 3) as usize);
                    // Giving back: stop using what is returned before writing it.
                    rep.slots = rep.slots.min(want);
                    let done_with: BTreeSet<String> = rep
                        .owns
                        .iter()
                        .filter(|c| **c != rep.name && work.get(*c).copied().unwrap_or(0) == 0)
                        .cloned()
                        .collect();
                    let req = SlotsRequest {
                        me: &rep.name,
                        want,
                        capacity,
                        now: local(r, now),
                        joined: rep.joined,
                        known: &rep.owns,
                        done_with: &done_with,
                    };
                    match hold_slots(&record, &req, &policy) {
                        SlotsStep::Lost { .. } => rep.alive = false,
                        SlotsStep::Write { record, .. } => {
                            if !rng.chance(f.write_lost) {
                                rep.in_flight = true;
                                let at = now + rng.below(f.max_delay + 1);
                                let ack = !rng.chance(f.ack_lost);
                                queue.push((at, 0, Event::Apply { replica: r, value: record, expected: revision, ack }));
                            }
                        }
                    }
                }
                Event::Apply { replica, value, expected, ack } => {
                    if !apply(&mut key, rng, f, now, replica, value, expected, ack, queue) {
                        replicas[replica].in_flight = false;
                    }
                }
                Event::Acked { replica, value } => {
                    let rep = &mut replicas[replica];
                    rep.in_flight = false;
                    // A write of an earlier process of this replica is not this process's.
                    if let Some(h) = value.held.get(&rep.name).filter(|_| rep.alive) {
                        rep.joined = true;
                        rep.slots = h.slots;
                        rep.usable_until = real(replica, h.usable_until(&policy));
                        rep.owns = h.owns.clone();
                    }
                }
            }
            worst = worst.max(work.values().sum());
        });
        prop_assert!(worst <= capacity, "{worst} workloads exist for {capacity} slots");
    }
}

/// One replica process in the model.
struct Replica {
    name: String,
    generation: usize,
    alive: bool,
    joined: bool,
    in_flight: bool,
    slots: usize,
    /// Real time until which it may make workloads.
    usable_until: u64,
    owns: BTreeSet<String>,
}

impl Replica {
    fn new(r: usize, generation: usize) -> Self {
        Self {
            name: format!("w{r}_{generation}"),
            generation,
            alive: true,
            joined: false,
            in_flight: false,
            slots: 0,
            usable_until: 0,
            owns: BTreeSet::from([format!("w{r}_{generation}")]),
        }
    }
}
