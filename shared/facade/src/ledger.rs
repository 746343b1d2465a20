//! The facade's only view of jetrunner state: one small trait the scheduler implements over
//! JetStream, plus an honest in-memory implementation for tests.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

use jr_bus::warm::WarmBinding;
use jr_protocol::{AssignmentId, BackendName, SealedTask, Terminal, TokenHash};

/// What the facade knows about one assignment (fed from JetStream by the scheduler).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssignmentView {
    pub id: AssignmentId,
    pub backend: BackendName,
    /// The current attempt; `token_hash` and `claimed` are about this attempt.
    pub attempt: u32,
    pub forge_task_id: i64,
    pub sealed_task: SealedTask,
    /// Lower-case hex SHA-256 of the executor token of `attempt`, from `workload-requested` or
    /// `workload-created`. `None` until that event is visible.
    pub token_hash: Option<TokenHash>,
    /// A `claimed` event exists for this assignment.
    pub claimed: bool,
    /// A `terminal` event exists for this assignment.
    pub terminal: bool,
    /// The job's trace (W3C context the assignment carries), for the facade's spans.
    pub trace: Option<Box<jr_protocol::TraceContext>>,
}

/// Why the ledger could not answer. The facade turns every variant into a retryable
/// `unavailable` for the executor.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// JetStream (or whatever backs the ledger) did not answer.
    #[error("ledger unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The ledger answered with something it cannot interpret.
    #[error("ledger data invalid: {0}")]
    Invalid(String),
}

impl LedgerError {
    pub fn unavailable(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        LedgerError::Unavailable(source.into())
    }

    pub fn kind(&self) -> &'static str {
        match self {
            LedgerError::Unavailable(_) => "unavailable",
            LedgerError::Invalid(_) => "invalid",
        }
    }
}

