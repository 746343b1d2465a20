//! Assignment deliveries and the backend's answers to create calls.

use std::time::Instant;

use jr_bus::Disposition;
use jr_protocol::{Reason, WorkloadPhase};

use super::{
    AttemptKey, BusFacts, CreateAnswer, Creating, DeliveryId, Effect, Event, Stage, TicketId,
    WorkerState,
};
use crate::backend::workload_name;

/// Why a delivered assignment is acknowledged without a create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NoCreate {
    Terminal,
    Superseded,
    HadWorkload,
    Claimed,
}

impl WorkerState {
    pub(super) fn delivered(
        &mut self,
        delivery: DeliveryId,
        key: AttemptKey,
        ticket: Option<TicketId>,
        facts: BusFacts,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if let Some(ticket) = ticket {
            self.tickets.remove(&ticket);
        }
        self.last_activity = Some(now);
        let settle = |disposition| Effect::Settle {
            delivery,
            disposition,
        };
        let no_warm = facts.no_warm;
        let verdict = self.why_not_create(key, facts, now);
        if matches!(verdict, Some(NoCreate::Terminal | NoCreate::Superseded)) {
            fx.push(settle(Disposition::Ack));
            return;
        }
        if self.creating.contains_key(&key) {
            // The same attempt is being created for an earlier delivery; wait for its outcome.
            fx.push(settle(Disposition::Nak(Some(self.cfg.busy_retry))));
            return;
        }
        let had = verdict == Some(NoCreate::HadWorkload);
        if let Some((name, stage, phase, warm)) = self
            .workloads
            .iter()
            .find(|(_, w)| w.key == key)
            .map(|(name, w)| (name.clone(), w.stage, w.phase, w.warm))
        {
            match stage {
                Stage::Live => fx.push(Effect::Confirm {
                    delivery,
                    events: vec![Event::Created {
                        key,
                        workload: name,
                        warm,
                    }],
                }),
                Stage::Deleting { .. } => fx.push(settle(Disposition::Ack)),
                // Not known to have run (still pending, on its way out, or unknown), and
                // nobody was told about it: it may be what a refused create left behind (an
                // OpenSandbox sandbox lingers briefly after a 429). Wait until it either runs
                // or is gone; then it is adopted, or the attempt gets its own workload.
                Stage::Stray { .. }
                    if !had
                        && matches!(
                            phase,
                            WorkloadPhase::Pending
                                | WorkloadPhase::Terminating
                                | WorkloadPhase::Unknown
                        ) =>
                {
                    fx.push(settle(Disposition::Nak(Some(self.cfg.busy_retry))))
                }
                Stage::Stray { .. } => {
                    // Made for this attempt by a call whose answer was lost: it is the one.
                    if let Some(w) = self.workloads.get_mut(&name) {
                        w.stage = Stage::Live;
                    }
                    self.had_workload(key, now);
                    fx.push(Effect::Remember {
                        key,
                        workload: name.clone(),
                    });
                    fx.push(Effect::Confirm {
                        delivery,
                        events: vec![Event::Created {
                            key,
                            workload: name,
                            warm: None,
                        }],
                    });
                }
            }
            return;
        }
        if verdict.is_some() {
            fx.push(settle(Disposition::Ack));
            return;
        }
        // An idle warm executor takes the job: no create call, no new slot.
        if !no_warm && self.bind(delivery, key, now, fx) {
            return;
        }
        if let Some(until) = self.paused_until.filter(|until| *until > now) {
            fx.push(settle(Disposition::Nak(Some(until - now))));
            return;
        }
        if self.used() + self.tickets.len() >= self.cfg.capacity {
            // Idle warm executors hold slots this delivery cannot bind to: one yields.
            if no_warm {
                self.yield_warm(key.assignment, now);
            }
            fx.push(settle(Disposition::Nak(Some(self.cfg.busy_retry))));
            return;
        }
        if no_warm {
            self.yield_used(key.assignment, now);
        }
        self.creating.insert(
            key,
            Creating {
                delivery,
                seen: Default::default(),
            },
        );
        fx.push(Effect::Create { delivery, key });
    }

