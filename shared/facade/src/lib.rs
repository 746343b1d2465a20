//! The RunnerService facade executors talk to (docs/architecture.md, "The facade").
//!
//! Executors are unmodified act_runner processes whose `address` is the facade. Each one
//! authenticates as one assignment (token and/or SPIFFE mTLS), receives its own forge task exactly
//! once, and reports through the facade, which checks and forwards those reports to the forge with
//! the scheduler's credentials and records `claimed` / `terminal` / `executor-finished` facts
//! through a [`Ledger`]. Artifact and cache paths are proxied to the forge unchanged.
//!
//! - [`Facade`] holds the state; [`router`] is its HTTP surface; [`serve`] runs it over TLS.
//! - [`Ledger`] is the IO boundary to JetStream; [`MemoryLedger`] is the in-memory stand-in.
//! - [`ForgeDirectory`] is how it reaches the forge: implemented by the Gitea/Forgejo intake,
//!   so the facade depends on no intake. A runner-bound forge (GitHub) needs none: its
//!   executors fetch their sealed runner registration from the facade and talk to the forge
//!   themselves.

mod auth;
mod github;
mod ledger;
mod limits;
mod progress;
mod proxy;
mod rpc;
mod server;
mod stats;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use jr_protocol::{AssignmentId, BackendName};

use jr_seal::Sealer;

pub use auth::{ClientIdentity, SpiffeId};
pub use ledger::{AssignmentView, Ledger, LedgerError, MemoryLedger, MemoryRecord};
pub use limits::{CallRate, FacadeLimits};
pub use rpc::router;
pub use server::{TlsSettings, serve};
pub use stats::{AuthRefusal, FacadeStats};

use progress::Progress;
use stats::Counters;

/// How executors prove which assignment they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMode {
    /// `x-runner-token` whose SHA-256 matches the attempt's published hash.
    Token,
    /// A client certificate from the trust bundle whose SPIFFE id ends in the assignment id.
    Spiffe,
    /// Either; every credential that is presented must be valid.
    Both,
}

impl AuthMode {
    pub fn uses_token(self) -> bool {
        matches!(self, AuthMode::Token | AuthMode::Both)
    }

    pub fn uses_spiffe(self) -> bool {
        matches!(self, AuthMode::Spiffe | AuthMode::Both)
    }
}

impl From<jr_config::FacadeAuthMode> for AuthMode {
    fn from(mode: jr_config::FacadeAuthMode) -> Self {
        match mode {
            jr_config::FacadeAuthMode::Token => AuthMode::Token,
            jr_config::FacadeAuthMode::Spiffe => AuthMode::Spiffe,
            jr_config::FacadeAuthMode::Both => AuthMode::Both,
        }
    }
}

/// Everything the facade needs besides its ledger.
#[derive(Debug)]
pub struct FacadeSettings {
    pub mode: AuthMode,
    /// SPIFFE trust domain executor ids must belong to (`spiffe://<trust_domain>/…`). `None`
    /// accepts any trust domain the trust bundle vouches for.
    pub trust_domain: Option<String>,
    /// Forge clients with the scheduler's real runner credentials, per backend (a task belongs
    /// to the runner that fetched it).
    pub forges: Arc<dyn ForgeDirectory>,
    /// Forge instance root URL; proxied artifact/cache paths are appended to it.
    pub forge_base_url: String,
    /// Opens the sealed task of an assignment.
    pub sealer: Arc<Sealer>,
    /// Per backend, the key executor tokens are derived from (HMAC over assignment and
    /// attempt). With the keys the facade checks tokens itself and ignores the hash on the bus,
    /// and refuses ids that name no stored assignment. Either every enabled backend has its key
    /// here or none does (then the facade falls back to the hash the worker published).
    pub token_keys: std::collections::BTreeMap<jr_protocol::BackendName, jr_seal::TokenKey>,
    /// Body size and time, connections, calls per assignment.
    pub limits: FacadeLimits,
    /// The SPIFFE id path executors must present, `{assignment}` standing for the id.
    pub spiffe_path: String,
    /// Allow [`serve`] without TLS (development only).
    pub insecure_plain_http: bool,
}

/// Where the facade forwards an executor's reports: the registration that fetched the
/// assignment's task (job-bound forges: Gitea, Forgejo). The Gitea/Forgejo intake implements
/// it; the facade depends on no intake.
pub trait ForgeDirectory: Send + Sync + std::fmt::Debug + 'static {
    /// The client of the registration that fetches `backend`'s tasks.
    fn client(&self, backend: &BackendName) -> Result<jr_forge::ForgeClient, ForgeUnavailable>;
    /// The forge's capabilities (relayed on Declare replies), once the registration knows them.
    fn capabilities(&self, backend: &BackendName) -> Option<String>;
}

/// Why [`ForgeDirectory::client`] has no client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForgeUnavailable {
    /// The registration exists but is not established yet (the executor retries).
    NotEstablished,
    /// No registration serves this backend.
    NotServed,
}

