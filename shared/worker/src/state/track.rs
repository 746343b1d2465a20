//! What the backend shows: start-up recovery, watch/poll observations, periodic listings, and
//! the timers (announcing strays, forgetting old facts, resyncing).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use jr_protocol::{Reason, WorkloadPhase};

use super::{AttemptKey, Effect, Event, Stage, WorkerState, Workload};
use crate::backend::ObservedWorkload;

impl WorkerState {
    pub(super) fn recovered(
        &mut self,
        listed: Vec<ObservedWorkload>,
        remembered: Vec<(AttemptKey, String)>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if self.recovered {
            return;
        }
        self.recovered = true;
        self.next_resync = Some(now + self.cfg.resync_every);
        let remembered: BTreeMap<String, AttemptKey> =
            remembered.into_iter().map(|(k, w)| (w, k)).collect();
        let present: BTreeSet<&str> = listed.iter().map(|o| o.workload.as_str()).collect();
        for (workload, key) in &remembered {
            if !present.contains(workload.as_str()) {
                fx.push(Effect::Publish(Event::Observed {
                    key: *key,
                    workload: workload.clone(),
                    phase: WorkloadPhase::Gone,
                    reason: Some(Reason::VanishedWhileWorkerDown.to_string()),
                }));
                self.release(*key, workload.clone(), now, fx);
            }
        }
        for o in listed {
            if o.phase == WorkloadPhase::Gone {
                continue;
            }
            let key = AttemptKey::of(&o);
            let announced = remembered.contains_key(&o.workload);
            let stage = if announced {
                self.had_workload(key, now);
                fx.push(Effect::Publish(Event::Observed {
                    key,
                    workload: o.workload.clone(),
                    phase: o.phase,
                    reason: o.reason.clone(),
                }));
                Stage::Live
            } else {
                Stage::Stray {
                    announce_at: now + self.cfg.stray_grace,
                }
            };
            self.workloads.insert(
                o.workload,
                Workload::new(key, o.phase, o.reason, stage, now),
            );
        }
    }

    /// One observation, as of `as_of` (a listing's start, or now for a watch event).
    pub(super) fn observe(
        &mut self,
        o: ObservedWorkload,
        as_of: Instant,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if self.released.contains_key(&o.workload) {
            return;
        }
        let key = AttemptKey::of(&o);
        if let Some(creating) = self.creating.get_mut(&key) {
            creating.seen.insert(
                o.workload,
                Workload::new(key, o.phase, o.reason, Stage::Live, now),
            );
            return;
        }
        if let Some(w) = self.workloads.get_mut(&o.workload) {
            if w.updated > as_of {
                return;
            }
            if o.phase == WorkloadPhase::Gone {
                self.gone(&o.workload, now, fx);
                return;
            }
            w.phase = o.phase;
            w.reason = o.reason;
            w.updated = now;
            report(w, &o.workload, self.cfg.exit_report_delay, now, fx);
            return;
        }
        if o.phase == WorkloadPhase::Gone {
            return;
        }
        let stage = Stage::Stray {
            announce_at: now + self.cfg.stray_grace,
        };
        self.workloads.insert(
            o.workload,
            Workload::new(key, o.phase, o.reason, stage, now),
        );
    }

    pub(super) fn listed(
        &mut self,
        started: Instant,
        listed: Vec<ObservedWorkload>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        self.listing = false;
        self.next_resync = Some(now + self.cfg.resync_every);
        if !self.recovered {
            return;
        }
        let present: BTreeSet<String> = listed.iter().map(|o| o.workload.clone()).collect();
        let vanished: Vec<String> = self
            .workloads
            .iter()
            .filter(|(name, w)| !present.contains(*name) && w.since < started)
            .map(|(name, _)| name.clone())
            .collect();
        for name in vanished {
            self.gone(&name, now, fx);
        }
        for creating in self.creating.values_mut() {
            for (name, w) in creating.seen.iter_mut() {
                if !present.contains(name) && w.updated < started {
                    w.phase = WorkloadPhase::Gone;
                    w.updated = now;
                }
            }
        }
        for o in listed {
            self.observe(o, started, now, fx);
        }
    }

    /// The backend no longer has `name`: free its slot; announced ones are released.
    pub(super) fn gone(&mut self, name: &str, now: Instant, fx: &mut Vec<Effect>) {
        let Some(w) = self.workloads.remove(name) else {
            return;
        };
        if w.is_announced() {
            // `released` says it is gone; a separate `gone` observation would only repeat it.
            self.release(w.key, name.to_owned(), now, fx);
        }
    }

