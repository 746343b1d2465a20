//! The configuration file's shape. Every struct refuses unknown keys; every key is documented in
//! docs/configuration.md (keep the two in step).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use jr_protocol::BackendName;
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub nats: NatsConfig,
    #[serde(default)]
    pub database: DatabaseConfig,
    /// The Gitea or Forgejo forge: the `[[forge]]` entry of kind `gitea`/`forgejo`, or the
    /// older `[forge]` table. Optional when GitHub entries are given: a deployment may serve
    /// GitHub alone (then `url` is empty; see [`Config::gitea`]).
    #[serde(default)]
    pub forge: ForgeConfig,
    /// GitHub Actions runner scale sets: the `[[forge]]` entries of kind `github`, and the
    /// older `[[github]]` entries.
    #[serde(default)]
    pub github: Vec<GitHubConfig>,
    pub facade: FacadeConfig,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub backend: BTreeMap<String, BackendConfig>,
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    #[serde(default)]
    pub pod_worker: WorkerConfig,
    #[serde(default)]
    pub vm_worker: WorkerConfig,
    #[serde(default)]
    pub reconciler: ReconcilerConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub lease: LeaseConfig,
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

/// `[runtime]`: the async runtime each service runs on.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Threads that run the service's tasks. 1: one thread (tokio's current-thread runtime),
    /// which costs the least CPU per job: no task moves between threads and no thread wakes
    /// another. More: a multi-thread runtime with that many worker threads.
    #[serde(default = "one")]
    pub threads: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self { threads: 1 }
    }
}

/// `[lease]`: the leases that let several replicas of the scheduler (one fetching replica per
/// forge registration) and the reconciler (one planning replica) run side by side. Kept in
/// JetStream KV; a replica acts until `ttl - max_clock_skew` after its last renewal and a
/// standby takes over from `ttl + max_clock_skew` after it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseConfig {
    #[serde(default = "default_lease_ttl", with = "humantime_serde")]
    pub ttl: Duration,
    /// Most any replica's clock may differ from true time.
    #[serde(default = "default_max_clock_skew", with = "humantime_serde")]
    pub max_clock_skew: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl: default_lease_ttl(),
            max_clock_skew: default_max_clock_skew(),
        }
    }
}

fn default_lease_ttl() -> Duration {
    Duration::from_secs(3)
}
fn default_max_clock_skew() -> Duration {
    Duration::from_millis(250)
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    pub url: String,
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    #[serde(default = "one")]
    pub stream_replicas: usize,
    /// Size limits of the three streams (applied by the scheduler and the reconciler).
    #[serde(default)]
    pub streams: StreamsConfig,
}

/// `[<service>.nats]` (`scheduler`, `pod_worker`, `vm_worker`, `reconciler`): the NATS user this
/// one service connects as, so that each service has only its own permissions. Give one of:
/// `credentials_file`; `user` with `password` or `password_file`; `nkey_seed_file`. Without
/// this table the service uses `nats.credentials_file` (or no credentials).
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsAuthConfig {
    /// A `.creds` file (user JWT and nkey seed, as `nsc` writes them).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// A file holding the user's nkey seed (`SU...`).
    #[serde(default)]
    pub nkey_seed_file: Option<PathBuf>,
}

/// How one service authenticates to NATS, resolved from the configuration
/// ([`crate::Config::nats_auth`]); secrets already read from their files.
#[derive(Clone, PartialEq, Eq)]
pub enum NatsAuth {
    CredentialsFile(PathBuf),
    UserPassword { user: String, password: String },
    NKeySeed(String),
}

/// `[nats.streams.*]`: limits per stream. A full stream refuses new messages (publishers
/// retry); nothing stored is discarded to make room.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamsConfig {
    #[serde(default = "assignments_limit")]
    pub assignments: StreamLimitConfig,
    #[serde(default = "events_limit")]
    pub events: StreamLimitConfig,
    #[serde(default = "commands_limit")]
    pub commands: StreamLimitConfig,
}

