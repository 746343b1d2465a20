//! The GitHub intake: jetrunner as the runner controller of GitHub Actions runner scale sets.
//!
//! Each `[[github]]` entry is an [`jr_intake::Intake`]: on the replica holding its lease, a
//! [`jr_github::Listener`] follows the scale set's message session and makes a just-in-time
//! runner for each job, published through the shared [`jr_intake::sink::AssignmentSink`] with
//! the [`ledger`]'s JetStream records. [`GitHubCommands`] is the forge's answer to `fail-task`.

pub mod commands;
pub mod forge;
pub mod ledger;

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use jr_bus::Bus;
use jr_bus::async_nats::jetstream::kv;
use jr_config::Config;
use jr_intake::board::IntakeBoard;
use jr_intake::sink::AssignmentSink;
use tokio_util::sync::CancellationToken;

pub use commands::GitHubCommands;
pub use forge::GitHubForge;

/// The kind and layout a GitHub intake reports on the board.
pub const BOARD_KIND: (&str, &str) = ("github", "scale-set");

/// Every `[[github]]` entry of a scheduler: those that could be built, and the error of each
/// that could not (its own intake's error; the others run).
pub struct GitHub {
    pub forges: Vec<GitHubForge>,
    pub broken: Vec<(String, anyhow::Error)>,
}

impl GitHub {
    /// Builds every `[[github]]` entry's client (reading its credentials); talks to no one.
    pub fn build(config: &Config) -> GitHub {
        let (forges, broken): (Vec<_>, Vec<_>) = GitHubForge::from_config(config)
            .into_iter()
            .partition(Result::is_ok);
        GitHub {
            forges: forges.into_iter().filter_map(Result::ok).collect(),
            broken: broken.into_iter().filter_map(Result::err).collect(),
        }
    }

    /// Reports the entries that could not be built as their intakes' errors.
    pub fn report_broken(&self, board: &IntakeBoard) {
        for (intake, error) in &self.broken {
            let why = format!("{error:#}");
            tracing::error!(%intake, error = %why, "this GitHub scale set cannot start; everything else runs");
            board.report(intake, Some(BOARD_KIND), Some(why), true);
        }
    }

    /// Each entry's listener statistics, by `[[github]]` name (for the metrics).
    pub fn stats(&self) -> Vec<(String, Arc<jr_github::ListenerStats>)> {
        self.forges
            .iter()
            .map(|f| (f.entry.name.clone(), f.stats.clone()))
            .collect()
    }

    /// The forge's answer to `fail-task`.
    pub fn commands(&self, bus: Bus) -> GitHubCommands {
        GitHubCommands {
            bus,
            clients: Arc::new(
                self.forges
                    .iter()
                    .map(|f| (f.entry.name.clone(), f.client.clone()))
                    .collect::<BTreeMap<_, _>>(),
            ),
        }
    }

    /// Every entry as an intake.
    pub fn intakes(self, parts: &GitHubParts) -> Vec<Box<dyn jr_intake::Intake>> {
        self.forges
            .into_iter()
            .map(|forge| {
                Box::new(GitHubIntake {
                    forge,
                    parts: parts.clone(),
                }) as Box<dyn jr_intake::Intake>
            })
            .collect()
    }
}

/// What every GitHub intake runs with.
#[derive(Clone)]
pub struct GitHubParts {
    pub bus: Bus,
    /// `JR_SCHEDULER`: the entries' leases, job index and session cursors.
    pub store: kv::Store,
    pub sink: AssignmentSink,
    pub board: Arc<IntakeBoard>,
    /// This replica's id (lease holder name, message session owner).
    pub me: String,
    pub policy: jr_lease::Policy,
}

/// One `[[github]]` entry as an intake: its listener runs on the replica holding
/// `lease.github.<name>`.
pub struct GitHubIntake {
    forge: GitHubForge,
    parts: GitHubParts,
}

impl jr_intake::Intake for GitHubIntake {
    fn name(&self) -> String {
        self.forge.intake()
    }

    fn run(self: Box<Self>, shutdown: CancellationToken) -> BoxFuture<'static, ()> {
        let GitHubIntake { forge, parts } = *self;
        Box::pin(async move {
            let leadership = jr_bus::lease::spawn_lease(
                jr_bus::lease::LeaseSpec {
                    store: parts.store.clone(),
                    key: format!("lease.github.{}", forge.entry.name),
                    me: parts.me.clone(),
                    policy: parts.policy,
                },
                shutdown.clone(),
            );
            forge
                .run(
                    parts.bus,
                    parts.store,
                    parts.sink,
                    leadership,
                    parts.me,
                    Some(parts.board),
                    shutdown,
                )
                .await;
        })
    }
}