/// Why the facade could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum FacadeError {
    #[error("plain HTTP refused: configure TLS or set insecure_plain_http")]
    PlainHttpRefused,
    #[error("SPIFFE mode needs TLS with a client trust bundle")]
    SpiffeWithoutTrustBundle,
    #[error("invalid TLS configuration: {0}")]
    TlsConfig(String),
    #[error("cannot read {path}")]
    ReadPem {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot build the proxy HTTP client")]
    ProxyClient(#[source] reqwest::Error),
}

impl FacadeError {
    pub fn kind(&self) -> &'static str {
        match self {
            FacadeError::PlainHttpRefused => "plain_http_refused",
            FacadeError::SpiffeWithoutTrustBundle => "spiffe_without_trust_bundle",
            FacadeError::TlsConfig(_) => "tls_config",
            FacadeError::ReadPem { .. } => "read_pem",
            FacadeError::ProxyClient(_) => "proxy_client",
        }
    }
}

/// Report progress records kept before idle ones are pruned.
const PROGRESS_PRUNE_AT: usize = 4096;

/// The facade's state: settings, ledger, counters and the per-assignment report progress.
pub struct Facade<L: Ledger> {
    settings: FacadeSettings,
    ledger: L,
    counters: Counters,
    /// Report progress per assignment. Entries are small; [`Facade::forget`] drops one when its
    /// workload is released.
    progress: Mutex<HashMap<AssignmentId, Arc<tokio::sync::Mutex<Progress>>>>,
    /// Calls per assignment in the current second.
    call_rate: CallRate,
    /// Client for proxied paths: no redirects followed, no transparent decompression, so the
    /// executor sees the forge's answer byte for byte.
    proxy_http: reqwest::Client,
    /// Warm executors with a FetchTask held here, woken when their worker binds them.
    warm_waiters: Mutex<HashMap<AssignmentId, Arc<tokio::sync::Notify>>>,
}

impl<L: Ledger> std::fmt::Debug for Facade<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Facade")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<L: Ledger> Facade<L> {
    pub fn new(settings: FacadeSettings, ledger: L) -> Result<Facade<L>, FacadeError> {
        // reqwest is built with `rustls-no-provider`; a second install is a harmless error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let proxy_http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_gzip()
            .connect_timeout(std::time::Duration::from_secs(10))
            // A whole proxied exchange (artifact uploads included) ends within this.
            .timeout(std::time::Duration::from_secs(15 * 60))
            .user_agent(concat!("jetrunner-facade/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(FacadeError::ProxyClient)?;
        Ok(Facade {
            call_rate: CallRate::new(settings.limits.max_calls_per_second),
            settings,
            ledger,
            counters: Counters::default(),
            progress: Mutex::new(HashMap::new()),
            proxy_http,
            warm_waiters: Mutex::new(HashMap::new()),
        })
    }

    /// A worker bound warm executor `warm` (its wake-up arrived): a FetchTask held for it
    /// looks at its binding now. Without a waiter the notice is kept for the next call.
    pub fn wake_warm(&self, warm: AssignmentId) {
        let waiter = self
            .warm_waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&warm)
            .cloned();
        if let Some(waiter) = waiter {
            waiter.notify_one();
        }
    }

    /// The wake-up of warm executor `warm`'s held FetchTask.
    fn warm_wake(&self, warm: AssignmentId) -> Arc<tokio::sync::Notify> {
        self.warm_waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(warm)
            .or_default()
            .clone()
    }

    /// Drops `warm`'s wake-up once no call waits on it.
    fn warm_unwatch(&self, warm: AssignmentId) {
        let mut waiters = self
            .warm_waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if waiters
            .get(&warm)
            .is_some_and(|w| Arc::strong_count(w) == 1)
        {
            waiters.remove(&warm);
        }
    }

    pub fn settings(&self) -> &FacadeSettings {
        &self.settings
    }

    pub fn ledger(&self) -> &L {
        &self.ledger
    }

    pub fn stats(&self) -> FacadeStats {
        self.counters.snapshot()
    }

    /// Drops the report progress of an assignment (call when its workload is released). A later
    /// call for it is judged from the ledger alone.
    pub fn forget(&self, id: AssignmentId) {
        self.progress_map().remove(&id);
    }

    fn progress_map(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<AssignmentId, Arc<tokio::sync::Mutex<Progress>>>> {
        // Only plain inserts/removes happen under this lock, so a poisoned map is still valid.
        self.progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The progress record of an assignment (created on first use). Records nobody holds are
    /// dropped once the map grows past [`PROGRESS_PRUNE_AT`]: the ledger's `terminal` fact is
    /// all a later call of a finished task needs, and an unfinished one starts afresh from it.
    fn progress_of(&self, id: AssignmentId) -> Arc<tokio::sync::Mutex<Progress>> {
        let mut map = self.progress_map();
        if map.len() >= PROGRESS_PRUNE_AT && !map.contains_key(&id) {
            map.retain(|_, p| Arc::strong_count(p) > 1 || p.try_lock().is_ok_and(|p| !p.is_done()));
            if map.len() >= PROGRESS_PRUNE_AT {
                map.retain(|_, p| Arc::strong_count(p) > 1);
            }
        }
        map.entry(id).or_default().clone()
    }
}
