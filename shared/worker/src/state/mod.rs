//! The worker's decisions as a pure state machine: [`WorkerState::on`] takes one [`Input`] and
//! the current time and returns the [`Effect`]s to perform. No IO, no locks, no clock of its
//! own; the driver performs the effects and feeds their outcomes back as inputs.
//!
//! What it guarantees (property-tested in `tests/properties.rs`):
//! - tracked workloads (being created, live, being deleted) plus reserved pulls never exceed
//!   capacity, except for debt: workloads adopted beyond capacity at start or found later; no
//!   create happens while any debt is left;
//! - no create for an attempt that is superseded, whose task is terminal or claimed, or that
//!   already had a workload; at most one create per attempt in flight;
//! - every delete ends in exactly one `released` for its workload;
//! - "full" (429, quota) only naks the message and pauses pulling: nothing is published that
//!   the reconciler could read as a failure, and no attempt is spent;
//! - warm executors (`warm.rs`) hold slots like any workload; only idle ones are ever retired
//!   by the worker itself, a bound one is a job workload like any other.

mod delete;
mod deliver;
mod track;
mod types;
mod warm;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use jr_protocol::AssignmentId;

pub use types::{
    AttemptKey, BusFacts, CreateAnswer, DeleteAnswer, DeliveryId, Effect, Event, Input, Stage,
    StateConfig, TicketId, WarmPolicy, Workload,
};

/// What the worker has learnt about one assignment.
#[derive(Clone, Debug)]
struct Knowledge {
    /// Highest attempt seen (deliveries and the assignment subject).
    current: u32,
    terminal: bool,
    claimed: bool,
    /// Attempts that had a workload (created or adopted); never created again.
    had_workload: BTreeSet<u32>,
    touched: Instant,
}

/// A create call in flight; it holds a capacity slot.
#[derive(Clone, Debug)]
struct Creating {
    delivery: DeliveryId,
    /// Workloads of this attempt the backend showed while the call ran (not yet ours).
    seen: BTreeMap<String, Workload>,
}

/// Everything the worker knows. See the module docs.
#[derive(Clone, Debug)]
pub struct WorkerState {
    cfg: StateConfig,
    recovered: bool,
    creating: BTreeMap<AttemptKey, Creating>,
    workloads: BTreeMap<String, Workload>,
    tickets: BTreeSet<TicketId>,
    next_ticket: u64,
    /// Waiting pulls, oldest first, each with the most messages it asks for.
    pull_waiters: VecDeque<usize>,
    paused_until: Option<Instant>,
    /// Workloads whose `released` was published, with their attempt, until forgotten.
    released: BTreeMap<String, (AttemptKey, Instant)>,
    assignments: BTreeMap<AssignmentId, Knowledge>,
    listing: bool,
    next_resync: Option<Instant>,
    /// Warm executors whose create call is in flight (each holds a slot).
    warm_creating: BTreeSet<AssignmentId>,
    next_warm: u64,
    /// No new warm executor before this (after a failed create).
    warm_retry_at: Option<Instant>,
    /// Last time the backend was not completely idle (a delivery, a job workload).
    last_activity: Option<Instant>,
    /// Assignments bound to warm executors since start.
    warm_binds: u64,
    /// Slots idle warm executors gave up for deliveries that could not bind to them, each until
    /// when it is kept for such a delivery (not refilled by a warm create meanwhile).
    warm_yielded: Vec<(AssignmentId, Instant)>,
    /// Idle warm executors retired for such deliveries since start.
    warm_yields: u64,
    /// Deliveries whose create answered "wait" (over a fair share), held instead of refused,
    /// each until when at most: released for redelivery as soon as a workload goes (a slot
    /// frees), so waiting work takes a freed slot at once. See [`park`](Self::park).
    parked: Vec<(DeliveryId, Instant)>,
    /// Live worker replicas of the backend: each keeps its part of the warm executors.
    replicas: usize,
}

