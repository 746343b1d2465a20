//! The GitHub scale set listener's ledger: what `jr_github::Listener` decides, made durable
//! in JetStream with the same messages a Gitea job produces.
//!
//! - Each runner the listener makes is an assignment on `jr.assignment.<backend>.<id>`
//!   (deduplicated by message id), named by no job (`forge_task_id` 0): GitHub hands any job
//!   assigned to the scale set to any idle runner of it. Its sealed task is the runner's JIT
//!   config, sealed for that assignment and backend like a Gitea task, so nothing on the bus
//!   can start a runner.
//! - The facade publishes the once-only `claimed` when the workload's executor fetches the
//!   runner config (as a FetchTask claims a Gitea task), so the reconciler's claim timeout is
//!   about the workload starting its runner. `JobStarted` publishes it too, if it is still
//!   missing, naming the job. `JobCompleted` is the once-only `terminal` of the assignment of
//!   the runner that ran the job, naming that job (source `executor`). Its workload, the one
//!   that ran the job, is then deleted as for a Gitea job.
//! - Jobs are named by one number, `forge_task_id` = [`JobFacts::task_id`]: the job's
//!   `runnerRequestId`, or, where github.com sends 0 for it, a negative number derived from the
//!   job's `jobId` (the protocol's messages carry no other field for a GitHub job id).
//! - A runner removed unused (beyond `min_idle` on an idle scale set) gets a `terminal` with
//!   source `withdrawn`.
//! - The runners the listener holds are kept in the scheduler's KV bucket `JR_SCHEDULER`, as
//!   one JSON object under `github.<forge>.runners` (assignment → `made` before its JIT config
//!   is made, `busy` once GitHub says it took a job; written only by the listener, which holds
//!   the entry's lease), and so is the session cursor (`github.<forge>.cursor`), so a restarted
//!   scheduler or a new leader goes on where the last one stopped. A record whose assignment
//!   is final is dropped when the runners are next read, and when its terminal is published.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use jr_bus::async_nats::jetstream::kv;
use jr_bus::{Bus, PublishOnce};
use jr_github::listener::Outcome;
use jr_github::wire::{JitConfig, JobFacts};
use jr_github::{RunnerRecord, Sink, SinkError};
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
    /// Where the scale set's runners register (`acme`, `acme/app`): the assignments'
    /// repository.
    pub scope: String,
    /// The scale set's name and labels: the assignments' labels.
    pub labels: Vec<String>,
    pub backend: BackendName,
    pub max_duration: Duration,
    pub room: Room,
    /// The runner records as last written (see the module notes), and whether the last write
    /// failed (the next one writes even if it changes nothing).
    pub records: std::sync::Mutex<(BTreeMap<String, String>, bool)>,
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
    fn runners_key(&self) -> String {
        format!("github.{}.runners", self.forge)
    }

    fn cursor_key(&self) -> String {
        format!("github.{}.cursor", self.forge)
    }

    /// Changes the runner records and writes them.
    async fn write_records(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, String>) -> bool,
    ) -> Result<(), SinkError> {
        let text = {
            let mut guard = self
                .records
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (records, unsaved) = &mut *guard;
            if !change(records) && !*unsaved {
                return Ok(());
            }
            *unsaved = true;
            serde_json::to_vec(&*records).map_err(|e| sink_error("runner records", e))?
        };
        self.kv
            .put(self.runners_key(), text.into())
            .await
            .map_err(|e| sink_error("runner records", e))?;
        self.records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1 = false;
        Ok(())
    }

    /// Records a new runner as `made`.
    async fn add_record(&self, assignment: &str) -> Result<(), SinkError> {
        self.write_records(|records| {
            records
                .insert(assignment.to_owned(), "made".to_owned())
                .is_none()
        })
        .await
    }

    /// Marks a recorded runner `busy` (one with no record is final, or not this forge's).
    async fn mark_busy(&self, assignment: &str) -> Result<(), SinkError> {
        self.write_records(|records| match records.get_mut(assignment) {
            Some(state) if state != "busy" => {
                "busy".clone_into(state);
                true
            }
            _ => false,
        })
        .await
    }

    async fn drop_record(&self, assignment: &str) -> Result<(), SinkError> {
        self.write_records(|records| records.remove(assignment).is_some())
            .await
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
        job: Option<&JobFacts>,
        outcome: &Outcome,
        source: TerminalSource,
        reason: Option<String>,
    ) -> Result<(), SinkError> {
        let id = assignment_id(assignment)?;
        let Some(attempt) = self.attempt(id).await? else {
            tracing::info!(%assignment, "a runner this forge did not publish ended; ignored");
            return Ok(());
        };
        let outcome = jr_intake::ours::publish_terminal(
            &self.bus,
            &self.backend,
            id,
            attempt,
            "github",
            Terminal {
                forge_task_id: job.map_or(0, JobFacts::task_id),
                result: task_result(outcome),
                source,
                log_closed: true,
                reason,
            },
        )
        .await;
        settled(id, Kind::Terminal, outcome)?;
        self.drop_record(assignment).await
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

    async fn runners(&self) -> Result<Vec<(String, RunnerRecord)>, SinkError> {
        let stored: BTreeMap<String, String> = match self.kv.get(self.runners_key()).await {
            Ok(Some(value)) => serde_json::from_slice(&value).unwrap_or_else(|e| {
                tracing::error!(key = %self.runners_key(), error = %e, "the runner records cannot be read; starting without them (runners they named end at their claim timeout or max duration)");
                BTreeMap::new()
            }),
            Ok(None) => BTreeMap::new(),
            Err(e) => return Err(sink_error("runner records", e)),
        };
        let mut runners = Vec::new();
        let mut kept = BTreeMap::new();
        for (assignment, state) in stored {
            let Ok(id) = assignment_id(&assignment) else {
                tracing::warn!(%assignment, "a runner record that names no assignment; dropped");
                continue;
            };
            if !self.is_published(id).await? {
                runners.push((assignment.clone(), RunnerRecord::Unpublished));
            } else if self.has_event(id, Kind::Terminal).await? {
                continue;
            } else if state == "busy" {
                runners.push((assignment.clone(), RunnerRecord::Busy));
            } else {
                runners.push((assignment.clone(), RunnerRecord::Free));
            }
            kept.insert(assignment, state);
        }
        self.write_records(|records| {
            *records = kept;
            true
        })
        .await?;
        Ok(runners)
    }

    async fn prepare(&self, assignment: &str) -> Result<(), SinkError> {
        assignment_id(assignment)?;
        self.add_record(assignment).await
    }

    async fn forget(&self, assignment: &str) -> Result<(), SinkError> {
        self.drop_record(assignment).await
    }

    async fn assign(&self, assignment: &str, jit: &JitConfig) -> Result<(), SinkError> {
        let id = assignment_id(assignment)?;
        let task = jr_protocol::RunnerRegistration {
            runner_name: jit.runner.name.clone(),
            jit_config: jit.encoded.clone(),
        };
        let plaintext = serde_json::to_vec(&task).map_err(|e| sink_error("encode", e))?;
        let envelope = self
            .assignments
            .build(Draft {
                id,
                forge: jr_protocol::ForgeKind::GitHub(self.forge.clone()),
                forge_task_id: 0,
                backend: self.backend.clone(),
                placement: format!("github scale set of backend {}", self.backend),
                labels: self.labels.clone(),
                repository: self.scope.clone(),
                workflow: None,
                job_name: jit.runner.name.clone(),
                max_duration: self.max_duration,
                plaintext,
                dedup: "github".to_owned(),
            })
            .map_err(|e| sink_error("seal", e))?;
        self.assignments
            .publish(&self.backend, &envelope)
            .await
            .map(|_| ())
            .map_err(|e| sink_error("publish assignment", e))
    }

    async fn backend_waiting(&self) -> usize {
        match &self.room {
            Room::Fixed(_) => 0,
            Room::Backend { .. } => jr_intake::presence::waiting(&self.bus, &self.backend)
                .await
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0),
        }
    }

    async fn started(&self, assignment: &str) -> Result<bool, SinkError> {
        self.has_event(assignment_id(assignment)?, Kind::Claimed)
            .await
    }

    async fn open(&self, assignment: &str) -> Result<bool, SinkError> {
        let id = assignment_id(assignment)?;
        Ok(self.is_published(id).await? && !self.has_event(id, Kind::Terminal).await?)
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
        self.mark_busy(assignment).await?;
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
        self.terminal(
            assignment,
            Some(job),
            outcome,
            TerminalSource::Executor,
            reason,
        )
        .await
    }

    async fn withdrawn(&self, assignment: &str, reason: &str) -> Result<(), SinkError> {
        self.terminal(
            assignment,
            None,
            &Outcome::Cancelled,
            TerminalSource::Withdrawn,
            Some(format!("runner withdrawn unused: {reason}")),
        )
        .await
    }

    async fn refused(&self, job: &JobFacts, reason: &str) -> Result<(), SinkError> {
        tracing::warn!(job = %job.key(), task = job.task_id(), repository = %format!("{}/{}", job.owner_name, job.repository_name), %reason, "GitHub job gets no runner");
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
