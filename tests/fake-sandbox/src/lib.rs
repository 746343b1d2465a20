//! A fake OpenSandbox Lifecycle server (1.1.1 on its Kubernetes runtime) with a simulation mode.
//!
//! It reproduces what a client can observe of the 1.1.x server: API-key auth, pooled
//! creates that block and answer 202 `Running`, label validation (400) and FastAPI's 422 shape,
//! the nested `metadata` list filter with paging (`pageSize` ≤ 200), `Stopping` then 404 after a
//! delete or expiry, 429 + `Retry-After` when a pool stays exhausted, 504 with clean-up. It records
//! what happened (every sandbox created, peak concurrency, list requests) and injects faults
//! (slow create replies, a 5xx rate, a full outage). In simulation mode a runner callback is
//! started for every sandbox that becomes `Running`; like the real server, the sandbox stays
//! `Running` after the runner returns, until it is deleted or expires.

mod create;
mod server;
mod wire;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use time::OffsetDateTime;
use tokio::sync::Notify;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;

/// What a simulated sandbox runs with once it is `Running`.
#[derive(Clone, Debug)]
pub struct SandboxRun {
    pub id: String,
    /// The request's `env` plus `OPENSANDBOX_ID`, as the pool task receives it.
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
}

/// Started when a sandbox becomes `Running`; aborted when the sandbox stops.
pub type Runner = Arc<dyn Fn(SandboxRun) -> BoxFuture<'static, ()> + Send + Sync>;

#[derive(Clone)]
pub struct FakeConfig {
    /// `None` = the server runs with `OPENSANDBOX_INSECURE_SERVER=YES` (no auth).
    pub api_key: Option<String>,
    /// Pool name → capacity (`poolMax`).
    pub pools: BTreeMap<String, usize>,
    /// How long a create waits for a free pool slot before 429 (`Retry-After` = its ceiling).
    pub pool_acquisition_timeout: Duration,
    /// How long a sandbox stays `Stopping` before it disappears (404).
    pub stopping_for: Duration,
    /// Time from allocation to `Running` (the create call blocks meanwhile).
    pub ready_after: Duration,
    /// `server.max_sandbox_timeout_seconds`: TTLs and renewals are capped to it.
    pub max_timeout: Option<Duration>,
    /// A ResourceQuota: at most this many sandboxes exist at once, beyond that 403.
    pub quota: Option<usize>,
    pub runner: Option<Runner>,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            pools: BTreeMap::from([("ci-vm".to_owned(), 15)]),
            pool_acquisition_timeout: Duration::from_secs(1),
            stopping_for: Duration::from_millis(500),
            ready_after: Duration::ZERO,
            max_timeout: None,
            quota: None,
            runner: None,
        }
    }
}

impl fmt::Debug for FakeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeConfig")
            .field("pools", &self.pools)
            .field("pool_acquisition_timeout", &self.pool_acquisition_timeout)
            .field("stopping_for", &self.stopping_for)
            .field("ready_after", &self.ready_after)
            .field("max_timeout", &self.max_timeout)
            .field("quota", &self.quota)
            .field("runner", &self.runner.is_some())
            .finish_non_exhaustive()
    }
}

/// The states this fake reports (a subset of the server's free strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxState {
    Pending,
    Running,
    Stopping,
    Failed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Pending => "Pending",
            SandboxState::Running => "Running",
            SandboxState::Stopping => "Stopping",
            SandboxState::Failed => "Failed",
        }
    }
}

/// One existing sandbox.
#[derive(Clone, Debug)]
pub struct SandboxSnapshot {
    pub id: String,
    pub pool: Option<String>,
    pub image: Option<String>,
    pub state: SandboxState,
    pub reason: String,
    pub message: Option<String>,
    pub created_at: OffsetDateTime,
    pub last_transition_at: OffsetDateTime,
    pub expires_at: Option<OffsetDateTime>,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    pub entrypoint: Option<Vec<String>>,
}

/// Every sandbox (BatchSandbox CR) a create made, kept after it is gone.
#[derive(Clone, Debug)]
pub struct CreatedSandbox {
    pub id: String,
    pub pool: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    /// It got a pool slot (a VM). False for creates that ended in 429.
    pub allocated: bool,
}

