//! Test helpers (feature `testkit`): envelope builders for one assignment and a seeded generator
//! of messy but plausible histories (duplicates, stale and out-of-order observations, leaks).

use jr_protocol::{
    Assignment, AssignmentId, BackendName, Claimed, Envelope, ExecutorFinished, Message,
    Redispatched, Released, SealedTask, TaskFailed, TaskResult, Terminal, TerminalSource,
    TokenHash, WorkloadCreated, WorkloadObserved, WorkloadPhase, WorkloadRequested,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Builds the messages of one assignment.
#[derive(Clone, Debug)]
pub struct Builder {
    pub id: AssignmentId,
    pub backend: BackendName,
    pub forge_task_id: i64,
}

impl Builder {
    pub fn new(forge_task_id: i64, backend: &str) -> Self {
        let backend = BackendName::new(backend).unwrap_or_else(|e| panic!("testkit backend: {e}"));
        Self {
            id: AssignmentId::for_task("https://forge.test", forge_task_id),
            backend,
            forge_task_id,
        }
    }

    pub fn workload(&self, attempt: u32) -> String {
        format!("jr-{}-{attempt}", self.id)
    }

    fn envelope(&self, attempt: u32, at: u64, message: Message) -> Envelope {
        let id = format!("{}:{}:{attempt}:{at}", message.kind(), self.id);
        Envelope::new(id, at, self.id, attempt, message)
    }

    pub fn assignment(&self, attempt: u32, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::Assignment(Assignment {
                forge_instance: "https://forge.test".into(),
                forge_task_id: self.forge_task_id,
                backend: self.backend.clone(),
                provider: None,
                // Attempt 1 carries the scheduler's decision, a redispatch none.
                placement: (attempt == 1).then(|| "trusted: push to org/repo".to_owned()),
                labels: vec![self.backend.to_string(), "self-hosted".into()],
                repository: "org/repo".into(),
                workflow: None,
                job_name: format!("job-{}", self.forge_task_id),
                max_duration_secs: 3600,
                fetched_at: at.saturating_sub(5),
                sealed_task: SealedTask {
                    key_id: "k1".into(),
                    nonce: vec![0; 24],
                    ciphertext: vec![1, 2, 3],
                },
            }),
        )
    }

    pub fn requested(&self, attempt: u32, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::WorkloadRequested(WorkloadRequested {
                backend: self.backend.clone(),
                workload: self.workload(attempt),
                token_hash: TokenHash::from_published(format!("hash-{attempt}")),
                worker_id: "worker-1".into(),
            }),
        )
    }

    pub fn created(&self, attempt: u32, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::WorkloadCreated(WorkloadCreated {
                backend: self.backend.clone(),
                workload: self.workload(attempt),
                token_hash: TokenHash::from_published(format!("hash-{attempt}")),
                worker_id: "worker-1".into(),
                warm: None,
            }),
        )
    }

    /// `workload-created` of an arbitrary workload reference (a provider's `<provider>/<name>`).
    pub fn created_ref(&self, attempt: u32, workload: &str, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::WorkloadCreated(WorkloadCreated {
                backend: self.backend.clone(),
                workload: workload.to_owned(),
                token_hash: TokenHash::from_published(format!("hash-{attempt}")),
                worker_id: "worker-1".into(),
                warm: None,
            }),
        )
    }

    pub fn observed(
        &self,
        attempt: u32,
        at: u64,
        phase: WorkloadPhase,
        reason: Option<&str>,
    ) -> Envelope {
        self.observed_ref(attempt, &self.workload(attempt), at, phase, reason)
    }

    /// An observation of an arbitrary workload reference attributed to `attempt`.
    pub fn observed_ref(
        &self,
        attempt: u32,
        workload: &str,
        at: u64,
        phase: WorkloadPhase,
        reason: Option<&str>,
    ) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::WorkloadObserved(WorkloadObserved {
                backend: self.backend.clone(),
                workload: workload.to_owned(),
                phase,
                reason: reason.map(str::to_owned),
            }),
        )
    }

    pub fn claimed(&self, attempt: u32, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::Claimed(Claimed {
                forge_task_id: self.forge_task_id,
                executor: "token".into(),
            }),
        )
    }

    pub fn terminal(&self, attempt: u32, at: u64, log_closed: bool) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::Terminal(Terminal {
                forge_task_id: self.forge_task_id,
                result: TaskResult::Success,
                source: TerminalSource::Executor,
                log_closed,
                reason: None,
            }),
        )
    }

    /// The terminal marker the scheduler writes after executing `fail-task`.
    pub fn terminal_failed(&self, attempt: u32, at: u64, reason: &str) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::Terminal(Terminal {
                forge_task_id: self.forge_task_id,
                result: TaskResult::Failure,
                source: TerminalSource::FailTask,
                log_closed: true,
                reason: Some(reason.to_owned()),
            }),
        )
    }

    pub fn executor_finished(&self, attempt: u32, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::ExecutorFinished(ExecutorFinished {
                forge_task_id: self.forge_task_id,
            }),
        )
    }

    pub fn released(&self, attempt: u32, at: u64) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::Released(Released {
                backend: self.backend.clone(),
                workload: self.workload(attempt),
            }),
        )
    }

    pub fn redispatched(&self, from_attempt: u32, at: u64, reason: &str) -> Envelope {
        self.envelope(
            from_attempt,
            at,
            Message::Redispatched(Redispatched {
                next_attempt: from_attempt + 1,
                reason: reason.to_owned(),
            }),
        )
    }

    pub fn task_failed(&self, attempt: u32, at: u64, reason: &str) -> Envelope {
        self.envelope(
            attempt,
            at,
            Message::TaskFailed(TaskFailed {
                forge_task_id: self.forge_task_id,
                reason: reason.to_owned(),
            }),
        )
    }
}

