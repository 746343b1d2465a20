//! The fake's world: tokens, runner groups, scale sets with their sessions and message queues,
//! jobs and JIT runners. Pure state transitions under one lock; the HTTP layer (`server.rs`)
//! checks credentials and shapes answers.

use std::collections::{BTreeMap, VecDeque};

use serde_json::{Value, json};

/// One job as a test enqueues it: what GitHub knows when the workflow run is queued.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub owner: String,
    pub repository: String,
    /// File name under `.github/workflows/`.
    pub workflow_file: String,
    /// The ref of `jobWorkflowRef` (`refs/heads/main`, `refs/pull/7/merge`, …).
    pub git_ref: String,
    /// `push`, `pull_request`, `pull_request_target`, …
    pub event_name: String,
    /// The job's `runs-on`.
    pub labels: Vec<String>,
    pub display_name: String,
    /// The run's head repository is a fork of `owner/repository`.
    pub from_fork: bool,
}

impl JobSpec {
    /// A push to `main` of `acme/app` that runs on `labels`.
    pub fn push(labels: &[&str]) -> JobSpec {
        JobSpec {
            owner: "acme".into(),
            repository: "app".into(),
            workflow_file: "ci.yml".into(),
            git_ref: "refs/heads/main".into(),
            event_name: "push".into(),
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
            display_name: "build".into(),
            from_fork: false,
        }
    }
}

/// Where a job is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    /// No scale set matches its labels yet.
    Queued,
    /// Offered to a scale set (`JobAvailable`), waiting to be acquired.
    Available { scale_set: i64 },
    /// Assigned to a scale set (`JobAssigned`), waiting for one of its runners.
    Assigned { scale_set: i64 },
    /// A runner of the scale set took it (`JobStarted`).
    Running { scale_set: i64, runner: i64 },
    /// Over (`JobCompleted`, or cancelled before any scale set saw it).
    Completed { result: String },
}

#[derive(Clone, Debug)]
pub struct Job {
    /// How the fake and its tests know the job.
    pub request_id: i64,
    /// The `runnerRequestId` its messages carry: `request_id`, or 0 when it was queued while
    /// [`World::zero_request_ids`] was on.
    pub message_request_id: i64,
    pub job_id: String,
    pub run_id: i64,
    pub spec: JobSpec,
    pub state: JobState,
    /// Times it was assigned to a scale set (a runner that never started makes it go again).
    pub assignments: u32,
    /// A cancel arrived while it ran: the runner's finish reports `canceled`.
    pub cancel_requested: bool,
    /// The runner that took it, if one did.
    pub runner: Option<i64>,
    /// Its runner went silent while it ran ([`World::runner_lost_after`]): it ended `failed`.
    pub runner_lost: bool,
}

#[derive(Clone, Debug)]
pub struct Session {
    pub id: String,
    pub owner: String,
    pub queue_token: String,
}

/// One message on a scale set's queue: a batch of job messages.
#[derive(Clone, Debug)]
pub struct QueueMessage {
    pub id: i64,
    pub body: Vec<Value>,
}

#[derive(Clone, Debug)]
pub struct ScaleSet {
    pub id: i64,
    pub name: String,
    pub group_id: i64,
    pub labels: Vec<String>,
    pub session: Option<Session>,
    /// Formed messages not yet deleted, oldest first.
    pub queue: VecDeque<QueueMessage>,
    /// Job messages not yet in a formed message.
    pub pending: Vec<Value>,
    /// `X-ScaleSetMaxCapacity` of the last poll: github.com assigns no more jobs to the scale
    /// set than that many at once.
    pub max_capacity: Option<u64>,
}

impl ScaleSet {
    fn accepts(&self, labels: &[String]) -> bool {
        labels.iter().all(|l| {
            l.eq_ignore_ascii_case(&self.name)
                || self.labels.iter().any(|s| s.eq_ignore_ascii_case(l))
        })
    }
}