impl Default for StreamsConfig {
    fn default() -> Self {
        Self {
            assignments: assignments_limit(),
            events: events_limit(),
            commands: commands_limit(),
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StreamLimitConfig {
    pub max_messages: std::num::NonZeroU64,
    pub max_bytes: std::num::NonZeroU64,
}

fn stream_limit(max_messages: u64, max_bytes: u64) -> StreamLimitConfig {
    // Both arguments are non-zero constants below; `MIN` (1) is never used.
    StreamLimitConfig {
        max_messages: std::num::NonZeroU64::new(max_messages).unwrap_or(std::num::NonZeroU64::MIN),
        max_bytes: std::num::NonZeroU64::new(max_bytes).unwrap_or(std::num::NonZeroU64::MIN),
    }
}
fn assignments_limit() -> StreamLimitConfig {
    stream_limit(1_000_000, 2 << 30)
}
fn events_limit() -> StreamLimitConfig {
    stream_limit(10_000_000, 4 << 30)
}
fn commands_limit() -> StreamLimitConfig {
    stream_limit(100_000, 256 << 20)
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    #[serde(default = "default_database_url")]
    pub url: String,
    #[serde(default = "default_db_pool")]
    pub max_connections: u32,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: default_database_url(),
            max_connections: default_db_pool(),
        }
    }
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForgeConfig {
    /// Empty when no `[forge]` table is given (a GitHub-only deployment).
    #[serde(default)]
    pub url: String,
    #[serde(default = "default_runner_name")]
    pub runner_name: String,
    /// Registration token (inline); or `registration_token_file`.
    #[serde(default)]
    pub registration_token: Option<String>,
    #[serde(default)]
    pub registration_token_file: Option<PathBuf>,
    /// Pre-made runner credentials (skip registration).
    #[serde(default)]
    pub runner_uuid: Option<String>,
    #[serde(default)]
    pub runner_token: Option<String>,
    #[serde(default)]
    pub runner_token_file: Option<PathBuf>,
    /// Where registered credentials are persisted (JSON with uuid and token).
    #[serde(default = "default_credentials_file")]
    pub credentials_file: PathBuf,
    /// Removed: fetching is paced by capacity (`backend.<name>.lookahead`). Still accepted so
    /// an older file loads; a warning says it is ignored.
    #[serde(default)]
    pub fetchers: Option<usize>,
    /// `per-backend` (default): one forge runner per enabled backend, each declaring only that
    /// backend's labels, so the forge hands each fetch loop only jobs its backend can run.
    /// `shared`: one runner declaring every backend's labels (the layout before per-backend
    /// registrations; used automatically when `forge.runner_uuid` is set).
    #[serde(default)]
    pub registration: Option<RegistrationLayout>,
    /// Which forge answers: `gitea` (default) or `forgejo` (request keys; multi-task fetches
    /// when `task_capacity` > 1).
    #[serde(default)]
    pub flavor: ForgeFlavor,
    /// Forgejo only: most tasks asked for in one FetchTask (`task_capacity`). 1 = one per call.
    #[serde(default = "one")]
    pub task_capacity: usize,
    /// Heartbeat (UpdateTask without result) for every fetched task no executor has claimed
    /// yet, well inside the forge's zombie timeout (Gitea: 10 min).
    #[serde(default = "three_min", with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// The fetcher sends `tasks_version = 0` at least this often, forcing the forge to look
    /// for a job even when its version counter did not move.
    #[serde(default = "thirty_s", with = "humantime_serde")]
    pub version_reset_interval: Duration,
    #[serde(default = "two_s", with = "humantime_serde")]
    pub poll_interval: Duration,
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub max_backoff: Duration,
    #[serde(default = "ten_s", with = "humantime_serde")]
    pub request_timeout: Duration,
}

impl Default for ForgeConfig {
    /// No Gitea/Forgejo forge (an empty URL), every other key at its default.
    fn default() -> Self {
        Self {
            url: String::new(),
            runner_name: default_runner_name(),
            registration_token: None,
            registration_token_file: None,
            runner_uuid: None,
            runner_token: None,
            runner_token_file: None,
            credentials_file: default_credentials_file(),
            fetchers: None,
            registration: None,
            flavor: ForgeFlavor::default(),
            task_capacity: one(),
            keepalive_interval: three_min(),
            version_reset_interval: thirty_s(),
            poll_interval: two_s(),
            max_backoff: ten_s(),
            request_timeout: ten_s(),
        }
    }
}

/// One `[[github]]` entry: a GitHub runner scale set whose jobs jetrunner runs, each on a
/// just-in-time runner in a workload of `backend`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GitHubConfig {
    /// The forge's name in jetrunner: assignments' `forge_instance`, lease and KV keys. Lower
    /// case letters, digits and `-`; unique.
    pub name: String,
    /// Where the runners register: `https://github.com/ORG`, `https://github.com/OWNER/REPO`
    /// or `https://github.com/enterprises/NAME` (or the same on a GitHub Enterprise Server).
    pub url: String,
    /// The REST API base when it is not the one `url` implies (`https://api.github.com`, or
    /// `<server>/api/v3`).
    #[serde(default)]
    pub api_url: Option<String>,
    /// The backend every runner of the scale set runs on. It must suit the least trusted job
    /// the scale set can receive: the per-job trust facts only guard, they cannot route.
    pub backend: String,
    /// The scale set's name, which workflows name in `runs-on`.
    #[serde(default = "default_scale_set")]
    pub scale_set: String,
    #[serde(default = "default_runner_group")]
    pub runner_group: String,
    /// Labels of the scale set besides its name.
    #[serde(default)]
    pub labels: Vec<String>,
    /// Most runners at once (the capacity announced to the service); default: the backend's
    /// capacity.
    #[serde(default)]
    pub max_runners: Option<u32>,
    /// Idle runners kept registered and ready for the scale set's next jobs (warm runners),
    /// beyond the jobs waiting; they hold backend slots. Default 0.
    #[serde(default)]
    pub min_idle: u32,
    /// A personal access token (or `pat_file`); or the three `app_*` keys.
    #[serde(default)]
    pub pat: Option<String>,
    #[serde(default)]
    pub pat_file: Option<PathBuf>,
    /// A GitHub App: its client id (or numeric App id) …
    #[serde(default)]
    pub app_id: Option<String>,
    /// … its installation on the owner of `url` …
    #[serde(default)]
    pub app_installation_id: Option<u64>,
    /// … and its private key (PEM).
    #[serde(default)]
    pub app_private_key_file: Option<PathBuf>,
    /// The runner's work folder, relative to its installation.
    #[serde(default = "default_work_folder")]
    pub work_folder: String,
    /// Where the entry is written in the file (`github[0]`, or `forge[2]` for a `[[forge]]`
    /// entry of kind `github`), for errors that name its keys.
    #[serde(skip)]
    pub origin: String,
}

fn default_scale_set() -> String {
    "jetrunner".to_owned()
}

fn default_runner_group() -> String {
    "default".to_owned()
}

fn default_work_folder() -> String {
    "_work".to_owned()
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum RegistrationLayout {
    PerBackend,
    Shared,
}

impl RegistrationLayout {
    /// As written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            RegistrationLayout::PerBackend => "per-backend",
            RegistrationLayout::Shared => "shared",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ForgeFlavor {
    #[default]
    Gitea,
    Forgejo,
}

impl ForgeFlavor {
    /// As written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            ForgeFlavor::Gitea => "gitea",
            ForgeFlavor::Forgejo => "forgejo",
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum FacadeAuthMode {
    Token,
    Spiffe,
    Both,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FacadeConfig {
    pub listen: SocketAddr,
    /// URL executors use to reach the facade (their runner `address`).
    pub public_url: String,
    #[serde(default = "default_auth_mode")]
    pub mode: FacadeAuthMode,
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// PEM bundle of CAs that issue executor (SPIFFE) certificates.
    #[serde(default)]
    pub trust_bundle_file: Option<PathBuf>,
    #[serde(default)]
    pub trust_domain: Option<String>,
    /// Serve plain HTTP. For development only; refused unless set explicitly.
    #[serde(default)]
    pub insecure_plain_http: bool,
    /// Largest request body (bytes) an authenticated executor may send; larger UpdateLog
    /// batches are refused with `resource_exhausted`.
    #[serde(default = "four_mib")]
    pub max_body_bytes: usize,
    /// A request whose body has not fully arrived within this time is answered and closed.
    #[serde(default = "thirty_s", with = "humantime_serde")]
    pub body_timeout: Duration,
    /// Open executor connections at most; further ones wait in the listen backlog.
    #[serde(default = "default_facade_connections")]
    pub max_connections: usize,
    /// The path of an executor's SPIFFE id; `{assignment}` stands for its assignment id.
    #[serde(default = "default_spiffe_path")]
    pub spiffe_path: String,
    /// RunnerService calls per second one assignment may make (a running act_runner makes ~2).
    #[serde(default = "default_facade_rate")]
    pub max_calls_per_second: u32,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Evaluated in order; the first rule whose label is among the job's `runs-on` labels wins.
    #[serde(default)]
    pub rules: Vec<RoutingRule>,
    /// Backend for jobs no rule matches; when unset such jobs are failed with an explanation.
    #[serde(default)]
    pub default_backend: Option<String>,
    /// Which backends a job may use, from its forge context (`[routing.trust]`).
    #[serde(default)]
    pub trust: TrustConfig,
}

/// `[routing.trust]`: the most trusted backend level a job may use, decided from its forge
/// context. Fork code (a pull request from a fork) is always at most `untrusted`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustConfig {
    /// Evaluated in order; the first rule whose matcher fits the job's context sets the maximum.
    #[serde(default)]
    pub rules: Vec<jr_placement::TrustRule>,
    /// The maximum when no rule matches.
    #[serde(default = "trusted")]
    pub default_max: jr_placement::TrustLevel,
}

impl Default for TrustConfig {
    fn default() -> Self {
        Self {
            rules: Vec::new(),
            default_max: trusted(),
        }
    }
}

impl TrustConfig {
    pub fn policy(&self) -> jr_placement::TrustPolicy {
        jr_placement::TrustPolicy {
            rules: self.rules.clone(),
            default_max: self.default_max,
        }
    }
}

fn trusted() -> jr_placement::TrustLevel {
    jr_placement::TrustLevel::Trusted
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingRule {
    pub label: String,
    pub backend: String,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    Pod,
    Vm,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub kind: BackendKind,
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Maximum live workloads of this backend.
    pub capacity: usize,
    /// Labels declared to the forge for this backend (default: the backend name).
    #[serde(default)]
    pub labels: Vec<String>,
    #[serde(default = "three_h", with = "humantime_serde")]
    pub max_duration: Duration,
    /// Jobs taken from the forge beyond free slots: how many may wait in JetStream for this
    /// backend's worker. The rest of the backlog stays at the forge.
    #[serde(default = "two")]
    pub lookahead: usize,
    /// Pre-made forge credentials of this backend's own runner (per-backend registrations).
    #[serde(default)]
    pub runner_uuid: Option<String>,
    #[serde(default)]
    pub runner_token: Option<String>,
    #[serde(default)]
    pub runner_token_file: Option<PathBuf>,
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// How the providers with `tier = "burst"` take work.
    #[serde(default)]
    pub burst: Option<BurstConfig>,
    /// Per-repository and per-owner concurrency quotas inside this backend.
    #[serde(default)]
    pub fair_share: Option<FairShareConfig>,
    /// Executors started ahead of demand and bound to the next job at its FetchTask.
    #[serde(default)]
    pub warm: Option<WarmConfig>,
    /// How much this backend is trusted with: `trusted` (only jobs whose context may use it) or
    /// `untrusted` (any job). Default: `trusted` for `pod`, `untrusted` for `vm`.
    #[serde(default)]
    pub trust: Option<jr_placement::TrustLevel>,
    /// Runner block defaults (Pod template fragment for pod backends).
    #[serde(default)]
    pub runner: Option<toml::Table>,
    #[serde(default)]
    pub kubernetes: Option<KubernetesConfig>,
    #[serde(default)]
    pub opensandbox: Option<OpenSandboxConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub name: String,
    #[serde(default = "one_u32")]
    pub weight: u32,
    #[serde(default)]
    pub max_runners: Option<usize>,
    #[serde(default)]
    pub disabled: bool,
    /// Per-provider overrides layered over the backend's runner block.
    #[serde(default)]
    pub runner: Option<toml::Table>,
    /// `default` or `burst`: a burst provider takes work only while the burst switch is on
    /// and the default tier has no room (`[backend.<name>.burst]`).
    #[serde(default)]
    pub tier: ProviderTier,
    /// Pod backends: where this provider's Pods run (unset keys: the backend's).
    #[serde(default)]
    pub kubernetes: Option<ProviderKubernetes>,
    /// VM backends: where this provider's sandboxes run (unset keys: the backend's).
    #[serde(default)]
    pub opensandbox: Option<ProviderOpenSandbox>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderTier {
    #[default]
    Default,
    Burst,
}

/// `[backend.<name>.burst]`: how the burst tier (the providers with `tier = "burst"`) takes work.
/// Whether it is on, and for what share of jobs, is the run-time switch in the JetStream KV
/// bucket `JR_PLACEMENT` (key `burst`, set with `jr burst`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BurstConfig {
    /// Jobs that never leave the default tier.
    #[serde(default)]
    pub protected: Vec<ProtectedJob>,
    /// A job that waited longer than this since it was fetched may use the burst tier even
    /// while the default tier has room (unset: only when the default tier is full).
    #[serde(default, with = "humantime_serde")]
    pub after: Option<Duration>,
}

/// `[backend.<name>.warm]`: executors started ahead of demand. They hold capacity slots like
/// job workloads; the worker binds the next assignment it pulls to an idle one instead of
/// creating a workload, and the facade hands that executor the task at its next FetchTask.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmConfig {
    /// Idle warm executors kept started at all times (capacity permitting).
    pub min_idle: usize,
    /// While jobs keep arriving, up to this many idle warm executors (default: `min_idle`).
    #[serde(default)]
    pub max_idle: Option<usize>,
    /// Back to `min_idle` only after the backend was completely idle (no job workload, no
    /// assignment delivered) this long.
    #[serde(default = "five_min", with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// An idle warm executor older than this is replaced; its workload lives at most
    /// `2 × max_age + max_duration`, so a job bound to it always has its full `max_duration`.
    #[serde(default = "one_h", with = "humantime_serde")]
    pub max_age: Duration,
}

impl WarmConfig {
    /// `max_idle`, or `min_idle` when unset.
    pub fn max_idle(&self) -> usize {
        self.max_idle.unwrap_or(self.min_idle).max(self.min_idle)
    }
}

/// `[backend.<name>.fair_share]`: at most this many workloads of one repository / one owner
/// at once; work over a quota waits in JetStream without spending an attempt.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FairShareConfig {
    #[serde(default)]
    pub per_repository: Option<usize>,
    #[serde(default)]
    pub per_owner: Option<usize>,
    /// `owner/name` → weight (≥ 1): that repository's quota is `per_repository × weight`.
    #[serde(default)]
    pub weights: std::collections::BTreeMap<String, u32>,
}

/// A protected-job matcher: every given field must match (`*` matches any run of characters,
/// case-insensitive); a field
/// left out matches anything.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtectedJob {
    #[serde(default)]
    pub repository: Option<String>,
    #[serde(default)]
    pub workflow: Option<String>,
    #[serde(default)]
    pub job: Option<String>,
    /// Each must match one of the job's `runs-on` labels.
    #[serde(default)]
    pub labels: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderKubernetes {
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub api_url: Option<String>,
}

#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderOpenSandbox {
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub pool: Option<String>,
    #[serde(default)]
    pub api_key: Option<String>,
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for ProviderOpenSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderOpenSandbox")
            .field("url", &self.url)
            .field("pool", &self.pool)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("api_key_file", &self.api_key_file)
            .finish()
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    pub namespace: String,
    /// API server URL; when unset the in-cluster service account / kubeconfig is used.
    #[serde(default)]
    pub api_url: Option<String>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenSandboxConfig {
    pub url: String,
    #[serde(default)]
    pub api_key: Option<String>,
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    #[serde(default = "default_pool")]
    pub pool: String,
    #[serde(default = "two_s", with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Client-side timeout of one create call, which blocks until the sandbox is `Running`. Must
    /// exceed the server's `sandbox_create_timeout_seconds` + `pool_acquisition_timeout_seconds`
    /// (60 s + 30 s by default); on expiry the worker looks the sandbox up by its metadata.
    #[serde(default = "default_sandbox_create_timeout", with = "humantime_serde")]
    pub create_timeout: Duration,
    /// Command of the pool task that runs the job: the executor image's entrypoint. OpenSandbox
    /// hands the sandbox's environment (the executor contract) to this task only. An empty
    /// list leaves the pool's own task command.
    #[serde(default = "default_sandbox_entrypoint")]
    pub entrypoint: Vec<String>,
}

fn default_sandbox_entrypoint() -> Vec<String> {
    vec!["/usr/local/bin/jetrunner-executor".to_owned()]
}

fn default_sandbox_create_timeout() -> Duration {
    Duration::from_secs(120)
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    #[serde(default = "default_scheduler_ops")]
    pub ops_listen: SocketAddr,
    /// Id of the key that seals new assignments (must be in `seal_keys`).
    #[serde(default)]
    pub seal_key_id: Option<String>,
    /// key id → base64 of 32 random bytes. Older keys stay listed to open in-flight assignments.
    #[serde(default)]
    pub seal_keys: BTreeMap<String, String>,
    /// Alternative to `seal_keys`: a TOML file holding the same table (e.g. a mounted Secret).
    #[serde(default)]
    pub seal_keys_file: Option<PathBuf>,
    /// The scheduler's own NATS user.
    #[serde(default)]
    pub nats: Option<NatsAuthConfig>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            ops_listen: default_scheduler_ops(),
            seal_key_id: None,
            seal_keys: BTreeMap::new(),
            seal_keys_file: None,
            nats: None,
        }
    }
}

#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Which `[backend.<name>]` this worker serves (default: `pod` / `vm`).
    #[serde(default)]
    pub backend: Option<String>,
    #[serde(default)]
    pub ops_listen: Option<SocketAddr>,
    /// Worker identity in workload metadata; default: host name.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// Secret from which per-attempt executor tokens are derived (HMAC), base64 of ≥ 32 bytes.
    #[serde(default)]
    pub token_key: Option<String>,
    #[serde(default)]
    pub token_key_file: Option<PathBuf>,
    /// This worker's own NATS user.
    #[serde(default)]
    pub nats: Option<NatsAuthConfig>,
    /// How often the worker lists its backend to reconcile what it tracks (default 15 s).
    #[serde(default, with = "humantime_serde")]
    pub resync_interval: Option<Duration>,
    /// How long a workload of ours that no create of this worker made (a backend's leftover
    /// after a refused create, a workload of an unknown assignment) is held before it is
    /// announced (default 60 s).
    #[serde(default, with = "humantime_serde")]
    pub stray_grace: Option<Duration>,
    /// Publish `workload-requested` (the executor token's hash) before every create call.
    /// Only a scheduler without this worker's token key needs it (it then checks executors
    /// against the hashes workers publish); default false.
    #[serde(default)]
    pub publish_requested: bool,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcilerConfig {
    #[serde(default = "default_reconciler_ops")]
    pub ops_listen: SocketAddr,
    #[serde(default = "default_status_listen")]
    pub status_listen: SocketAddr,
    #[serde(default = "default_claim_timeout", with = "humantime_serde")]
    pub claim_timeout: Duration,
    #[serde(default = "default_terminal_grace", with = "humantime_serde")]
    pub terminal_grace: Duration,
    #[serde(default = "default_lost_timeout", with = "humantime_serde")]
    pub lost_timeout: Duration,
    #[serde(default = "default_unreachable_hold", with = "humantime_serde")]
    pub unreachable_hold: Duration,
    /// How long a workload of an assignment jetrunner does not know may live before it is
    /// deleted as an orphan.
    #[serde(default = "default_orphan_grace", with = "humantime_serde")]
    pub orphan_grace: Duration,
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    #[serde(default = "default_plan_interval", with = "humantime_serde")]
    pub plan_interval: Duration,
    #[serde(default = "default_batch")]
    pub max_batch: usize,
    /// After the first message of a batch, how long the projector keeps collecting messages
    /// (up to `max_batch`) before it writes: fewer, larger transactions under load for at most
    /// this much extra projection lag.
    #[serde(default = "default_batch_linger", with = "humantime_serde")]
    pub batch_linger: Duration,
    /// The reconciler's own NATS user.
    #[serde(default)]
    pub nats: Option<NatsAuthConfig>,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            ops_listen: default_reconciler_ops(),
            status_listen: default_status_listen(),
            claim_timeout: default_claim_timeout(),
            terminal_grace: default_terminal_grace(),
            lost_timeout: default_lost_timeout(),
            unreachable_hold: default_unreachable_hold(),
            orphan_grace: default_orphan_grace(),
            max_attempts: default_max_attempts(),
            plan_interval: default_plan_interval(),
            max_batch: default_batch(),
            batch_linger: default_batch_linger(),
            nats: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    #[default]
    Json,
    Pretty,
}

#[derive(Clone, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    #[serde(default)]
    pub log_format: LogFormat,
    #[serde(default)]
    pub log_filter: Option<String>,
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
}

