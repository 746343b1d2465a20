//! The GitHub scale set listener's ledger: what `jr_github::Listener` decides, made durable
//! in JetStream with the same messages a Gitea job produces.
//!
//! - An assigned job becomes an assignment on `jr.assignment.<backend>.<id>` (deduplicated by
//!   message id). Its sealed task is the attempt's JIT runner config, sealed for that
//!   assignment and backend like a Gitea task, so nothing on the bus can start a runner.
//! - A GitHub assignment stands for the runner made when its job was assigned: any idle runner
//!   of the scale set may take any of its jobs. The facade publishes the once-only `claimed`
//!   when the workload's executor fetches the runner config (as a FetchTask claims a Gitea
//!   task), so the reconciler's claim timeout is about the workload starting its runner, not
//!   about GitHub handing the runner a job. `JobStarted` publishes it too, if it is still
//!   missing. `JobCompleted` is the once-only `terminal` of the assignment of the runner that
//!   ran the job, naming that job (source `executor`). Its workload, the one that ran the job,
//!   is then deleted as for a Gitea job.
//! - Every message names its job by one number, `forge_task_id` = [`JobFacts::task_id`]: the
//!   job's `runnerRequestId`, or, where github.com sends 0 for it, a negative number derived
//!   from the job's `jobId` (the protocol's messages carry no other field for a GitHub job
//!   id). The assignment names the job its runner was made for, the claim and the terminal
//!   the job the runner took, and the sealed task's scope the assignment's number.
//! - A runner withdrawn unused (its job ended before it ran) gets a `terminal` with source
//!   `withdrawn`.
//! - Which assignment holds a job, and the session cursor, are kept in the scheduler's KV
//!   bucket `JR_SCHEDULER` (`github.<forge>.job.<key>`, the key being the job's
//!   `runnerRequestId` or `job-<jobId>` as the listener keys it ([`JobFacts::key`]), and
//!   `github.<forge>.cursor`), so a restarted scheduler or a new leader goes on where the last
//!   one stopped.
//!

use std::str::FromStr;
use std::time::Duration;

use jr_bus::async_nats::jetstream::kv;
use jr_bus::{Bus, PublishOnce};
use jr_github::listener::Outcome;
use jr_github::wire::{JitConfig, JobFacts};
use jr_github::{Sink, SinkError};
use jr_protocol::{
    AssignmentId, BackendName, Claimed, Envelope, Kind, Message, TaskResult, Terminal,
    TerminalSource, subject,
};
use uuid::Uuid;

use jr_intake::sink::{AssignmentSink, Draft};

/// The forge's room: how many more jobs its backend can start soon.
#[derive(Clone, Debug)]
pub enum Room {
    /// The backend's lookahead less the assignments waiting for its worker, read from the
    /// worker's consumer each time (as the Gitea fetchers pace).
    Backend { lookahead: usize },
    /// A fixed room (tests).
    Fixed(usize),
}

pub struct JetStreamSink {
    pub bus: Bus,
    pub kv: kv::Store,
    /// Builds, seals and publishes the assignments (shared with every other intake).
    pub assignments: AssignmentSink,
    /// The forge's name (`[[github]] name`): part of assignment ids and keys.
    pub forge: String,
    pub backend: BackendName,
    pub max_duration: Duration,
    pub room: Room,
}

fn sink_error(what: &str, e: impl std::fmt::Display) -> SinkError {
    SinkError(format!("{what}: {e}"))
}

/// The jetrunner id of a listener's assignment (32 hex digits).
pub fn assignment_id(listener_id: &str) -> Result<AssignmentId, SinkError> {
    Uuid::from_str(listener_id)
        .map(AssignmentId)
        .map_err(|e| sink_error("assignment id", e))
}

fn task_result(outcome: &Outcome) -> TaskResult {
    match outcome {
        Outcome::Succeeded => TaskResult::Success,
        Outcome::Failed | Outcome::Other(_) => TaskResult::Failure,
        Outcome::Cancelled => TaskResult::Cancelled,
    }
}

impl JetStreamSink {
    fn job_key(&self, job: &JobFacts) -> String {
        format!("github.{}.job.{}", self.forge, job.key())
    }

    fn cursor_key(&self) -> String {
        format!("github.{}.cursor", self.forge)
    }

