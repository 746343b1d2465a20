//! The Gitea/Forgejo intake: jetrunner as a runner of a Gitea or Forgejo forge.
//!
//! Each registration (one per backend, or one shared runner) is an [`jr_intake::Intake`]: its
//! runner is established on its own, then its fetch loop takes tasks while its backends have
//! room and publishes them through the shared [`jr_intake::sink::AssignmentSink`]. Fetched tasks
//! are kept alive at the forge until an executor claims them ([`unclaimed`]). [`Forges`] is the
//! facade's [`jr_facade::ForgeDirectory`] (a task belongs to the runner that fetched it) and
//! [`GiteaCommands`] the forge's answer to `fail-task`.

pub mod commands;
pub mod declaration;
pub mod fetcher;
pub mod forges;
pub mod intake;
pub mod registration;
pub mod request_key;
pub mod tasks_version;
pub mod unclaimed;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use jr_bus::Bus;
use jr_bus::async_nats::jetstream::kv;
use jr_config::Config;
use jr_intake::board::IntakeBoard;
use jr_intake::routing::Router;
use jr_intake::sink::AssignmentSink;
use tokio_util::sync::CancellationToken;

pub use commands::GiteaCommands;
pub use fetcher::{Dispatcher, Pacing};
pub use forges::{Forges, Planned, Registration};
pub use registration::SharedCredentials;
pub use unclaimed::Unclaimed;

/// The Gitea/Forgejo forge of a scheduler, assembled from `[forge]`: its registrations (each
/// an intake), the dispatcher their fetch loops share, and the tasks waiting for a claim.
pub struct Gitea {
    pub config: Arc<Config>,
    pub dispatcher: Arc<Dispatcher>,
    pub planned: Vec<Planned>,
    pub shared: BTreeMap<String, SharedCredentials>,
    pub pacing: Pacing,
}

/// Where a Gitea forge's parts come from.
pub struct GiteaParts<'a> {
    pub config: Arc<Config>,
    pub bus: Bus,
    pub sink: AssignmentSink,
    pub board: Arc<IntakeBoard>,
    /// `JR_SCHEDULER`: leases, shared credentials, request keys.
    pub store: kv::Store,
    /// This replica's id (lease holder name).
    pub me: &'a str,
    pub policy: jr_lease::Policy,
}

impl Gitea {
    /// Plans every registration `[forge]` asks for and starts their leases. Nothing talks to
    /// the forge yet: each registration is established by its own intake.
    pub fn build(parts: GiteaParts<'_>, shutdown: &CancellationToken) -> Gitea {
        let GiteaParts {
            config,
            bus,
            sink,
            board,
            store,
            me,
            policy,
        } = parts;
        let router = Router::from_config(&config);
        // One fetching replica per registration: the holder of its lease in `JR_SCHEDULER`. It
        // registers the runner when none is known yet (the others wait for its sealed
        // credentials) and replays the tasks fetched before and still waiting for a claim when
        // it takes over.
        let leases: BTreeMap<String, jr_bus::lease::Leadership> = config
            .registration_names()
            .into_iter()
            .map(|name| {
                let spec = jr_bus::lease::LeaseSpec {
                    store: store.clone(),
                    key: format!("lease.{name}"),
                    me: me.to_owned(),
                    policy,
                };
                let leadership = jr_bus::lease::spawn_lease(spec, shutdown.clone());
                (name, leadership)
            })
            .collect();
        let shared: BTreeMap<String, SharedCredentials> = leases
            .iter()
            .map(|(name, leadership)| {
                (
                    name.clone(),
                    SharedCredentials {
                        store: store.clone(),
                        sealer: sink.sealer().clone(),
                        leadership: leadership.clone(),
                        registration: name.clone(),
                    },
                )
            })
            .collect();
        let (forges, planned) = Forges::plan(&config, &router);
        let max_duration: BTreeMap<_, _> = config
            .enabled_backends()
            .map(|(n, b)| (n, b.max_duration))
            .collect();
        let lookahead = config
            .enabled_backends()
            .map(|(n, b)| (n, b.lookahead))
            .collect();
        // Tasks fetched before a restart and still unclaimed need their heartbeats again. The
        // forge's endless-task timeout (3 h on Gitea) bounds how far back one can still be alive.
        let unclaimed = Arc::new(Unclaimed::new(config.forge.keepalive_interval));
        let horizon = max_duration
            .values()
            .copied()
            .max()
            .unwrap_or(Duration::from_secs(3 * 3600))
            + Duration::from_secs(600);
        let dispatcher = Arc::new(Dispatcher {
            bus,
            forges,
            router,
            sink,
            forge_instance: config.forge.url.trim_end_matches('/').to_owned(),
            max_duration,
            lookahead,
            unclaimed,
            unclaimed_horizon: horizon,
            leases,
            stats: Default::default(),
            presence: Default::default(),
            intakes: board,
        });
        let pacing = Pacing {
            poll_interval: config.forge.poll_interval,
            max_backoff: config.forge.max_backoff,
            version_reset_interval: config.forge.version_reset_interval,
            flavor: config.forge.flavor,
            task_capacity: config.forge.task_capacity,
        };
        Gitea {
            config,
            dispatcher,
            planned,
            shared,
            pacing,
        }
    }

    /// The registrations' clients (the facade's [`jr_facade::ForgeDirectory`]).
    pub fn forges(&self) -> &Forges {
        &self.dispatcher.forges
    }

    /// Fetched tasks no executor claimed yet (the facade's ledger settles them).
    pub fn unclaimed(&self) -> Arc<Unclaimed> {
        self.dispatcher.unclaimed.clone()
    }

    /// The forge's answer to `fail-task`.
    pub fn commands(&self) -> GiteaCommands {
        GiteaCommands {
            bus: self.dispatcher.bus.clone(),
            forges: self.dispatcher.forges.clone(),
        }
    }

    /// Every registration as an intake, to run each as its own task.
    pub fn intakes(&self) -> Vec<Box<dyn jr_intake::Intake>> {
        self.planned
            .iter()
            .map(|planned| {
                Box::new(GiteaIntake {
                    dispatcher: self.dispatcher.clone(),
                    config: self.config.clone(),
                    planned: planned.clone(),
                    shared: self.shared.get(&planned.name).cloned(),
                    pacing: self.pacing,
                }) as Box<dyn jr_intake::Intake>
            })
            .collect()
    }

    /// Keeps fetched, unclaimed tasks alive at the forge until `shutdown`.
    pub fn keepalive(&self, shutdown: CancellationToken) -> BoxFuture<'static, anyhow::Result<()>> {
        let (u, f, b) = (
            self.dispatcher.unclaimed.clone(),
            self.dispatcher.forges.clone(),
            self.dispatcher.bus.clone(),
        );
        Box::pin(async move { unclaimed::run_keepalive(u, f, b, shutdown).await })
    }
}

/// One registration as an intake.
pub struct GiteaIntake {
    dispatcher: Arc<Dispatcher>,
    config: Arc<Config>,
    planned: Planned,
    shared: Option<SharedCredentials>,
    pacing: Pacing,
}

impl jr_intake::Intake for GiteaIntake {
    fn name(&self) -> String {
        self.planned.name.clone()
    }

    fn run(self: Box<Self>, shutdown: CancellationToken) -> BoxFuture<'static, ()> {
        let GiteaIntake {
            dispatcher,
            config,
            planned,
            shared,
            pacing,
        } = *self;
        Box::pin(intake::run_registration(
            dispatcher, config, planned, shared, pacing, shutdown,
        ))
    }
}