/// A history split the way JetStream stores it: assignment messages on one stream, events on the
/// other, each with its own sequence numbers (1-based, ascending).
#[derive(Clone, Debug, Default)]
pub struct History {
    pub assignments: Vec<(u64, Envelope)>,
    pub events: Vec<(u64, Envelope)>,
}

pub const ASSIGNMENTS_STREAM: &str = "JR_ASSIGNMENTS";
pub const EVENTS_STREAM: &str = "JR_EVENTS";

impl History {
    /// Both streams in one order (all assignments, then all events) with their stream names.
    pub fn streams(&self) -> [(&'static str, &[(u64, Envelope)]); 2] {
        [
            (ASSIGNMENTS_STREAM, &self.assignments),
            (EVENTS_STREAM, &self.events),
        ]
    }
}

/// A seeded random history over `count` assignments. Deliberately messy: duplicated messages,
/// observations published late (older `occurred_at` after newer ones), events of an attempt
/// before its assignment message, leaked workloads observed after release, redispatches and
/// failures. Only the relative order inside each stream is fixed.
pub fn random_history(seed: u64, count: usize) -> History {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut assignments: Vec<Envelope> = Vec::new();
    let mut events: Vec<(u64, Envelope)> = Vec::new(); // (publish order key, envelope)
    let phases = [
        WorkloadPhase::Pending,
        WorkloadPhase::Running,
        WorkloadPhase::Succeeded,
        WorkloadPhase::Failed,
        WorkloadPhase::Terminating,
        WorkloadPhase::Gone,
        WorkloadPhase::Unknown,
    ];
    for n in 0..count {
        let b = Builder::new(
            1000 + n as i64,
            if rng.random_bool(0.5) { "pod" } else { "vm" },
        );
        let mut t = 1_700_000_000_000 + rng.random_range(0..60_000u64);
        let attempts = rng.random_range(1..=3u32);
        let claim_attempt = rng.random_range(1..=attempts + 1); // attempts + 1 = never claimed
        for attempt in 1..=attempts {
            assignments.push(b.assignment(attempt, t));
            if rng.random_bool(0.1) {
                assignments.push(b.assignment(attempt, t)); // duplicate publish
            }
            let mut push = |e: Envelope, rng: &mut StdRng| {
                // Publishing lag: an event may land after events that happened later.
                let key = e.occurred_at + rng.random_range(0..3_000);
                events.push((key, e));
            };
            t += rng.random_range(100..2_000);
            if rng.random_bool(0.9) {
                push(b.requested(attempt, t), &mut rng);
            }
            t += rng.random_range(100..2_000);
            if rng.random_bool(0.85) {
                push(b.created(attempt, t), &mut rng);
            }
            for _ in 0..rng.random_range(0..4) {
                t += rng.random_range(1..5_000);
                let phase = phases[rng.random_range(0..phases.len())];
                let reason = match rng.random_range(0..6) {
                    0 => Some(crate::REASON_BACKEND_UNREACHABLE),
                    1 => Some("evicted"),
                    _ => None,
                };
                push(b.observed(attempt, t, phase, reason), &mut rng);
            }
            if attempt == claim_attempt {
                t += rng.random_range(100..2_000);
                push(b.claimed(attempt, t), &mut rng);
                if rng.random_bool(0.1) {
                    push(b.claimed(attempt, t + 1), &mut rng); // refused second claim, projected anyway
                }
                if rng.random_bool(0.7) {
                    t += rng.random_range(1_000..60_000);
                    push(b.terminal(attempt, t, rng.random_bool(0.5)), &mut rng);
                    if rng.random_bool(0.6) {
                        push(b.executor_finished(attempt, t + 50), &mut rng);
                    }
                } else if rng.random_bool(0.5) {
                    t += rng.random_range(1_000..60_000);
                    push(b.task_failed(attempt, t, "workload-lost"), &mut rng);
                }
            } else if attempt < attempts {
                t += rng.random_range(100..2_000);
                push(b.redispatched(attempt, t, "claim-timeout"), &mut rng);
            } else if rng.random_bool(0.3) {
                t += rng.random_range(100..2_000);
                push(b.task_failed(attempt, t, "max-attempts"), &mut rng);
            }
            if rng.random_bool(0.7) {
                t += rng.random_range(100..5_000);
                push(b.released(attempt, t), &mut rng);
                if rng.random_bool(0.1) {
                    // A leak: the workload shows up again after its release.
                    push(
                        b.observed(attempt, t + 10, WorkloadPhase::Running, None),
                        &mut rng,
                    );
                }
            }
            if rng.random_bool(0.05) {
                let dup = events[rng.random_range(0..events.len())].clone();
                events.push(dup);
            }
        }
    }
    events.sort_by_key(|(key, _)| *key);
    // Assignment messages are published in fetch order but interleave across assignments.
    assignments.sort_by_key(|e| e.occurred_at);
    History {
        assignments: assignments
            .into_iter()
            .enumerate()
            .map(|(i, e)| (i as u64 + 1, e))
            .collect(),
        events: events
            .into_iter()
            .enumerate()
            .map(|(i, (_, e))| (i as u64 + 1, e))
            .collect(),
    }
}