/// Deliveries parked for their fair share, per slot of the backend, at most.
pub const PARK_PER_SLOT: usize = 4;

impl WorkerState {
    pub fn new(cfg: StateConfig) -> Self {
        Self {
            cfg,
            recovered: false,
            creating: BTreeMap::new(),
            workloads: BTreeMap::new(),
            tickets: BTreeSet::new(),
            next_ticket: 0,
            pull_waiters: VecDeque::new(),
            paused_until: None,
            released: BTreeMap::new(),
            assignments: BTreeMap::new(),
            listing: false,
            next_resync: None,
            warm_creating: BTreeSet::new(),
            next_warm: 0,
            warm_retry_at: None,
            last_activity: None,
            warm_binds: 0,
            warm_yielded: Vec::new(),
            warm_yields: 0,
            parked: Vec::new(),
            replicas: 1,
        }
    }

    /// Handles one input at `now`; returns the effects to perform, in order.
    pub fn on(&mut self, input: Input, now: Instant) -> Vec<Effect> {
        let mut fx = Vec::new();
        let workloads_before = self.workloads.len();
        // Without warm executors configured, only a few inputs can leave idle ones behind
        // (adopted from an earlier configuration): look for them then, not after every input.
        let warm_scan = self.warm_on()
            || matches!(
                input,
                Input::Tick
                    | Input::Recovered { .. }
                    | Input::Adopted { .. }
                    | Input::Replicas(_)
                    | Input::Listed { .. }
            );
        match input {
            Input::Recovered { listed, remembered } => {
                self.recovered(listed, remembered, now, &mut fx)
            }
            Input::Adopted { listed, remembered } => {
                if self.recovered {
                    self.adopt(listed, remembered, now, &mut fx)
                }
            }
            Input::Capacity(slots) => self.cfg.capacity = slots,
            Input::Replicas(n) => self.replicas = n.max(1),
            Input::PullWanted { max } => self.pull_waiters.push_back(max.max(1)),
            Input::TicketDropped(ticket) => {
                self.tickets.remove(&ticket);
            }
            Input::Delivered {
                delivery,
                key,
                ticket,
                facts,
            } => self.delivered(delivery, key, ticket, facts, now, &mut fx),
            Input::CreateAnswered {
                delivery,
                key,
                answer,
            } => self.create_answered(delivery, key, answer, now, &mut fx),
            Input::DeleteRequested {
                delivery,
                key,
                workload,
            } => self.delete_requested(delivery, key, workload, now, &mut fx),
            Input::DeleteAnswered {
                delivery,
                key,
                workload,
                answer,
            } => self.delete_answered(delivery, key, workload, answer, now, &mut fx),
            Input::Observed(o) => {
                if self.recovered {
                    self.observe(o, now, now, &mut fx)
                }
            }
            Input::Listed { started, listed } => self.listed(started, listed, now, &mut fx),
            Input::ListFailed => {
                self.listing = false;
                self.next_resync = Some(now + self.cfg.resync_every);
            }
            Input::WarmCreateAnswered { warm, answer } => {
                self.warm_create_answered(warm, answer, now, &mut fx)
            }
            Input::WarmDeleteAnswered { workload, answer } => {
                self.warm_delete_answered(workload, answer, now, &mut fx)
            }
            Input::Tick => self.tick(now, &mut fx),
        }
        if warm_scan {
            self.maintain_warm(now, &mut fx);
        }
        self.release_parked(self.workloads.len() < workloads_before, now, &mut fx);
        self.grant(now, &mut fx);
        fx
    }

    /// Most deliveries held at once by [`park`](Self::park): [`PARK_PER_SLOT`] per slot (the
    /// assignment consumer runs that many handlers beyond the slots). Beyond it, a delivery that
    /// must wait is refused with its delay.
    fn park_limit(&self) -> usize {
        self.cfg.capacity.max(1).saturating_mul(PARK_PER_SLOT)
    }

