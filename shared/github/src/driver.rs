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
use crate::scale::{self, Limits};
use crate::wire::{JitConfig, JobFacts};
use crate::{GitHubError, MessageSession, ScaleSetClient};

/// Why the sink could not take a fact; the message is not deleted and comes again.
#[derive(Debug, thiserror::Error)]
#[error("ledger: {0}")]
pub struct SinkError(pub String);

/// What the ledger holds about one runner of the scale set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunnerRecord {
    /// Recorded before its JIT config was made, never published: no workload has it, so it
    /// is removed from GitHub (if it was made) and forgotten.
    Unpublished,
    /// Published and not final, not known to have taken a job.
    Free,
    /// Published and not final; GitHub said it took a job.
    Busy,
}

/// Where the listener's decisions go. Every method must be idempotent: a message whose
/// actions were done but which was not deleted is handled again. A claim or terminal for an
/// assignment the ledger does not hold (another client's runner) is ignored, not an error: an
/// error would hold the message forever.
pub trait Sink: Send + Sync {
    /// How many more jobs the backends can start soon.
    /// Read when it is needed (before each poll and for each message), so that assignments
    /// just published count against it at once.
    fn room(&self) -> impl Future<Output = usize> + Send;
    /// The runners the ledger holds for this scale set, by assignment.
    fn runners(
        &self,
    ) -> impl Future<Output = Result<Vec<(String, RunnerRecord)>, SinkError>> + Send;
    /// A runner is about to be made for `assignment`: recorded first, so that one made at
    /// GitHub and never published is found after a crash.
    fn prepare(&self, assignment: &str) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// Drops the record of `assignment`, a runner that was never published.
    fn forget(&self, assignment: &str) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// Publishes the assignment `assignment` (once-only by its id) carrying `jit`, its
    /// runner's config, which only its workload may read.
    fn assign(
        &self,
        assignment: &str,
        jit: &JitConfig,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// How many assignments wait for a slot of the backend (its worker's consumer's pending
    /// count; 0 when it cannot be read), this scale set's own runners included.
    fn backend_waiting(&self) -> impl Future<Output = usize> + Send;
    /// Whether the workload of `assignment` started its runner (the facade handed it the
    /// config): it is no longer waiting for a slot.
    fn started(&self, assignment: &str) -> impl Future<Output = Result<bool, SinkError>> + Send;
    /// Whether `assignment` is published and not final (its runner is not lost or withdrawn).
    fn open(&self, assignment: &str) -> impl Future<Output = Result<bool, SinkError>> + Send;
    /// Runner `runner_name`, the runner of `assignment`, took `job`: the once-only claim of
    /// the runner's assignment (its current attempt). Its workload now runs `job`.
    fn claimed(
        &self,
        job: &JobFacts,
        assignment: &str,
        runner_name: &str,
        runner_id: i64,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// `job` is over on the runner of `assignment`: the once-only terminal of the runner's
    /// assignment.
    fn finished(
        &self,
        job: &JobFacts,
        assignment: &str,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// The idle runner of `assignment` was removed from the service (`reason`): the once-only
    /// terminal of its assignment, so its workload is deleted.
    fn withdrawn(
        &self,
        assignment: &str,
        reason: &str,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    /// `job` gets no runner: the guard refused it (its run was cancelled). For the operators.
    fn refused(
        &self,
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
    /// Idle runners removed because the scale set was idle and they were beyond `min_idle`.
    pub runners_removed: AtomicU64,
    /// Free runners found gone (their workload lost, or withdrawn by `fail-task`), and so
    /// made again while jobs wait.
    pub runners_lost: AtomicU64,
    /// Runners published and not known to have taken a job (this process's view).
    pub runners_idle: AtomicU64,
    /// Runners GitHub holds busy (this process's view).
    pub runners_busy: AtomicU64,
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
    /// Idle runners kept registered and ready (warm runners), beyond the jobs waiting.
    pub min_idle: u32,
    pub work_folder: String,
    /// Set when the scale set's runners run on a trusted backend (see [`Guard`]).
    pub guard: Option<Guard>,
    pub sink: S,
}

/// The back-off of the listener's retries: 200 ms doubling to [`MAX_DELAY`], with jitter.
fn backoff() -> Backoff {
    Backoff::new(Duration::from_millis(200), MAX_DELAY)
}

/// How often the free runners are checked against the ledger (a workload lost, a runner
/// withdrawn by `fail-task`) at most.
const REFRESH: Duration = Duration::from_secs(2);

impl<S: Sink> Listener<S> {
    /// The gauges: what the listener holds, and the service's latest statistics.
    fn observe(&self, state: &ListenerState) {
        let stats = &self.stats;
        let set = |gauge: &AtomicU64, value: i64| {
            gauge.store(u64::try_from(value).unwrap_or(0), Ordering::Relaxed);
        };
        set(&stats.runners_idle, state.free_runners().len() as i64);
        set(&stats.runners_busy, state.busy_runners() as i64);
        set(&stats.jobs_held, state.jobs_held() as i64);
        let s = &state.statistics();
        set(&stats.available_jobs, s.total_available_jobs);
        set(&stats.assigned_jobs, s.total_assigned_jobs);
        set(&stats.running_jobs, s.total_running_jobs);
    }

    fn limits(&self) -> Limits {
        Limits {
            min_idle: self.min_idle as usize,
            max_runners: self.max_capacity as usize,
        }
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

    /// The runners the ledger holds, read until it answers; a runner recorded but never
    /// published is removed from GitHub (no workload has its config) and forgotten. `None`
    /// at `stop`.
    async fn held_runners(&self, stop: &CancellationToken) -> Option<ListenerState> {
        let mut backoff = backoff();
        loop {
            match self.load_runners().await {
                Ok(state) => return Some(state),
                Err(error) => {
                    tracing::warn!(error = %jr_error_chain(&error), "reading the scale set's runners from the ledger failed; retrying")
                }
            }
            if !backoff.pause(stop).await {
                return None;
            }
        }
    }

    async fn load_runners(&self) -> Result<ListenerState, ListenError> {
        let mut held = Vec::new();
        for (assignment, record) in self.sink.runners().await? {
            match record {
                RunnerRecord::Free => held.push((assignment, false)),
                RunnerRecord::Busy => held.push((assignment, true)),
                RunnerRecord::Unpublished => {
                    let name = runner_name(&assignment, 1);
                    if let Some(runner) = self.client.runner_by_name(&name).await? {
                        self.client.remove_runner(runner.id).await?;
                    }
                    self.sink.forget(&assignment).await?;
                    tracing::info!(%assignment, "removed a runner made but never published");
                }
            }
        }
        tracing::info!(
            runners = held.len(),
            "the scale set's runners read from the ledger"
        );
        Ok(ListenerState::new(held))
    }

    /// The most jobs the listener can run now, announced to the service: the runners it holds
    /// (busy, or free to take a job) and the runners the backend's room allows it to make, at
    /// most `max_capacity`. Jobs assigned beyond the runners would only wait; counting them
    /// would let every announcement raise the next.
    async fn capacity(&self, state: &ListenerState) -> u32 {
        let held = state.free_runners().len() + state.busy_runners();
        let room = self.sink.room().await;
        let open = held.saturating_add(room);
        tracing::debug!(held, jobs = state.jobs_held(), room, "capacity announced");
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

    /// A JIT config named for `assignment`'s runner. A name left over from an earlier try whose
    /// assignment was never published is removed and made again (no workload can have started
    /// it: only a published assignment carries a config).
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
        let Some(mut state) = self.held_runners(&stop).await else {
            return Ok(());
        };
        let Some(mut session) = self.session(&stop).await? else {
            return Ok(());
        };
        bump(&self.stats.sessions);
        if let Some(statistics) = session.session_statistics() {
            state.set_statistics(statistics);
        }
        let mut saved_session = session.id().to_owned();
        let mut backoff = backoff();
        let mut refreshed = tokio::time::Instant::now();
        loop {
            let capacity = tokio::select! {
                () = stop.cancelled() => break,
                capacity = self.capacity(&state) => capacity,
            };
            // The desired state is applied again every few seconds while the long poll is held
            // (GitHub sends nothing when a runner's workload is lost or room frees up).
            let polled = {
                let poll = session.next_message(capacity);
                tokio::pin!(poll);
                let mut every =
                    tokio::time::interval_at(tokio::time::Instant::now() + REFRESH, REFRESH);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break None,
                        polled = &mut poll => break Some(polled),
                        _ = every.tick() => {
                            refreshed = tokio::time::Instant::now();
                            if let Err(error) = self.scale(&mut state, true).await {
                                tracing::warn!(error = %jr_error_chain(&error), "making or removing runners failed; tried again");
                            }
                            self.observe(&state);
                        }
                    }
                }
            };
            let Some(polled) = polled else {
                break;
            };
            // A session opened again after an eviction is saved at once.
            if session.id() != saved_session {
                self.save(&session).await;
                saved_session = session.id().to_owned();
            }
            let message = match polled {
                Ok(Some(message)) => Some(message),
                Ok(None) => None,
                Err(error) if error.is_transient() => {
                    tracing::warn!(%error, "polling the scale set failed; retrying");
                    if !backoff.pause(&stop).await {
                        break;
                    }
                    continue;
                }
                Err(error) => return Err(error.into()),
            };
            if let Some(message) = message {
                backoff.reset();
                let before = state.clone();
                let room = self.sink.room().await;
                let actions = state.on_message(&message, room);
                // Stopping mid-message is safe: the message is not deleted, every action
                // repeats.
                let done = tokio::select! {
                    () = stop.cancelled() => break,
                    done = self.perform(&mut session, &mut state, actions) => done,
                };
                if let Err(error) = done {
                    tracing::warn!(error = %jr_error_chain(&error), message = message.id, "handling a message failed; it will come again");
                    state = before;
                    if !backoff.pause(&stop).await {
                        break;
                    }
                    continue;
                }
            }
            self.acquire_offered(&mut session, &mut state).await;
            // The desired state is applied again after every poll, an empty one too.
            let refresh = refreshed.elapsed() >= REFRESH;
            if refresh {
                refreshed = tokio::time::Instant::now();
            }
            let scaled = tokio::select! {
                () = stop.cancelled() => break,
                scaled = self.scale(&mut state, refresh) => scaled,
            };
            if let Err(error) = scaled {
                tracing::warn!(error = %jr_error_chain(&error), "making or removing runners failed; tried again after the next poll");
                if !backoff.pause(&stop).await {
                    break;
                }
            }
            self.observe(&state);
        }
        if !keep_session() {
            session.close().await?;
        }
        Ok(())
    }

    /// Compares the runners held with what GitHub's statistics ask for ([`scale::plan`]),
    /// and makes or removes runners. With `refresh`, free runners are first checked against
    /// the ledger: one whose assignment ended (its workload lost, withdrawn by `fail-task`) no
    /// longer counts, so it is made again while a job waits for it.
    async fn scale(&self, state: &mut ListenerState, refresh: bool) -> Result<(), ListenError> {
        let mut unsettled = state.take_unsettled().into_iter();
        while let Some(assignment) = unsettled.next() {
            if let Err(error) = self.settle(state, &assignment).await {
                state.runner_unsettled(&assignment);
                for rest in unsettled {
                    state.runner_unsettled(&rest);
                }
                return Err(error);
            }
        }
        if refresh {
            for assignment in state.free_runners() {
                if !self.sink.open(&assignment).await? {
                    tracing::info!(%assignment, "a free runner is gone (its workload lost, or withdrawn); it no longer counts");
                    state.runner_gone(&assignment);
                    bump(&self.stats.runners_lost);
                }
            }
        }
        let room = self.sink.room().await;
        let free = state.free_runners();
        let mut demand = state.demand();
        if self.min_idle > 0 || free.len() > demand.waiting {
            demand.others_waiting = self.others_waiting(&free).await?;
        }
        let plan = scale::plan(demand, &free, state.busy_runners(), room, self.limits());
        for assignment in &plan.remove {
            self.retire(state, assignment).await?;
        }
        for _ in 0..plan.make {
            if !self.make_runner(state).await? {
                break;
            }
        }
        Ok(())
    }

    /// Assignments of other work waiting for a slot of the backend: those waiting less this
    /// scale set's free runners whose workloads have not started yet (counted as waiting
    /// even once delivered, so this errs towards keeping warm runners).
    async fn others_waiting(&self, free: &[String]) -> Result<usize, ListenError> {
        let waiting = self.sink.backend_waiting().await;
        if waiting == 0 {
            return Ok(0);
        }
        let mut own = 0;
        for assignment in free {
            if !self.sink.started(assignment).await? {
                own += 1;
            }
        }
        Ok(waiting.saturating_sub(own))
    }

    /// A runner whose publish failed: held if it was published after all, else removed from
    /// GitHub (no workload has its config) and forgotten.
    async fn settle(&self, state: &mut ListenerState, assignment: &str) -> Result<(), ListenError> {
        if self.sink.open(assignment).await? {
            state.runner_made(assignment);
            return Ok(());
        }
        if let Some(runner) = self
            .client
            .runner_by_name(&runner_name(assignment, 1))
            .await?
        {
            self.client.remove_runner(runner.id).await?;
        }
        self.sink.forget(assignment).await?;
        tracing::info!(%assignment, "removed a runner whose assignment was not published");
        Ok(())
    }

    /// Makes one runner: recorded, its JIT config made, its assignment published. `false`
    /// when GitHub refuses to make it for good (logged; tried again after the next poll).
    async fn make_runner(&self, state: &mut ListenerState) -> Result<bool, ListenError> {
        let assignment = uuid::Uuid::new_v4().simple().to_string();
        self.sink.prepare(&assignment).await?;
        let jit = match self.jit(&assignment).await {
            Ok(jit) => jit,
            Err(error) => {
                bump(&self.stats.jit_failures);
                if error.is_transient() || matches!(error.status(), Some(401 | 409)) {
                    // It may have been made at GitHub all the same: settled (removed) later.
                    state.runner_unsettled(&assignment);
                    return Err(error.into());
                }
                self.sink.forget(&assignment).await?;
                tracing::error!(error = %jr_error_chain(&error), "GitHub refuses to make a runner; trying again after the next poll");
                return Ok(false);
            }
        };
        if let Err(error) = self.sink.assign(&assignment, &jit).await {
            state.runner_unsettled(&assignment);
            return Err(error.into());
        }
        state.runner_made(&assignment);
        bump(&self.stats.runners_made);
        tracing::info!(%assignment, runner = %jit.runner.name, "runner made");
        Ok(true)
    }

    /// Removes the free runner of `assignment`, beyond `min_idle` on an idle scale set. A
    /// runner is removed from the service before its assignment ends, so it cannot take a job
    /// while its workload is deleted; one that took a job meanwhile is kept, as busy.
    async fn retire(&self, state: &mut ListenerState, assignment: &str) -> Result<(), ListenError> {
        if !self.sink.open(assignment).await? {
            state.runner_gone(assignment);
            return Ok(());
        }
        // Removed at GitHub by an earlier try whose withdrawal was not recorded: record it now
        // (the lookup below would no longer find the runner and take it for a busy one).
        let removed = state.was_removed(assignment) || self.remove_idle_runner(assignment).await?;
        if removed {
            state.runner_removed(assignment);
            self.sink
                .withdrawn(
                    assignment,
                    "the scale set is idle, or other work waits for its slot: runner removed unused",
                )
                .await?;
            state.runner_gone(assignment);
            bump(&self.stats.runners_removed);
        } else {
            state.runner_busy(assignment);
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

    /// A job newly assigned to the scale set: if the guard refuses it, its run is cancelled
    /// and it gets no runner.
    async fn check(&self, state: &mut ListenerState, job: &JobFacts) -> Result<(), ListenError> {
        bump(&self.stats.jobs_assigned);
        let Some(reason) = self.refusal(job).await? else {
            return Ok(());
        };
        tracing::warn!(job = %job.key(), run = job.workflow_run_id, %reason, "job refused by the trust guard; cancelling its run");
        match self
            .client
            .cancel_run(&job.owner_name, &job.repository_name, job.workflow_run_id)
            .await
        {
            Ok(()) => {}
            Err(error) if error.is_transient() => return Err(error.into()),
            Err(error) => {
                tracing::error!(error = %jr_error_chain(&error), run = job.workflow_run_id, "the refused job's run cannot be cancelled; it gets no runner from jetrunner")
            }
        }
        self.sink.refused(job, &reason).await?;
        state.job_refused(job);
        Ok(())
    }

    /// Removes the runner of `assignment` if it never had a job: `false` when it has one now
    /// (`JobStillRunningException`) or had one (an ephemeral runner is gone after its job).
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
                Action::Check(job) => self.check(state, &job).await?,
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
                Action::Delete(id) => {
                    session.delete_message(id).await?;
                    // The commit point: the message is gone and its actions are done.
                    self.save(session).await;
                    bump(&self.stats.messages);
                }
            }
        }
        Ok(())
    }
}

/// `error` with its whole chain of causes.
fn jr_error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