#[derive(Clone, Debug)]
pub struct Runner {
    pub id: i64,
    pub name: String,
    pub scale_set: i64,
    pub encoded_jit_config: String,
    /// The JIT config was used to start it (it works once).
    pub started: bool,
    pub job: Option<i64>,
    /// When the runner last talked to the service (started, polled, renewed its job).
    pub last_seen: Option<std::time::Instant>,
}

/// Everything the fake knows.
#[derive(Debug, Default)]
pub struct World {
    pub groups: BTreeMap<i64, String>,
    pub scale_sets: BTreeMap<i64, ScaleSet>,
    pub jobs: BTreeMap<i64, Job>,
    pub runners: BTreeMap<i64, Runner>,
    /// Runners removed (by the client or after their job), kept for checks.
    pub removed_runners: Vec<Runner>,
    pub next_id: i64,
    pub next_message_id: i64,
    /// GHES style: jobs are offered (`JobAvailable`) and must be acquired; github.com assigns
    /// them directly (`JobAssigned`).
    pub acquire_step: bool,
    /// Most jobs one acquire call grants (fewer than asked when lower).
    pub acquire_limit: Option<usize>,
    /// Per scale set: the most jobs assigned to it or running on it at once.
    pub peak_open: BTreeMap<i64, usize>,
    /// Jobs queued now carry `runnerRequestId` 0 in their messages and are known by `jobId`
    /// only, as github.com has sent them since 2025 (garm PR #459).
    pub zero_request_ids: bool,
    /// A runner silent this long while it runs a job is lost: the job ends `failed` and the
    /// runner is removed, as GitHub does when a runner stops renewing its job. `None`: never.
    pub runner_lost_after: Option<std::time::Duration>,
}

/// Times a job is assigned before it stays cancelled (a runner never started each time).
pub const MAX_ASSIGNMENTS: u32 = 3;
/// Most job messages in one queue message.
pub const MAX_BATCH: usize = 50;

impl World {
    pub fn new() -> World {
        let mut world = World {
            next_id: 100,
            next_message_id: 1,
            ..World::default()
        };
        world.groups.insert(1, "Default".into());
        world
    }

    pub fn fresh_id(&mut self) -> i64 {
        self.next_id += 1;
        self.next_id
    }

    /// A job message of `kind` for `job` (the fields every type carries, plus `extra`).
    fn job_message(job: &Job, kind: &str, extra: Value) -> Value {
        let mut message = json!({
            "messageType": kind,
            "runnerRequestId": job.message_request_id,
            "jobId": job.job_id,
            "repositoryName": job.spec.repository,
            "ownerName": job.spec.owner,
            "jobWorkflowRef": format!(
                "{}/{}/.github/workflows/{}@{}",
                job.spec.owner, job.spec.repository, job.spec.workflow_file, job.spec.git_ref
            ),
            "jobDisplayName": job.spec.display_name,
            "workflowRunId": job.run_id,
            "eventName": job.spec.event_name,
            "requestLabels": job.spec.labels,
            "queueTime": "2026-12-05T10:00:00Z",
            "scaleSetAssignTime": "0001-01-01T00:00:00Z",
            "runnerAssignTime": "0001-01-01T00:00:00Z",
            "finishTime": "0001-01-01T00:00:00Z",
        });
        if let (Some(m), Value::Object(extra)) = (message.as_object_mut(), extra) {
            m.extend(extra);
        }
        message
    }

    fn push(&mut self, scale_set: i64, message: Value) {
        if let Some(set) = self.scale_sets.get_mut(&scale_set) {
            set.pending.push(message);
        }
    }