    /// Publishes `released` (once per workload) and forgets it in the ledger.
    pub(super) fn release(
        &mut self,
        key: AttemptKey,
        workload: String,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        self.released
            .insert(workload.clone(), (key, now + self.cfg.memory));
        fx.push(Effect::Publish(Event::Released {
            key,
            workload: workload.clone(),
        }));
        fx.push(Effect::Forget { key, workload });
    }

    pub(super) fn tick(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        let mut promoted = Vec::new();
        for (name, w) in self.workloads.iter_mut() {
            if let Stage::Stray { announce_at } = w.stage
                && announce_at <= now
                && w.phase != WorkloadPhase::Terminating
            {
                // It stayed: a real workload of ours the reconciler must know about.
                w.stage = Stage::Live;
                w.reported = (w.phase, w.reason.clone());
                w.report_at = None;
                promoted.push(w.key);
                fx.push(Effect::Remember {
                    key: w.key,
                    workload: name.clone(),
                });
                fx.push(Effect::Publish(Event::Observed {
                    key: w.key,
                    workload: name.clone(),
                    phase: w.phase,
                    reason: w.reason.clone(),
                }));
            }
        }
        for key in promoted {
            self.had_workload(key, now);
        }
        for (name, w) in self.workloads.iter_mut() {
            if w.report_at.is_some_and(|at| at <= now) {
                w.report_at = None;
                if w.stage == Stage::Live {
                    publish_observation(w, name, fx);
                }
            }
        }
        self.released.retain(|_, (_, forget_at)| *forget_at > now);
        let memory = self.cfg.memory;
        let busy: BTreeSet<_> = self
            .workloads
            .values()
            .map(|w| w.key.assignment)
            .chain(self.creating.keys().map(|k| k.assignment))
            .collect();
        self.assignments
            .retain(|id, k| busy.contains(id) || k.touched + memory > now);
        if self.paused_until.is_some_and(|until| until <= now) {
            self.paused_until = None;
        }
        if self.recovered && !self.listing && self.next_resync.is_some_and(|at| at <= now) {
            self.listing = true;
            fx.push(Effect::List);
        }
    }
}

/// Whether the reconciler would read `a` and `b` alike: pending, running and terminating
/// (without a reason that explains a problem) all mean "healthy", so moving between them tells
/// it nothing; any other phase, and any change of reason, is news.
pub(super) fn same_news(
    a: &(WorkloadPhase, Option<String>),
    b: &(WorkloadPhase, Option<String>),
) -> bool {
    let healthy = |p: WorkloadPhase| {
        matches!(
            p,
            WorkloadPhase::Pending | WorkloadPhase::Running | WorkloadPhase::Terminating
        )
    };
    a.1 == b.1 && (a.0 == b.0 || (healthy(a.0) && healthy(b.0)))
}

/// Publishes what changed about an announced workload, if it is news to the reconciler. The
/// exit of a live workload is held for `exit_delay` (a `delete-workload` usually overtakes
/// it); while a delete is under way, its expected outcomes (terminating, exited) are not news
/// either: `released` follows.
fn report(w: &mut Workload, name: &str, exit_delay: Duration, now: Instant, fx: &mut Vec<Effect>) {
    let current = (w.phase, w.reason.clone());
    if !w.is_announced() || same_news(&current, &w.reported) {
        w.report_at = None;
        return;
    }
    let exited = w.phase == WorkloadPhase::Succeeded && w.reason.is_none();
    match w.stage {
        Stage::Deleting { .. }
            if exited || (w.phase == WorkloadPhase::Terminating && w.reason.is_none()) =>
        {
            w.report_at = None;
        }
        Stage::Live if exited => {
            w.report_at.get_or_insert(now + exit_delay);
        }
        _ => publish_observation(w, name, fx),
    }
}

fn publish_observation(w: &mut Workload, name: &str, fx: &mut Vec<Effect>) {
    w.report_at = None;
    if same_news(&(w.phase, w.reason.clone()), &w.reported) {
        return;
    }
    w.reported = (w.phase, w.reason.clone());
    fx.push(Effect::Publish(Event::Observed {
        key: w.key,
        workload: name.to_owned(),
        phase: w.phase,
        reason: w.reason.clone(),
    }));
}