    /// The assignment made for `job`, from the job index.
    async fn resolve(&self, job: &JobFacts) -> Result<Option<AssignmentId>, SinkError> {
        match self.kv.get(self.job_key(job)).await {
            Ok(Some(value)) => {
                let text = String::from_utf8_lossy(&value);
                assignment_id(text.trim()).map(Some)
            }
            Ok(None) => Ok(None),
            Err(e) => Err(sink_error("job index", e)),
        }
    }

    /// The attempt `id`'s assignment is at, if it was published (the listener may name one
    /// the guard refused).
    async fn attempt(&self, id: AssignmentId) -> Result<Option<u32>, SinkError> {
        self.bus
            .last_on_subject(
                jr_protocol::STREAM_ASSIGNMENTS,
                &subject::assignment(&self.backend, id),
            )
            .await
            .map(|found| found.map(|(_, envelope)| envelope.attempt))
            .map_err(|e| sink_error("assignment lookup", e))
    }

    async fn is_published(&self, id: AssignmentId) -> Result<bool, SinkError> {
        Ok(self.attempt(id).await?.is_some())
    }

    async fn has_event(&self, id: AssignmentId, kind: Kind) -> Result<bool, SinkError> {
        self.bus
            .last_on_subject(
                jr_protocol::STREAM_EVENTS,
                &subject::event(&self.backend, id, kind),
            )
            .await
            .map(|found| found.is_some())
            .map_err(|e| sink_error("event lookup", e))
    }

    /// Publishes the once-only terminal of runner assignment `assignment` (at its current
    /// attempt) about `job`; nothing for an assignment that was never published.
    async fn terminal(
        &self,
        assignment: &str,
        job: &JobFacts,
        outcome: &Outcome,
        source: TerminalSource,
        reason: Option<String>,
    ) -> Result<(), SinkError> {
        let id = assignment_id(assignment)?;
        let Some(attempt) = self.attempt(id).await? else {
            tracing::info!(%assignment, job = %job.key(), "a runner this forge did not publish ended; ignored");
            return Ok(());
        };
        let outcome = jr_intake::ours::publish_terminal(
            &self.bus,
            &self.backend,
            id,
            attempt,
            "github",
            Terminal {
                forge_task_id: job.task_id(),
                result: task_result(outcome),
                source,
                log_closed: true,
                reason,
            },
        )
        .await;
        settled(id, Kind::Terminal, outcome)
    }

    async fn once(
        &self,
        id: AssignmentId,
        kind: Kind,
        envelope: Envelope,
    ) -> Result<(), SinkError> {
        let outcome = self
            .bus
            .publish_once(&subject::event(&self.backend, id, kind), &envelope)
            .await;
        settled(id, kind, outcome)
    }
}

/// A once-only event published (or already there, by this writer or another).
fn settled(
    id: AssignmentId,
    kind: Kind,
    outcome: Result<PublishOnce, jr_bus::BusError>,
) -> Result<(), SinkError> {
    match outcome {
        Ok(PublishOnce::Published { .. } | PublishOnce::Duplicate { .. }) => Ok(()),
        Ok(PublishOnce::AlreadyExists { .. }) => {
            tracing::debug!(assignment = %id, ?kind, "already recorded");
            Ok(())
        }
        Err(e) => Err(sink_error("publish", e)),
    }
}

impl Sink for JetStreamSink {
    async fn room(&self) -> usize {
        match &self.room {
            Room::Fixed(n) => *n,
            Room::Backend { lookahead } => self.assignments.room(&self.backend, *lookahead).await,
        }
    }

    async fn published(&self, assignment: &str) -> Result<bool, SinkError> {
        self.is_published(assignment_id(assignment)?).await
    }

    async fn holder(&self, job: &JobFacts) -> Result<Option<String>, SinkError> {
        let Some(id) = self.resolve(job).await? else {
            return Ok(None);
        };
        if !self.is_published(id).await? || self.has_event(id, Kind::Terminal).await? {
            return Ok(None);
        }
        Ok(Some(id.0.simple().to_string()))
    }