impl BackendConfig {
    /// The trust level in effect: the configured one, else by kind.
    pub fn trust_level(&self) -> jr_placement::TrustLevel {
        self.trust.unwrap_or(match self.kind {
            BackendKind::Pod => jr_placement::TrustLevel::Trusted,
            BackendKind::Vm => jr_placement::TrustLevel::Untrusted,
        })
    }

    /// Labels declared to the forge: the configured ones, or the backend name.
    pub fn declared_labels(&self, name: &str) -> Vec<String> {
        if self.labels.is_empty() {
            vec![name.to_owned()]
        } else {
            self.labels.clone()
        }
    }
}

impl ForgeConfig {
    /// The registration layout in effect: the configured one, else `shared` when pre-made
    /// shared credentials are configured (so an existing single registration keeps working),
    /// else `per-backend`.
    pub fn layout(&self) -> RegistrationLayout {
        self.registration.unwrap_or(if self.runner_uuid.is_some() {
            RegistrationLayout::Shared
        } else {
            RegistrationLayout::PerBackend
        })
    }
}

impl Config {
    /// Enabled backends with their validated names.
    pub fn enabled_backends(&self) -> impl Iterator<Item = (BackendName, &BackendConfig)> {
        self.backend
            .iter()
            .filter(|(_, b)| b.enabled)
            .filter_map(|(n, b)| BackendName::new(n.clone()).ok().map(|n| (n, b)))
    }
}

