//! Property tests of the worker's state machine over random interleavings of deliveries
//! (fresh, redelivered, superseded, with stale bus facts), backend answers (created, full with
//! a lingering half-made workload, transient with or without a workload behind it, refused),
//! observations, stale listings, delete commands racing creates, timers and restarts that
//! adopt more than capacity.
//!
//! Cases per property: `JR_PROPTEST_CASES` (default 64 for CI; the soak script runs 10,000).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use jr_bus::Disposition;
use jr_protocol::{AssignmentId, WorkloadPhase};
use jr_worker::ObservedWorkload;
use jr_worker::state::{
    AttemptKey, BusFacts, CreateAnswer, DeleteAnswer, DeliveryId, Effect, Event, Input,
    StateConfig, TicketId, WarmPolicy, WorkerState,
};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("JR_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// Ghosts (what a refused create leaves) vanish well inside the state machine's stray grace.
const GHOST_LIFE: Duration = Duration::from_secs(20);

#[derive(Clone, Debug)]
struct BackendWorkload {
    key: AttemptKey,
    phase: WorkloadPhase,
    /// What a refused create left behind; it vanishes by itself.
    ghost_until: Option<Instant>,
    deleting: bool,
}

#[derive(Clone, Copy, Debug)]
enum Pending {
    Assignment(AttemptKey),
    Command(AttemptKey),
}

/// What the current incarnation was told about an assignment.
#[derive(Clone, Debug, Default)]
struct Given {
    latest: u32,
    terminal: bool,
    claimed: bool,
    created: BTreeSet<u32>,
}

struct World {
    now: Instant,
    /// The slots the worker may fill now (its replica's share, changed by `Input::Capacity`).
    capacity: usize,
    /// The backend's whole capacity: the most a share can be.
    full_capacity: usize,
    state: WorkerState,
    truth: BTreeMap<AssignmentId, BusFacts>,
    history: BTreeMap<AssignmentId, Vec<BusFacts>>,
    /// Unacked messages: assignment attempts and delete commands (with their workload).
    messages: BTreeSet<AttemptKey>,
    commands: BTreeMap<String, AttemptKey>,
    in_delivery: BTreeMap<DeliveryId, (Pending, String)>,
    next_delivery: u64,
    tickets: Vec<TicketId>,
    /// What each waiting pull asked for, oldest first.
    asked: VecDeque<usize>,
    creates: BTreeMap<DeliveryId, AttemptKey>,
    deletes: BTreeMap<DeliveryId, String>,
    list: Option<(Instant, Vec<ObservedWorkload>)>,
    backend: BTreeMap<String, BackendWorkload>,
    ledger: BTreeSet<(AttemptKey, String)>,
    announced: BTreeMap<String, AttemptKey>,
    told: BTreeSet<String>,
    given: BTreeMap<AssignmentId, Given>,
    created_keys: BTreeSet<AttemptKey>,
    deleted: BTreeSet<String>,
    released: BTreeMap<String, BTreeSet<AttemptKey>>,
    /// Attempts whose every create answer was back-pressure and that never had a workload.
    backpressure_only: BTreeMap<AttemptKey, bool>,
    next_workload: u64,
    next_task: i64,
    create_calls: usize,
    /// Attempts that ever had a real (not half-made) workload on the backend.
    ever_workload: BTreeSet<AttemptKey>,
    /// Warm executors: the policy, creates and deletes in flight, and bindings published.
    warm: WarmPolicy,
    warm_creates: BTreeSet<AssignmentId>,
    warm_deletes: BTreeSet<String>,
    bound: BTreeMap<String, AttemptKey>,
    binds: usize,
}

fn observed(name: &str, w: &BackendWorkload) -> ObservedWorkload {
    ObservedWorkload {
        workload: name.to_owned(),
        assignment_id: w.key.assignment,
        attempt: w.key.attempt,
        phase: w.phase,
        reason: None,
        worker: String::new(),
    }
}

impl World {
    fn config(capacity: usize, warm: &WarmPolicy) -> StateConfig {
        let mut cfg = StateConfig::new(capacity);
        cfg.warm = warm.clone();
        cfg
    }

    fn new(capacity: usize, warm: WarmPolicy) -> Self {
        let mut w = World {
            now: Instant::now(),
            capacity,
            full_capacity: capacity,
            state: WorkerState::new(Self::config(capacity, &warm)),
            truth: BTreeMap::new(),
            history: BTreeMap::new(),
            messages: BTreeSet::new(),
            commands: BTreeMap::new(),
            in_delivery: BTreeMap::new(),
            next_delivery: 0,
            tickets: Vec::new(),
            asked: VecDeque::new(),
            creates: BTreeMap::new(),
            deletes: BTreeMap::new(),
            list: None,
            backend: BTreeMap::new(),
            ledger: BTreeSet::new(),
            announced: BTreeMap::new(),
            told: BTreeSet::new(),
            given: BTreeMap::new(),
            created_keys: BTreeSet::new(),
            deleted: BTreeSet::new(),
            released: BTreeMap::new(),
            backpressure_only: BTreeMap::new(),
            next_workload: 0,
            next_task: 0,
            create_calls: 0,
            ever_workload: BTreeSet::new(),
            warm,
            warm_creates: BTreeSet::new(),
            warm_deletes: BTreeSet::new(),
            bound: BTreeMap::new(),
            binds: 0,
        };
        w.recover();
        w
    }

    fn listing(&self) -> Vec<ObservedWorkload> {
        self.backend.iter().map(|(n, w)| observed(n, w)).collect()
    }

    fn recover(&mut self) {
        let listed = self.listing();
        for o in &listed {
            self.told.insert(o.workload.clone());
        }
        let remembered = self.ledger.iter().cloned().collect();
        self.feed(Input::Recovered { listed, remembered });
    }

    fn delivery(&mut self, pending: Pending, workload: String) -> DeliveryId {
        self.next_delivery += 1;
        let id = DeliveryId(self.next_delivery);
        self.in_delivery.insert(id, (pending, workload));
        id
    }

    fn feed(&mut self, input: Input) {
        let trace = std::env::var("JR_TRACE").is_ok();
        if trace {
            eprintln!("IN  {input:?}");
        }
        let effects = self.state.on(input, self.now);
        if trace {
            eprintln!("FX  {effects:?} used={}", self.state.used());
        }
        for effect in effects {
            self.apply(effect);
        }
    }

    fn alive_told(&self, key: AttemptKey) -> Option<&String> {
        self.backend
            .iter()
            .find(|(n, w)| w.key == key && self.told.contains(*n))
            .map(|(n, _)| n)
    }

    /// A create (job or warm) may start only while the workloads the worker knows of, its job
    /// creates that have no workload yet and its warm creates leave a slot free.
    fn assert_room_for_a_create(&self, what: &str) {
        let alive_known = self
            .backend
            .keys()
            .filter(|n| self.told.contains(*n))
            .count();
        // A create whose attempt already has a workload finds that one (idempotent).
        let fresh_creates = self
            .creates
            .values()
            .filter(|k| self.alive_told(**k).is_none())
            .count();
        let warm = self.warm_creates.len();
        assert!(
            alive_known + fresh_creates + warm < self.capacity,
            "{what} beyond capacity: {alive_known} known workloads, {fresh_creates} creates and {warm} warm creates in flight, capacity {}",
            self.capacity
        );
    }

    fn apply(&mut self, effect: Effect) {
        match effect {
            Effect::GrantPull(tickets) => {
                assert!(!tickets.is_empty(), "an empty grant");
                let asked = self
                    .asked
                    .pop_front()
                    .expect("a grant with no pull waiting");
                assert!(
                    tickets.len() <= asked,
                    "granted {} tickets to a pull that asked for {asked}",
                    tickets.len()
                );
                // Idle warm executors' slots are offered to pulls (a delivery binds one).
                assert!(
                    self.state.used() + self.state.reserved()
                        <= self.capacity + self.state.warm_idle_count(),
                    "a pull granted beyond capacity"
                );
                self.tickets.extend(tickets);
            }
            Effect::Create { delivery, key } => {
                let g = self.given.get(&key.assignment).cloned().unwrap_or_default();
                assert!(!g.terminal, "create for a terminal task {key}");
                assert!(
                    key.attempt >= g.latest,
                    "create for a superseded attempt {key}"
                );
                assert!(!g.claimed, "create for a claimed task {key}");
                assert!(
                    !g.created.contains(&key.attempt) && !self.created_keys.contains(&key),
                    "second workload for {key}"
                );
                assert!(
                    !self.creates.values().any(|k| *k == key),
                    "two creates in flight for {key}"
                );
                if let Some(existing) = self.alive_told(key) {
                    panic!("create for {key} while {existing} exists");
                }
                self.assert_room_for_a_create("create");
                assert_eq!(self.state.debt(), 0, "create while in debt");
                self.creates.insert(delivery, key);
                self.create_calls += 1;
            }
            Effect::CreateWarm { warm } => {
                self.assert_room_for_a_create("warm create");
                assert_eq!(self.state.debt(), 0, "warm create while in debt");
                assert!(self.warm_creates.insert(warm), "warm id {warm} twice");
            }
            Effect::DeleteWarm { workload } => {
                assert!(
                    !self.bound.contains_key(&workload) && !self.announced.contains_key(&workload),
                    "the worker deleted {workload}, a workload the reconciler knows (bound)"
                );
                self.warm_deletes.insert(workload);
            }
            Effect::Delete {
                delivery, workload, ..
            } => {
                self.deletes.insert(delivery, workload);
            }
            Effect::List => self.list = Some((self.now, self.listing())),
            Effect::Publish(event) => self.record(event),
            Effect::Confirm { delivery, events } => {
                for event in events {
                    self.record(event);
                }
                self.settle(delivery, Disposition::Ack);
            }
            Effect::Settle {
                delivery,
                disposition,
            } => self.settle(delivery, disposition),
            Effect::Remember { key, workload } => {
                self.ledger.insert((key, workload));
            }
            Effect::Forget { key, workload } => {
                self.ledger.remove(&(key, workload));
            }
        }
    }

    fn record(&mut self, event: Event) {
        let (key, workload, failure) = match &event {
            Event::Created {
                key,
                workload,
                warm,
            } => {
                let t = self.truth.entry(key.assignment).or_default();
                t.created_attempt = Some(t.created_attempt.unwrap_or(0).max(key.attempt));
                if let Some(warm) = warm {
                    let listed = self.backend.get(workload).map(|w| w.key);
                    assert!(
                        listed.is_none_or(|k| k == AttemptKey::new(*warm, 0)),
                        "{workload} bound as warm {warm} but it is {listed:?}"
                    );
                    if let Some(before) = self.bound.insert(workload.clone(), *key) {
                        assert_eq!(before, *key, "{workload} bound to two attempts");
                    } else {
                        assert!(
                            !self.created_keys.contains(key),
                            "{key} bound to a warm executor after a create"
                        );
                        self.binds += 1;
                    }
                    self.created_keys.insert(*key);
                    self.ever_workload.insert(*key);
                }
                (*key, workload.clone(), false)
            }
            Event::Observed {
                key,
                workload,
                phase,
                ..
            } => (*key, workload.clone(), phase.is_terminal()),
            Event::Released { key, workload } => {
                let keys = self.released.entry(workload.clone()).or_default();
                keys.insert(*key);
                assert_eq!(keys.len(), 1, "{workload} released for two attempts");
                (*key, workload.clone(), true)
            }
        };
        assert!(
            key.attempt > 0,
            "published about an idle warm executor: {event:?}"
        );
        if failure && !self.ever_workload.contains(&key) {
            assert!(
                !self.backpressure_only.get(&key).copied().unwrap_or(false),
                "back-pressure on {key} became a failure: {event:?}"
            );
        }
        self.announced.insert(workload, key);
    }

    fn settle(&mut self, delivery: DeliveryId, disposition: Disposition) {
        let Some((pending, workload)) = self.in_delivery.remove(&delivery) else {
            panic!("delivery {delivery:?} settled twice or never delivered");
        };
        let done = !matches!(disposition, Disposition::Nak(_));
        match pending {
            Pending::Assignment(key) if done => {
                self.messages.remove(&key);
            }
            Pending::Command(_) if done => {
                self.commands.remove(&workload);
            }
            Pending::Assignment(_) | Pending::Command(_) => {}
        }
    }

    fn snapshot(&mut self, id: AssignmentId) {
        let facts = self.truth.get(&id).copied().unwrap_or_default();
        self.history.entry(id).or_default().push(facts);
    }

    fn new_task(&mut self) {
        self.next_task += 1;
        let id = AssignmentId::for_task("https://forge", self.next_task);
        self.truth.insert(
            id,
            BusFacts {
                latest_attempt: Some(1),
                ..BusFacts::default()
            },
        );
        self.snapshot(id);
        self.messages.insert(AttemptKey::new(id, 1));
    }

    fn pick<T: Clone>(items: impl Iterator<Item = T>, i: u8) -> Option<T> {
        let items: Vec<T> = items.collect();
        (!items.is_empty()).then(|| items[usize::from(i) % items.len()].clone())
    }

    fn add_workload(&mut self, key: AttemptKey, ghost: bool) -> String {
        self.next_workload += 1;
        let name = format!("w{}", self.next_workload);
        if !ghost {
            self.ever_workload.insert(key);
        }
        self.backend.insert(
            name.clone(),
            BackendWorkload {
                key,
                phase: WorkloadPhase::Pending,
                ghost_until: ghost.then(|| self.now + GHOST_LIFE),
                deleting: false,
            },
        );
        name
    }

    fn answer_warm(&mut self, a: u8, b: u8) {
        if b.is_multiple_of(2) {
            let Some(warm) = Self::pick(self.warm_creates.iter().copied(), a) else {
                return;
            };
            self.warm_creates.remove(&warm);
            let key = AttemptKey::new(warm, 0);
            let answer = match b % 8 {
                0 | 2 => {
                    let name = self.add_workload(key, false);
                    self.told.insert(name.clone());
                    CreateAnswer::Created(name)
                }
                4 => CreateAnswer::Full {
                    retry_after: Duration::from_secs(u64::from(a % 20)),
                },
                _ => {
                    if a.is_multiple_of(2) {
                        // Made, but the answer was lost.
                        self.add_workload(key, false);
                    }
                    CreateAnswer::Transient { retry_after: None }
                }
            };
            self.feed(Input::WarmCreateAnswered { warm, answer });
        } else {
            let Some(workload) = Self::pick(self.warm_deletes.iter().cloned(), a) else {
                return;
            };
            self.warm_deletes.remove(&workload);
            let answer = if b % 5 == 1 {
                DeleteAnswer::Transient { retry_after: None }
            } else {
                if let Some(w) = self.backend.get_mut(&workload) {
                    w.deleting = true;
                    w.phase = WorkloadPhase::Terminating;
                }
                DeleteAnswer::Deleted
            };
            self.feed(Input::WarmDeleteAnswered { workload, answer });
        }
    }

    fn step(&mut self, (kind, a, b, c): (u8, u8, u8, u8)) {
        match kind % 14 {
            // Another replica came or went, or the share expired: any share, even below
            // what is in use (that is debt).
            13 => {
                self.capacity = usize::from(a) % (self.full_capacity + 1);
                self.feed(Input::Capacity(self.capacity));
            }
            12 => self.answer_warm(a, b),
            // The gated consumer asks for up to a few tickets per pull, and asks again only
            // when it holds none.
            0 if self.tickets.is_empty() => {
                let max = usize::from(a % 4) + 1;
                self.asked.push_back(max);
                self.feed(Input::PullWanted { max });
            }
            0 => {
                if let Some(ticket) = self.tickets.pop() {
                    self.feed(Input::TicketDropped(ticket));
                }
            }
            1 | 2 => self.deliver(a, b, c),
            3 => self.answer_create(a, b, c),
            4 => self.observe(a, b),
            5 => self.delete_command(a, b),
            6 => self.answer_delete(a, b),
            7 => self.finish_deletions(b),
            8 => self.tick(Duration::from_secs(u64::from(a % 10))),
            9 => {
                if let Some((started, listed)) = self.list.take() {
                    for o in &listed {
                        self.told.insert(o.workload.clone());
                    }
                    self.feed(Input::Listed { started, listed });
                }
            }
            10 => self.advance_truth(a, b),
            _ => self.restart(b),
        }
    }

    fn deliver(&mut self, a: u8, b: u8, c: u8) {
        let Some(key) = Self::pick(self.messages.iter().copied(), a) else {
            return;
        };
        let facts = if c.is_multiple_of(3) {
            Self::pick(
                self.history
                    .get(&key.assignment)
                    .into_iter()
                    .flatten()
                    .copied(),
                b,
            )
            .unwrap_or_default()
        } else {
            self.truth.get(&key.assignment).copied().unwrap_or_default()
        };
        let g = self.given.entry(key.assignment).or_default();
        g.latest = g
            .latest
            .max(key.attempt)
            .max(facts.latest_attempt.unwrap_or(0));
        g.terminal |= facts.terminal;
        g.claimed |= facts.claimed_attempt.is_some();
        if let Some(created) = facts.created_attempt {
            g.created.insert(created);
            g.latest = g.latest.max(created);
        }
        let ticket = if b.is_multiple_of(4) {
            None
        } else {
            self.tickets.pop()
        };
        let delivery = self.delivery(Pending::Assignment(key), String::new());
        self.feed(Input::Delivered {
            delivery,
            key,
            ticket,
            facts,
        });
    }

    fn answer_create(&mut self, a: u8, b: u8, c: u8) {
        let Some((delivery, key)) = Self::pick(self.creates.iter().map(|(d, k)| (*d, *k)), a)
        else {
            return;
        };
        self.creates.remove(&delivery);
        let answer = match b % 6 {
            0..=2 => {
                let existing = self
                    .backend
                    .iter()
                    .find(|(_, w)| w.key == key && w.ghost_until.is_none() && !w.deleting)
                    .map(|(n, _)| n.clone());
                let name = existing.unwrap_or_else(|| self.add_workload(key, false));
                self.told.insert(name.clone());
                self.created_keys.insert(key);
                self.backpressure_only.insert(key, false);
                CreateAnswer::Created(name)
            }
            3 => {
                self.backpressure_only.entry(key).or_insert(true);
                if c.is_multiple_of(2) {
                    // OpenSandbox lists its half-made sandbox while the call waits.
                    let ghost = self.add_workload(key, true);
                    if c.is_multiple_of(4) {
                        self.told.insert(ghost.clone());
                        let o = observed(&ghost, &self.backend[&ghost]);
                        self.feed(Input::Observed(o));
                    }
                }
                CreateAnswer::Full {
                    retry_after: Duration::from_secs(u64::from(c % 40)),
                }
            }
            4 => {
                if c.is_multiple_of(3) {
                    // The server made it, but the answer was lost.
                    self.add_workload(key, false);
                    self.backpressure_only.insert(key, false);
                } else {
                    self.backpressure_only.entry(key).or_insert(true);
                }
                CreateAnswer::Transient { retry_after: None }
            }
            _ => {
                self.backpressure_only.insert(key, false);
                CreateAnswer::Refused {
                    message: "bad template".into(),
                }
            }
        };
        self.feed(Input::CreateAnswered {
            delivery,
            key,
            answer,
        });
    }

    fn observe(&mut self, a: u8, b: u8) {
        let Some(name) = Self::pick(self.backend.keys().cloned(), a) else {
            return;
        };
        let w = self.backend.get_mut(&name).expect("picked");
        if b.is_multiple_of(3) && w.ghost_until.is_none() && !w.deleting {
            w.phase = match (w.phase, b % 2) {
                (WorkloadPhase::Pending, _) => WorkloadPhase::Running,
                (WorkloadPhase::Running, 0) => WorkloadPhase::Succeeded,
                (WorkloadPhase::Running, _) => WorkloadPhase::Failed,
                (other, _) => other,
            };
        }
        let o = observed(&name, &self.backend[&name]);
        self.told.insert(name);
        self.feed(Input::Observed(o));
    }

    fn delete_command(&mut self, a: u8, b: u8) {
        let target = if b.is_multiple_of(4) {
            Self::pick(self.commands.iter().map(|(w, k)| (w.clone(), *k)), a)
        } else if b % 7 == 1 {
            // A name nobody made (the reconciler only names workloads it heard of, so an
            // attempt nobody knows).
            let key = AttemptKey::new(AssignmentId::for_task("https://elsewhere", i64::from(a)), 1);
            Some((format!("junk{a}"), key))
        } else {
            Self::pick(self.announced.iter().map(|(w, k)| (w.clone(), *k)), a)
        };
        let Some((workload, key)) = target else {
            return;
        };
        self.commands.insert(workload.clone(), key);
        let delivery = self.delivery(Pending::Command(key), workload.clone());
        self.feed(Input::DeleteRequested {
            delivery,
            key,
            workload,
        });
    }

    fn answer_delete(&mut self, a: u8, b: u8) {
        let Some((delivery, workload)) =
            Self::pick(self.deletes.iter().map(|(d, w)| (*d, w.clone())), a)
        else {
            return;
        };
        self.deletes.remove(&delivery);
        let key = match self.in_delivery.get(&delivery) {
            Some((Pending::Command(key), _)) => *key,
            _ => panic!("delete without its command"),
        };
        let answer = if b.is_multiple_of(4) {
            DeleteAnswer::Transient { retry_after: None }
        } else {
            if let Some(w) = self.backend.get_mut(&workload) {
                w.deleting = true;
                w.phase = WorkloadPhase::Terminating;
            }
            self.deleted.insert(workload.clone());
            DeleteAnswer::Deleted
        };
        self.feed(Input::DeleteAnswered {
            delivery,
            key,
            workload,
            answer,
        });
    }

    fn finish_deletions(&mut self, b: u8) {
        let done: Vec<String> = self
            .backend
            .iter()
            .filter(|(_, w)| w.deleting)
            .map(|(n, _)| n.clone())
            .collect();
        for name in done {
            let mut w = self.backend.remove(&name).expect("listed");
            if b.is_multiple_of(2) {
                w.phase = WorkloadPhase::Gone;
                self.feed(Input::Observed(observed(&name, &w)));
            }
        }
    }

    fn tick(&mut self, by: Duration) {
        // Half-made workloads vanish on their own, well inside the grace.
        let vanish: Vec<String> = self
            .backend
            .iter()
            .filter(|(_, w)| w.ghost_until.is_some_and(|t| t <= self.now + by))
            .map(|(n, _)| n.clone())
            .collect();
        for name in vanish {
            let mut w = self.backend.remove(&name).expect("listed");
            w.phase = WorkloadPhase::Gone;
            self.feed(Input::Observed(observed(&name, &w)));
        }
        self.now += by;
        self.feed(Input::Tick);
    }

    fn advance_truth(&mut self, a: u8, b: u8) {
        let Some(id) = Self::pick(self.truth.keys().copied(), a) else {
            self.new_task();
            return;
        };
        let t = self.truth.get_mut(&id).expect("picked");
        let latest = t.latest_attempt.unwrap_or(1);
        match b % 4 {
            0 if !t.terminal && t.claimed_attempt.is_none() => {
                t.latest_attempt = Some(latest + 1);
                self.messages.insert(AttemptKey::new(id, latest + 1));
            }
            1 => t.terminal = true,
            2 => {
                let key = AttemptKey::new(id, latest);
                if self.backend.iter().any(|(name, w)| {
                    (w.key == key || self.bound.get(name) == Some(&key)) && w.ghost_until.is_none()
                }) {
                    t.claimed_attempt = Some(latest);
                }
            }
            _ => {
                self.new_task();
                return;
            }
        }
        self.snapshot(id);
    }

    fn restart(&mut self, b: u8) {
        // Creates in flight may have made their workload; nobody hears the answer.
        let lost: Vec<AttemptKey> = self.creates.values().copied().collect();
        for key in lost {
            if b.is_multiple_of(2) {
                self.add_workload(key, false);
                self.backpressure_only.insert(key, false);
            }
        }
        let lost_warm: Vec<AssignmentId> = self.warm_creates.iter().copied().collect();
        for warm in lost_warm {
            if b.is_multiple_of(2) {
                self.add_workload(AttemptKey::new(warm, 0), false);
            }
        }
        self.state = WorkerState::new(Self::config(self.capacity, &self.warm));
        self.warm_creates.clear();
        self.warm_deletes.clear();
        self.creates.clear();
        self.deletes.clear();
        self.in_delivery.clear();
        self.tickets.clear();
        self.asked.clear();
        self.list = None;
        self.given.clear();
        self.created_keys.clear();
        self.told.clear();
        self.recover();
    }

    /// Lets everything settle: answer all calls, finish deletions, redeliver commands, list.
    fn drain(&mut self) {
        for _ in 0..6 {
            let creates: Vec<u8> = (0..self.creates.len()).map(|_| 0).collect();
            for _ in creates {
                self.answer_create(0, 0, 1);
            }
            let commands: Vec<(String, AttemptKey)> =
                self.commands.iter().map(|(w, k)| (w.clone(), *k)).collect();
            for (workload, key) in commands {
                let delivery = self.delivery(Pending::Command(key), workload.clone());
                self.feed(Input::DeleteRequested {
                    delivery,
                    key,
                    workload,
                });
            }
            while !self.deletes.is_empty() {
                self.answer_delete(0, 1);
            }
            while !self.warm_creates.is_empty() {
                self.answer_warm(0, 0);
            }
            while !self.warm_deletes.is_empty() {
                self.answer_warm(0, 3);
            }
            self.finish_deletions(1);
            self.tick(Duration::from_secs(16));
            if let Some((_, _)) = self.list.take() {
                let listed = self.listing();
                self.feed(Input::Listed {
                    started: self.now,
                    listed,
                });
            }
        }
    }
}

fn action() -> impl Strategy<Value = (u8, u8, u8, u8)> {
    (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn worker_state_keeps_its_invariants_under_random_interleavings(
        capacity in 1usize..4,
        tasks in 1usize..5,
        adopted in 0usize..5,
        warm_min in 0usize..3,
        warm_extra in 0usize..2,
        steps in proptest::collection::vec(action(), 1..160),
    ) {
        let max_idle = (warm_min + warm_extra).min(capacity);
        let warm = WarmPolicy {
            min_idle: warm_min.min(max_idle),
            max_idle,
            idle_timeout: Duration::from_secs(30),
            max_age: Duration::from_secs(120),
            seed: 9,
        };
        let mut world = World::new(capacity, warm);
        for _ in 0..tasks {
            world.new_task();
        }
        // A restart that adopts more than capacity: announced workloads of older attempts.
        for i in 0..adopted {
            world.new_task();
            let id = AssignmentId::for_task("https://forge", world.next_task);
            let key = AttemptKey::new(id, 1);
            let name = world.add_workload(key, false);
            if i % 2 == 0 {
                world.backend.get_mut(&name).expect("added").phase = WorkloadPhase::Running;
            }
            world.ledger.insert((key, name.clone()));
            world.announced.insert(name, key);
            world.truth.get_mut(&id).expect("task").created_attempt = Some(1);
            world.snapshot(id);
        }
        world.restart(1);
        for step in steps {
            world.step(step);
        }
        world.drain();
        if std::env::var("JR_STATS").is_ok() { eprintln!("STATS creates={} binds={} released={} deleted={} bp={} msgs={}", world.create_calls, world.binds, world.released.len(), world.deleted.len(), world.backpressure_only.values().filter(|v| **v).count(), world.messages.len()); }
        prop_assert!(world.state.debt() > 0 || world.state.used() <= world.capacity,
            "{} slots used with capacity {}", world.state.used(), world.capacity);
        for workload in &world.deleted {
            let released = world.released.get(workload).map_or(0, |k| k.len());
            prop_assert_eq!(released, 1, "deleted {} was released {} times", workload, released);
        }
        prop_assert!(world.in_delivery.values().all(|(p, _)| matches!(p, Pending::Assignment(_))),
            "a command was never settled");
    }
}
