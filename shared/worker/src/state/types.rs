//! The vocabulary of the worker's state machine: what goes in ([`Input`]), what comes out
//! ([`Effect`]), and the lifecycle of one workload ([`Stage`]).

use std::time::{Duration, Instant};

use jr_bus::Disposition;
use jr_protocol::{AssignmentId, WorkloadPhase};

use crate::backend::ObservedWorkload;

/// One attempt of one assignment: the unit that owns at most one workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttemptKey {
    pub assignment: AssignmentId,
    pub attempt: u32,
}

impl AttemptKey {
    pub fn new(assignment: AssignmentId, attempt: u32) -> Self {
        Self {
            assignment,
            attempt,
        }
    }

    pub fn of(o: &ObservedWorkload) -> Self {
        Self::new(o.assignment_id, o.attempt)
    }
}

impl std::fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.assignment, self.attempt)
    }
}

/// A message being handled (an assignment or a command); settled exactly once by an effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryId(pub u64);

/// Permission to pull one assignment: a reserved capacity slot until the pulled message is
/// handled (or the ticket is dropped unused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketId(pub u64);

/// What JetStream held about an assignment when one of its messages was delivered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BusFacts {
    /// Attempt of the last message on the assignment's subject (the current attempt).
    pub latest_attempt: Option<u32>,
    /// A `terminal` event exists (the task is final, or was withdrawn while waiting).
    pub terminal: bool,
    /// The attempt whose executor claimed the task, if any.
    pub claimed_attempt: Option<u32>,
    /// The last attempt for which a `workload-created` was published.
    pub created_attempt: Option<u32>,
    /// The job must get a workload of its own, not an idle warm executor (a GitHub job, whose
    /// runner is made for it).
    pub no_warm: bool,
}

/// The backend's answer to a create call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreateAnswer {
    /// The workload exists (created now or found from an earlier call).
    Created(String),
    /// No room right now (OpenSandbox 429, a quota): back-pressure, not a failure.
    Full { retry_after: Duration },
    /// No room for this job now, while others may fit: it waits, pulling goes on.
    Wait { retry_after: Duration },
    /// Worth trying again later; the server may or may not have made something.
    Transient { retry_after: Option<Duration> },
    /// Retrying the same request cannot succeed (bad template, missing pool).
    Refused { message: String },
}

/// The backend's answer to a delete call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeleteAnswer {
    /// Accepted, or the workload was already gone.
    Deleted,
    Transient {
        retry_after: Option<Duration>,
    },
    /// Never retry (not ours, not a valid name).
    Refused {
        message: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Start-up: everything the backend lists as ours, and every workload this worker had
    /// announced and not yet released (from its own ledger on the bus).
    Recovered {
        listed: Vec<ObservedWorkload>,
        remembered: Vec<(AttemptKey, String)>,
    },
    /// Workloads of another worker process of this backend that this one takes over (a
    /// replica that stopped renewing its holding): what the backend lists of them, and what
    /// that process remembered.
    Adopted {
        listed: Vec<ObservedWorkload>,
        remembered: Vec<(AttemptKey, String)>,
    },
    /// The slots this process may fill now (its share of the backend's capacity).
    Capacity(usize),
    /// How many worker replicas of the backend are live: each keeps its part (rounded up) of
    /// the warm executors.
    Replicas(usize),
    /// The assignment consumer wants to pull up to `max` messages (at least one) in one pull.
    PullWanted {
        max: usize,
    },
    /// A granted ticket was given back without a message.
    TicketDropped(TicketId),
    /// An assignment message, with the pull ticket it came through.
    Delivered {
        delivery: DeliveryId,
        key: AttemptKey,
        ticket: Option<TicketId>,
        facts: BusFacts,
    },
    CreateAnswered {
        delivery: DeliveryId,
        key: AttemptKey,
        answer: CreateAnswer,
    },
    /// A `delete-workload` command (already checked to be for this backend).
    DeleteRequested {
        delivery: DeliveryId,
        key: AttemptKey,
        workload: String,
    },
    DeleteAnswered {
        delivery: DeliveryId,
        key: AttemptKey,
        workload: String,
        answer: DeleteAnswer,
    },
    /// A change seen by the backend's watch or poller.
    Observed(ObservedWorkload),
    /// A full listing of the backend, requested at `started`.
    Listed {
        started: Instant,
        listed: Vec<ObservedWorkload>,
    },
    ListFailed,
    /// The backend's answer to creating warm executor `warm`.
    WarmCreateAnswered {
        warm: AssignmentId,
        answer: CreateAnswer,
    },
    /// The backend's answer to deleting an idle warm executor.
    WarmDeleteAnswered {
        workload: String,
        answer: DeleteAnswer,
    },
    /// Time passed.
    Tick,
}

