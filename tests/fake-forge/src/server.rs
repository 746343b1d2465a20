//! The running server and its handle: start, test hooks, records, shutdown.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::{Behaviour, Config};
use crate::error::FakeForgeError;
use crate::faults::{FaultConfig, FaultPlan, Rpc};
use crate::model::{JobId, JobSpec, ReapReport, Snapshot, Stats};
use crate::state::{State, random_hex40};

/// State shared by the handlers and the handle.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    faults: Mutex<FaultConfig>,
    pub clock: Arc<dyn Clock>,
    changed: watch::Sender<u64>,
    pub shutdown: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Runs `f` on the state and wakes `wait_until` callers.
    pub fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let out = f(&mut lock(&self.state));
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
        out
    }

    pub fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&lock(&self.state))
    }

    pub fn now(&self) -> SystemTime {
        self.clock.now()
    }

    pub fn fault_plan(&self, rpc: Rpc) -> FaultPlan {
        lock(&self.faults).decide(rpc, rand::random::<f64>)
    }

    pub fn faults(&self) -> FaultConfig {
        lock(&self.faults).clone()
    }

    pub fn set_faults(&self, faults: FaultConfig) {
        *lock(&self.faults) = faults;
    }

    pub fn enqueue(&self, spec: JobSpec, count: u32) -> Vec<JobId> {
        let now = self.now();
        self.with_state(|s| (0..count).map(|_| s.enqueue(spec.clone(), now)).collect())
    }

    pub fn reap(&self, now: SystemTime) -> ReapReport {
        self.with_state(|s| s.reap(now))
    }
}

/// A running fake forge. Dropping it stops the server.
#[derive(Debug)]
pub struct FakeForge {
    shared: Arc<Shared>,
    addr: SocketAddr,
    url: String,
    server: Option<JoinHandle<std::io::Result<()>>>,
    reaper: Option<JoinHandle<()>>,
}

impl FakeForge {
    /// Binds `config.listen` and serves until `shutdown` (or drop).
    pub async fn start(config: Config) -> Result<Self, FakeForgeError> {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| FakeForgeError::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| FakeForgeError::Bind {
                addr: config.listen,
                source,
            })?;
        let url = format!("http://{addr}");
        let token = config
            .registration_token
            .clone()
            .unwrap_or_else(random_hex40);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(config.behaviour.clone(), url.clone(), token)),
            faults: Mutex::new(config.faults.clone()),
            clock: config.clock.clone(),
            changed: watch::Sender::new(0),
            shutdown: CancellationToken::new(),
        });
        let app = crate::rpc::routes()
            .merge(crate::admin::routes())
            .with_state(shared.clone());
        let stop = shared.shutdown.clone();
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        });
        let reaper = config.reap_interval.map(|every| {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tokio::select! {
                        () = shared.shutdown.cancelled() => break,
                        _ = tick.tick() => { shared.reap(shared.now()); }
                    }
                }
            })
        });
        tracing::info!(%url, "fake forge listening");
        Ok(Self {
            shared,
            addr,
            url,
            server: Some(server),
            reaper,
        })
    }

    /// Instance root URL without trailing slash, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current (active) global registration token.
    pub fn registration_token(&self) -> String {
        self.shared.read(|s| s.registration_token().to_owned())
    }

    /// Issues a new registration token; older ones are refused by Register from now on.
    pub fn rotate_registration_token(&self) -> String {
        self.shared.with_state(State::rotate_registration_token)
    }

    pub fn enqueue_job(&self, spec: JobSpec) -> JobId {
        let now = self.shared.now();
        self.shared.with_state(|s| s.enqueue(spec, now))
    }

    pub fn enqueue_jobs(&self, spec: JobSpec, count: u32) -> Vec<JobId> {
        self.shared.enqueue(spec, count)
    }

    /// Puts a finished job back in the queue; the next pick creates a new task (attempt + 1).
    pub fn rerun_job(&self, id: JobId) -> bool {
        let now = self.shared.now();
        self.shared.with_state(|s| s.rerun(id, now))
    }

    /// Marks a running task cancelled; its runner learns it from the next UpdateTask reply.
    pub fn cancel_task(&self, task_id: i64) -> bool {
        let now = self.shared.now();
        self.shared.with_state(|s| s.cancel_task(task_id, now))
    }

    /// Cancels a waiting job, or the task of a running job.
    pub fn cancel_job(&self, id: JobId) -> bool {
        let now = self.shared.now();
        self.shared.with_state(|s| s.cancel_job(id, now))
    }

    /// Soft-deletes a runner: its calls then fail as "unregistered runner".
    pub fn remove_runner(&self, uuid: &str) -> bool {
        self.shared.with_state(|s| s.remove_runner(uuid))
    }

    /// One pass of the zombie, endless and abandoned reapers as of `now`.
    pub fn reap(&self, now: SystemTime) -> ReapReport {
        self.shared.reap(now)
    }

    pub fn behaviour(&self) -> Behaviour {
        self.shared.read(|s| s.behaviour.clone())
    }

    pub fn set_behaviour(&self, behaviour: Behaviour) {
        self.shared.with_state(|s| s.behaviour = behaviour);
    }

    pub fn set_error_style(&self, style: crate::ErrorStyle) {
        self.shared.with_state(|s| s.behaviour.error_style = style);
    }

    pub fn faults(&self) -> FaultConfig {
        self.shared.faults()
    }

    pub fn set_faults(&self, faults: FaultConfig) {
        self.shared.set_faults(faults);
    }

    pub fn snapshot(&self) -> Snapshot {
        self.shared.read(State::snapshot)
    }

    pub fn stats(&self) -> Stats {
        self.shared.read(State::stats)
    }

    pub fn queued_count(&self) -> usize {
        self.shared.read(State::queued_count)
    }

    pub fn all_final(&self) -> bool {
        self.shared.read(State::all_final)
    }

    /// Waits until `cond(snapshot)` holds, re-checking after every state change.
    pub async fn wait_until(
        &self,
        mut cond: impl FnMut(&Snapshot) -> bool,
        timeout: Duration,
    ) -> Result<Snapshot, FakeForgeError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.shared.changed.subscribe();
        loop {
            changes.borrow_and_update();
            let snapshot = self.snapshot();
            if cond(&snapshot) {
                return Ok(snapshot);
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Err(FakeForgeError::WaitTimeout(timeout)),
            }
        }
    }

    /// Stops accepting, releases hanging replies and waits for the server task.
    pub async fn shutdown(mut self) -> Result<(), FakeForgeError> {
        self.shared.shutdown.cancel();
        if let Some(reaper) = self.reaper.take() {
            let _ = reaper.await;
        }
        match self.server.take() {
            Some(server) => match server.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(FakeForgeError::Serve(e.to_string())),
                Err(e) => Err(FakeForgeError::Serve(e.to_string())),
            },
            None => Ok(()),
        }
    }
}

impl Drop for FakeForge {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
        if let Some(reaper) = self.reaper.take() {
            reaper.abort();
        }
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}
