//! Runs a scale set listener: opens (or resumes) the message session, polls, lets
//! [`ListenerState`] decide and performs its actions against the GitHub client and a [`Sink`]
//! (jetrunner's ledger), deleting a message only when all its actions are done.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::guard::{Guard, Verdict};
use crate::listener::{Action, ListenerState, Outcome, runner_name};
use crate::wire::{JitConfig, JobFacts};
use crate::{GitHubError, MessageSession, ScaleSetClient};

/// Why the sink could not take a fact; the message is not deleted and comes again.
#[derive(Debug, thiserror::Error)]
#[error("ledger: {0}")]
pub struct SinkError(pub String);

/// Where the listener's decisions go. Every method must be idempotent: a message whose
/// actions were done but which was not deleted is handled again. A claim or terminal for a job
/// or assignment the ledger does not hold (one the guard refused, or another client's) is
/// ignored, not an error: an error would hold the message forever.
pub trait Sink: Send + Sync {
    /// How many more jobs the backends can start soon.
    fn room(&self) -> usize;
    /// Publishes the assignment for `job` (once-only by `assignment`) carrying `jit`, the
    /// runner config of attempt 1, which only its workload may read.
    fn assign(
        &self,
        assignment: &str,
        job: &JobFacts,
        jit: &JitConfig,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// Job `request_id` started on runner `runner_name`: the once-only claim of its
    /// assignment (`assignment` when the listener knows it, else the ledger finds it by job),
    /// binding the job to the runner's workload.
    fn claimed(
        &self,
        request_id: i64,
        assignment: Option<&str>,
        runner_name: &str,
        runner_id: i64,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// Job `request_id` is over: the once-only terminal of its assignment.
    fn finished(
        &self,
        request_id: i64,
        assignment: Option<&str>,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// The guard refused `job` (its run was cancelled, no runner was made): for the operators.
    fn refused(
        &self,
        assignment: &str,
        job: &JobFacts,
        reason: &str,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// Keeps the session id and the last deleted message id, for a restart or a new leader.
    fn save_cursor(
        &self,
        session: &str,
        last_message_id: i64,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// The cursor saved last, if any.
    fn load_cursor(&self) -> impl Future<Output = Result<Option<(String, i64)>, SinkError>> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(transparent)]
    GitHub(#[from] GitHubError),
    #[error(transparent)]
    Sink(#[from] SinkError),
}

pub struct Listener<S> {
    pub client: ScaleSetClient,
    pub scale_set: i64,
    pub owner: String,
    pub forge: String,
    pub max_capacity: u32,
    pub work_folder: String,
    /// Set when the scale set's runners run on a trusted backend (see [`Guard`]).
    pub guard: Option<Guard>,
    pub sink: S,
}

impl<S: Sink> Listener<S> {
    /// Resumes the saved session, or opens a new one.
    async fn session(&self) -> Result<MessageSession, ListenError> {
        if let Some((id, last)) = self.sink.load_cursor().await? {
            match self.client.resume_session(self.scale_set, &id, last).await {
                Ok(session) => return Ok(session),
                Err(error) => {
                    tracing::info!(%error, "the saved session cannot be resumed; opening a new one")
                }
            }
        }
        let session = self
            .client
            .create_session(self.scale_set, &self.owner)
            .await?;
        self.sink
            .save_cursor(session.id(), session.last_message_id())
            .await?;
        Ok(session)
    }

    /// A JIT config named for `assignment`'s attempt 1. A name left over from an earlier try
    /// (the config was made but the assignment not published) is removed and made again.
    async fn jit(&self, assignment: &str) -> Result<JitConfig, GitHubError> {
        let name = runner_name(assignment, 1);
        match self
            .client
            .generate_jit_config(self.scale_set, &name, &self.work_folder)
            .await
        {
            Err(error) if error.is_exception("AgentExistsException") => {
                if let Some(old) = self.client.runner_by_name(&name).await? {
                    self.client.remove_runner(old.id).await?;
                }
                self.client
                    .generate_jit_config(self.scale_set, &name, &self.work_folder)
                    .await
            }
            other => other,
        }
    }

    /// Handles messages until `stop`; then deletes the session (so the next listener need
    /// not wait for it to lapse) unless `keep_session`.
    pub async fn run(
        &self,
        stop: CancellationToken,
        keep_session: bool,
    ) -> Result<(), ListenError> {
        let mut session = self.session().await?;
        let mut state = ListenerState::new(&self.forge, Default::default());
        let mut delay = Duration::from_millis(200);
        loop {
            let polled = tokio::select! {
                () = stop.cancelled() => break,
                polled = session.next_message(self.max_capacity) => polled,
            };
            let message = match polled {
                Ok(Some(message)) => message,
                Ok(None) => {
                    self.acquire_offered(&mut session, &mut state).await;
                    continue;
                }
                Err(error) if error.is_transient() => {
                    tracing::warn!(%error, "polling the scale set failed; retrying");
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(30));
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            delay = Duration::from_millis(200);
            let before = state.clone();
            let actions = state.on_message(&message, self.sink.room());
            if let Err(error) = self.perform(&mut session, &mut state, actions).await {
                // Not deleted: the message comes again (polls ask for what follows the last
                // deleted one) and is decided again from the memory held before it.
                tracing::warn!(%error, message = message.id, "handling a message failed; it will come again");
                state = before;
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(30));
                continue;
            }
            // Completions free room: offers waiting for it are asked for now.
            self.acquire_offered(&mut session, &mut state).await;
        }
        if !keep_session {
            session.close().await?;
        }
        Ok(())
    }

    /// Why the guard refuses `job`, if it does. A run that cannot be looked up for a reason
    /// other than backpressure or an outage counts as a fork's; those two make the message
    /// come again.
    async fn refusal(&self, job: &JobFacts) -> Result<Option<String>, ListenError> {
        let Some(guard) = &self.guard else {
            return Ok(None);
        };
        let origin = if guard.needs_origin(job) {
            match self
                .client
                .run_origin(&job.owner_name, &job.repository_name, job.workflow_run_id)
                .await
            {
                Ok(origin) => Some(origin),
                Err(error) if error.is_transient() => return Err(error.into()),
                Err(error) => {
                    tracing::warn!(%error, run = job.workflow_run_id, "cannot look the run up; treating it as a fork's");
                    None
                }
            }
        } else {
            None
        };
        Ok(match guard.check(job, origin.as_ref()) {
            Verdict::Allowed => None,
            Verdict::Refused { reason } => Some(reason),
        })
    }

    /// Asks for offered jobs there is room for now; a failure leaves them offered.
    async fn acquire_offered(&self, session: &mut MessageSession, state: &mut ListenerState) {
        let before = state.clone();
        if let Some(action) = state.on_room(self.sink.room())
            && let Err(error) = self.perform(session, state, vec![action]).await
        {
            tracing::warn!(%error, "acquiring offered jobs failed; they stay offered");
            *state = before;
        }
    }

    async fn perform(
        &self,
        session: &mut MessageSession,
        state: &mut ListenerState,
        actions: Vec<Action>,
    ) -> Result<(), ListenError> {
        for action in actions {
            match action {
                Action::Acquire(ids) => {
                    let granted = session.acquire(&ids).await?;
                    state.acquire_answered(&ids, &granted);
                }
                Action::Assign { assignment, job } => {
                    if let Some(reason) = self.refusal(&job).await? {
                        tracing::warn!(request = job.runner_request_id, run = job.workflow_run_id, %reason, "job refused by the trust guard; cancelling its run");
                        self.client
                            .cancel_run(&job.owner_name, &job.repository_name, job.workflow_run_id)
                            .await?;
                        self.sink.refused(&assignment, &job, &reason).await?;
                        continue;
                    }
                    let jit = self.jit(&assignment).await?;
                    self.sink.assign(&assignment, &job, &jit).await?;
                }
                Action::Claim {
                    request_id,
                    assignment,
                    runner_name,
                    runner_id,
                } => {
                    self.sink
                        .claimed(request_id, assignment.as_deref(), &runner_name, runner_id)
                        .await?;
                }
                Action::Finish {
                    request_id,
                    assignment,
                    outcome,
                    ..
                } => {
                    self.sink
                        .finished(request_id, assignment.as_deref(), &outcome)
                        .await?;
                }
                Action::Delete(id) => {
                    session.delete_message(id).await?;
                    self.sink
                        .save_cursor(session.id(), session.last_message_id())
                        .await?;
                }
            }
        }
        Ok(())
    }
}
