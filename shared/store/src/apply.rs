//! Folding one envelope into an [`AssignmentRecord`]. The rules are chosen so that:
//! - replaying a message changes nothing (first-wins for once-only facts, min/max for times);
//! - the assignments stream and the events stream touch disjoint facts (or merge with min/max),
//!   so how the two streams interleave does not change the result;
//! - a stale observation (older `occurred_at`, or equal with a lower sequence) never replaces a
//!   newer one, and it only ever touches the workload and attempt it names.

use jr_protocol::{BackendName, Envelope, Message, WorkloadObserved};

use crate::model::{
    AssignmentInfo, AssignmentRecord, AttemptRecord, ClaimRecord, FailureRecord, Observation,
    RedispatchRecord, TerminalRecord, WorkloadRecord,
};

fn min_time(current: Option<u64>, at: u64) -> Option<u64> {
    Some(current.map_or(at, |c| c.min(at)))
}

impl AssignmentRecord {
    /// Applies one message with stream sequence `seq`. Commands (`delete-workload`, `fail-task`,
    /// `redispatch`) are not projected and leave the record untouched.
    pub fn apply(&mut self, seq: u64, envelope: &Envelope) {
        let at = envelope.occurred_at;
        let attempt = envelope.attempt;
        match &envelope.message {
            Message::Assignment(a) => {
                let highest_published = self
                    .attempts
                    .values()
                    .filter(|r| r.published_at.is_some())
                    .map(|r| r.attempt)
                    .max();
                if highest_published.is_none_or(|h| attempt >= h) {
                    let placement = a
                        .placement
                        .clone()
                        .or_else(|| self.info.as_ref().and_then(|i| i.placement.clone()));
                    self.info = Some(AssignmentInfo {
                        forge_instance: a.forge_instance.clone(),
                        forge_task_id: a.forge_task_id,
                        backend: a.backend.clone(),
                        provider: a.provider.clone(),
                        placement,
                        labels: a.labels.clone(),
                        repository: a.repository.clone(),
                        job_name: a.job_name.clone(),
                        max_duration_secs: a.max_duration_secs,
                        fetched_at: a.fetched_at,
                    });
                }
                let record = self.attempt_mut(attempt);
                record.published_at = min_time(record.published_at, at);
                if record.backend.is_none() {
                    record.backend = Some(a.backend.clone());
                }
            }
            Message::WorkloadRequested(r) => {
                let record = self.attempt_mut(attempt);
                record.requested_at = min_time(record.requested_at, at);
                if record.created_at.is_none() {
                    record.backend.get_or_insert_with(|| r.backend.clone());
                    record.workload.get_or_insert_with(|| r.workload.clone());
                    record
                        .token_hash
                        .get_or_insert_with(|| r.token_hash.to_string());
                    record.worker_id.get_or_insert_with(|| r.worker_id.clone());
                }
            }
            Message::WorkloadCreated(c) => {
                let record = self.attempt_mut(attempt);
                if record.created_at.is_none() {
                    record.created_at = Some(at);
                    record.backend = Some(c.backend.clone());
                    record.workload = Some(c.workload.clone());
                    record.token_hash = Some(c.token_hash.to_string());
                    record.worker_id = Some(c.worker_id.clone());
                }
                let workload = self.workload_mut(&c.backend, &c.workload, attempt, at);
                workload.created_at = min_time(workload.created_at, at);
            }
            Message::WorkloadObserved(o) => self.observe(seq, at, attempt, o),
            Message::Claimed(c) => {
                self.claim.get_or_insert_with(|| ClaimRecord {
                    attempt,
                    forge_task_id: c.forge_task_id,
                    executor: c.executor.clone(),
                    claimed_at: at,
                });
            }
            Message::Terminal(t) => {
                let marker = self.terminal.get_or_insert_with(TerminalRecord::default);
                if marker.result.is_none() {
                    marker.attempt = Some(attempt);
                    marker.forge_task_id = Some(t.forge_task_id);
                    marker.result = Some(t.result);
                    marker.source = Some(t.source);
                    marker.log_closed = t.log_closed;
                    marker.reason = t.reason.clone();
                    marker.at = Some(at);
                }
            }
            Message::ExecutorFinished(e) => {
                let marker = self.terminal.get_or_insert_with(TerminalRecord::default);
                marker.executor_finished_at = min_time(marker.executor_finished_at, at);
                marker.forge_task_id.get_or_insert(e.forge_task_id);
            }
            Message::Released(r) => {
                let workload = self.workload_mut(&r.backend, &r.workload, attempt, at);
                workload.released_at = Some(workload.released_at.map_or(at, |t| t.max(at)));
                let record = self.attempt_mut(attempt);
                record.backend.get_or_insert_with(|| r.backend.clone());
                record.workload.get_or_insert_with(|| r.workload.clone());
            }
            Message::Redispatched(r) => {
                self.redispatches
                    .entry(r.next_attempt)
                    .or_insert_with(|| RedispatchRecord {
                        from_attempt: attempt,
                        next_attempt: r.next_attempt,
                        reason: r.reason.clone(),
                        at,
                    });
            }
            Message::TaskFailed(f) => {
                self.failure.get_or_insert_with(|| FailureRecord {
                    attempt,
                    forge_task_id: f.forge_task_id,
                    reason: f.reason.clone(),
                    failed_at: at,
                });
            }
            Message::DeleteWorkload(_) | Message::FailTask(_) | Message::Redispatch(_) => return,
        }
        self.updated_at = self.updated_at.max(at);
    }

    fn observe(&mut self, seq: u64, at: u64, attempt: u32, o: &WorkloadObserved) {
        let workload = self.workload_mut(&o.backend, &o.workload, attempt, at);
        let newer = workload
            .observation
            .as_ref()
            .is_none_or(|prev| (at, seq) > (prev.at, prev.seq));
        if !newer {
            return;
        }
        let unreachable = o.reason.as_deref() == Some(crate::model::REASON_BACKEND_UNREACHABLE);
        let unreachable_since = match (&workload.observation, unreachable) {
            (_, false) => None,
            (Some(prev), true) if prev.is_unreachable() => prev.unreachable_since.or(Some(prev.at)),
            (_, true) => Some(at),
        };
        workload.observation = Some(Observation {
            phase: o.phase,
            reason: o.reason.clone(),
            at,
            seq,
            unreachable_since,
        });
        let record = self.attempt_mut(attempt);
        if record.created_at.is_none() {
            // Until `workload-created` names it, the observed workload is the attempt's best
            // reference (better than the requested name, which a backend may replace by an id).
            record.backend = Some(o.backend.clone());
            record.workload = Some(o.workload.clone());
        }
    }

    fn attempt_mut(&mut self, attempt: u32) -> &mut AttemptRecord {
        self.attempts
            .entry(attempt)
            .or_insert_with(|| AttemptRecord {
                attempt,
                ..AttemptRecord::default()
            })
    }

    fn workload_mut(
        &mut self,
        backend: &BackendName,
        workload: &str,
        attempt: u32,
        at: u64,
    ) -> &mut WorkloadRecord {
        let record = self
            .workloads
            .entry((backend.clone(), workload.to_owned()))
            .or_insert_with(|| WorkloadRecord {
                backend: backend.clone(),
                workload: workload.to_owned(),
                attempt,
                first_seen: at,
                created_at: None,
                observation: None,
                released_at: None,
            });
        record.first_seen = record.first_seen.min(at);
        record
    }
}
