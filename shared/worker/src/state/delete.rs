//! `delete-workload` commands and the backend's answers to delete calls.

use std::time::Instant;

use jr_bus::Disposition;

use super::{AttemptKey, DeleteAnswer, DeliveryId, Effect, Event, Stage, WorkerState};

impl WorkerState {
    pub(super) fn delete_requested(
        &mut self,
        delivery: DeliveryId,
        key: AttemptKey,
        workload: String,
        _now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        let idle_warm = self
            .workloads
            .get(&workload)
            .is_some_and(|w| w.is_idle_warm())
            || self
                .released
                .get(&workload)
                .is_some_and(|(k, _)| k.attempt == 0);
        if idle_warm {
            self.refuse_idle_warm_delete(delivery, fx);
            return;
        }
        if let Some((released_key, _)) = self.released.get(&workload) {
            // Already gone and released: say so again (same message id, deduplicated).
            fx.push(Effect::Confirm {
                delivery,
                events: vec![Event::Released {
                    key: *released_key,
                    workload,
                }],
            });
            return;
        }
        if self.creating.contains_key(&key) {
            // Racing the create of its own attempt: decide once the create has answered.
            fx.push(Effect::Settle {
                delivery,
                disposition: Disposition::Nak(Some(self.cfg.busy_retry)),
            });
            return;
        }
        let Some(w) = self.workloads.get_mut(&workload) else {
            // Not tracked: delete it anyway (the backend refuses what is not ours); `released`
            // follows the call, since no slot and no watch will report it.
            fx.push(Effect::Delete {
                delivery,
                key,
                workload,
            });
            return;
        };
        match w.stage {
            // Another command for a workload already being deleted: `released` follows the
            // first one.
            Stage::Deleting {
                call_in_flight: true,
            } => fx.push(Effect::Settle {
                delivery,
                disposition: Disposition::Ack,
            }),
            Stage::Stray { .. } | Stage::Live | Stage::Deleting { .. } => {
                if !w.is_announced() {
                    // The reconciler knows it, so its end must be reported, also after a restart.
                    fx.push(Effect::Remember {
                        key: w.key,
                        workload: workload.clone(),
                    });
                }
                w.stage = Stage::Deleting {
                    call_in_flight: true,
                };
                fx.push(Effect::Delete {
                    delivery,
                    key: w.key,
                    workload,
                });
            }
        }
    }

    pub(super) fn delete_answered(
        &mut self,
        delivery: DeliveryId,
        key: AttemptKey,
        workload: String,
        answer: DeleteAnswer,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        let settle = |disposition| Effect::Settle {
            delivery,
            disposition,
        };
        match answer {
            DeleteAnswer::Deleted => match self.workloads.get_mut(&workload) {
                Some(w) => {
                    if !w.is_announced() {
                        fx.push(Effect::Remember {
                            key: w.key,
                            workload: workload.clone(),
                        });
                    }
                    // Released when the backend reports it gone.
                    w.stage = Stage::Deleting {
                        call_in_flight: false,
                    };
                    fx.push(settle(Disposition::Ack));
                }
                None if self.released.contains_key(&workload) => fx.push(settle(Disposition::Ack)),
                None => {
                    // Untracked: nothing will report it gone, so it is released now.
                    self.released
                        .insert(workload.clone(), (key, now + self.cfg.memory));
                    fx.push(Effect::Confirm {
                        delivery,
                        events: vec![Event::Released { key, workload }],
                    });
                }
            },
            DeleteAnswer::Transient { retry_after } => {
                self.delete_call_ended(&workload);
                fx.push(settle(Disposition::Nak(Some(
                    retry_after.unwrap_or(self.cfg.busy_retry),
                ))));
            }
            DeleteAnswer::Refused { message } => {
                self.delete_call_ended(&workload);
                fx.push(settle(Disposition::Term(format!(
                    "delete refused: {message}"
                ))));
            }
        }
    }

    fn delete_call_ended(&mut self, workload: &str) {
        if let Some(w) = self.workloads.get_mut(workload)
            && let Stage::Deleting { call_in_flight } = &mut w.stage
        {
            *call_in_flight = false;
        }
    }
}