    /// Merges `facts` into what is known about the assignment and says why this attempt must
    /// not get a workload, if it must not.
    fn why_not_create(
        &mut self,
        key: AttemptKey,
        facts: BusFacts,
        now: Instant,
    ) -> Option<NoCreate> {
        let k = self.know(key.assignment, now);
        k.current = k
            .current
            .max(key.attempt)
            .max(facts.latest_attempt.unwrap_or(0))
            .max(facts.created_attempt.unwrap_or(0));
        k.terminal |= facts.terminal;
        k.claimed |= facts.claimed_attempt.is_some();
        if let Some(created) = facts.created_attempt {
            k.had_workload.insert(created);
        }
        if k.terminal {
            Some(NoCreate::Terminal)
        } else if key.attempt < k.current {
            Some(NoCreate::Superseded)
        } else if k.had_workload.contains(&key.attempt) {
            Some(NoCreate::HadWorkload)
        } else if k.claimed {
            Some(NoCreate::Claimed)
        } else {
            None
        }
    }

    pub(super) fn create_answered(
        &mut self,
        delivery: DeliveryId,
        key: AttemptKey,
        answer: CreateAnswer,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        let Some(creating) = self
            .creating
            .remove(&key)
            .filter(|c| c.delivery == delivery)
        else {
            // Not a call this state started; never act on it twice.
            fx.push(Effect::Settle {
                delivery,
                disposition: Disposition::Nak(Some(self.cfg.busy_retry)),
            });
            return;
        };
        let mut seen = creating.seen;
        match answer {
            CreateAnswer::Created(name) => {
                self.had_workload(key, now);
                let mut events = vec![Event::Created {
                    key,
                    workload: name.clone(),
                    warm: None,
                }];
                match seen.remove(&name) {
                    Some(w) if w.phase == WorkloadPhase::Gone => {
                        // It came up and went while the call was answered.
                        events.push(Event::Released {
                            key,
                            workload: name.clone(),
                        });
                        self.released.insert(name, (key, now + self.cfg.memory));
                    }
                    found => {
                        let (phase, reason) = found
                            .map(|w| (w.phase, w.reason))
                            .unwrap_or((WorkloadPhase::Pending, None));
                        // `workload-created` implies "pending"; anything the backend showed
                        // since is published only if it is news to the reconciler.
                        let observed = (phase, reason.clone());
                        if !super::track::same_news(&observed, &(WorkloadPhase::Pending, None)) {
                            events.push(Event::Observed {
                                key,
                                workload: name.clone(),
                                phase,
                                reason: reason.clone(),
                            });
                        }
                        self.workloads.insert(
                            name.clone(),
                            super::Workload::new(key, phase, reason, Stage::Live, now),
                        );
                        fx.push(Effect::Remember {
                            key,
                            workload: name,
                        });
                    }
                }
                fx.push(Effect::Confirm { delivery, events });
            }
            CreateAnswer::Full { retry_after } => {
                let until = now + retry_after;
                self.paused_until = Some(self.paused_until.map_or(until, |p| p.max(until)));
                fx.push(Effect::Settle {
                    delivery,
                    disposition: Disposition::Nak(Some(retry_after)),
                });
            }
            CreateAnswer::Wait { retry_after } => {
                if !self.park(delivery, retry_after, now) {
                    fx.push(Effect::Settle {
                        delivery,
                        disposition: Disposition::Nak(Some(retry_after)),
                    });
                }
            }
            CreateAnswer::Transient { retry_after } => fx.push(Effect::Settle {
                delivery,
                disposition: Disposition::Nak(Some(
                    retry_after.unwrap_or(self.cfg.transient_retry),
                )),
            }),
            CreateAnswer::Refused { message } => fx.push(Effect::Confirm {
                delivery,
                // Reported as a failed workload so the reconciler retries or fails the task
                // with this reason instead of letting the job wait forever.
                events: vec![Event::Observed {
                    key,
                    workload: workload_name(key.assignment, key.attempt),
                    phase: WorkloadPhase::Failed,
                    reason: Some(Reason::CreateRefused.with_detail(message)),
                }],
            }),
        }
        // Whatever else the backend showed for this attempt while the call ran is not ours
        // yet: tracked (it occupies the backend) but announced only if it stays.
        for (name, mut w) in seen {
            if w.phase != WorkloadPhase::Gone && !self.released.contains_key(&name) {
                w.stage = Stage::Stray {
                    announce_at: now + self.cfg.stray_grace,
                };
                w.since = now;
                self.workloads.insert(name, w);
            }
        }
    }
}
