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
        self.adopt(listed, remembered, now, fx);
    }

    /// Takes over workloads another worker process managed (an earlier process of this
    /// replica at start, or a replica that stopped): those it had announced are live and
    /// reported, those it remembered that are gone are released, the rest are strays.
    pub(super) fn adopt(
        &mut self,
        listed: Vec<ObservedWorkload>,
        remembered: Vec<(AttemptKey, String)>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        // A warm executor bound just before a stop may be remembered twice (bound attempt and
        // warm identity): the bound attempt wins.
        let mut by_name: BTreeMap<String, AttemptKey> = BTreeMap::new();
        let mut warm_entries: Vec<(AttemptKey, String)> = Vec::new();
        for (k, w) in remembered {
            if k.attempt == 0 {
                warm_entries.push((k, w.clone()));
            }
            match by_name.get(&w) {
                Some(old) if old.attempt > 0 => {}
                _ => {
                    by_name.insert(w, k);
                }
            }
        }
        let remembered = by_name;
        for (k, w) in warm_entries {
            if remembered.get(&w).is_some_and(|bound| bound.attempt > 0) {
                fx.push(Effect::Forget {
                    key: k,
                    workload: w,
                });
            }
        }
        let present: BTreeSet<&str> = listed.iter().map(|o| o.workload.as_str()).collect();
        for (workload, key) in &remembered {
            if self.workloads.contains_key(workload) || self.released.contains_key(workload) {
                continue;
            }
            if !present.contains(workload.as_str()) && key.attempt == 0 {
                // An idle warm executor that went while the worker was down: nobody else knew it.
                fx.push(Effect::Forget {
                    key: *key,
                    workload: workload.clone(),
                });
            } else if !present.contains(workload.as_str()) {
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
            if o.phase == WorkloadPhase::Gone || self.workloads.contains_key(&o.workload) {
                continue;
            }
            let listed_key = AttemptKey::of(&o);
            let remembered_key = remembered.get(&o.workload).copied();
            if listed_key.attempt == 0 && remembered_key.is_none_or(|k| k.attempt == 0) {
                // An idle warm executor: adopted as one (remembered if a stop came between
                // its create and the ledger write).
                if remembered_key.is_none() {
                    fx.push(Effect::Remember {
                        key: listed_key,
                        workload: o.workload.clone(),
                    });
                }
                self.adopt_idle_warm(o, now);
                continue;
            }
            // A bound warm executor is listed under its warm identity; the ledger names the
            // attempt it serves.
            let key = remembered_key.unwrap_or(listed_key);
            let warm = (listed_key.attempt == 0).then_some(listed_key.assignment);
            let announced = remembered_key.is_some();
            let stage = if announced {
                self.had_workload(key, now);
                if warm.is_some() {
                    // The binding may not have been recorded before the stop.
                    fx.push(Effect::Publish(Event::Created {
                        key,
                        workload: o.workload.clone(),
                        warm,
                    }));
                }
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
            let mut w = Workload::new(key, o.phase, o.reason, stage, now);
            w.warm = warm;
            self.workloads.insert(o.workload, w);
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
        if key.attempt == 0 {
            // A warm executor of ours that is not tracked: one being created right now is
            // tracked when its create answers; any other is adopted (a create whose answer
            // was lost).
            if !self.warm_creating.contains(&key.assignment) {
                fx.push(Effect::Remember {
                    key,
                    workload: o.workload.clone(),
                });
                self.adopt_idle_warm(o, now);
            }
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

    /// Tracks `o` as an idle warm executor (live, as listed).
    fn adopt_idle_warm(&mut self, o: ObservedWorkload, now: Instant) {
        let key = AttemptKey::of(&o);
        let mut w = Workload::new(key, o.phase, o.reason, Stage::Live, now);
        w.warm = Some(key.assignment);
        self.workloads.insert(o.workload, w);
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
        } else if w.is_idle_warm() {
            // Nobody else knew it: only the ledger entry goes. Remembered as gone so a late
            // observation does not bring it back.
            self.released
                .insert(name.to_owned(), (w.key, now + self.cfg.memory));
            fx.push(Effect::Forget {
                key: w.key,
                workload: name.to_owned(),
            });
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
                && !w.is_idle_warm()
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
