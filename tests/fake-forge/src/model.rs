//! Public, serialisable types: what callers enqueue and what they read back for invariant checks.

use std::collections::BTreeMap;
use std::time::SystemTime;

use jr_forge::proto::runner::v1 as pb;
use serde::{Deserialize, Serialize};

/// Identifier of a queued job (one job = one single-job workflow run).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub u64);

impl std::fmt::Display for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A job to put in the queue. Every field has a default so admin callers can send `{}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct JobSpec {
    /// `owner/name`.
    pub repo: String,
    /// Job name; also the (slugged) job key in the workflow YAML.
    pub name: String,
    /// `runs-on` labels; a runner must declare all of them.
    pub runs_on: Vec<String>,
    /// Configuration variables (`vars` context).
    pub vars: BTreeMap<String, String>,
    /// Extra secrets besides `GITHUB_TOKEN`/`GITEA_TOKEN`.
    pub secrets: BTreeMap<String, String>,
    /// Number of steps in the workflow YAML (step ids 0..steps).
    pub steps: u32,
    /// The run was triggered by a pull request from this fork (`owner/name`): the context's
    /// `event_name` is `pull_request` and its event payload names the fork as the head
    /// repository, as the forge does. `None`: a push to the repository itself.
    pub pull_request_from_fork: Option<String>,
}

impl Default for JobSpec {
    fn default() -> Self {
        Self {
            repo: "example/repo".to_owned(),
            name: "build".to_owned(),
            runs_on: Vec::new(),
            vars: BTreeMap::new(),
            secrets: BTreeMap::new(),
            steps: 1,
            pull_request_from_fork: None,
        }
    }
}

/// A final result (the non-`UNSPECIFIED` values of `runner.v1.Result`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Success,
    Failure,
    Cancelled,
    Skipped,
}

impl Outcome {
    /// `None` for `RESULT_UNSPECIFIED`; `Err(())` for a value outside the enum.
    pub(crate) fn from_proto(value: i32) -> Result<Option<Self>, i32> {
        match pb::Result::try_from(value) {
            Ok(pb::Result::Unspecified) => Ok(None),
            Ok(pb::Result::Success) => Ok(Some(Self::Success)),
            Ok(pb::Result::Failure) => Ok(Some(Self::Failure)),
            Ok(pb::Result::Cancelled) => Ok(Some(Self::Cancelled)),
            Ok(pb::Result::Skipped) => Ok(Some(Self::Skipped)),
            Err(_) => Err(value),
        }
    }

    pub(crate) fn to_proto(self) -> pb::Result {
        match self {
            Self::Success => pb::Result::Success,
            Self::Failure => pb::Result::Failure,
            Self::Cancelled => pb::Result::Cancelled,
            Self::Skipped => pb::Result::Skipped,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Failure => "failure",
            Self::Cancelled => "cancelled",
            Self::Skipped => "skipped",
        }
    }
}

/// Lifecycle position of a job, task or step as seen in a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Waiting,
    Running,
    Done(Outcome),
}

impl Status {
    pub fn is_final(self) -> bool {
        matches!(self, Self::Done(_))
    }
}

/// Why a task stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopCause {
    /// The runner reported a final result through UpdateTask.
    Runner,
    /// `cancel_task`/`cancel_job` (user cancel).
    Cancelled,
    /// No UpdateTask for longer than the zombie timeout.
    Zombie,
    /// Running longer than the endless timeout.
    Endless,
}

/// Everything the fake knows, for invariant checks.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub tasks_version: i64,
    pub runners: Vec<RunnerView>,
    pub jobs: Vec<JobView>,
    pub tasks: Vec<TaskView>,
    pub faults: FaultCounters,
}

impl Snapshot {
    pub fn job(&self, id: JobId) -> Option<&JobView> {
        self.jobs.iter().find(|j| j.id == id)
    }

    pub fn task(&self, id: i64) -> Option<&TaskView> {
        self.tasks.iter().find(|t| t.id == id)
    }

    /// Jobs still waiting for a runner.
    pub fn queued_count(&self) -> usize {
        self.jobs
            .iter()
            .filter(|j| j.status == Status::Waiting)
            .count()
    }

    /// Every job has a final result (vacuously true with no jobs).
    pub fn all_final(&self) -> bool {
        self.jobs.iter().all(|j| j.status.is_final())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerView {
    pub id: i64,
    pub uuid: String,
    pub name: String,
    pub version: String,
    pub labels: Vec<String>,
    pub ephemeral: bool,
    /// Soft-deleted (ephemeral runner after its task, or `remove_runner`).
    pub deleted: bool,
    /// Last authenticated call of any kind.
    pub last_online: SystemTime,
    /// Last authenticated UpdateTask/UpdateLog.
    pub last_active: Option<SystemTime>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    pub id: JobId,
    pub repo: String,
    pub name: String,
    pub runs_on: Vec<String>,
    pub status: Status,
    /// Number of times a task was created for this job (1 + re-runs).
    pub attempt: u32,
    /// Number of times FetchTask handed this job out. Must equal `attempt`.
    pub fetch_count: u32,
    /// Set when the abandoned-job reaper cancelled it while waiting.
    pub abandoned: bool,
    pub task_ids: Vec<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskView {
    pub id: i64,
    pub job_id: JobId,
    pub attempt: u32,
    pub runner_uuid: String,
    pub runner_name: String,
    pub status: Status,
    pub stop_cause: Option<StopCause>,
    /// Server pick time.
    pub started_at: SystemTime,
    /// Runner-reported `stopped_at` (epoch if it sent none) or the server's stop time.
    pub stopped_at: Option<SystemTime>,
    /// How often FetchTask returned this task (always 1 here; > 1 would be a bug).
    pub handed_out: u32,
    /// UpdateTask calls without a final result.
    pub heartbeats: u32,
    /// The result of every UpdateTask call that carried a final result, in arrival order.
    pub final_reports: Vec<Outcome>,
    /// How many of those calls moved the task to final (0 or 1).
    pub final_accepted: u32,
    pub log: Vec<String>,
    pub log_archived: bool,
    pub outputs: BTreeMap<String, String>,
    pub steps: Vec<StepView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepView {
    pub index: u32,
    pub status: Status,
    pub log_index: i64,
    pub log_length: i64,
}

/// Counts of injected faults.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultCounters {
    /// Requests answered with an injected 500 (not processed).
    pub injected_errors: u64,
    /// Requests processed whose reply was withheld.
    pub dropped_replies: u64,
    /// Most FetchTask calls of one runner in flight at the same moment.
    pub max_concurrent_fetches: u64,
    /// FetchTask calls answered "no task" because an earlier call of the same runner was
    /// still in flight (`Behaviour::fetch_race`).
    pub lost_fetch_races: u64,
    /// Forgejo: fetches that repeated a request key and got its tasks again.
    pub replayed_request_keys: u64,
}

/// Aggregate counts for dashboards (`GET /_fake/stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub queued: u64,
    pub running: u64,
    /// Finished jobs by outcome (`success`, `failure`, …).
    pub done: BTreeMap<String, u64>,
    /// The same counts per `runs-on` label.
    pub labels: BTreeMap<String, LabelStats>,
    pub tasks_version: i64,
    pub runners: u64,
    pub faults: FaultCounters,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelStats {
    pub queued: u64,
    pub running: u64,
    pub done: u64,
}

/// What one `reap` pass changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReapReport {
    pub zombie_tasks: Vec<i64>,
    pub endless_tasks: Vec<i64>,
    pub abandoned_jobs: Vec<JobId>,
}
