//! A fake Kubernetes API server (Pods, Secrets, watch) with a simulation mode.
//!
//! Serves the core/v1 paths kube-rs uses for Pods and Secrets:
//! `/api/v1/namespaces/{ns}/{pods|secrets}[/{name}]` (create, get, list, watch, replace, merge
//! patch, delete) and `/api/v1/{pods|secrets}` (cluster-wide list/watch). One global, monotonically
//! increasing resourceVersion; an event log that `?watch=true&resourceVersion=N` replays from N;
//! `Status` bodies for errors (404 NotFound, 409 AlreadyExists/Conflict, 422 Invalid, 503 during an
//! injected outage). Deleting a Pod garbage-collects the objects that name it in
//! `metadata.ownerReferences`.
//!
//! With [`SimConfig::simulate`], a tiny kubelet moves each new Pod Pending → Running after
//! [`SimConfig::start_delay`], runs the [`PodRunner`] callback with the container's environment
//! resolved (a missing Secret keeps the Pod Pending with `CreateContainerConfigError`) and marks
//! the Pod Succeeded/Failed from the returned [`ExitStatus`]. [`FaultRule`]s inject failures.

mod http;
mod sim;
mod store;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand::{Rng as _, SeedableRng as _};
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

pub use sim::{ExitStatus, Fault, FaultRule, PodRun, PodRunner, PodSelector, SimConfig};
pub use store::{ApiError, MANAGED_BY_LABEL, MANAGED_BY_VALUE, Records, Resource};

use store::Store;

#[derive(Debug, thiserror::Error)]
pub enum FakeKubeError {
    #[error("bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("create {resource:?} {namespace}: {} {}", .error.code, .error.message)]
    Create {
        resource: Resource,
        namespace: String,
        error: ApiError,
    },
    #[error("{namespace}/{name}: pod not found")]
    PodNotFound { namespace: String, name: String },
}

impl FakeKubeError {
    pub fn kind(&self) -> &'static str {
        match self {
            FakeKubeError::Bind { .. } => "bind",
            FakeKubeError::Create { .. } => "create",
            FakeKubeError::PodNotFound { .. } => "pod_not_found",
        }
    }
}

/// State shared by the HTTP handlers, the simulated kubelet and the [`FakeKube`] handle.
pub(crate) struct Shared {
    store: Mutex<Store>,
    /// Latest resourceVersion; watch streams wait on it.
    changed: watch::Sender<u64>,
    /// `true` while the API is "down": requests get 503 and open watches are closed.
    unavailable: watch::Sender<bool>,
    sim: SimConfig,
    rng: Mutex<rand::rngs::StdRng>,
    fault_uses: Mutex<Vec<u32>>,
    /// `(namespace/name, fault kind)` of every Pod a fault rule or a fault call hit.
    faulted: Mutex<Vec<(String, &'static str)>>,
    /// Per-Pod kubelet task (simulation or graceful removal); dropping the handle aborts it.
    pod_tasks: Mutex<HashMap<(String, String), AbortOnDropHandle<()>>>,
    outage_task: Mutex<Option<AbortOnDropHandle<()>>>,
    /// Requests answered with 503 because of an injected outage.
    rejected: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking test thread must not wedge the fake server for everyone else.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        let (result, rv) = {
            let mut store = lock(&self.store);
            let result = f(&mut store);
            (result, store.resource_version())
        };
        self.changed.send_if_modified(|current| {
            let moved = *current != rv;
            *current = rv;
            moved
        });
        result
    }

    pub(crate) fn is_unavailable(&self) -> bool {
        *self.unavailable.borrow()
    }

    pub(crate) fn count_rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    fn choose_fault(&self, pod: &Value) -> Option<Fault> {
        let mut uses = lock(&self.fault_uses);
        let mut rng = lock(&self.rng);
        for (i, rule) in self.sim.faults.iter().enumerate() {
            let used = uses.get(i).copied().unwrap_or(0);
            if !rule.selector.matches(pod) || rule.max_times.is_some_and(|max| used >= max) {
                continue;
            }
            if rng.random::<f64>() < rule.probability {
                if let Some(u) = uses.get_mut(i) {
                    *u += 1;
                }
                return Some(rule.fault.clone());
            }
        }
        None
    }

    pub(crate) fn create(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        object: Value,
    ) -> Result<Value, ApiError> {
        let created = self.with_store(|s| s.create(resource, namespace, object))?;
        if resource == Resource::Pods && self.sim.simulate {
            let name = created
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let fault = self.choose_fault(&created);
            if let Some(fault) = &fault {
                lock(&self.faulted).push((format!("{namespace}/{name}"), fault.kind()));
            }
            let task = tokio::spawn(sim::run_pod(
                self.clone(),
                namespace.to_owned(),
                name.clone(),
                fault,
            ));
            lock(&self.pod_tasks)
                .insert((namespace.to_owned(), name), AbortOnDropHandle::new(task));
        }
        Ok(created)
    }