    /// A delivery that must wait for its fair share (its create answered `wait`): held, not
    /// refused, until a workload of the backend goes or `retry_after` passes. Refusing it with
    /// a delay would leave a slot freed meanwhile idle until the delay ran out, even when that
    /// repository is the only one with work.
    fn park(&mut self, delivery: DeliveryId, retry_after: Duration, now: Instant) -> bool {
        if self.parked.len() >= self.park_limit() {
            return false;
        }
        self.parked.push((delivery, now + retry_after));
        true
    }

    /// Deliveries parked for their fair share are handed back for redelivery at once (and
    /// decided again, with fresh facts, when they come back) when a workload went (`freed`),
    /// else each when its wait is over. JetStream offers due redeliveries before new messages,
    /// so they come back first.
    fn release_parked(&mut self, freed: bool, now: Instant, fx: &mut Vec<Effect>) {
        if self.parked.is_empty() {
            return;
        }
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|(_, until)| freed || *until <= now);
        self.parked = keep;
        for (delivery, _) in due {
            fx.push(Effect::Settle {
                delivery,
                disposition: jr_bus::Disposition::Nak(None),
            });
        }
    }

    /// Deliveries parked for their fair share.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// Capacity slots held by workloads and create calls.
    pub fn used(&self) -> usize {
        self.creating.len() + self.warm_creating.len() + self.workloads.len()
    }

    pub fn capacity(&self) -> usize {
        self.cfg.capacity
    }

    /// Workloads held beyond capacity (only ever from adoption); pulling waits until it is 0.
    pub fn debt(&self) -> usize {
        self.used().saturating_sub(self.cfg.capacity)
    }

    /// Pull tickets granted and not yet used or returned.
    pub fn reserved(&self) -> usize {
        self.tickets.len()
    }

    pub fn is_ready(&self) -> bool {
        self.recovered
    }

    pub fn is_paused(&self, now: Instant) -> bool {
        self.paused_until.is_some_and(|until| until > now)
    }

    /// Tracked workloads by backend reference.
    pub fn workloads(&self) -> &BTreeMap<String, Workload> {
        &self.workloads
    }

    /// Attempts with a create call in flight.
    pub fn creating(&self) -> impl Iterator<Item = &AttemptKey> {
        self.creating.keys()
    }

    fn know(&mut self, assignment: AssignmentId, now: Instant) -> &mut Knowledge {
        let k = self
            .assignments
            .entry(assignment)
            .or_insert_with(|| Knowledge {
                current: 0,
                terminal: false,
                claimed: false,
                had_workload: BTreeSet::new(),
                touched: now,
            });
        k.touched = now;
        k
    }

    fn had_workload(&mut self, key: AttemptKey, now: Instant) {
        let k = self.know(key.assignment, now);
        k.current = k.current.max(key.attempt);
        k.had_workload.insert(key.attempt);
    }

    /// Hands out pull tickets while a slot is free, nothing is paused and no debt is left: each
    /// waiting pull in turn gets as many as it asked for and the free slots allow.
    /// Slots held by idle warm executors are free for pulls (a delivery binds one instead of
    /// creating), and slots the warm minimum still needs are not.
    fn grant(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        let (bindable, needed) = if self.warm_on() {
            (self.bindable(now), self.warm_needed(now))
        } else {
            (0, 0)
        };
        while self.recovered && !self.is_paused(now) {
            let free = (self.cfg.capacity + bindable)
                .saturating_sub(self.used() + self.tickets.len() + needed);
            if free == 0 {
                return;
            }
            let Some(max) = self.pull_waiters.pop_front() else {
                return;
            };
            let granted = (0..max.min(free))
                .map(|_| {
                    self.next_ticket += 1;
                    let ticket = TicketId(self.next_ticket);
                    self.tickets.insert(ticket);
                    ticket
                })
                .collect();
            fx.push(Effect::GrantPull(granted));
        }
    }
}

#[cfg(test)]
mod tests;
