//! Shared pieces of the dispatch tests: a real nats-server, the in-process fake forge, a config
//! pointing at both, the scheduler's fetchers started the way `service::run` starts them, and
//! readers that count what landed in JR_ASSIGNMENTS.

#![allow(dead_code, reason = "each test uses a different subset")]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use jr_bus::async_nats::jetstream::consumer::{self, DeliverPolicy};
use jr_bus::testing::NatsServer;
use jr_bus::{Bus, ConsumerSpec, Topology};
use jr_config::Config;
use jr_fake_forge::FakeForge;
use jr_gitea_intake::fetcher::{Dispatcher, FetchError, Pacing, run_fetchers};
use jr_gitea_intake::forges::Forges;
use jr_gitea_intake::unclaimed::Unclaimed;
use jr_intake::routing::Router;
use jr_protocol::{Assignment, Envelope, Message, STREAM_ASSIGNMENTS, subject};
use jr_seal::Sealer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const SEAL_KEY_ID: &str = "k1";

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Everything a test talks to. Dropping it stops the forge and kills nats-server.
pub struct World {
    pub nats: NatsServer,
    pub forge: FakeForge,
    pub bus: Bus,
    pub config: Config,
    pub dir: tempfile::TempDir,
    /// Stand-in worker replicas renewing their capacity holdings, by backend.
    presence: std::sync::Mutex<BTreeMap<String, (CancellationToken, JoinHandle<()>)>>,
}

impl Drop for World {
    fn drop(&mut self) {
        for stop in self
            .presence
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
        {
            stop.0.cancel();
        }
    }
}

/// `pod` (labels `pod`, plus `extra_pod_labels`) and `vm` backends, routing `pod`→pod, `vm`→vm,
/// no default backend; registration with the forge's token, credentials in a temp dir.
pub fn config_text(
    forge_url: &str,
    nats_url: &str,
    credentials: &std::path::Path,
    extra_pod_labels: &[&str],
) -> String {
    let mut pod_labels = vec!["\"pod\"".to_owned()];
    pod_labels.extend(extra_pod_labels.iter().map(|l| format!("{l:?}")));
    format!(
        r#"
[nats]
url = "{nats_url}"
[forge]
url = "{forge_url}"
registration = "LAYOUT"
registration_token = "REGISTRATION_TOKEN"
credentials_file = "{credentials}"
request_timeout = "5s"
[facade]
listen = "127.0.0.1:1"
public_url = "http://127.0.0.1:1"
insecure_plain_http = true
[[routing.rules]]
label = "pod"
backend = "pod"
[[routing.rules]]
label = "vm"
backend = "vm"
[backend.pod]
kind = "pod"
capacity = 4
labels = [{pod_labels}]
kubernetes = {{ namespace = "jobs" }}
[backend.vm]
kind = "vm"
capacity = 4
opensandbox = {{ url = "http://127.0.0.1:1" }}
[scheduler.seal_keys]
{SEAL_KEY_ID} = "{key}"
"#,
        credentials = credentials.display(),
        pod_labels = pod_labels.join(", "),
        key = Sealer::generate_key(),
    )
}

impl World {
    pub async fn start() -> World {
        Self::start_with(jr_fake_forge::Config::default(), &[]).await
    }

    /// `extra_pod_labels` are declared by the pod backend without a routing rule. One shared
    /// registration for both backends.
    pub async fn start_with(
        forge_config: jr_fake_forge::Config,
        extra_pod_labels: &[&str],
    ) -> World {
        Self::start_layout(forge_config, extra_pod_labels, "shared", "").await
    }

    /// `layout` is `forge.registration`; `extra_config` is appended to the config file.
    pub async fn start_layout(
        forge_config: jr_fake_forge::Config,
        extra_pod_labels: &[&str],
        layout: &str,
        extra_config: &str,
    ) -> World {
        init_tracing();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let nats = NatsServer::start().await.expect("nats-server starts");
        let forge = FakeForge::start(forge_config)
            .await
            .expect("fake forge starts");
        let dir = tempfile::tempdir().expect("temp dir");
        let text = config_text(
            forge.url(),
            &nats.url(),
            &dir.path().join("runner.json"),
            extra_pod_labels,
        )
        .replace("REGISTRATION_TOKEN", &forge.registration_token())
        .replace("LAYOUT", layout)
            + extra_config;
        let config = jr_config::load_str(&text, "test", std::iter::empty()).expect("valid config");
        let bus = Bus::connect(&nats.url(), "scheduler-test", None)
            .await
            .expect("bus connects");
        let mut topology = Topology::new().consumer(ConsumerSpec::scheduler_commands());
        for (backend, _) in config.enabled_backends() {
            topology = topology.consumer(ConsumerSpec::worker_assignments(&backend));
        }
        bus.ensure_topology(&topology)
            .await
            .expect("streams declared");
        let world = World {
            nats,
            forge,
            bus,
            config,
            dir,
            presence: Default::default(),
        };
        for (backend, _) in world.config.enabled_backends() {
            world.worker_starts(backend.as_str());
        }
        world
    }