    fn stop_kubelet(&self, namespace: &str, name: &str) {
        let task = lock(&self.pod_tasks).remove(&(namespace.to_owned(), name.to_owned()));
        drop(task);
    }

    pub(crate) fn delete(
        self: &Arc<Self>,
        resource: Resource,
        namespace: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        if resource == Resource::Secrets {
            return self.with_store(|s| s.remove(resource, namespace, name));
        }
        self.stop_kubelet(namespace, name);
        let grace = self.sim.delete_grace;
        if grace.is_zero() {
            return self.with_store(|s| s.remove(resource, namespace, name));
        }
        let terminating = self.with_store(|s| s.mark_deleting(namespace, name))?;
        let shared = self.clone();
        let (ns, n) = (namespace.to_owned(), name.to_owned());
        let task = tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            // Gone already (e.g. deleted twice) is fine.
            let _ = shared.with_store(|s| s.remove(Resource::Pods, &ns, &n));
        });
        lock(&self.pod_tasks).insert(
            (namespace.to_owned(), name.to_owned()),
            AbortOnDropHandle::new(task),
        );
        Ok(terminating)
    }

    pub(crate) fn set_status(&self, namespace: &str, name: &str, status: Value) -> Option<Value> {
        self.with_store(|s| s.update_pod_status(namespace, name, |current| *current = status))
    }
}

/// A running fake API server. Dropping it stops the server and every simulated Pod.
pub struct FakeKube {
    shared: Arc<Shared>,
    addr: SocketAddr,
    _server: AbortOnDropHandle<()>,
}