    /// Offers or assigns `request_id` to the first scale set that accepts its labels.
    fn route(&mut self, request_id: i64) {
        let Some(job) = self.jobs.get(&request_id) else {
            return;
        };
        let Some(set) = self
            .scale_sets
            .values()
            .find(|s| s.accepts(&job.spec.labels))
            .map(|s| s.id)
        else {
            return;
        };
        if self.acquire_step {
            let message = Self::job_message(
                job,
                "JobAvailable",
                json!({
                    "acquireJobUrl": format!("_apis/runtime/runnerscalesets/{set}/acquirejobs"),
                }),
            );
            self.push(set, message);
            if let Some(job) = self.jobs.get_mut(&request_id) {
                job.state = JobState::Available { scale_set: set };
            }
        } else if self.has_capacity(set) {
            self.assign(request_id, set);
        }
        // Else it stays queued until the scale set has room (see `route_queued`).
    }

    /// Whether github.com would assign one more job to `set`: fewer jobs assigned or running
    /// than the `X-ScaleSetMaxCapacity` its listener last sent (no limit before the first poll).
    fn has_capacity(&self, set: i64) -> bool {
        let Some(max) = self.scale_sets.get(&set).and_then(|s| s.max_capacity) else {
            return true;
        };
        let held = self
            .jobs
            .values()
            .filter(|j| match j.state {
                JobState::Assigned { scale_set } | JobState::Running { scale_set, .. } => {
                    scale_set == set
                }
                _ => false,
            })
            .count();
        (held as u64) < max
    }

    fn assign(&mut self, request_id: i64, set: i64) {
        let Some(job) = self.jobs.get_mut(&request_id) else {
            return;
        };
        job.state = JobState::Assigned { scale_set: set };
        job.assignments += 1;
        let message = Self::job_message(job, "JobAssigned", json!({}));
        self.push(set, message);
        let open = self
            .jobs
            .values()
            .filter(|j| match j.state {
                JobState::Assigned { scale_set } | JobState::Running { scale_set, .. } => {
                    scale_set == set
                }
                _ => false,
            })
            .count();
        let peak = self.peak_open.entry(set).or_default();
        *peak = (*peak).max(open);
    }

    pub fn enqueue(&mut self, spec: JobSpec) -> i64 {
        let request_id = self.fresh_id();
        let run_id = self.fresh_id() * 10;
        let message_request_id = if self.zero_request_ids { 0 } else { request_id };
        self.jobs.insert(
            request_id,
            Job {
                request_id,
                message_request_id,
                job_id: uuid::Uuid::new_v4().to_string(),
                run_id,
                spec,
                state: JobState::Queued,
                assignments: 0,
                cancel_requested: false,
                runner: None,
                runner_lost: false,
            },
        );
        self.route(request_id);
        request_id
    }

    /// Routes jobs that no scale set accepted when they were queued (after a scale set appears).
    pub fn route_queued(&mut self) {
        let queued: Vec<i64> = self
            .jobs
            .values()
            .filter(|j| j.state == JobState::Queued)
            .map(|j| j.request_id)
            .collect();
        for id in queued {
            self.route(id);
        }
    }

    fn complete(&mut self, request_id: i64, result: &str, runner: Option<&Runner>) {
        let Some(job) = self.jobs.get_mut(&request_id) else {
            return;
        };
        let set = match job.state {
            JobState::Available { scale_set }
            | JobState::Assigned { scale_set }
            | JobState::Running { scale_set, .. } => Some(scale_set),
            JobState::Queued | JobState::Completed { .. } => None,
        };
        job.state = JobState::Completed {
            result: result.to_owned(),
        };
        if let Some(set) = set {
            let extra = match runner {
                Some(r) => json!({"result": result, "runnerId": r.id, "runnerName": r.name}),
                None => json!({"result": result, "runnerId": 0, "runnerName": ""}),
            };
            let message = Self::job_message(job, "JobCompleted", extra);
            self.push(set, message);
        }
    }

    /// The workflow run was cancelled. A running job ends when its runner reports.
    pub fn cancel(&mut self, request_id: i64) {
        self.cancel_one(request_id);
        self.route_queued();
    }