/// Reads assignments and publishes the facade's facts. The once-only publishes must be settled
/// by the store itself (JetStream: `Nats-Expected-Last-Subject-Sequence: 0` on the
/// per-assignment subject), never by the caller's memory: several scheduler replicas may race.
pub trait Ledger: Send + Sync + 'static {
    /// The assignment as currently known, or `None` if it is not (yet) visible.
    fn lookup(
        &self,
        id: AssignmentId,
    ) -> impl Future<Output = Result<Option<AssignmentView>, LedgerError>> + Send;

    /// The assignment as far as checking its executor needs (backend, attempt, token hash,
    /// sealed task); `claimed` and `terminal` may be left unread (false). For calls that decide
    /// nothing on the task's progress (Declare).
    fn identify(
        &self,
        id: AssignmentId,
    ) -> impl Future<Output = Result<Option<AssignmentView>, LedgerError>> + Send {
        self.lookup(id)
    }

    /// Once-only `claimed` for `view.attempt`. `Ok(true)`: this call created it;
    /// `Ok(false)`: a claim already existed.
    fn publish_claimed(
        &self,
        view: &AssignmentView,
        executor: &str,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send;

    /// Once-only `terminal`. `Ok(true)`: this call created it; `Ok(false)`: one already existed.
    fn publish_terminal(
        &self,
        view: &AssignmentView,
        terminal: Terminal,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send;

    /// The `terminal` recorded for the assignment, if any (read when a final arrives for a task
    /// this facade did not see end, to answer it without the forge).
    fn terminal_of(
        &self,
        view: &AssignmentView,
    ) -> impl Future<Output = Result<Option<Terminal>, LedgerError>> + Send;

    /// `executor-finished`: the executor closed its log after its final result was accepted.
    /// May be called more than once for one assignment (deduplicate by message id).
    fn publish_executor_finished(
        &self,
        view: &AssignmentView,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send;

    /// The attempt `backend`'s worker bound warm executor `warm` to, if it did (read from
    /// that backend's own record, which only its worker may write).
    fn warm_binding(
        &self,
        backend: &BackendName,
        warm: AssignmentId,
    ) -> impl Future<Output = Result<Option<WarmBinding>, LedgerError>> + Send;
}

/// One assignment's record inside [`MemoryLedger`].
#[derive(Clone, Debug)]
pub struct MemoryRecord {
    pub view: AssignmentView,
    /// Executor of the winning claim.
    pub claimed_by: Option<String>,
    pub terminal: Option<Terminal>,
    /// How many times `publish_executor_finished` was called.
    pub executor_finished: u32,
    /// Publish attempts refused because the fact already existed (claims, terminals).
    pub refused_publishes: u32,
}

/// An in-memory [`Ledger`] with the same once-only semantics as JetStream: the first claim or
/// terminal for an assignment wins under a lock; later ones get `Ok(false)`.
#[derive(Debug, Default)]
pub struct MemoryLedger {
    records: Mutex<HashMap<AssignmentId, MemoryRecord>>,
    warm: Mutex<HashMap<(BackendName, AssignmentId), WarmBinding>>,
}

impl MemoryLedger {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces an assignment (its `claimed`/`terminal` flags are taken as given).
    pub fn insert(&self, view: AssignmentView) {
        let record = MemoryRecord {
            view,
            claimed_by: None,
            terminal: None,
            executor_finished: 0,
            refused_publishes: 0,
        };
        self.lock().insert(record.view.id, record);
    }

    /// Sets the token hash of the current attempt (what `workload-requested` does).
    pub fn set_token_hash(&self, id: AssignmentId, token_hash: Option<TokenHash>) {
        if let Some(record) = self.lock().get_mut(&id) {
            record.view.token_hash = token_hash;
        }
    }

    /// Records what a worker of `backend` does when it binds warm executor `warm`.
    pub fn bind_warm(&self, backend: &BackendName, warm: AssignmentId, binding: WarmBinding) {
        self.warm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((backend.clone(), warm), binding);
    }

    pub fn record(&self, id: AssignmentId) -> Option<MemoryRecord> {
        self.lock().get(&id).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AssignmentId, MemoryRecord>> {
        // A panic while holding this lock can only come from a bug in this file; the map itself
        // stays consistent, so keep serving.
        self.records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Ledger for MemoryLedger {
    async fn lookup(&self, id: AssignmentId) -> Result<Option<AssignmentView>, LedgerError> {
        Ok(self.lock().get(&id).map(|r| r.view.clone()))
    }

    async fn terminal_of(&self, view: &AssignmentView) -> Result<Option<Terminal>, LedgerError> {
        Ok(self.lock().get(&view.id).and_then(|r| r.terminal.clone()))
    }

    async fn publish_claimed(
        &self,
        view: &AssignmentView,
        executor: &str,
    ) -> Result<bool, LedgerError> {
        let mut records = self.lock();
        let record = records
            .get_mut(&view.id)
            .ok_or_else(|| LedgerError::Invalid(format!("no assignment {}", view.id)))?;
        if record.view.claimed {
            record.refused_publishes += 1;
            return Ok(false);
        }
        record.view.claimed = true;
        record.claimed_by = Some(executor.to_owned());
        Ok(true)
    }

    async fn publish_terminal(
        &self,
        view: &AssignmentView,
        terminal: Terminal,
    ) -> Result<bool, LedgerError> {
        let mut records = self.lock();
        let record = records
            .get_mut(&view.id)
            .ok_or_else(|| LedgerError::Invalid(format!("no assignment {}", view.id)))?;
        if record.view.terminal {
            record.refused_publishes += 1;
            return Ok(false);
        }
        record.view.terminal = true;
        record.terminal = Some(terminal);
        Ok(true)
    }

    async fn publish_executor_finished(&self, view: &AssignmentView) -> Result<(), LedgerError> {
        let mut records = self.lock();
        let record = records
            .get_mut(&view.id)
            .ok_or_else(|| LedgerError::Invalid(format!("no assignment {}", view.id)))?;
        record.executor_finished += 1;
        Ok(())
    }

    async fn warm_binding(
        &self,
        backend: &BackendName,
        warm: AssignmentId,
    ) -> Result<Option<WarmBinding>, LedgerError> {
        Ok(self
            .warm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&(backend.clone(), warm))
            .copied())
    }
}

/// A shared ledger (e.g. several facades over one [`MemoryLedger`] in tests).
impl<T: Ledger> Ledger for std::sync::Arc<T> {
    fn lookup(
        &self,
        id: AssignmentId,
    ) -> impl Future<Output = Result<Option<AssignmentView>, LedgerError>> + Send {
        (**self).lookup(id)
    }

    fn identify(
        &self,
        id: AssignmentId,
    ) -> impl Future<Output = Result<Option<AssignmentView>, LedgerError>> + Send {
        (**self).identify(id)
    }

    fn terminal_of(
        &self,
        view: &AssignmentView,
    ) -> impl Future<Output = Result<Option<Terminal>, LedgerError>> + Send {
        (**self).terminal_of(view)
    }

    fn publish_claimed(
        &self,
        view: &AssignmentView,
        executor: &str,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send {
        (**self).publish_claimed(view, executor)
    }

    fn publish_terminal(
        &self,
        view: &AssignmentView,
        terminal: Terminal,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send {
        (**self).publish_terminal(view, terminal)
    }

    fn publish_executor_finished(
        &self,
        view: &AssignmentView,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send {
        (**self).publish_executor_finished(view)
    }

    fn warm_binding(
        &self,
        backend: &BackendName,
        warm: AssignmentId,
    ) -> impl Future<Output = Result<Option<WarmBinding>, LedgerError>> + Send {
        (**self).warm_binding(backend, warm)
    }
}
