//! Simulation mode: a tiny kubelet that starts Pods, runs a user callback in their place and
//! reports the outcome, with injectable faults.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{Value, json};

use crate::Shared;
use crate::store::{Resource, now_rfc3339, secret_value};

/// Runs a Pod's container: receives the resolved Pod and returns how the container exited.
pub type PodRunner = Arc<dyn Fn(PodRun) -> BoxFuture<'static, ExitStatus> + Send + Sync>;

/// A Pod about to run, with its first container's environment resolved (Secrets included).
#[derive(Clone, Debug)]
pub struct PodRun {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
}

/// How a container ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitStatus {
    pub exit_code: i32,
    /// The container's terminated reason; defaults to `Completed` / `Error`. `OOMKilled` works.
    pub reason: Option<String>,
}

impl ExitStatus {
    pub fn success() -> Self {
        Self {
            exit_code: 0,
            reason: None,
        }
    }

    pub fn failed(exit_code: i32) -> Self {
        Self {
            exit_code,
            reason: None,
        }
    }

    pub fn oom_killed() -> Self {
        Self {
            exit_code: 137,
            reason: Some("OOMKilled".into()),
        }
    }
}

/// A fault the simulated kubelet injects into a Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The container never starts: phase Failed (container terminated with `StartError`).
    FailBeforeStart,
    /// The Pod starts, then is evicted after `after`: phase Failed, reason `Evicted`.
    Evict { after: Duration },
    /// The Pod is never scheduled: stays Pending with `PodScheduled=False` / `Unschedulable`.
    StuckPending,
}

impl Fault {
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::FailBeforeStart => "fail-before-start",
            Fault::Evict { .. } => "evict",
            Fault::StuckPending => "stuck-pending",
        }
    }
}

/// Which Pods a fault rule applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodSelector {
    Any,
    Name(String),
    Label(String, String),
}

#[derive(Clone, Debug)]
pub struct FaultRule {
    pub selector: PodSelector,
    pub fault: Fault,
    /// Chance (0.0–1.0) that a matching Pod gets the fault.
    pub probability: f64,
    /// Stop applying the rule after this many Pods.
    pub max_times: Option<u32>,
}

impl FaultRule {
    pub fn always(selector: PodSelector, fault: Fault) -> Self {
        Self {
            selector,
            fault,
            probability: 1.0,
            max_times: None,
        }
    }
}

/// How the fake server behaves beyond plain storage.
#[derive(Clone)]
pub struct SimConfig {
    /// `false`: Pods stay as created (Pending) until a test changes them with the
    /// `FakeKube::mark_*` methods.
    pub simulate: bool,
    /// Pending → Running after this long.
    pub start_delay: Duration,
    /// Runs the container; `None` keeps a started Pod Running until it is deleted or evicted.
    pub runner: Option<PodRunner>,
    /// Evaluated in order at Pod creation; the first rule that matches (and wins its roll) applies.
    pub faults: Vec<FaultRule>,
    pub seed: u64,
    /// Zero: a deleted Pod disappears at once. Otherwise it is Terminating (deletionTimestamp set)
    /// for this long first.
    pub delete_grace: Duration,
    /// How long a DELETE call takes to be answered (a slow API server); zero: at once.
    pub delete_call_delay: Duration,
    /// Watch events kept for replay (0: all). Older resourceVersions get `410 Gone`, as after
    /// etcd compaction; clients must relist.
    pub watch_history: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            simulate: false,
            start_delay: Duration::from_millis(50),
            runner: None,
            faults: Vec::new(),
            seed: 7,
            delete_grace: Duration::ZERO,
            delete_call_delay: Duration::ZERO,
            watch_history: 0,
        }
    }
}

impl std::fmt::Debug for SimConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimConfig")
            .field("simulate", &self.simulate)
            .field("start_delay", &self.start_delay)
            .field("runner", &self.runner.is_some())
            .field("faults", &self.faults)
            .field("delete_grace", &self.delete_grace)
            .field("delete_call_delay", &self.delete_call_delay)
            .field("watch_history", &self.watch_history)
            .finish()
    }
}