    async fn assign(
        &self,
        assignment: &str,
        job: &JobFacts,
        jit: &JitConfig,
    ) -> Result<(), SinkError> {
        let id = assignment_id(assignment)?;
        let task = jr_protocol::RunnerRegistration {
            runner_name: jit.runner.name.clone(),
            jit_config: jit.encoded.clone(),
        };
        let plaintext = serde_json::to_vec(&task).map_err(|e| sink_error("encode", e))?;
        let workflow = job
            .job_workflow_ref
            .split_once("/.github/workflows/")
            .map(|(_, file)| file.split('@').next().unwrap_or(file).to_owned());
        let envelope = self
            .assignments
            .build(Draft {
                id,
                forge: jr_protocol::ForgeKind::GitHub(self.forge.clone()),
                forge_task_id: job.task_id(),
                backend: self.backend.clone(),
                placement: format!("github scale set of backend {}", self.backend),
                labels: job.request_labels.clone(),
                repository: format!("{}/{}", job.owner_name, job.repository_name),
                workflow,
                job_name: job.job_display_name.clone(),
                max_duration: self.max_duration,
                plaintext,
                dedup: "github".to_owned(),
            })
            .map_err(|e| sink_error("seal", e))?;
        // The index first: a completion that arrives before the assignment finds its id.
        self.kv
            .put(self.job_key(job), assignment.as_bytes().to_vec().into())
            .await
            .map_err(|e| sink_error("job index", e))?;
        self.assignments
            .publish(&self.backend, &envelope)
            .await
            .map(|_| ())
            .map_err(|e| sink_error("publish assignment", e))
    }

    async fn claimed(
        &self,
        job: &JobFacts,
        assignment: &str,
        runner_name: &str,
        _runner_id: i64,
    ) -> Result<(), SinkError> {
        let id = assignment_id(assignment)?;
        let Some(attempt) = self.attempt(id).await? else {
            tracing::info!(%runner_name, job = %job.key(), "a runner this forge did not publish took a job; ignored");
            return Ok(());
        };
        let envelope = Envelope::new(
            format!("claimed:{id}:{attempt}:github"),
            jr_protocol::now_ms(),
            id,
            attempt,
            Message::Claimed(Claimed {
                forge_task_id: job.task_id(),
                executor: runner_name.to_owned(),
            }),
        );
        self.once(id, Kind::Claimed, envelope).await
    }

    async fn finished(
        &self,
        job: &JobFacts,
        assignment: &str,
        outcome: &Outcome,
    ) -> Result<(), SinkError> {
        let reason = match outcome {
            Outcome::Other(result) => Some(format!("GitHub result {result:?}")),
            _ => None,
        };
        self.terminal(assignment, job, outcome, TerminalSource::Executor, reason)
            .await
    }

    async fn made_for(&self, job: &JobFacts) -> Result<Option<String>, SinkError> {
        let Some(id) = self.resolve(job).await? else {
            return Ok(None);
        };
        Ok(self
            .is_published(id)
            .await?
            .then(|| id.0.simple().to_string()))
    }

    async fn idle_runner(&self, assignment: &str) -> Result<bool, SinkError> {
        let id = assignment_id(assignment)?;
        Ok(self.is_published(id).await? && !self.has_event(id, Kind::Terminal).await?)
    }

    async fn withdrawn(
        &self,
        assignment: &str,
        job: &JobFacts,
        outcome: &Outcome,
    ) -> Result<(), SinkError> {
        let reason = format!(
            "runner withdrawn unused: job {} ended without running on it",
            job.key()
        );
        self.terminal(
            assignment,
            job,
            outcome,
            TerminalSource::Withdrawn,
            Some(reason),
        )
        .await
    }

    async fn refused(
        &self,
        assignment: &str,
        job: &JobFacts,
        reason: &str,
    ) -> Result<(), SinkError> {
        tracing::warn!(assignment, job = %job.key(), task = job.task_id(), repository = %format!("{}/{}", job.owner_name, job.repository_name), %reason, "GitHub job gets no runner");
        Ok(())
    }

    async fn save_cursor(&self, session: &str, last_message_id: i64) -> Result<(), SinkError> {
        let value = format!("{session} {last_message_id}");
        self.kv
            .put(self.cursor_key(), value.into_bytes().into())
            .await
            .map(|_| ())
            .map_err(|e| sink_error("cursor", e))
    }

    async fn load_cursor(&self) -> Result<Option<(String, i64)>, SinkError> {
        match self.kv.get(self.cursor_key()).await {
            Ok(Some(value)) => {
                let text = String::from_utf8_lossy(&value);
                let (session, last) = text
                    .split_once(' ')
                    .ok_or_else(|| SinkError(format!("cursor {text:?} is not `<session> <id>`")))?;
                let last = last.trim().parse().map_err(|e| sink_error("cursor", e))?;
                Ok(Some((session.to_owned(), last)))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(sink_error("cursor", e)),
        }
    }
}
