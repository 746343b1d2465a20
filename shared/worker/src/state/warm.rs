//! Warm executors: workloads started ahead of demand, each holding a slot, bound to the next
//! assignment the worker pulls instead of a create call.
//!
//! A warm executor's identity is attempt 0 of a fresh warm id (real attempts start at 1), so
//! backends create, name, list and delete it like any workload and its executor token is the
//! usual HMAC over (warm id, 0). While idle it is the worker's own business: nothing is
//! published about it and the reconciler never hears of it. Binding turns it into the
//! workload of the delivered attempt (`workload-created` naming the warm id); from then on it
//! is a job workload like any other, deleted only by the reconciler's commands.
//!
//! Rules (each property- or unit-tested):
//! - only idle warm executors are ever deleted by the worker: when dead (exited, failed),
//!   older than `max_age`, beyond the target, or to pay slot debt;
//! - the target is `max_idle` while the backend is busy and back to `min_idle` only after it
//!   was completely idle (no job workload, no delivery) for `idle_timeout`;
//! - the target is derived again after every input, so nothing drifts (after a restart the
//!   adopted warm executors count, the missing ones are made);
//! - warm creates respect capacity like job creates; the slots the target still needs are
//!   kept from pulls, and idle warm executors' slots are offered to pulls (a delivery binds);
//! - warm capacity yields: a delivery that cannot bind (a runner-bound forge's runner) and finds
//!   no free slot retires one idle warm executor, and that slot is kept for such a delivery
//!   (not refilled) for [`YIELD_HOLD`], so warm executors never starve work they cannot take.

use std::time::{Duration, Instant};

use jr_bus::Disposition;
use jr_protocol::{AssignmentId, WorkloadPhase};

use super::{
    AttemptKey, CreateAnswer, DeleteAnswer, DeliveryId, Effect, Event, Stage, WorkerState, Workload,
};

/// Delay before a warm create is tried again after a refusal or an error without a hint.
const WARM_RETRY: Duration = Duration::from_secs(5);
const WARM_REFUSED_RETRY: Duration = Duration::from_secs(60);
/// How long after an accepted delete an idle warm executor still listed is deleted again.
const RETIRE_AGAIN: Duration = Duration::from_secs(30);
/// How long a slot a warm executor yielded is kept for the delivery that could not bind.
pub const YIELD_HOLD: Duration = Duration::from_secs(30);

impl WorkerState {
    /// Whether the backend keeps warm executors at all.
    pub(super) fn warm_on(&self) -> bool {
        self.cfg.warm.max_idle > 0
    }

    /// Idle warm executors a delivery could be bound to now.
    pub(super) fn bindable(&self, now: Instant) -> usize {
        self.workloads
            .values()
            .filter(|w| self.can_bind(w, now))
            .count()
    }

    fn can_bind(&self, w: &Workload, now: Instant) -> bool {
        w.is_idle_warm()
            && w.stage == Stage::Live
            && w.retire_at.is_none()
            && matches!(w.phase, WorkloadPhase::Running | WorkloadPhase::Pending)
            && w.reason.is_none()
            && w.since + self.cfg.warm.max_age > now
    }

    /// Idle warm executors (live, not being retired) plus warm creates in flight.
    fn warm_idle(&self) -> usize {
        self.workloads
            .values()
            .filter(|w| w.is_idle_warm() && w.stage == Stage::Live && w.retire_at.is_none())
            .count()
            + self.warm_creating.len()
    }

    /// The idle warm count wanted now: this replica's part (rounded up) of the backend's
    /// `max_idle` while busy, of `min_idle` once idle.
    pub fn warm_target(&self, now: Instant) -> usize {
        let warm = &self.cfg.warm;
        let busy = self
            .last_activity
            .is_some_and(|at| at + warm.idle_timeout > now);
        let whole = if busy { warm.max_idle } else { warm.min_idle };
        whole.div_ceil(self.replicas.max(1))
    }

    /// Warm executors still to be made to reach the target, less the slots yielded to
    /// deliveries that cannot bind.
    pub(super) fn warm_needed(&self, now: Instant) -> usize {
        let yielded = self
            .warm_yielded
            .iter()
            .filter(|(_, until)| *until > now)
            .count();
        self.warm_target(now)
            .saturating_sub(self.warm_idle())
            .saturating_sub(yielded)
    }

    /// Idle warm executors retired for deliveries that could not bind, since start.
    pub fn warm_yields(&self) -> u64 {
        self.warm_yields
    }