    /// A stand-in worker replica of `backend` renews its capacity holding every second, as a
    /// live worker does (pacing takes work for a backend only while one does).
    pub fn worker_starts(&self, backend: &str) {
        let stop = CancellationToken::new();
        let (js, token) = (self.bus.jetstream().clone(), stop.clone());
        let bucket = format!("JR_WORKLOADS_{backend}");
        let name = format!("{backend}-worker_0000beef");
        let task = tokio::spawn(async move {
            while !token.is_cancelled() {
                let store = js
                    .create_or_update_key_value(jr_bus::async_nats::jetstream::kv::Config {
                        bucket: bucket.clone(),
                        history: 1,
                        ..Default::default()
                    })
                    .await;
                if let Ok(store) = store {
                    let mut slots = jr_lease::Slots::default();
                    slots.held.insert(
                        name.clone(),
                        jr_lease::Holding {
                            slots: 0,
                            renewed_at: jr_protocol::now_ms(),
                            ttl_ms: 6_000,
                            owns: Default::default(),
                        },
                    );
                    if let Ok(bytes) = serde_json::to_vec(&slots) {
                        let _ = store.put("slots", bytes.into()).await;
                    }
                }
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
        if let Some(old) = self
            .presence
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(backend.to_owned(), (stop, task))
        {
            old.0.cancel();
        }
    }

    /// `backend`'s stand-in worker stops and its holding is gone (as after its lifetime).
    pub async fn worker_stops(&self, backend: &str) {
        let stopped = self
            .presence
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(backend);
        if let Some(stop) = stopped {
            stop.0.cancel();
            // No renewal may land after the holding is removed.
            let _ = stop.1.await;
        }
        let bucket = format!("JR_WORKLOADS_{backend}");
        if let Ok(store) = self.bus.jetstream().get_key_value(&bucket).await {
            store.delete("slots").await.expect("holding removed");
        }
    }

    pub fn forge_instance(&self) -> String {
        self.config.forge.url.trim_end_matches('/').to_owned()
    }

    pub fn router(&self) -> Router {
        Router::from_config(&self.config)
    }

    /// Registers (or reuses the stored credentials) and declares, as `service::run` does.
    pub async fn establish(&self) -> Forges {
        let shutdown = CancellationToken::new();
        Forges::establish(&self.config, &self.router(), &Default::default(), &shutdown)
            .await
            .expect("registration succeeds")
    }

    pub fn dispatcher(&self, forges: Forges) -> Arc<Dispatcher> {
        let sealer = jr_scheduler::service::sealer_from_config(&self.config).expect("seal key");
        Arc::new(Dispatcher {
            bus: self.bus.clone(),
            forges,
            router: self.router(),
            sink: jr_intake::sink::AssignmentSink::new(self.bus.clone(), Arc::new(sealer)),
            forge_instance: self.forge_instance(),
            max_duration: self
                .config
                .enabled_backends()
                .map(|(n, b)| (n, b.max_duration))
                .collect(),
            lookahead: self
                .config
                .enabled_backends()
                .map(|(n, b)| (n, b.lookahead))
                .collect(),
            unclaimed: Arc::new(Unclaimed::new(self.config.forge.keepalive_interval)),
            unclaimed_horizon: Duration::from_secs(3 * 3600),
            leases: Default::default(),
            stats: Default::default(),
            presence: Default::default(),
            intakes: Arc::new(jr_intake::board::IntakeBoard::new(
                "gitea", "shared", "test", None,
            )),
        })
    }

    /// Registration, then one fetch loop per registration polling every `poll`, paced by the
    /// worker consumers (see [`World::drain_workers`]).
    pub async fn start_fetchers(&self, poll: Duration, max_backoff: Duration) -> Fetchers {
        let forges = self.establish().await;
        let dispatcher = self.dispatcher(forges);
        let shutdown = CancellationToken::new();
        let pacing = Pacing {
            poll_interval: poll,
            max_backoff,
            version_reset_interval: self.config.forge.version_reset_interval,
            flavor: self.config.forge.flavor,
            task_capacity: self.config.forge.task_capacity,
        };
        let task = tokio::spawn(run_fetchers(dispatcher.clone(), pacing, shutdown.clone()));
        Fetchers {
            dispatcher,
            shutdown,
            task: Some(task),
        }
    }

    /// Stand-in workers with unlimited capacity: every assignment delivered to a worker
    /// consumer is acked at once, so nothing waits and fetching is never paused. Stops when
    /// the returned token is cancelled (or the test ends).
    pub fn drain_workers(&self) -> CancellationToken {
        let all: Vec<String> = self
            .config
            .enabled_backends()
            .map(|(b, _)| b.to_string())
            .collect();
        self.drain_workers_of(&all.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// [`World::drain_workers`] for the named backends only.
    pub fn drain_workers_of(&self, backends: &[&str]) -> CancellationToken {
        let stop = CancellationToken::new();
        for (backend, _) in self
            .config
            .enabled_backends()
            .filter(|(b, _)| backends.contains(&b.as_str()))
        {
            let (js, stop) = (self.bus.jetstream().clone(), stop.clone());
            let durable = ConsumerSpec::worker_assignments(&backend).durable;
            tokio::spawn(async move {
                // Re-binds after errors (NATS restarts in some tests) until stopped.
                while !stop.is_cancelled() {
                    let messages = match js.get_stream(STREAM_ASSIGNMENTS).await {
                        Ok(stream) => match stream
                            .get_consumer::<consumer::pull::Config>(&durable)
                            .await
                        {
                            Ok(consumer) => consumer.messages().await.ok(),
                            Err(_) => None,
                        },
                        Err(_) => None,
                    };
                    if let Some(mut messages) = messages {
                        loop {
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                next = messages.next() => match next {
                                    Some(Ok(m)) => { let _ = m.ack().await; }
                                    Some(Err(_)) | None => break,
                                },
                            }
                        }
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
            });
        }
        stop
    }

    /// Assignments of `backend` stored but not yet delivered to its worker.
    pub async fn waiting_for(&self, backend: &str) -> u64 {
        let backend = jr_protocol::BackendName::new(backend).expect("backend");
        self.bus
            .consumer_info(
                STREAM_ASSIGNMENTS,
                &ConsumerSpec::worker_assignments(&backend).durable,
            )
            .await
            .map(|c| c.num_pending)
            .unwrap_or(0)
    }

    /// Messages now stored in JR_ASSIGNMENTS.
    pub async fn assignment_count(&self) -> u64 {
        match self.bus.jetstream().get_stream(STREAM_ASSIGNMENTS).await {
            Ok(stream) => stream.cached_info().state.messages,
            Err(_) => 0,
        }
    }

    /// Every message of JR_ASSIGNMENTS, in stream order, read with an ordered consumer.
    pub async fn read_assignments(&self) -> Vec<StoredAssignment> {
        let expected = self.assignment_count().await;
        let stream = self
            .bus
            .jetstream()
            .get_stream(STREAM_ASSIGNMENTS)
            .await
            .expect("stream");
        let reader = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: subject::ASSIGNMENTS_ALL.to_owned(),
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .expect("ordered consumer");
        let mut messages = reader.messages().await.expect("message stream");
        let mut out = Vec::new();
        while (out.len() as u64) < expected {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .expect("stream delivers every stored message")
                .expect("stream open")
                .expect("message");
            let envelope = jr_protocol::decode(&message.payload).expect("assignment decodes");
            let Message::Assignment(assignment) = envelope.message.clone() else {
                panic!("{} on {}", envelope.kind(), message.subject);
            };
            let msg_id = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map(|v| v.as_str().to_owned());
            out.push(StoredAssignment {
                subject: message.subject.to_string(),
                msg_id,
                raw: message.payload.to_vec(),
                envelope,
                assignment,
            });
        }
        out
    }
}

pub struct StoredAssignment {
    pub subject: String,
    pub msg_id: Option<String>,
    pub raw: Vec<u8>,
    pub envelope: Envelope,
    pub assignment: Assignment,
}

/// Running fetchers; dropping them cancels.
pub struct Fetchers {
    pub dispatcher: Arc<Dispatcher>,
    pub shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), FetchError>>>,
}

impl Fetchers {
    /// Cancels and waits for every fetcher.
    pub async fn stop(mut self) -> Result<(), FetchError> {
        self.shutdown.cancel();
        let task = self.task.take().expect("running");
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("fetchers stop within 10 s")
            .expect("fetchers did not panic")
    }

    /// Waits until the fetchers end on their own (only an unregistered runner does that).
    pub async fn finished(mut self, timeout: Duration) -> Result<(), FetchError> {
        let task = self.task.take().expect("running");
        tokio::time::timeout(timeout, task)
            .await
            .expect("fetchers end on their own")
            .expect("fetchers did not panic")
    }
}

impl Drop for Fetchers {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Polls `check` every 50 ms until it holds; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks that JR_ASSIGNMENTS holds exactly one assignment per forge task of `expected`
/// (task id → backend name), each on its backend's subject; returns the messages.
pub async fn assert_published_exactly_once(
    world: &World,
    expected: &BTreeMap<i64, String>,
) -> Vec<StoredAssignment> {
    let stored = world.read_assignments().await;
    let mut seen: BTreeMap<i64, usize> = BTreeMap::new();
    let mut per_prefix: BTreeMap<String, usize> = BTreeMap::new();
    let instance = world.forge_instance();
    for m in &stored {
        let a = &m.assignment;
        *seen.entry(a.forge_task_id).or_default() += 1;
        let backend = m
            .subject
            .split('.')
            .nth(2)
            .expect("jr.assignment.<backend>.<id>")
            .to_owned();
        *per_prefix.entry(backend.clone()).or_default() += 1;
        let want = expected
            .get(&a.forge_task_id)
            .unwrap_or_else(|| panic!("task {} was published but not expected", a.forge_task_id));
        assert_eq!(
            &backend, want,
            "task {} published to the wrong backend",
            a.forge_task_id
        );
        assert_eq!(a.backend.as_str(), want);
        let id = jr_protocol::AssignmentId::for_task(&instance, a.forge_task_id);
        assert_eq!(m.envelope.assignment_id, id);
        assert_eq!(m.subject, subject::assignment(&a.backend, id));
        assert_eq!(m.envelope.attempt, 1);
        assert_eq!(
            m.msg_id.as_deref(),
            Some(m.envelope.id.as_str()),
            "Nats-Msg-Id is the envelope id"
        );
    }
    let duplicates: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        duplicates.is_empty(),
        "tasks published more than once: {duplicates:?}"
    );
    let missing: Vec<_> = expected.keys().filter(|t| !seen.contains_key(t)).collect();
    assert!(missing.is_empty(), "tasks never published: {missing:?}");
    let mut want_prefix: BTreeMap<String, usize> = BTreeMap::new();
    for b in expected.values() {
        *want_prefix.entry(b.clone()).or_default() += 1;
    }
    assert_eq!(
        per_prefix, want_prefix,
        "messages per jr.assignment.<backend>.>"
    );
    stored
}

/// task id → expected backend (the job's first `runs-on` label, which is also the backend name
/// in these tests), for every task the forge handed out.
pub fn expected_backends(snapshot: &jr_fake_forge::Snapshot) -> BTreeMap<i64, String> {
    snapshot
        .tasks
        .iter()
        .map(|t| {
            let job = snapshot.job(t.job_id).expect("task's job");
            (t.id, job.runs_on.first().cloned().unwrap_or_default())
        })
        .collect()
}

/// Attempt `attempt` of a `pod` assignment of forge task `task_id`, sealed by `sealer` as the
/// scheduler seals (a genuine assignment when `sealer` is the configured one).
pub fn sealed_assignment(
    id: jr_protocol::AssignmentId,
    attempt: u32,
    task_id: i64,
    sealer: &Sealer,
) -> Envelope {
    use prost::Message as _;
    let pod = jr_protocol::BackendName::new("pod").expect("name");
    let task = jr_forge::proto::runner::v1::Task {
        id: task_id,
        ..Default::default()
    };
    Envelope::new(
        format!("assignment:{id}:{attempt}:test"),
        1_000,
        id,
        attempt,
        Message::Assignment(Assignment {
            forge_instance: "https://forge.test".into(),
            forge_task_id: task_id,
            backend: pod.clone(),
            provider: None,
            placement: None,
            labels: vec!["pod".into()],
            repository: "org/repo".into(),
            workflow: None,
            job_name: format!("job-{task_id}"),
            max_duration_secs: 3600,
            fetched_at: 1_000,
            sealed_task: sealer
                .seal(
                    jr_seal::SealScope::new(id, &pod, task_id),
                    &task.encode_to_vec(),
                )
                .expect("seal"),
        }),
    )
}