fn one() -> usize {
    1
}
fn default_spiffe_path() -> String {
    "/jetrunner/executor/{assignment}".to_owned()
}
fn four_mib() -> usize {
    4 * 1024 * 1024
}
fn default_facade_connections() -> usize {
    1024
}
fn default_facade_rate() -> u32 {
    50
}
fn two() -> usize {
    2
}
fn thirty_s() -> Duration {
    Duration::from_secs(30)
}
fn three_min() -> Duration {
    Duration::from_secs(180)
}
fn one_u32() -> u32 {
    1
}
fn yes() -> bool {
    true
}
fn two_s() -> Duration {
    Duration::from_secs(2)
}
fn ten_s() -> Duration {
    Duration::from_secs(10)
}
fn five_min() -> Duration {
    Duration::from_secs(300)
}
fn one_h() -> Duration {
    Duration::from_secs(3600)
}
fn three_h() -> Duration {
    Duration::from_secs(3 * 3600)
}
fn default_database_url() -> String {
    "postgres://postgres@127.0.0.1:5432/jetrunner".into()
}
fn default_db_pool() -> u32 {
    8
}
fn default_runner_name() -> String {
    "jetrunner".into()
}
fn default_credentials_file() -> PathBuf {
    PathBuf::from("jetrunner-runner.json")
}
fn default_auth_mode() -> FacadeAuthMode {
    FacadeAuthMode::Token
}
fn default_pool() -> String {
    "ci-vm".into()
}
fn default_scheduler_ops() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 9101))
}
fn default_reconciler_ops() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 9104))
}
fn default_status_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8090))
}
fn default_claim_timeout() -> Duration {
    Duration::from_secs(120)
}
fn default_terminal_grace() -> Duration {
    Duration::from_secs(30)
}
fn default_lost_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_unreachable_hold() -> Duration {
    Duration::from_secs(300)
}
fn default_orphan_grace() -> Duration {
    Duration::from_secs(120)
}
fn default_max_attempts() -> u32 {
    3
}
fn default_plan_interval() -> Duration {
    Duration::from_secs(2)
}
fn default_batch() -> usize {
    512
}
fn default_batch_linger() -> Duration {
    Duration::from_millis(25)
}