impl SimConfig {
    /// Storage only: no kubelet.
    pub fn passive() -> Self {
        Self::default()
    }

    /// A kubelet that runs every Pod with `runner`, as strict as a real cluster in what matters
    /// to a client: deleted Pods stay Terminating for a grace period, and the watch history is
    /// compacted (a resumed watch may get `410 Gone` and must relist).
    pub fn simulated(runner: PodRunner) -> Self {
        Self {
            simulate: true,
            runner: Some(runner),
            delete_grace: Duration::from_millis(300),
            watch_history: 64,
            ..Self::default()
        }
    }
}

impl PodSelector {
    pub(crate) fn matches(&self, pod: &Value) -> bool {
        match self {
            PodSelector::Any => true,
            PodSelector::Name(name) => {
                pod.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
            }
            PodSelector::Label(k, v) => {
                pod.pointer("/metadata/labels")
                    .and_then(|l| l.get(k))
                    .and_then(Value::as_str)
                    == Some(v)
            }
        }
    }
}

fn first_container(pod: &Value) -> (String, String) {
    let c = pod.pointer("/spec/containers/0");
    let field = |f: &str| {
        c.and_then(|c| c.get(f))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (field("name"), field("image"))
}

fn container_status(pod: &Value, state: Value, ready: bool) -> Value {
    let (name, image) = first_container(pod);
    json!([{
        "name": name, "image": image, "imageID": "", "ready": ready, "restartCount": 0,
        "started": ready, "state": state,
    }])
}

fn scheduled(status: bool, reason: Option<&str>) -> Value {
    let mut condition =
        json!({"type": "PodScheduled", "status": if status { "True" } else { "False" }});
    if let Some(reason) = reason {
        condition["reason"] = json!(reason);
        condition["message"] = json!("0/3 nodes are available: 3 Insufficient cpu. (simulated)");
    }
    condition
}

/// Status builders (what a kubelet would write).
pub(crate) mod status {
    use super::*;

    pub fn unschedulable() -> Value {
        json!({"phase": "Pending", "conditions": [scheduled(false, Some("Unschedulable"))]})
    }

    pub fn failed_before_start(pod: &Value) -> Value {
        let state = json!({"terminated": {
            "exitCode": 128, "reason": "StartError",
            "message": "failed to create containerd task: simulated start failure",
            "startedAt": now_rfc3339(), "finishedAt": now_rfc3339()}});
        json!({"phase": "Failed", "conditions": [scheduled(true, None)],
               "containerStatuses": container_status(pod, state, false)})
    }

    pub fn config_error(pod: &Value, message: &str) -> Value {
        let state =
            json!({"waiting": {"reason": "CreateContainerConfigError", "message": message}});
        json!({"phase": "Pending", "conditions": [scheduled(true, None)],
               "containerStatuses": container_status(pod, state, false)})
    }

    pub fn running(pod: &Value) -> Value {
        let state = json!({"running": {"startedAt": now_rfc3339()}});
        json!({"phase": "Running", "startTime": now_rfc3339(),
               "conditions": [scheduled(true, None), {"type": "Ready", "status": "True"}],
               "containerStatuses": container_status(pod, state, true)})
    }

    pub fn exited(pod: &Value, exit: &ExitStatus) -> Value {
        let reason = exit.reason.clone().unwrap_or_else(|| {
            if exit.exit_code == 0 {
                "Completed".into()
            } else {
                "Error".into()
            }
        });
        let state = json!({"terminated": {"exitCode": exit.exit_code, "reason": reason,
                                         "startedAt": now_rfc3339(), "finishedAt": now_rfc3339()}});
        json!({"phase": if exit.exit_code == 0 { "Succeeded" } else { "Failed" },
               "conditions": [scheduled(true, None)],
               "containerStatuses": container_status(pod, state, false)})
    }

    pub fn evicted(pod: &Value) -> Value {
        let state = json!({"terminated": {"exitCode": 137, "reason": "Error",
                                         "startedAt": now_rfc3339(), "finishedAt": now_rfc3339()}});
        json!({"phase": "Failed", "reason": "Evicted",
               "message": "The node was low on resource: memory. (simulated)",
               "conditions": [scheduled(true, None)],
               "containerStatuses": container_status(pod, state, false)})
    }
}

/// Resolves the first container's env like the kubelet: `value` as is, `secretKeyRef` from the
/// Secret. `Err` carries the kubelet's message when a Secret or key is missing.
pub(crate) fn resolve_run(shared: &Shared, pod: &Value) -> Result<PodRun, String> {
    let namespace = pod
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let name = pod
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let labels = pod
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|l| {
            l.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default();
    let container = pod
        .pointer("/spec/containers/0")
        .cloned()
        .unwrap_or(Value::Null);
    let strings = |field: &str| -> Vec<String> {
        container[field]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut env = BTreeMap::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let Some(var_name) = var["name"].as_str() else {
            continue;
        };
        if let Some(value) = var["value"].as_str() {
            env.insert(var_name.to_owned(), value.to_owned());
        } else if let Some(reference) = var.pointer("/valueFrom/secretKeyRef") {
            let secret_name = reference["name"].as_str().unwrap_or_default();
            let key = reference["key"].as_str().unwrap_or_default();
            let optional = reference["optional"].as_bool().unwrap_or(false);
            let secret =
                shared.with_store(|s| s.get(Resource::Secrets, &namespace, secret_name).ok());
            match secret {
                Some(secret) => match secret_value(&secret, key) {
                    Some(value) => {
                        env.insert(var_name.to_owned(), value);
                    }
                    None if optional => {}
                    None => {
                        return Err(format!(
                            "couldn't find key {key} in Secret {namespace}/{secret_name}"
                        ));
                    }
                },
                None if optional => {}
                None => return Err(format!("secret \"{secret_name}\" not found")),
            }
        } else {
            env.insert(var_name.to_owned(), String::new());
        }
    }
    let (_, image) = first_container(pod);
    Ok(PodRun {
        namespace,
        name,
        labels,
        image,
        command: strings("command"),
        args: strings("args"),
        env,
    })
}

enum Outcome {
    Exited(ExitStatus),
    Evicted,
}

/// The life of one simulated Pod (a named task owned by `Shared`, aborted when the Pod is deleted).
pub(crate) async fn run_pod(
    shared: Arc<Shared>,
    namespace: String,
    name: String,
    fault: Option<Fault>,
) {
    let config = shared.sim.clone();
    tokio::time::sleep(config.start_delay).await;
    let Some(pod) = shared.with_store(|s| s.get(Resource::Pods, &namespace, &name).ok()) else {
        return;
    };
    match fault {
        Some(Fault::StuckPending) => {
            shared.set_status(&namespace, &name, status::unschedulable());
            return;
        }
        Some(Fault::FailBeforeStart) => {
            shared.set_status(&namespace, &name, status::failed_before_start(&pod));
            return;
        }
        Some(Fault::Evict { .. }) | None => {}
    }
    let mut reported_config_error = false;
    let run = loop {
        let Some(pod) = shared.with_store(|s| s.get(Resource::Pods, &namespace, &name).ok()) else {
            return;
        };
        match resolve_run(&shared, &pod) {
            Ok(run) => break run,
            Err(message) => {
                if !reported_config_error {
                    tracing::debug!(pod = %name, %message, "simulated kubelet: CreateContainerConfigError");
                    shared.set_status(&namespace, &name, status::config_error(&pod, &message));
                    reported_config_error = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    if shared
        .set_status(&namespace, &name, status::running(&pod))
        .is_none()
    {
        return;
    }
    let container: BoxFuture<'static, ExitStatus> = match &config.runner {
        Some(runner) => runner(run),
        None => Box::pin(futures::future::pending()),
    };
    let outcome = match fault {
        Some(Fault::Evict { after }) => tokio::select! {
            exit = container => Outcome::Exited(exit),
            () = tokio::time::sleep(after) => Outcome::Evicted,
        },
        Some(Fault::StuckPending | Fault::FailBeforeStart) | None => {
            Outcome::Exited(container.await)
        }
    };
    let status = match outcome {
        Outcome::Exited(exit) => status::exited(&pod, &exit),
        Outcome::Evicted => status::evicted(&pod),
    };
    shared.set_status(&namespace, &name, status);
}
