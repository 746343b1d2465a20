//! The scheduler's forge registrations: one runner per enabled backend (each declaring only that
//! backend's labels, so the forge hands its fetch loop only jobs the backend can run), or one
//! shared runner for all backends. A task belongs to the runner that fetched it, so every later
//! call about it (keepalive, forwarded reports, failure reports) uses that runner's client.
//!
//! Each registration is established on its own ([`Planned::establish`]), while the rest of the
//! scheduler already runs: [`Forges`] is shared by the facade, the command handlers and the
//! fetch loops and fills as registrations come up, so a forge that is down or refuses a runner
//! holds up nothing but that registration.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, PoisonError, RwLock};

use jr_config::{Config, RegistrationLayout};
use jr_forge::ForgeClient;
use jr_protocol::BackendName;
use tokio_util::sync::CancellationToken;

use crate::registration::{
    RegistrationError, RunnerIdentity, SharedCredentials, establish_declared,
};
use jr_intake::routing::Router;

/// One forge registration and the backends it fetches for.
#[derive(Clone, Debug)]
pub struct Registration {
    /// `shared`, or the backend's name.
    pub name: String,
    pub client: ForgeClient,
    pub backends: Vec<BackendName>,
    /// Per-backend registrations route every task they fetch to their own backend.
    pub own_backend: Option<BackendName>,
    /// The forge's capabilities header from this runner's Declare, relayed to executors.
    pub capabilities: Option<String>,
}

/// A registration the config asks for, before its runner is known to the forge.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    pub identity: RunnerIdentity,
    /// What its runner declares first (every label of its backends).
    pub labels: Vec<String>,
    pub backends: Vec<BackendName>,
    pub own_backend: Option<BackendName>,
}

impl Planned {
    /// Registers (or reuses the credentials of) the runner and declares its labels; waits for
    /// the forge while it is unreachable. `shared`: where replicas share registered
    /// credentials (none: only the credentials file).
    pub async fn establish(
        &self,
        config: &Config,
        shared: Option<&SharedCredentials>,
        shutdown: &CancellationToken,
    ) -> Result<Registration, RegistrationError> {
        let (client, capabilities) = establish_declared(
            &config.forge,
            &self.identity,
            &self.labels,
            shared,
            shutdown,
        )
        .await?;
        Ok(Registration {
            name: self.name.clone(),
            client,
            backends: self.backends.clone(),
            own_backend: self.own_backend.clone(),
            capabilities,
        })
    }
}

#[derive(Debug, Default)]
struct Inner {
    registrations: Vec<Registration>,
    by_backend: BTreeMap<BackendName, ForgeClient>,
    /// Backends some configured registration serves, established or not.
    planned: BTreeSet<BackendName>,
}

/// Every established registration, and which client speaks for which backend's tasks. Clones
/// share one set.
#[derive(Clone, Debug, Default)]
pub struct Forges {
    inner: Arc<RwLock<Inner>>,
}

impl Forges {
    pub fn new(registrations: Vec<Registration>) -> Self {
        let forges = Forges::default();
        for r in registrations {
            forges.insert(r);
        }
        forges
    }

    /// One shared registration for `backends` (tests and the shared layout).
    pub fn shared(client: ForgeClient, backends: Vec<BackendName>) -> Self {
        Self::new(vec![Registration {
            name: "shared".to_owned(),
            client,
            backends,
            own_backend: None,
            capabilities: None,
        }])
    }

