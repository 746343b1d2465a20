//! Runs a scale set listener: opens (or resumes) the message session, polls, lets
//! [`ListenerState`] decide and performs its actions against the GitHub client and a [`Sink`]
//! (jetrunner's ledger), deleting a message only when all its actions are done.
//!
//! What can fail, and what happens then:
//! - A transient failure (the ledger, an outage, backpressure) leaves the message on the queue;
//!   it comes again and is decided again from the memory held before it.
//! - A permanent refusal about one job (GitHub will not make its runner, or will not cancel a
//!   refused run) is reported to the ledger and the message goes on: one job must not hold the
//!   queue of every other.
//! - Deleting the message is the commit point: what follows (saving the cursor) is retried on
//!   the next message, never undone.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use jr_retry::Backoff;
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
    /// Read when it is needed (before each poll and for each message), so that assignments
    /// just published count against it at once.
    fn room(&self) -> impl Future<Output = usize> + Send;
    /// Whether the assignment `assignment` is already published (its runner config with it).
    fn published(&self, assignment: &str) -> impl Future<Output = Result<bool, SinkError>> + Send;
    /// The open assignment (published, not final) that holds `job`, if any.
    fn holder(
        &self,
        job: &JobFacts,
    ) -> impl Future<Output = Result<Option<String>, SinkError>> + Send;
    /// Publishes the assignment for `job` (once-only by `assignment`) carrying `jit`, the
    /// runner config of attempt 1, which only its workload may read.
    fn assign(
        &self,
        assignment: &str,
        job: &JobFacts,
        jit: &JitConfig,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// Runner `runner_name`, the runner made for `assignment`, took `job`: the once-only claim
    /// of the runner's assignment (its current attempt). Its workload now runs `job`.
    fn claimed(
        &self,
        job: &JobFacts,
        assignment: &str,
        runner_name: &str,
        runner_id: i64,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// `job` is over on the runner made for `assignment`: the once-only terminal of the
    /// runner's assignment.
    fn finished(
        &self,
        job: &JobFacts,
        assignment: &str,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// The published assignment whose runner was made for `job`, if any (the listener
    /// forgot it after a restart).
    fn made_for(
        &self,
        job: &JobFacts,
    ) -> impl Future<Output = Result<Option<String>, SinkError>> + Send;
    /// Whether `assignment` is published and not final: its runner may not have taken a job
    /// (GitHub's answer to removing it decides).
    fn idle_runner(&self, assignment: &str)
    -> impl Future<Output = Result<bool, SinkError>> + Send;
    /// The idle runner of `assignment` was removed from the service because `job` ended (or
    /// started) without it: the once-only terminal of the runner's assignment, so its
    /// workload is deleted.
    fn withdrawn(
        &self,
        assignment: &str,
        job: &JobFacts,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// `job` gets no runner: the guard refused it (its run was cancelled) or GitHub refused to
    /// make one. For the operators.
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

impl ListenError {
    /// Worth handling the message again later (everything but GitHub's own refusals).
    fn transient(&self) -> bool {
        match self {
            ListenError::GitHub(error) => {
                error.is_transient() || matches!(error.status(), Some(401 | 409))
            }
            ListenError::Sink(_) => true,
        }
    }
}

/// The longest wait between two tries of the same thing.
const MAX_DELAY: Duration = Duration::from_secs(30);

/// What a listener did, for metrics (read at scrape time).
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Message sessions opened or resumed.
    pub sessions: AtomicU64,
    /// Messages handled (deleted after their actions).
    pub messages: AtomicU64,
    pub jobs_assigned: AtomicU64,
    pub jobs_started: AtomicU64,
    pub jobs_completed: AtomicU64,
    /// Runners made (a JIT config and a published assignment).
    pub runners_made: AtomicU64,
    pub acquire_failures: AtomicU64,
    pub jit_failures: AtomicU64,
    /// Runners published and not known to have taken a job (this process's view).
    pub runners_idle: AtomicU64,
    /// Jobs the listener holds an assignment for.
    pub jobs_held: AtomicU64,
    /// The service's latest statistics: jobs available, assigned and running in the scale set.
    pub available_jobs: AtomicU64,
    pub assigned_jobs: AtomicU64,
    pub running_jobs: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

pub struct Listener<S> {
    /// What it did (metrics); shared with whoever reads them.
    pub stats: Arc<ListenerStats>,
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

/// The back-off of the listener's retries: 200 ms doubling to [`MAX_DELAY`], with jitter.
fn backoff() -> Backoff {
    Backoff::new(Duration::from_millis(200), MAX_DELAY)
}

impl<S: Sink> Listener<S> {
    /// The gauges: what the listener holds, and the service's latest statistics.
    fn observe(&self, session: &MessageSession, state: &ListenerState) {
        let stats = &self.stats;
        let set = |gauge: &AtomicU64, value: i64| {
            gauge.store(u64::try_from(value).unwrap_or(0), Ordering::Relaxed);
        };
        set(&stats.runners_idle, state.idle_runners() as i64);
        set(&stats.jobs_held, state.tracked().len() as i64);
        let s = session.statistics();
        set(&stats.available_jobs, s.total_available_jobs);
        set(&stats.assigned_jobs, s.total_assigned_jobs);
        set(&stats.running_jobs, s.total_running_jobs);
    }

    /// Resumes the saved session, or opens a new one. Transient failures and a session
    /// conflict (another listener's session, or our own earlier one the service still holds)
    /// are tried again until `stop`.
    async fn session(
        &self,
        stop: &CancellationToken,
    ) -> Result<Option<MessageSession>, ListenError> {
        let mut backoff = backoff();
        let saved = loop {
            match self.sink.load_cursor().await {
                Ok(saved) => break saved,
                Err(error) => tracing::warn!(%error, "reading the session cursor failed; retrying"),
            }
            if !backoff.pause(stop).await {
                return Ok(None);
            }
        };
        if let Some((id, last)) = saved {
            loop {
                match self.client.resume_session(self.scale_set, &id, last).await {
                    Ok(session) => return Ok(Some(session)),
                    Err(error) if error.is_transient() => {
                        tracing::warn!(%error, "resuming the session failed; retrying")
                    }
                    Err(error) => {
                        tracing::info!(%error, "the saved session cannot be resumed; opening a new one");
                        break;
                    }
                }
                if !backoff.pause(stop).await {
                    return Ok(None);
                }
            }
        }
        loop {
            match self
                .client
                .create_session(self.scale_set, &self.owner)
                .await
            {
                Ok(session) => {
                    self.save(&session).await;
                    return Ok(Some(session));
                }
                Err(error) if error.is_session_conflict() || error.is_transient() => {
                    tracing::warn!(%error, "opening the session failed; retrying (a session left by a stopped listener lapses on the service's side)");
                }
                Err(error) => return Err(error.into()),
            }
            if !backoff.pause(stop).await {
                return Ok(None);
            }
        }
    }

    /// The most runners the listener can run now, announced to the service: the jobs it holds
    /// and the room the backends have, at most `max_capacity`.
    async fn capacity(&self, state: &ListenerState) -> u32 {
        let open = state.tracked().len().saturating_add(self.sink.room().await);
        u32::try_from(open)
            .unwrap_or(u32::MAX)
            .min(self.max_capacity)
    }

    /// Saves the cursor; a failure is logged and the next message saves it again.
    async fn save(&self, session: &MessageSession) {
        if let Err(error) = self
            .sink
            .save_cursor(session.id(), session.last_message_id())
            .await
        {
            tracing::warn!(%error, "saving the session cursor failed; saved again after the next message");
        }
    }

    /// A JIT config named for `assignment`'s attempt 1. A name left over from an earlier try
    /// whose assignment was never published is removed and made again (no workload can have
    /// started it: only a published assignment carries a config).
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
        self.run_keeping(stop, move || keep_session).await
    }

    /// [`Listener::run`], asking `keep_session` at the stop whether to keep the session (for a
    /// new leader to resume) or delete it (a shutdown).
    pub async fn run_keeping(
        &self,
        stop: CancellationToken,
        keep_session: impl Fn() -> bool + Send,
    ) -> Result<(), ListenError> {
        let Some(mut session) = self.session(&stop).await? else {
            return Ok(());
        };
        bump(&self.stats.sessions);
        let mut saved_session = session.id().to_owned();
        let mut state = ListenerState::new(&self.forge, Default::default());
        let mut backoff = backoff();
        loop {
            let capacity = tokio::select! {
                () = stop.cancelled() => break,
                capacity = self.capacity(&state) => capacity,
            };
            let polled = tokio::select! {
                () = stop.cancelled() => break,
                polled = session.next_message(capacity) => polled,
            };
            // A session opened again after an eviction is saved at once.
            if session.id() != saved_session {
                self.save(&session).await;
                saved_session = session.id().to_owned();
            }
            let message = match polled {
                Ok(Some(message)) => message,
                Ok(None) => {
                    self.acquire_offered(&mut session, &mut state).await;
                    continue;
                }
                Err(error) if error.is_transient() => {
                    tracing::warn!(%error, "polling the scale set failed; retrying");
                    if !backoff.pause(&stop).await {
                        break;
                    }
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            backoff.reset();
            let before = state.clone();
            let room = self.sink.room().await;
            let actions = state.on_message(&message, room);
            // Stopping mid-message is safe: the message is not deleted, every action repeats.
            let done = tokio::select! {
                () = stop.cancelled() => break,
                done = self.perform(&mut session, &mut state, actions) => done,
            };
            match done {
                Ok(()) => self.acquire_offered(&mut session, &mut state).await,
                Err(error) => {
                    tracing::warn!(%error, message = message.id, "handling a message failed; it will come again");
                    state = before;
                    if !backoff.pause(&stop).await {
                        break;
                    }
                }
            }
        }
        if !keep_session() {
            session.close().await?;
        }
        Ok(())
    }

    /// Why the guard refuses `job`, if it does. A run the service says does not exist, or
    /// whose answer cannot be read, counts as a fork's; any other failure (an outage, a rate
    /// limit, a refused credential) makes the message come again rather than cancel a run.
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
                Err(error)
                    if error.status() == Some(404)
                        || matches!(error, GitHubError::Decode { .. }) =>
                {
                    tracing::warn!(%error, run = job.workflow_run_id, "the run cannot be looked up; treating it as a fork's");
                    None
                }
                Err(error) => return Err(error.into()),
            }
        } else {
            None
        };
        Ok(match guard.check(job, origin.as_ref()) {
            Verdict::Allowed => None,
            Verdict::Refused { reason } => Some(reason),
        })
    }

    /// Publishes `assignment` for `job` with a new runner, unless it is published already (a
    /// message handled again) or another open assignment holds the job (a re-sent message).
    /// `true` when `assignment`'s runner is published.
    async fn assign(&self, assignment: &str, job: &JobFacts) -> Result<bool, ListenError> {
        bump(&self.stats.jobs_assigned);
        if self.sink.published(assignment).await? {
            return Ok(true);
        }
        if let Some(other) = self.sink.holder(job).await?
            && other != assignment
        {
            tracing::info!(job = %job.key(), holder = %other, "job already held by an open assignment; re-sent assignment ignored");
            return Ok(false);
        }
        if let Some(reason) = self.refusal(job).await? {
            tracing::warn!(job = %job.key(), run = job.workflow_run_id, %reason, "job refused by the trust guard; cancelling its run");
            match self
                .client
                .cancel_run(&job.owner_name, &job.repository_name, job.workflow_run_id)
                .await
            {
                Ok(()) => {}
                Err(error) if error.is_transient() => return Err(error.into()),
                Err(error) => {
                    tracing::error!(%error, run = job.workflow_run_id, "the refused job's run cannot be cancelled; it gets no runner from jetrunner")
                }
            }
            self.sink.refused(assignment, job, &reason).await?;
            return Ok(false);
        }
        let jit = self.jit(assignment).await;
        if jit.is_err() {
            bump(&self.stats.jit_failures);
        }
        let jit = match jit {
            Ok(jit) => jit,
            Err(error) if !error.is_transient() && !matches!(error.status(), Some(401 | 409)) => {
                let reason = format!("GitHub refused to make its runner: {error}");
                tracing::error!(job = %job.key(), %reason, "job gets no runner");
                self.sink.refused(assignment, job, &reason).await?;
                return Ok(false);
            }
            Err(error) => return Err(error.into()),
        };
        self.sink.assign(assignment, job, &jit).await?;
        bump(&self.stats.runners_made);
        Ok(true)
    }

    /// Withdraws one idle runner because `job` ended or started without one of ours, if a
    /// runner was made for it (a job the guard refused had none). The job's own runner is
    /// tried first, then the others not known to be busy. A runner is removed from the service
    /// before its assignment ends, so it cannot take a job while its workload is deleted; one
    /// that is busy (`JobStillRunningException`) just took a job, and the next is tried.
    async fn withdraw(
        &self,
        state: &mut ListenerState,
        job: &JobFacts,
        own: Option<String>,
        others: Vec<String>,
        outcome: &Outcome,
    ) -> Result<(), ListenError> {
        let own = match own {
            Some(own) => Some(own),
            None => self.sink.made_for(job).await?,
        };
        let Some(own) = own else {
            return Ok(());
        };
        if !self.sink.published(&own).await? {
            return Ok(());
        }
        for candidate in std::iter::once(own).chain(others) {
            if !self.sink.idle_runner(&candidate).await? {
                state.runner_withdrawn(&candidate);
                continue;
            }
            if self.remove_idle_runner(&candidate).await? {
                self.sink.withdrawn(&candidate, job, outcome).await?;
                state.runner_withdrawn(&candidate);
                return Ok(());
            }
            state.runner_withdrawn(&candidate);
        }
        tracing::warn!(job = %job.key(), "no idle runner to withdraw for a job that ran without one; the reconciler's claim timeout ends a runner left idle");
        Ok(())
    }

    /// Removes the runner made for `assignment` if it never had a job: `false` when it has one
    /// now (`JobStillRunningException`) or had one (an ephemeral runner is gone after its job).
    /// The lookup by name is what tells a runner gone after its job from an idle one: the
    /// removal itself answers 204 for a runner the service no longer holds as well.
    async fn remove_idle_runner(&self, assignment: &str) -> Result<bool, GitHubError> {
        let name = runner_name(assignment, 1);
        let Some(runner) = self.client.runner_by_name(&name).await? else {
            return Ok(false);
        };
        match self.client.remove_runner(runner.id).await {
            Ok(()) => Ok(true),
            Err(error) if error.is_exception("JobStillRunningException") => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Asks for offered jobs there is room for now; a failure leaves them offered.
    async fn acquire_offered(&self, session: &mut MessageSession, state: &mut ListenerState) {
        let before = state.clone();
        if let Some(action) = state.on_room(self.sink.room().await)
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
                Action::Acquire(ids) => match session.acquire(&ids).await {
                    Ok(granted) => state.acquire_answered(&ids, &granted),
                    Err(error) if error.is_transient() || error.status() == Some(401) => {
                        bump(&self.stats.acquire_failures);
                        return Err(error.into());
                    }
                    // Refused for good: none granted; the offers are forgotten.
                    Err(error) => {
                        bump(&self.stats.acquire_failures);
                        tracing::warn!(%error, "acquire refused");
                        state.acquire_answered(&ids, &[]);
                    }
                },
                Action::Assign { assignment, job } => match self.assign(&assignment, &job).await {
                    Ok(true) => state.runner_published(&assignment),
                    Ok(false) => {}
                    Err(error) if error.transient() => return Err(error),
                    Err(error) => {
                        tracing::error!(%error, job = %job.key(), "the job's assignment failed for good; going on with the others");
                    }
                },
                Action::Claim {
                    job,
                    assignment,
                    runner_name,
                    runner_id,
                } => {
                    bump(&self.stats.jobs_started);
                    self.sink
                        .claimed(&job, &assignment, &runner_name, runner_id)
                        .await?;
                }
                Action::Finish {
                    job,
                    assignment,
                    outcome,
                } => {
                    bump(&self.stats.jobs_completed);
                    self.sink.finished(&job, &assignment, &outcome).await?;
                }
                Action::Withdraw {
                    job,
                    own,
                    others,
                    outcome,
                } => self.withdraw(state, &job, own, others, &outcome).await?,
                Action::Delete(id) => {
                    session.delete_message(id).await?;
                    // The commit point: the message is gone and its actions are done.
                    self.save(session).await;
                    bump(&self.stats.messages);
                    self.observe(session, state);
                }
            }
        }
        Ok(())
    }
}