/// One `GET /sandboxes` as received.
#[derive(Clone, Debug)]
pub struct ListRequest {
    pub page: u32,
    pub page_size: u32,
    pub metadata: Vec<(String, String)>,
    pub states: Vec<String>,
}

struct Entry {
    sandbox: SandboxSnapshot,
    /// Insertion order, to keep list order stable among equal `createdAt` seconds.
    seq: u64,
    /// Holds a pool slot.
    allocated: bool,
    remove_at: Option<Instant>,
    run: Option<AbortHandle>,
}

impl Entry {
    fn transition(&mut self, state: SandboxState, reason: &str) {
        self.sandbox.state = state;
        self.sandbox.reason = reason.to_owned();
        self.sandbox.last_transition_at = OffsetDateTime::now_utc();
    }

    /// The CR gets a deletionTimestamp: `Stopping` for a while, then gone. The VM stops now.
    fn stop(&mut self, stopping_for: Duration) {
        if self.sandbox.state != SandboxState::Stopping {
            self.transition(SandboxState::Stopping, "DELETING");
            self.remove_at = Some(Instant::now() + stopping_for);
        }
        if let Some(run) = self.run.take() {
            run.abort();
        }
    }
}

#[derive(Default)]
struct State {
    sandboxes: HashMap<String, Entry>,
    pools: BTreeMap<String, usize>,
    created: Vec<CreatedSandbox>,
    max_live: usize,
    max_held: usize,
    list_requests: Vec<ListRequest>,
    seq: u64,
}

impl State {
    fn allocated_in(&self, pool: &str) -> usize {
        self.sandboxes
            .values()
            .filter(|e| e.allocated && e.sandbox.pool.as_deref() == Some(pool))
            .count()
    }

    fn allocated_total(&self) -> usize {
        self.sandboxes.values().filter(|e| e.allocated).count()
    }

    /// Sandboxes that hold a VM or wait for one: every `Pending` CR (it keeps its place in the
    /// pool's queue) and every allocated one until it is removed (a `Stopping` VM still runs).
    /// A create refused as full stops without a VM and is not counted.
    fn held_total(&self) -> usize {
        self.sandboxes
            .values()
            .filter(|e| e.allocated || e.sandbox.state == SandboxState::Pending)
            .count()
    }

    pub(crate) fn note_held(&mut self) {
        let held = self.held_total();
        self.max_held = self.max_held.max(held);
    }
}

pub(crate) struct Shared {
    config: FakeConfig,
    state: Mutex<State>,
    /// Signalled whenever a sandbox disappears (a pool slot may be free).
    freed: Notify,
    outage: AtomicBool,
    error_rate_ppm: AtomicU32,
    create_reply_delay_ms: AtomicU64,
    ready_timeouts: AtomicU32,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Handlers never panic while holding the lock except on a bug that fails the test anyway.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Drops sandboxes whose `Stopping` time is over and stops expired ones.
    fn reap(&self) {
        let now = Instant::now();
        let wall = OffsetDateTime::now_utc();
        let mut state = self.lock();
        let before = state.sandboxes.len();
        state
            .sandboxes
            .retain(|_, e| e.remove_at.is_none_or(|at| at > now));
        let stopping_for = self.config.stopping_for;
        for entry in state.sandboxes.values_mut() {
            if entry.sandbox.expires_at.is_some_and(|at| at <= wall) {
                entry.stop(stopping_for);
            }
        }
        if state.sandboxes.len() != before {
            self.freed.notify_waiters();
        }
    }
}

/// A running fake server. Dropping it stops the server and every simulated sandbox.
pub struct FakeSandbox {
    shared: Arc<Shared>,
    addr: SocketAddr,
    server: JoinHandle<()>,
    reaper: JoinHandle<()>,
}

impl FakeSandbox {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub async fn start(config: FakeConfig) -> std::io::Result<Self> {
        Self::bind(SocketAddr::from(([127, 0, 0, 1], 0)), config).await
    }