    /// The delivery of `assignment`, which cannot bind to a warm executor, found no free
    /// slot: the newest idle warm executor that is not already going is retired, and its slot
    /// kept for such a delivery. Once per waiting assignment (it comes back after its Nak).
    pub(super) fn yield_warm(&mut self, assignment: AssignmentId, now: Instant) {
        self.warm_yielded.retain(|(_, until)| *until > now);
        if self.warm_yielded.iter().any(|(a, _)| *a == assignment) {
            return;
        }
        let pick = self
            .workloads
            .iter()
            .filter(|(_, w)| w.is_idle_warm() && w.stage == Stage::Live && w.retire_at.is_none())
            .max_by_key(|(_, w)| w.since)
            .map(|(name, _)| name.clone());
        let Some(name) = pick else {
            return;
        };
        if let Some(w) = self.workloads.get_mut(&name) {
            w.retire_at = Some(now);
        }
        self.warm_yielded.push((assignment, now + YIELD_HOLD));
        self.warm_yields += 1;
    }

    /// A delivery of `assignment` that could not bind got a slot: the slot yielded for it (or,
    /// if none was, the oldest yielded one) is used.
    pub(super) fn yield_used(&mut self, assignment: AssignmentId, now: Instant) {
        self.warm_yielded.retain(|(_, until)| *until > now);
        let at = self
            .warm_yielded
            .iter()
            .position(|(a, _)| *a == assignment)
            .or((!self.warm_yielded.is_empty()).then_some(0));
        if let Some(at) = at {
            self.warm_yielded.remove(at);
        }
    }

    /// Idle warm executors (live, healthy or not, not being retired).
    pub fn warm_idle_count(&self) -> usize {
        self.workloads
            .values()
            .filter(|w| w.is_idle_warm() && w.stage == Stage::Live && w.retire_at.is_none())
            .count()
    }

    /// Job workloads that started as warm executors.
    pub fn warm_bound_count(&self) -> usize {
        self.workloads
            .values()
            .filter(|w| w.warm.is_some() && !w.is_idle_warm())
            .count()
    }

    /// Assignments bound to a warm executor since start.
    pub fn warm_binds(&self) -> u64 {
        self.warm_binds
    }

    /// Binds the delivered attempt to an idle warm executor, if there is one: the workload
    /// becomes the attempt's, `workload-created` (naming the warm id) is confirmed and the
    /// delivery acked. Returns whether it did.
    pub(super) fn bind(
        &mut self,
        delivery: DeliveryId,
        key: AttemptKey,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) -> bool {
        if !self.warm_on() {
            return false;
        }
        // A running one first (its executor is already polling), the oldest first.
        let pick = self
            .workloads
            .iter()
            .filter(|(_, w)| self.can_bind(w, now))
            .min_by_key(|(_, w)| (w.phase != WorkloadPhase::Running, w.since))
            .map(|(name, _)| name.clone());
        let Some(name) = pick else {
            return false;
        };
        let Some(w) = self.workloads.get_mut(&name) else {
            return false;
        };
        let warm_key = w.key;
        let warm = warm_key.assignment;
        w.key = key;
        w.warm = Some(warm);
        // `workload-created` implies "pending" to the reconciler.
        w.reported = (WorkloadPhase::Pending, None);
        w.report_at = None;
        self.warm_binds += 1;
        self.had_workload(key, now);
        // The ledger holds the bound attempt before the warm entry goes: a restart in between
        // finds both and keeps the binding.
        fx.push(Effect::Remember {
            key,
            workload: name.clone(),
        });
        fx.push(Effect::Forget {
            key: warm_key,
            workload: name.clone(),
        });
        fx.push(Effect::Confirm {
            delivery,
            events: vec![Event::Created {
                key,
                workload: name,
                warm: Some(warm),
            }],
        });
        true
    }