    fn cancel_one(&mut self, request_id: i64) {
        let Some(job) = self.jobs.get_mut(&request_id) else {
            return;
        };
        match job.state {
            JobState::Running { .. } => job.cancel_requested = true,
            JobState::Completed { .. } => {}
            JobState::Queued | JobState::Available { .. } | JobState::Assigned { .. } => {
                self.complete(request_id, "canceled", None);
            }
        }
    }

    /// No runner took the assigned job in time: `JobCompleted{canceled}`, then the job is
    /// assigned again, at most [`MAX_ASSIGNMENTS`] times in all.
    pub fn assignment_lapsed(&mut self, request_id: i64) -> bool {
        let Some(job) = self.jobs.get(&request_id) else {
            return false;
        };
        let JobState::Assigned { scale_set } = job.state else {
            return false;
        };
        let again = job.assignments < MAX_ASSIGNMENTS;
        let message = Self::job_message(
            job,
            "JobCompleted",
            json!({"result": "canceled", "runnerId": 0, "runnerName": ""}),
        );
        self.push(scale_set, message);
        if again {
            if let Some(job) = self.jobs.get_mut(&request_id) {
                job.state = JobState::Queued;
            }
            self.route(request_id);
        } else if let Some(job) = self.jobs.get_mut(&request_id) {
            job.state = JobState::Completed {
                result: "canceled".into(),
            };
        }
        true
    }

    /// Acquires what it can of `ids` for `set`: only jobs offered to it, at most `acquire_limit`.
    pub fn acquire(&mut self, set: i64, ids: &[i64]) -> Vec<i64> {
        let mut granted = Vec::new();
        for id in ids {
            if self
                .acquire_limit
                .is_some_and(|limit| granted.len() >= limit)
            {
                break;
            }
            // Jobs are acquired by the `runnerRequestId` their offer carried; one offered
            // with 0 cannot be named.
            let offered = self.jobs.get(id).is_some_and(|j| {
                j.message_request_id == *id && j.state == JobState::Available { scale_set: set }
            });
            if offered && !granted.contains(id) {
                self.assign(*id, set);
                granted.push(*id);
            }
        }
        granted
    }