    /// The registrations `config` asks for, none established yet.
    pub fn plan(config: &Config, router: &Router) -> (Forges, Vec<Planned>) {
        let forge = &config.forge;
        if forge.fetchers.is_some() {
            tracing::warn!(
                "forge.fetchers is ignored: fetching is paced by capacity (backend.<name>.lookahead)"
            );
        }
        let planned: Vec<Planned> = match forge.layout() {
            RegistrationLayout::Shared => {
                let backends: Vec<BackendName> =
                    config.enabled_backends().map(|(n, _)| n).collect();
                if backends.len() > 1 {
                    let names: Vec<&str> = backends.iter().map(BackendName::as_str).collect();
                    tracing::info!(
                        backends = %names.join(","),
                        "one shared forge registration serves several backends: it declares only the \
                         labels of the backends taking work, so a full or stopped backend's jobs wait \
                         at the forge while the others are fetched (the runner's labels in the forge \
                         change accordingly); forge.registration = \"per-backend\" keeps each \
                         runner's labels fixed"
                    );
                }
                vec![Planned {
                    name: "shared".to_owned(),
                    identity: RunnerIdentity::shared(forge),
                    labels: router.declared_labels().to_vec(),
                    backends,
                    own_backend: None,
                }]
            }
            RegistrationLayout::PerBackend => {
                if forge.credentials_file.exists() {
                    tracing::warn!(
                        file = %forge.credentials_file.display(),
                        "a shared runner registration exists but forge.registration is per-backend: \
                         each backend now registers its own runner; remove the old runner in the forge \
                         and this file once its jobs are done"
                    );
                }
                config
                    .enabled_backends()
                    .map(|(name, backend)| Planned {
                        name: name.to_string(),
                        identity: RunnerIdentity::per_backend(forge, name.as_str(), backend),
                        labels: router.labels_of(&name).to_vec(),
                        backends: vec![name.clone()],
                        own_backend: Some(name),
                    })
                    .collect()
            }
        };
        let forges = Forges::default();
        forges.write().planned = planned
            .iter()
            .flat_map(|p| p.backends.iter().cloned())
            .collect();
        (forges, planned)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds an established registration (replacing one of the same name).
    pub fn insert(&self, registration: Registration) {
        let mut inner = self.write();
        inner.registrations.retain(|r| r.name != registration.name);
        for b in &registration.backends {
            inner
                .by_backend
                .insert(b.clone(), registration.client.clone());
            inner.planned.insert(b.clone());
        }
        inner.registrations.push(registration);
    }

    /// The forge's capabilities header for executors of `backend`'s tasks.
    pub fn capabilities(&self, backend: &BackendName) -> Option<String> {
        self.read()
            .registrations
            .iter()
            .find(|r| r.backends.contains(backend))
            .and_then(|r| r.capabilities.clone())
    }

    /// The established registrations.
    pub fn registrations(&self) -> Vec<Registration> {
        self.read().registrations.clone()
    }

    /// The client holding `backend`'s tasks, once its registration is established.
    pub fn client(&self, backend: &BackendName) -> Option<ForgeClient> {
        self.read().by_backend.get(backend).cloned()
    }

    /// Whether a configured registration serves `backend` (established or still coming up).
    pub fn serves(&self, backend: &BackendName) -> bool {
        self.read().planned.contains(backend)
    }

    /// The names of the registrations `config` asks for (`shared`, or each enabled backend's).
    pub fn registration_names(config: &Config) -> Vec<String> {
        config.registration_names()
    }

    /// Establishes every registration `config` asks for, one after the other (tests, tools).
    pub async fn establish(
        config: &Config,
        router: &Router,
        shared: &BTreeMap<String, SharedCredentials>,
        shutdown: &CancellationToken,
    ) -> Result<Forges, RegistrationError> {
        let (forges, planned) = Forges::plan(config, router);
        for p in planned {
            let registration = p.establish(config, shared.get(&p.name), shutdown).await?;
            forges.insert(registration);
        }
        Ok(forges)
    }
}

impl jr_facade::ForgeDirectory for Forges {
    fn client(&self, backend: &BackendName) -> Result<ForgeClient, jr_facade::ForgeUnavailable> {
        Forges::client(self, backend).ok_or(if self.serves(backend) {
            jr_facade::ForgeUnavailable::NotEstablished
        } else {
            jr_facade::ForgeUnavailable::NotServed
        })
    }

    fn capabilities(&self, backend: &BackendName) -> Option<String> {
        Forges::capabilities(self, backend)
    }
}