    /// Makes the idle warm count follow the target: retires dead, old and surplus idle
    /// executors and creates missing ones while slots allow. Runs after every input.
    pub(super) fn maintain_warm(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        if !self.recovered {
            return;
        }
        let busy = !self.creating.is_empty() || self.workloads.values().any(|w| !w.is_idle_warm());
        if busy {
            self.last_activity = Some(now);
        }
        let target = self.warm_target(now);
        let max_age = self.cfg.warm.max_age;
        // Dead or too old to take a job: replaced.
        let mut retire: Vec<String> = self
            .workloads
            .iter()
            .filter(|(_, w)| w.is_idle_warm() && w.stage == Stage::Live && w.retire_at.is_none())
            .filter(|(_, w)| {
                matches!(
                    w.phase,
                    WorkloadPhase::Succeeded | WorkloadPhase::Failed | WorkloadPhase::Terminating
                ) || w.reason.is_some()
                    || w.since + max_age <= now
            })
            .map(|(name, _)| name.clone())
            .collect();
        // Surplus beyond the target, and slot debt: the newest idle ones go.
        let mut idle: Vec<(Instant, String)> = self
            .workloads
            .iter()
            .filter(|(name, w)| {
                w.is_idle_warm()
                    && w.stage == Stage::Live
                    && w.retire_at.is_none()
                    && !retire.contains(name)
            })
            .map(|(name, w)| (w.since, name.clone()))
            .collect();
        idle.sort();
        let surplus = (idle.len() + self.warm_creating.len()).saturating_sub(target);
        let debt = self.debt().saturating_sub(retire.len());
        let drop = surplus.max(debt).min(idle.len());
        retire.extend(idle.into_iter().rev().take(drop).map(|(_, name)| name));
        for name in retire {
            if let Some(w) = self.workloads.get_mut(&name) {
                w.retire_at = Some(now);
            }
        }
        // Issue (or repeat) the delete calls that are due.
        for (name, w) in self.workloads.iter_mut() {
            if w.is_idle_warm()
                && w.retire_at.is_some_and(|at| at <= now)
                && w.stage
                    != (Stage::Deleting {
                        call_in_flight: true,
                    })
            {
                w.stage = Stage::Deleting {
                    call_in_flight: true,
                };
                w.retire_at = Some(now + RETIRE_AGAIN);
                fx.push(Effect::DeleteWarm {
                    workload: name.clone(),
                });
            }
        }
        if self.is_paused(now) || self.debt() > 0 || self.warm_retry_at.is_some_and(|at| at > now) {
            return;
        }
        let uncovered = self.tickets.len().saturating_sub(self.bindable(now));
        let free = self.cfg.capacity.saturating_sub(self.used() + uncovered);
        for _ in 0..self.warm_needed(now).min(free) {
            let warm = self.next_warm_id();
            self.warm_creating.insert(warm);
            fx.push(Effect::CreateWarm { warm });
        }
    }

    fn next_warm_id(&mut self) -> AssignmentId {
        self.next_warm += 1;
        let hi = splitmix(self.cfg.warm.seed ^ self.next_warm.rotate_left(32));
        let lo = splitmix(hi ^ self.next_warm);
        // A version 4 UUID shape (random bits from the seeded mix).
        let bits =
            (u128::from(hi) << 64 | u128::from(lo)) & !(0xf000u128 << 64) | (0x4000u128 << 64);
        let bits = bits & !(0xc000u128 << 48) | (0x8000u128 << 48);
        AssignmentId(uuid::Uuid::from_u128(bits))
    }

    pub(super) fn warm_create_answered(
        &mut self,
        warm: AssignmentId,
        answer: CreateAnswer,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if !self.warm_creating.remove(&warm) {
            return;
        }
        let key = AttemptKey::new(warm, 0);
        match answer {
            CreateAnswer::Created(name) => {
                if self.released.contains_key(&name) {
                    return;
                }
                let mut w = Workload::new(key, WorkloadPhase::Pending, None, Stage::Live, now);
                if let Some(seen) = self.workloads.get(&name) {
                    // Observed while the call ran (tracked as a stray until now).
                    w.phase = seen.phase;
                    w.reason = seen.reason.clone();
                }
                w.warm = Some(warm);
                w.reported = (w.phase, w.reason.clone());
                self.workloads.insert(name.clone(), w);
                fx.push(Effect::Remember {
                    key,
                    workload: name,
                });
            }
            CreateAnswer::Full { retry_after } => {
                let until = now + retry_after;
                self.paused_until = Some(self.paused_until.map_or(until, |p| p.max(until)));
            }
            CreateAnswer::Wait { retry_after } => {
                self.warm_retry_at = Some(now + retry_after);
            }
            CreateAnswer::Transient { retry_after } => {
                self.warm_retry_at = Some(now + retry_after.unwrap_or(WARM_RETRY));
            }
            CreateAnswer::Refused { .. } => {
                self.warm_retry_at = Some(now + WARM_REFUSED_RETRY);
            }
        }
    }

    pub(super) fn warm_delete_answered(
        &mut self,
        workload: String,
        answer: DeleteAnswer,
        now: Instant,
        _fx: &mut Vec<Effect>,
    ) {
        let Some(w) = self.workloads.get_mut(&workload) else {
            return;
        };
        if !w.is_idle_warm() {
            return;
        }
        w.stage = Stage::Deleting {
            call_in_flight: false,
        };
        w.retire_at = Some(
            now + match answer {
                // Gone when the backend says so; asked again if it is still listed by then.
                DeleteAnswer::Deleted => RETIRE_AGAIN,
                DeleteAnswer::Transient { retry_after } => retry_after.unwrap_or(WARM_RETRY),
                DeleteAnswer::Refused { .. } => WARM_REFUSED_RETRY,
            },
        );
    }

    /// A `delete-workload` naming an idle warm executor: no attempt owns it, so the command
    /// is not for it.
    pub(super) fn refuse_idle_warm_delete(&self, delivery: DeliveryId, fx: &mut Vec<Effect>) {
        fx.push(Effect::Settle {
            delivery,
            disposition: Disposition::Term(
                "delete refused: the workload is an idle warm executor, bound to no attempt"
                    .to_owned(),
            ),
        });
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
