//! The seam between jetrunner's core and the forges it takes work from.
//!
//! An **intake** is one source of work: a Gitea/Forgejo runner registration, or a GitHub runner
//! scale set. Each runs as its own task with its own lease, pacing and failure domain; a forge
//! that is down, slow or refusing is retried and reported, and never stops another intake.
//! Every forge crate (`jr-gitea-intake`, `jr-github-intake`) builds on the same parts:
//!
//! - [`Intake`]: the loop the scheduler spawns, one per intake;
//! - [`pacing`] and [`presence`]: whether a backend takes work (a live worker, room left in its
//!   lookahead), read from the bus the same way for every forge;
//! - [`sink::AssignmentSink`]: the one place an assignment is built, sealed and published, and
//!   [`ours`]: the one place a terminal is built and published, and an assignment recognised as
//!   this scheduler's;
//! - [`board::IntakeBoard`]: every intake's health, in the log, `/readyz`, the metrics and the
//!   `JR_INTAKES` bucket the status page reads;
//! - [`ForgeCommands`]: what a forge does with the reconciler's `fail-task` for one of its
//!   assignments.
//!
//! The executor side of the contract (the environment a workload gets, whether a warm
//! executor may take the job) is [`jr_protocol::ForgeKind`], so workers need no forge crate.

pub mod board;
pub mod ours;
pub mod pacing;
pub mod presence;
pub mod routing;
pub mod sink;

use futures::future::BoxFuture;
use jr_bus::Disposition;
use jr_protocol::{AssignmentId, BackendName, ForgeKind};
use tokio_util::sync::CancellationToken;

/// One source of work, run by the scheduler as its own task.
pub trait Intake: Send + 'static {
    /// Its name, as keyed in `JR_INTAKES` and its lease: a registration's (`shared`, or its
    /// backend's), or `github.<name>`.
    fn name(&self) -> String;

    /// Runs until `shutdown`: establishes itself (retrying while its forge is down or refuses
    /// it), then takes work while its backends have room and publishes it through the
    /// [`sink::AssignmentSink`]. Trouble with the forge is reported on the board and retried;
    /// it never ends the intake, and never another one.
    fn run(self: Box<Self>, shutdown: CancellationToken) -> BoxFuture<'static, ()>;
}

/// A `fail-task` the reconciler sent for an assignment of this forge, checked to be one this
/// scheduler published (sealed with its key, for the forge task named).
#[derive(Clone, Copy, Debug)]
pub struct LostTask<'a> {
    pub id: AssignmentId,
    pub attempt: u32,
    pub backend: &'a BackendName,
    pub forge_task_id: i64,
    pub forge: &'a ForgeKind,
    /// Why the reconciler gave the workload up.
    pub reason: &'a str,
}

/// What a forge does with the scheduler's commands about its assignments.
pub trait ForgeCommands: Send + Sync + 'static {
    /// Whether this forge's commands handle assignments of `forge`.
    fn serves(&self, forge: &ForgeKind) -> bool;

    /// Ends the assignment whose workload is lost: publishes its once-only terminal and tells
    /// the forge (a job-bound forge reports the task failed; a runner-bound one withdraws a
    /// runner that never took a job, and waits for the forge's own end of one that did).
    /// Returns what to do with the command (retry later while the forge is unreachable).
    fn fail_task<'a>(&'a self, lost: LostTask<'a>) -> BoxFuture<'a, Disposition>;

    /// Whether a lost attempt is ended ([`ForgeCommands::fail_task`]) rather than started
    /// again as attempt n+1 when the reconciler asks for a redispatch: a runner-bound forge's
    /// runner registration works once, so its intake makes a fresh runner instead.
    fn ends_lost_attempts(&self) -> bool {
        false
    }
}
