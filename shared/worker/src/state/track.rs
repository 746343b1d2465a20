//! What the backend shows: start-up recovery, watch/poll observations, periodic listings, and
//! the timers (announcing strays, forgetting old facts, resyncing).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

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
                Workload {
                    key,
                    phase: o.phase,
                    reason: o.reason,
                    stage,
                    since: now,
                    updated: now,
                },
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
                Workload {
                    key,
                    phase: o.phase,
                    reason: o.reason,
                    stage: Stage::Live,
                    since: now,
                    updated: now,
                },
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
            let changed = w.phase != o.phase || w.reason != o.reason;
            // Terminating because we deleted it on the reconciler's command tells nobody
            // anything: `released` follows when it is gone.
            let own_delete =
                o.phase == WorkloadPhase::Terminating && matches!(w.stage, Stage::Deleting { .. });
            w.phase = o.phase;
            w.reason = o.reason.clone();
            w.updated = now;
            if changed && w.is_announced() && !own_delete {
                fx.push(Effect::Publish(Event::Observed {
                    key: w.key,
                    workload: o.workload,
                    phase: o.phase,
                    reason: o.reason,
                }));
            }
            return;
        }
        if o.phase == WorkloadPhase::Gone {
            return;
        }
        self.workloads.insert(
            o.workload,
            Workload {
                key,
                phase: o.phase,
                reason: o.reason,
                stage: Stage::Stray {
                    announce_at: now + self.cfg.stray_grace,
                },
                since: now,
                updated: now,
            },
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