    pub async fn bind(addr: SocketAddr, config: FakeConfig) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                pools: config.pools.clone(),
                ..State::default()
            }),
            config,
            freed: Notify::new(),
            outage: AtomicBool::new(false),
            error_rate_ppm: AtomicU32::new(0),
            create_reply_delay_ms: AtomicU64::new(0),
            ready_timeouts: AtomicU32::new(0),
        });
        let router = server::router(shared.clone());
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router).await {
                tracing::error!(error = %e, "fake sandbox server stopped");
            }
        });
        let reaper_shared = shared.clone();
        let reaper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            loop {
                tick.tick().await;
                reaper_shared.reap();
            }
        });
        Ok(Self {
            shared,
            addr,
            server,
            reaper,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL without `/v1` (the server answers at both `/` and `/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every sandbox ever created, in creation order.
    pub fn created(&self) -> Vec<CreatedSandbox> {
        self.shared.lock().created.clone()
    }

    /// Sandboxes that exist now (any state, `Stopping` included).
    pub fn sandboxes(&self) -> Vec<SandboxSnapshot> {
        let state = self.shared.lock();
        let mut all: Vec<_> = state
            .sandboxes
            .values()
            .map(|e| (e.seq, e.sandbox.clone()))
            .collect();
        all.sort_by_key(|(seq, _)| *seq);
        all.into_iter().map(|(_, s)| s).collect()
    }

    pub fn sandbox(&self, id: &str) -> Option<SandboxSnapshot> {
        self.shared
            .lock()
            .sandboxes
            .get(id)
            .map(|e| e.sandbox.clone())
    }

    /// Highest number of sandboxes holding a pool slot at the same time.
    pub fn max_live(&self) -> usize {
        self.shared.lock().max_live
    }

    /// Highest number of sandboxes in any state that holds or waits for a VM at the same time
    /// (`Pending`, or allocated and not yet removed): what a client's capacity must bound, by
    /// the server's own view, whatever the pool size.
    pub fn max_held(&self) -> usize {
        self.shared.lock().max_held
    }

    pub fn list_requests(&self) -> Vec<ListRequest> {
        self.shared.lock().list_requests.clone()
    }

    /// Answer 503 to every request while `on`.
    pub fn set_outage(&self, on: bool) {
        self.shared.outage.store(on, Ordering::SeqCst);
    }

    /// Answer this fraction (0.0–1.0) of requests with 500 `KUBERNETES::API_ERROR`, before acting.
    pub fn set_error_rate(&self, rate: f64) {
        let ppm = (rate.clamp(0.0, 1.0) * 1_000_000.0).round();
        // In range 0..=1_000_000 after the clamp.
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped above"
        )]
        self.shared
            .error_rate_ppm
            .store(ppm as u32, Ordering::SeqCst);
    }

    /// Delay every create reply by `delay` after the sandbox is `Running` (a client with a shorter
    /// timeout gives up while the sandbox exists).
    pub fn set_create_reply_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.shared
            .create_reply_delay_ms
            .store(ms, Ordering::SeqCst);
    }

    /// The next `n` creates end in 504 `POD_READY_TIMEOUT`; their sandbox goes `Stopping`.
    pub fn fail_next_creates_with_ready_timeout(&self, n: u32) {
        self.shared.ready_timeouts.store(n, Ordering::SeqCst);
    }

    /// Changes a pool's capacity (or adds the pool).
    pub fn set_pool_capacity(&self, pool: &str, capacity: usize) {
        self.shared.lock().pools.insert(pool.to_owned(), capacity);
        self.shared.freed.notify_waiters();
    }

    /// Marks a sandbox `Failed` (as `taskFailed > 0` would) and stops its runner.
    pub fn fail_sandbox(&self, id: &str, reason: &str) -> bool {
        let mut state = self.shared.lock();
        let Some(entry) = state.sandboxes.get_mut(id) else {
            return false;
        };
        entry.transition(SandboxState::Failed, reason);
        if let Some(run) = entry.run.take() {
            run.abort();
        }
        true
    }
}

impl Drop for FakeSandbox {
    fn drop(&mut self) {
        self.server.abort();
        self.reaper.abort();
        for entry in self.shared.lock().sandboxes.values_mut() {
            if let Some(run) = entry.run.take() {
                run.abort();
            }
        }
    }
}