    /// A JIT runner started with `encoded`: takes the oldest job assigned to its scale set.
    /// `Err` when the config is unknown or was used already.
    pub fn runner_started(&mut self, encoded: &str) -> Result<Option<(i64, i64)>, &'static str> {
        let Some(runner) = self
            .runners
            .values_mut()
            .find(|r| r.encoded_jit_config == encoded)
        else {
            return Err("unknown or removed JIT config");
        };
        if runner.started {
            return Err("JIT config already used");
        }
        runner.started = true;
        runner.last_seen = Some(std::time::Instant::now());
        let runner = runner.clone();
        Ok(self.take_job(&runner).map(|job| (runner.id, job)))
    }

    /// A started runner without a job looks again (the real runner keeps polling).
    pub fn runner_poll(&mut self, runner_id: i64) -> Option<i64> {
        if let Some(r) = self.runners.get_mut(&runner_id) {
            r.last_seen = Some(std::time::Instant::now());
        }
        let runner = self.runners.get(&runner_id)?.clone();
        if !runner.started || runner.job.is_some() {
            return runner.job;
        }
        self.take_job(&runner)
    }

    fn take_job(&mut self, runner: &Runner) -> Option<i64> {
        let job = self
            .jobs
            .values()
            .filter(|j| {
                j.state
                    == JobState::Assigned {
                        scale_set: runner.scale_set,
                    }
            })
            .map(|j| j.request_id)
            .next()?;
        if let Some(j) = self.jobs.get_mut(&job) {
            j.state = JobState::Running {
                scale_set: runner.scale_set,
                runner: runner.id,
            };
            j.runner = Some(runner.id);
            let message = Self::job_message(
                j,
                "JobStarted",
                json!({"runnerId": runner.id, "runnerName": runner.name}),
            );
            self.push(runner.scale_set, message);
        }
        if let Some(r) = self.runners.get_mut(&runner.id) {
            r.job = Some(job);
        }
        Some(job)
    }

    /// The runner's job ended with `result`; the ephemeral runner is removed.
    pub fn runner_finished(&mut self, runner_id: i64, result: &str) -> Result<(), &'static str> {
        let Some(runner) = self.runners.get(&runner_id).cloned() else {
            return Err("unknown runner");
        };
        let Some(job) = runner.job else {
            return Err("runner has no job");
        };
        let result = if self.jobs.get(&job).is_some_and(|j| j.cancel_requested) {
            "canceled"
        } else {
            result
        };
        self.complete(job, result, Some(&runner));
        if let Some(r) = self.runners.remove(&runner_id) {
            self.removed_runners.push(r);
        }
        self.route_queued();
        Ok(())
    }

    /// Ends the jobs of runners silent past [`World::runner_lost_after`]: `JobCompleted
    /// {failed}` naming the runner, which is removed. `true` when one was.
    pub fn sweep_lost_runners(&mut self, now: std::time::Instant) -> bool {
        let Some(after) = self.runner_lost_after else {
            return false;
        };
        let lost: Vec<Runner> = self
            .runners
            .values()
            .filter(|r| {
                r.job.is_some()
                    && r.last_seen
                        .is_some_and(|seen| now.duration_since(seen) > after)
            })
            .cloned()
            .collect();
        for runner in &lost {
            if let Some(job) = runner.job {
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.runner_lost = true;
                }
                self.complete(job, "failed", Some(runner));
            }
            if let Some(r) = self.runners.remove(&runner.id) {
                self.removed_runners.push(r);
            }
        }
        if !lost.is_empty() {
            self.route_queued();
        }
        !lost.is_empty()
    }

    pub fn statistics(&self, set: i64) -> Value {
        let count =
            |f: &dyn Fn(&JobState) -> bool| self.jobs.values().filter(|j| f(&j.state)).count();
        let available = count(&|s| *s == JobState::Available { scale_set: set });
        let assigned = count(&|s| *s == JobState::Assigned { scale_set: set });
        let running =
            count(&|s| matches!(s, JobState::Running { scale_set, .. } if *scale_set == set));
        let runners: Vec<&Runner> = self
            .runners
            .values()
            .filter(|r| r.scale_set == set)
            .collect();
        let busy = runners.iter().filter(|r| r.job.is_some()).count();
        json!({
            "totalAvailableJobs": available,
            "totalAcquiredJobs": assigned + running,
            "totalAssignedJobs": assigned + running,
            "totalRunningJobs": running,
            "totalRegisteredRunners": runners.len(),
            "totalBusyRunners": busy,
            "totalIdleRunners": runners.len() - busy,
        })
    }

    /// The next message for a poll that processed up to `last`: an undeleted one after `last`,
    /// else a new one formed from pending job messages (at most [`MAX_BATCH`]).
    pub fn next_message(&mut self, set: i64, last: i64) -> Option<QueueMessage> {
        let next_id = self.next_message_id;
        let s = self.scale_sets.get_mut(&set)?;
        if let Some(m) = s.queue.iter().find(|m| m.id > last) {
            return Some(m.clone());
        }
        if s.pending.is_empty() {
            return None;
        }
        let take = s.pending.len().min(MAX_BATCH);
        let body: Vec<Value> = s.pending.drain(..take).collect();
        let message = QueueMessage { id: next_id, body };
        s.queue.push_back(message.clone());
        self.next_message_id += 1;
        Some(message)
    }

    pub fn delete_message(&mut self, set: i64, id: i64) -> bool {
        let Some(s) = self.scale_sets.get_mut(&set) else {
            return false;
        };
        let before = s.queue.len();
        s.queue.retain(|m| m.id != id);
        s.queue.len() != before
    }
}