/// A fact the worker publishes on `jr.event.<backend>.<assignment>.<kind>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Created {
        key: AttemptKey,
        workload: String,
        /// The warm identity of a warm executor bound to this attempt. The driver records the
        /// binding where the facade reads it before it publishes the event.
        warm: Option<AssignmentId>,
    },
    Observed {
        key: AttemptKey,
        workload: String,
        phase: WorkloadPhase,
        reason: Option<String>,
    },
    Released {
        key: AttemptKey,
        workload: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Hand these tickets (one per message the pull may bring, at least one) to the oldest
    /// waiting pull.
    GrantPull(Vec<TicketId>),
    /// Publish `workload-requested` (the token hash), then call the backend's create; answer
    /// with [`Input::CreateAnswered`].
    Create {
        delivery: DeliveryId,
        key: AttemptKey,
    },
    /// Create warm executor `warm` (attempt 0 of the warm identity); answer with
    /// [`Input::WarmCreateAnswered`].
    CreateWarm {
        warm: AssignmentId,
    },
    /// Delete an idle warm executor; answer with [`Input::WarmDeleteAnswered`].
    DeleteWarm {
        workload: String,
    },
    /// Call the backend's delete; answer with [`Input::DeleteAnswered`].
    Delete {
        delivery: DeliveryId,
        key: AttemptKey,
        workload: String,
    },
    /// List the backend; answer with [`Input::Listed`] or [`Input::ListFailed`].
    List,
    /// Publish (retrying through outages).
    Publish(Event),
    /// Publish these in order, then ack the delivery; nak it if any cannot be published.
    Confirm {
        delivery: DeliveryId,
        events: Vec<Event>,
    },
    Settle {
        delivery: DeliveryId,
        disposition: Disposition,
    },
    /// Record in the worker's ledger that this workload is announced and not yet released.
    Remember {
        key: AttemptKey,
        workload: String,
    },
    Forget {
        key: AttemptKey,
        workload: String,
    },
}

/// Where a tracked workload is in its life. Every stage holds one capacity slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Found on the backend with no create of ours behind it and not in our ledger (left over
    /// from a refused or failed create, or from before a restart). Nothing is published about
    /// it until it has existed for the stray grace, so one that vanishes quickly (OpenSandbox
    /// cleaning up after a 429) is never reported as a failure.
    Stray { announce_at: Instant },
    /// Announced (created, or adopted and reported): its changes and its end are published.
    Live,
    /// A delete was asked for; `released` follows when the backend reports it gone.
    Deleting { call_in_flight: bool },
}

/// A workload the worker tracks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub key: AttemptKey,
    pub phase: WorkloadPhase,
    pub reason: Option<String>,
    pub stage: Stage,
    /// When it was first tracked; a listing older than this cannot say it is gone.
    pub since: Instant,
    /// When its phase was last updated; an older listing does not overwrite it.
    pub updated: Instant,
    /// The phase and reason the reconciler last heard of it (published, or implied by
    /// `workload-created`: pending).
    pub reported: (WorkloadPhase, Option<String>),
    /// When a held report of its exit is due (see [`StateConfig::exit_report_delay`]).
    pub report_at: Option<Instant>,
    /// A warm executor's warm identity: `key` is `(warm, 0)` while it is idle and the bound
    /// attempt afterwards.
    pub warm: Option<AssignmentId>,
    /// An idle warm executor being retired: when the delete call is (re)issued.
    pub retire_at: Option<Instant>,
}

impl Workload {
    /// Tracked from `now` in `stage`, as observed.
    pub fn new(
        key: AttemptKey,
        phase: WorkloadPhase,
        reason: Option<String>,
        stage: Stage,
        now: Instant,
    ) -> Self {
        Self {
            key,
            reported: (phase, reason.clone()),
            phase,
            reason,
            stage,
            since: now,
            updated: now,
            report_at: None,
            warm: None,
            retire_at: None,
        }
    }

    /// Whether the reconciler knows it: announced job workloads (an idle warm executor is
    /// the worker's own business until it is bound).
    pub fn is_announced(&self) -> bool {
        match self.stage {
            Stage::Stray { .. } => false,
            Stage::Live | Stage::Deleting { .. } => !self.is_idle_warm(),
        }
    }

    /// A warm executor not bound to a job (its key is attempt 0 of its warm identity; real
    /// attempts start at 1).
    pub fn is_idle_warm(&self) -> bool {
        self.key.attempt == 0
    }
}

/// Warm executors of the backend (`[backend.<name>.warm]`); all zero: none.
#[derive(Clone, Debug, Default)]
pub struct WarmPolicy {
    pub min_idle: usize,
    pub max_idle: usize,
    /// Back to `min_idle` after the backend was completely idle this long.
    pub idle_timeout: Duration,
    /// Idle warm executors older than this are replaced and no longer bound.
    pub max_age: Duration,
    /// Mixed into the warm identities this state makes (random per process).
    pub seed: u64,
}

/// Tunables of the state machine.
#[derive(Clone, Debug)]
pub struct StateConfig {
    pub capacity: usize,
    /// How long an unknown workload exists before it is announced.
    pub stray_grace: Duration,
    /// How often the backend is listed to catch what the watch or poller missed.
    pub resync_every: Duration,
    /// How long released workloads and per-assignment facts are remembered.
    pub memory: Duration,
    /// Nak delay for a message that has to wait (no slot, a create in flight).
    pub busy_retry: Duration,
    /// Nak delay after a transient create failure without a Retry-After.
    pub transient_retry: Duration,
    /// How long the exit of a live workload is held back before it is published. An executor
    /// exits right after reporting its job's result, and the reconciler's `delete-workload`
    /// follows within moments: an exit that a delete overtakes tells nobody anything, so in
    /// the usual case nothing is published for it and `released` is the only word.
    pub exit_report_delay: Duration,
    pub warm: WarmPolicy,
}

impl StateConfig {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            stray_grace: Duration::from_secs(60),
            resync_every: Duration::from_secs(15),
            memory: Duration::from_secs(1800),
            busy_retry: Duration::from_secs(1),
            transient_retry: Duration::from_secs(5),
            exit_report_delay: Duration::from_secs(2),
            warm: WarmPolicy::default(),
        }
    }
}