impl FakeKube {
    /// Starts on a free port of 127.0.0.1.
    pub async fn start(config: SimConfig) -> Result<Self, FakeKubeError> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), config).await
    }

    pub async fn start_on(addr: SocketAddr, config: SimConfig) -> Result<Self, FakeKubeError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| FakeKubeError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| FakeKubeError::Bind { addr, source })?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::with_history_limit(config.watch_history)),
            changed: watch::Sender::new(0),
            unavailable: watch::Sender::new(false),
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(config.seed)),
            fault_uses: Mutex::new(vec![0; config.faults.len()]),
            faulted: Mutex::new(Vec::new()),
            sim: config,
            pod_tasks: Mutex::new(HashMap::new()),
            outage_task: Mutex::new(None),
            rejected: AtomicU64::new(0),
        });
        let app = http::router(shared.clone());
        let server = tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::error!(%error, "fake kube API server stopped");
            }
        });
        tracing::info!(%addr, "fake kube API server listening");
        Ok(Self {
            shared,
            addr,
            _server: AbortOnDropHandle::new(server),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, for `kube::Config::new(url.parse()?)`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A ResourceQuota on `pods` in `namespace` (`None` removes it): a create beyond it is
    /// refused with 403 `exceeded quota`, as the API server does.
    pub fn set_pod_quota(&self, namespace: &str, limit: Option<usize>) {
        self.shared
            .with_store(|s| s.set_pod_quota(namespace, limit));
    }

    /// Pod creates a quota refused so far.
    pub fn quota_refusals(&self) -> u64 {
        self.shared.with_store(|s| s.quota_refusals)
    }

    pub fn records(&self) -> Records {
        self.shared.with_store(|s| s.records())
    }

    /// `(namespace/name, fault kind)` of every Pod that a fault rule or one of the fault calls
    /// (`evict`, `mark_failed_before_start`, …) hit, in order: the jobs whose outcome a test
    /// must not expect to be the executor's.
    pub fn faulted_pods(&self) -> Vec<(String, &'static str)> {
        lock(&self.shared.faulted).clone()
    }

    fn note_fault(&self, namespace: &str, name: &str, kind: &'static str) {
        lock(&self.shared.faulted).push((format!("{namespace}/{name}"), kind));
    }

    pub fn resource_version(&self) -> u64 {
        self.shared.with_store(|s| s.resource_version())
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .with_store(|s| s.get(Resource::Pods, namespace, name).ok())
    }

    pub fn secret(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .with_store(|s| s.get(Resource::Secrets, namespace, name).ok())
    }

    /// The decoded value of one key of a Secret.
    pub fn secret_value(&self, namespace: &str, name: &str, key: &str) -> Option<String> {
        self.secret(namespace, name)
            .and_then(|s| store::secret_value(&s, key))
    }

    pub fn pods(&self, namespace: &str) -> Vec<Value> {
        self.shared.with_store(|s| {
            s.list(
                Resource::Pods,
                Some(namespace),
                &store::LabelSelector::default(),
            )
        })
    }

    pub fn secrets(&self, namespace: &str) -> Vec<Value> {
        self.shared.with_store(|s| {
            s.list(
                Resource::Secrets,
                Some(namespace),
                &store::LabelSelector::default(),
            )
        })
    }

    /// Creates a Pod directly, as if someone other than jetrunner did (orphan tests). It is
    /// simulated like any other Pod.
    pub fn create_pod(&self, namespace: &str, pod: Value) -> Result<Value, FakeKubeError> {
        self.shared
            .create(Resource::Pods, namespace, pod)
            .map_err(|error| FakeKubeError::Create {
                resource: Resource::Pods,
                namespace: namespace.to_owned(),
                error,
            })
    }

    pub fn create_secret(&self, namespace: &str, secret: Value) -> Result<Value, FakeKubeError> {
        self.shared
            .create(Resource::Secrets, namespace, secret)
            .map_err(|error| FakeKubeError::Create {
                resource: Resource::Secrets,
                namespace: namespace.to_owned(),
                error,
            })
    }

    /// Deletes a Pod as `kubectl delete` would (honours [`SimConfig::delete_grace`]).
    pub fn delete_pod(&self, namespace: &str, name: &str) -> Result<Value, FakeKubeError> {
        self.shared
            .delete(Resource::Pods, namespace, name)
            .map_err(|_| FakeKubeError::PodNotFound {
                namespace: namespace.into(),
                name: name.into(),
            })
    }

    /// Replaces a Pod's status (stopping its simulated kubelet first, so the test is in control).
    pub fn set_pod_status(
        &self,
        namespace: &str,
        name: &str,
        status: Value,
    ) -> Result<Value, FakeKubeError> {
        self.shared.stop_kubelet(namespace, name);
        self.shared
            .set_status(namespace, name, status)
            .ok_or_else(|| FakeKubeError::PodNotFound {
                namespace: namespace.into(),
                name: name.into(),
            })
    }

    fn with_pod_status(
        &self,
        namespace: &str,
        name: &str,
        build: impl FnOnce(&Value) -> Value,
    ) -> Result<Value, FakeKubeError> {
        let pod = self
            .pod(namespace, name)
            .ok_or_else(|| FakeKubeError::PodNotFound {
                namespace: namespace.into(),
                name: name.into(),
            })?;
        self.set_pod_status(namespace, name, build(&pod))
    }

    pub fn mark_running(&self, namespace: &str, name: &str) -> Result<Value, FakeKubeError> {
        self.with_pod_status(namespace, name, sim::status::running)
    }

    pub fn mark_exited(
        &self,
        namespace: &str,
        name: &str,
        exit: &ExitStatus,
    ) -> Result<Value, FakeKubeError> {
        self.with_pod_status(namespace, name, |pod| sim::status::exited(pod, exit))
    }

    /// Phase Failed, `status.reason: Evicted`; a running simulated container is stopped.
    pub fn evict(&self, namespace: &str, name: &str) -> Result<Value, FakeKubeError> {
        self.note_fault(namespace, name, "evict");
        self.with_pod_status(namespace, name, sim::status::evicted)
    }

    pub fn mark_unschedulable(&self, namespace: &str, name: &str) -> Result<Value, FakeKubeError> {
        self.note_fault(namespace, name, "stuck-pending");
        self.with_pod_status(namespace, name, |_| sim::status::unschedulable())
    }

    pub fn mark_failed_before_start(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Value, FakeKubeError> {
        self.note_fault(namespace, name, "fail-before-start");
        self.with_pod_status(namespace, name, sim::status::failed_before_start)
    }

    /// Outage on/off: while on, every request gets 503 and open watch streams are closed.
    pub fn set_unavailable(&self, unavailable: bool) {
        drop(lock(&self.shared.outage_task).take());
        self.shared.unavailable.send_replace(unavailable);
    }

    /// How many requests were answered 503 because of an outage (lets a test wait until a client
    /// has actually hit the outage).
    pub fn rejected_requests(&self) -> u64 {
        self.shared.rejected.load(Ordering::Relaxed)
    }

    /// An outage that ends on its own after `duration`.
    pub fn unavailable_for(&self, duration: Duration) {
        self.shared.unavailable.send_replace(true);
        let shared = self.shared.clone();
        let task = tokio::spawn(async move {
            tokio::time::sleep(duration).await;
            shared.unavailable.send_replace(false);
        });
        *lock(&self.shared.outage_task) = Some(AbortOnDropHandle::new(task));
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        // Ends open watch streams (their connections outlive the server task) and stops the
        // simulated kubelet tasks, which hold references to `shared`.
        self.shared.unavailable.send_replace(true);
        lock(&self.shared.pod_tasks).clear();
        drop(lock(&self.shared.outage_task).take());
    }
}
