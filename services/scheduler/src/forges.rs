//! The scheduler's forge registrations: one runner per enabled backend (each declaring only that
//! backend's labels, so the forge hands its fetch loop only jobs the backend can run), or one
//! shared runner for all backends. A task belongs to the runner that fetched it, so every later
//! call about it (keepalive, forwarded reports, failure reports) uses that runner's client.

use std::collections::BTreeMap;

use jr_config::{Config, RegistrationLayout};
use jr_forge::ForgeClient;
use jr_protocol::BackendName;
use tokio_util::sync::CancellationToken;

use crate::registration::{
    RegistrationError, RunnerIdentity, SharedCredentials, establish_declared,
};
use crate::routing::Router;

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

/// Every registration, and which client speaks for which backend's tasks.
#[derive(Clone, Debug)]
pub struct Forges {
    registrations: Vec<Registration>,
    by_backend: BTreeMap<BackendName, ForgeClient>,
}

impl Forges {
    pub fn new(registrations: Vec<Registration>) -> Self {
        let by_backend = registrations
            .iter()
            .flat_map(|r| r.backends.iter().map(|b| (b.clone(), r.client.clone())))
            .collect();
        Self {
            registrations,
            by_backend,
        }
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

    /// The forge's capabilities header for executors of `backend`'s tasks.
    pub fn capabilities(&self, backend: &BackendName) -> Option<&str> {
        self.registrations
            .iter()
            .find(|r| r.backends.contains(backend))
            .and_then(|r| r.capabilities.as_deref())
    }

    pub fn registrations(&self) -> &[Registration] {
        &self.registrations
    }

    /// The client holding `backend`'s tasks.
    pub fn client(&self, backend: &BackendName) -> Option<&ForgeClient> {
        self.by_backend.get(backend)
    }

    /// The names of the registrations `config` asks for (`shared`, or each enabled backend's).
    pub fn registration_names(config: &Config) -> Vec<String> {
        config.registration_names()
    }

    /// Registers (or reuses the credentials of) every runner the configured layout needs and
    /// declares its labels.
    /// `shared`: per registration name, where replicas share registered credentials (none:
    /// only the credentials file).
    pub async fn establish(
        config: &Config,
        router: &Router,
        shared: &BTreeMap<String, SharedCredentials>,
        shutdown: &CancellationToken,
    ) -> Result<Forges, RegistrationError> {
        let forge = &config.forge;
        if forge.fetchers.is_some() {
            tracing::warn!(
                "forge.fetchers is ignored: fetching is paced by capacity (backend.<name>.lookahead)"
            );
        }
        let mut registrations = Vec::new();
        match forge.layout() {
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
                let (client, capabilities) = establish_declared(
                    forge,
                    &RunnerIdentity::shared(forge),
                    router.declared_labels(),
                    shared.get("shared"),
                    shutdown,
                )
                .await?;
                registrations.push(Registration {
                    name: "shared".to_owned(),
                    client,
                    backends,
                    own_backend: None,
                    capabilities,
                });
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
                for (name, backend) in config.enabled_backends() {
                    let identity = RunnerIdentity::per_backend(forge, name.as_str(), backend);
                    let (client, capabilities) = establish_declared(
                        forge,
                        &identity,
                        router.labels_of(&name),
                        shared.get(name.as_str()),
                        shutdown,
                    )
                    .await?;
                    registrations.push(Registration {
                        name: name.to_string(),
                        client,
                        backends: vec![name.clone()],
                        own_backend: Some(name),
                        capabilities,
                    });
                }
            }
        }
        Ok(Forges::new(registrations))
    }
}
