//! `VmBackend` against the fake OpenSandbox server.

use std::collections::BTreeMap;
use std::time::Duration;

use jr_fake_sandbox::{FakeConfig, FakeSandbox, SandboxState};
use jr_protocol::{AssignmentId, BackendName, WorkloadPhase};
use jr_worker::{Backend, BackendError, ObservedWorkload, WorkloadSpec};
use tokio::sync::{mpsc, oneshot};
use vm_worker::backend::{
    LABEL_ASSIGNMENT, LABEL_ATTEMPT, LABEL_BACKEND, LABEL_WORKER, PollConfig, VmBackend,
    VmBackendConfig,
};
use vm_worker::opensandbox::{ClientConfig, CreateSandbox, SandboxClient};

const API_KEY: &str = "test-key";
const WAIT: Duration = Duration::from_secs(10);

fn fake_config(pool_capacity: usize) -> FakeConfig {
    FakeConfig {
        api_key: Some(API_KEY.to_owned()),
        pools: BTreeMap::from([("ci-vm".to_owned(), pool_capacity)]),
        pool_acquisition_timeout: Duration::from_millis(200),
        stopping_for: Duration::from_millis(150),
        ..FakeConfig::default()
    }
}

fn client(fake: &FakeSandbox, create_timeout: Duration) -> SandboxClient {
    let mut config = ClientConfig::new(fake.base_url(), Some(API_KEY.to_owned()));
    config.create_timeout = create_timeout;
    config.request_timeout = Duration::from_secs(5);
    SandboxClient::new(config).expect("client")
}

fn backend_with(
    fake: &FakeSandbox,
    create_timeout: Duration,
    edit: impl FnOnce(&mut VmBackendConfig),
) -> VmBackend {
    let mut config = VmBackendConfig::new(BackendName::new("vm").expect("name"));
    config.poll = PollConfig {
        active: Duration::from_millis(30),
        steady: Duration::from_millis(60),
        max_backoff: Duration::from_millis(120),
        unreachable_after: 2,
        ..PollConfig::default()
    };
    edit(&mut config);
    VmBackend::new(client(fake, create_timeout), config)
}

fn backend(fake: &FakeSandbox) -> VmBackend {
    backend_with(fake, Duration::from_secs(10), |_| {})
}

fn spec() -> WorkloadSpec {
    WorkloadSpec {
        assignment_id: AssignmentId(uuid::Uuid::new_v4()),
        attempt: 1,
        backend: BackendName::new("vm").expect("name"),
        provider: None,
        labels: vec!["vm".into()],
        max_duration: Duration::from_secs(3600),
        worker_id: "vm-worker-1".into(),
        facade_url: "http://facade.test".into(),
        executor_token: "per-attempt-secret".into(),
        repository: "acme/widgets".into(),
        workflow: "ci".into(),
        job_name: "build".into(),
        fetched_at: 0,
        forge_env: None,
    }
}

/// Sandboxes the fake made for one attempt that got a VM.
fn created_for(fake: &FakeSandbox, spec: &WorkloadSpec) -> Vec<String> {
    let assignment = spec.assignment_id.to_string();
    fake.created()
        .into_iter()
        .filter(|c| c.allocated && c.metadata.get(LABEL_ASSIGNMENT) == Some(&assignment))
        .map(|c| c.id)
        .collect()
}

/// Sandboxes of one attempt that exist and are not on their way out.
fn live_for(fake: &FakeSandbox, spec: &WorkloadSpec) -> Vec<String> {
    let assignment = spec.assignment_id.to_string();
    fake.sandboxes()
        .into_iter()
        .filter(|s| {
            s.state != SandboxState::Stopping
                && s.metadata.get(LABEL_ASSIGNMENT) == Some(&assignment)
        })
        .map(|s| s.id)
        .collect()
}

async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

/// Observations received until one matches.
async fn observe_until(
    rx: &mut mpsc::Receiver<ObservedWorkload>,
    seen: &mut Vec<ObservedWorkload>,
    matches: impl Fn(&ObservedWorkload) -> bool,
) -> ObservedWorkload {
    tokio::time::timeout(WAIT, async {
        loop {
            let observed = rx.recv().await.expect("observer stopped");
            seen.push(observed.clone());
            if matches(&observed) {
                return observed;
            }
        }
    })
    .await
    .expect("timed out waiting for an observation")
}

struct Observer {
    rx: mpsc::Receiver<ObservedWorkload>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Observer {
    fn start(backend: &VmBackend) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let (stop, stopped) = oneshot::channel::<()>();
        let backend = backend.clone();
        let task = tokio::spawn(async move {
            backend
                .observe(tx, async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Self {
            rx,
            stop: Some(stop),
            task,
        }
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("observer stops on shutdown")
            .expect("observer task");
    }
}

#[tokio::test]
async fn create_is_idempotent_across_a_client_side_timeout() {
    let fake = FakeSandbox::start(fake_config(5)).await.expect("fake");
    fake.set_create_reply_delay(Duration::from_millis(1500));
    let backend = backend_with(&fake, Duration::from_millis(300), |_| {});
    let spec = spec();

    let id = backend
        .create(&spec)
        .await
        .expect("create adopts what the server made");
    assert_eq!(created_for(&fake, &spec), vec![id.clone()]);
    let sandbox = fake.sandbox(&id).expect("sandbox exists");
    assert_eq!(sandbox.state, SandboxState::Running);
    assert_eq!(
        sandbox
            .env
            .get("JETRUNNER_RUNNER_TOKEN")
            .map(String::as_str),
        Some("per-attempt-secret")
    );
    assert_eq!(
        sandbox.env.get("JETRUNNER_ASSIGNMENT_ID"),
        Some(&spec.assignment_id.to_string())
    );
    assert_eq!(
        sandbox.env.get("JETRUNNER_FACADE_URL").map(String::as_str),
        Some("http://facade.test")
    );
    assert_eq!(
        sandbox.env.get("JETRUNNER_LABELS").map(String::as_str),
        Some("vm")
    );
    assert_eq!(
        sandbox.metadata.get(LABEL_ATTEMPT).map(String::as_str),
        Some("1")
    );
    assert_eq!(
        sandbox.metadata.get(LABEL_WORKER).map(String::as_str),
        Some("vm-worker-1")
    );

    // A redelivery of the same assignment finds the sandbox instead of making another.
    fake.set_create_reply_delay(Duration::ZERO);
    assert_eq!(backend.create(&spec).await.expect("second create"), id);
    assert_eq!(created_for(&fake, &spec), vec![id]);
}

#[tokio::test]
async fn a_timed_out_create_whose_sandbox_is_already_stopping_reports_that_sandbox() {
    let fake = FakeSandbox::start(FakeConfig {
        stopping_for: Duration::from_secs(5),
        ..fake_config(2)
    })
    .await
    .expect("fake");
    fake.set_create_reply_delay(Duration::from_secs(3));
    let backend = backend_with(&fake, Duration::from_millis(800), |_| {});
    let spec = spec();
    let create = {
        let (backend, spec) = (backend.clone(), spec.clone());
        tokio::spawn(async move { backend.create(&spec).await })
    };
    // While the reply is late, the sandbox's job ends and it is deleted.
    wait_until("the sandbox exists", || {
        !created_for(&fake, &spec).is_empty()
    })
    .await;
    let made = created_for(&fake, &spec);
    backend.delete(&made[0]).await.expect("delete");
    assert_eq!(
        fake.sandbox(&made[0]).map(|s| s.state),
        Some(SandboxState::Stopping)
    );

    let id = create
        .await
        .expect("create task")
        .expect("the attempt's sandbox is reported, not an error");
    assert_eq!(id, made[0]);
    assert_eq!(
        created_for(&fake, &spec),
        made,
        "no second sandbox for the attempt"
    );
}

#[tokio::test]
async fn duplicates_of_one_attempt_are_reduced_to_one() {
    let fake = FakeSandbox::start(fake_config(5)).await.expect("fake");
    let backend = backend(&fake);
    let spec = spec();
    // Two sandboxes for the same attempt, as an earlier race could have left behind.
    let raw = client(&fake, Duration::from_secs(10));
    let metadata = BTreeMap::from([
        (LABEL_BACKEND.to_owned(), "vm".to_owned()),
        (LABEL_WORKER.to_owned(), "vm-worker-1".to_owned()),
        (LABEL_ASSIGNMENT.to_owned(), spec.assignment_id.to_string()),
        (LABEL_ATTEMPT.to_owned(), "1".to_owned()),
    ]);
    let request = CreateSandbox {
        pool: "ci-vm".into(),
        timeout_secs: Some(600),
        metadata,
        ..CreateSandbox::default()
    };
    let first = raw.create(&request).await.expect("first duplicate");
    let second = raw.create(&request).await.expect("second duplicate");

    let id = backend.create(&spec).await.expect("create adopts one");
    assert!(
        id == first.id || id == second.id,
        "an existing sandbox is kept"
    );
    assert_eq!(live_for(&fake, &spec), vec![id]);
    assert_eq!(
        created_for(&fake, &spec).len(),
        2,
        "no third sandbox was made"
    );
}

#[tokio::test]
async fn exhausted_pool_reports_full_with_retry_after() {
    let fake = FakeSandbox::start(fake_config(1)).await.expect("fake");
    let backend = backend(&fake);
    backend.create(&spec()).await.expect("first create fits");

    let refused = spec();
    match backend.create(&refused).await {
        Err(BackendError::Full { retry_after, .. }) => {
            assert_eq!(retry_after, Duration::from_secs(1))
        }
        other => panic!("expected Full, got {other:?}"),
    }
    assert_eq!(fake.max_live(), 1);
    assert!(created_for(&fake, &refused).is_empty());
    wait_until("the refused sandbox is cleaned up", || {
        !fake
            .sandboxes()
            .iter()
            .any(|s| s.metadata.get(LABEL_ASSIGNMENT) == Some(&refused.assignment_id.to_string()))
    })
    .await;
}

#[tokio::test]
async fn missing_pool_is_permanent() {
    let fake = FakeSandbox::start(fake_config(1)).await.expect("fake");
    let backend = backend_with(&fake, Duration::from_secs(10), |c| {
        c.pool = "no-such-pool".into()
    });
    match backend.create(&spec()).await {
        Err(BackendError::Permanent { message, .. }) => {
            assert!(message.contains("pool not found"), "{message}")
        }
        other => panic!("expected Permanent, got {other:?}"),
    }
    assert!(fake.created().is_empty());
}

#[tokio::test]
async fn ready_timeout_is_transient_and_the_retry_makes_a_fresh_sandbox() {
    let fake = FakeSandbox::start(fake_config(2)).await.expect("fake");
    let backend = backend(&fake);
    let spec = spec();
    fake.fail_next_creates_with_ready_timeout(1);
    match backend.create(&spec).await {
        Err(error @ BackendError::Transient { .. }) => {
            assert!(error.to_string().contains("not ready"), "{error}")
        }
        other => panic!("expected Transient, got {other:?}"),
    }
    // The server's clean-up leaves the first one Stopping; the retry must not adopt it.
    let id = backend.create(&spec).await.expect("retry");
    assert_eq!(live_for(&fake, &spec), vec![id.clone()]);
    assert_eq!(
        fake.sandbox(&id).map(|s| s.state),
        Some(SandboxState::Running)
    );
}

#[tokio::test]
async fn deleting_a_missing_sandbox_succeeds() {
    let fake = FakeSandbox::start(fake_config(1)).await.expect("fake");
    let backend = backend(&fake);
    backend
        .delete("00000000-0000-4000-8000-000000000000")
        .await
        .expect("missing is fine");
    let id = backend.create(&spec()).await.expect("create");
    backend.delete(&id).await.expect("delete");
    wait_until("the sandbox is gone", || fake.sandbox(&id).is_none()).await;
    backend.delete(&id).await.expect("deleting again is fine");
}

#[tokio::test]
async fn polling_observes_running_then_gone_after_delete() {
    let fake = FakeSandbox::start(fake_config(2)).await.expect("fake");
    let backend = backend(&fake);
    let mut observer = Observer::start(&backend);
    let spec = spec();
    let id = backend.create(&spec).await.expect("create");
    let mut seen = Vec::new();

    let running = observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == id && o.phase == WorkloadPhase::Running
    })
    .await;
    assert_eq!(
        (running.assignment_id, running.attempt),
        (spec.assignment_id, 1)
    );
    backend.delete(&id).await.expect("delete");
    observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == id && o.phase == WorkloadPhase::Gone
    })
    .await;

    let phases: Vec<WorkloadPhase> = seen
        .iter()
        .filter(|o| o.workload == id)
        .map(|o| o.phase)
        .collect();
    assert!(
        phases.windows(2).all(|w| w[0] != w[1]),
        "only changes are reported: {phases:?}"
    );
    assert_eq!(phases.first(), Some(&WorkloadPhase::Running));
    assert_eq!(phases.last(), Some(&WorkloadPhase::Gone));
    assert!(phases.iter().all(|p| matches!(
        p,
        WorkloadPhase::Running | WorkloadPhase::Terminating | WorkloadPhase::Gone
    )));
    observer.shutdown().await;
}

#[tokio::test]
async fn an_outage_is_reported_as_backend_unreachable_and_recovers() {
    let fake = FakeSandbox::start(fake_config(2)).await.expect("fake");
    let backend = backend(&fake);
    let mut observer = Observer::start(&backend);
    let id = backend.create(&spec()).await.expect("create");
    let mut seen = Vec::new();
    observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == id && o.phase == WorkloadPhase::Running
    })
    .await;

    fake.set_outage(true);
    let lost = observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == id && o.phase == WorkloadPhase::Unknown
    })
    .await;
    assert_eq!(lost.reason.as_deref(), Some("backend-unreachable"));
    fake.set_outage(false);
    observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == id && o.phase == WorkloadPhase::Running
    })
    .await;
    observer.shutdown().await;
}

#[tokio::test]
async fn long_jobs_get_their_expiry_renewed() {
    let mut config = fake_config(1);
    // The server caps TTLs below the job limit, so only renewals keep the sandbox alive.
    config.max_timeout = Some(Duration::from_secs(120));
    let fake = FakeSandbox::start(config).await.expect("fake");
    let backend = backend(&fake);
    let observer = Observer::start(&backend);
    let id = backend.create(&spec()).await.expect("create");
    let first = fake
        .sandbox(&id)
        .and_then(|s| s.expires_at)
        .expect("expiry");
    wait_until("the expiry is renewed", || {
        fake.sandbox(&id)
            .and_then(|s| s.expires_at)
            .is_some_and(|at| at > first)
    })
    .await;
    observer.shutdown().await;
}

#[tokio::test]
async fn list_pages_over_more_than_200_sandboxes() {
    let fake = FakeSandbox::start(fake_config(300)).await.expect("fake");
    let backend = backend(&fake);
    let mut ids = Vec::new();
    for _ in 0..205 {
        ids.push(backend.create(&spec()).await.expect("create"));
    }
    // Another replica's sandbox of the backend is listed too, under its creator's name (the
    // worker core keeps to the creators it manages and takes over those of stopped replicas).
    let foreign = backend
        .create(&WorkloadSpec {
            worker_id: "vm-worker-2".into(),
            ..spec()
        })
        .await
        .expect("another replica's create");

    let listed = backend.list().await.expect("list");
    let mut listed_ids: Vec<String> = listed
        .iter()
        .filter(|o| o.worker == "vm-worker-1")
        .map(|o| o.workload.clone())
        .collect();
    listed_ids.sort();
    ids.sort();
    assert_eq!(listed_ids, ids);
    assert_eq!(
        listed
            .iter()
            .filter(|o| o.worker == "vm-worker-2")
            .map(|o| o.workload.as_str())
            .collect::<Vec<_>>(),
        vec![foreign.as_str()]
    );
    assert!(listed.iter().all(|o| o.phase == WorkloadPhase::Running));
    let requests = fake.list_requests();
    assert!(requests.iter().all(|r| r.page_size <= 200));
    assert!(
        requests.iter().any(|r| r.page == 2
            && r.metadata
                .contains(&(LABEL_BACKEND.to_owned(), "vm".to_owned()))),
        "the second page was requested with the backend filter"
    );
}

#[tokio::test]
async fn delete_refuses_a_sandbox_without_this_workers_labels() {
    let fake = FakeSandbox::start(fake_config(3)).await.expect("fake");
    let foreign = client(&fake, Duration::from_secs(10))
        .create(&CreateSandbox {
            pool: "ci-vm".into(),
            timeout_secs: Some(600),
            metadata: BTreeMap::from([("team".to_owned(), "someone-else".to_owned())]),
            env: BTreeMap::new(),
            entrypoint: None,
        })
        .await
        .expect("foreign sandbox");
    let refused = backend(&fake).delete(&foreign.id).await;
    assert!(
        matches!(refused, Err(BackendError::Permanent { .. })),
        "{refused:?}"
    );
    let still = fake.sandbox(&foreign.id).expect("still there");
    assert_ne!(
        still.state,
        SandboxState::Stopping,
        "foreign sandbox was deleted"
    );

    // Another replica's sandbox of the same backend may be deleted (a replica takes over
    // the workloads of one that stopped).
    let theirs = backend(&fake)
        .create(&WorkloadSpec {
            worker_id: "vm-worker-2".into(),
            ..spec()
        })
        .await
        .expect("created by the other replica");
    backend(&fake)
        .delete(&theirs)
        .await
        .expect("a replica's sandbox of this backend");

    // Our own sandbox is deleted.
    let ours = backend(&fake).create(&spec()).await.expect("created");
    backend(&fake).delete(&ours).await.expect("deleted");
    assert!(
        fake.sandbox(&ours)
            .is_none_or(|s| s.state == SandboxState::Stopping),
        "our sandbox still runs"
    );
}

#[tokio::test]
async fn sandbox_ids_with_path_characters_never_reach_other_api_paths() {
    let fake = FakeSandbox::start(fake_config(1)).await.expect("fake");
    let ours = backend(&fake).create(&spec()).await.expect("created");
    // Would be `/v1/sandboxes/../sandboxes/<id>` = DELETE of our sandbox if not encoded.
    let sneaky = format!("../sandboxes/{ours}");
    let answer = backend(&fake).delete(&sneaky).await;
    assert!(
        answer.is_ok(),
        "an unknown id is simply not found: {answer:?}"
    );
    let still = fake.sandbox(&ours).expect("still there");
    assert_eq!(
        still.state,
        SandboxState::Running,
        "the sandbox behind the path was touched"
    );
    for bad in ["..", "."] {
        let refused = backend(&fake).delete(bad).await;
        assert!(
            matches!(refused, Err(BackendError::Permanent { .. })),
            "{bad}: {refused:?}"
        );
    }
}

/// The metadata a vm-worker wrote on its sandboxes before the keys moved to `jetrunner.dev/`.
fn legacy_request(spec: &WorkloadSpec, worker: &str) -> CreateSandbox {
    use jr_protocol::labels::legacy_sandbox as old;
    let deadline = time::OffsetDateTime::now_utc().unix_timestamp() + 3600;
    CreateSandbox {
        pool: "ci-vm".into(),
        timeout_secs: Some(600),
        metadata: BTreeMap::from([
            (old::BACKEND.to_owned(), "vm".to_owned()),
            (old::WORKER.to_owned(), worker.to_owned()),
            (old::ASSIGNMENT.to_owned(), spec.assignment_id.to_string()),
            (old::ATTEMPT.to_owned(), spec.attempt.to_string()),
            (old::DEADLINE.to_owned(), deadline.to_string()),
        ]),
        ..CreateSandbox::default()
    }
}

fn legacy_list_requests(fake: &FakeSandbox) -> usize {
    fake.list_requests()
        .iter()
        .filter(|r| {
            r.metadata
                .iter()
                .any(|(key, _)| key.starts_with(jr_protocol::labels::legacy_sandbox::PREFIX))
        })
        .count()
}

#[tokio::test]
async fn sandboxes_with_the_legacy_keys_are_listed_adopted_observed_and_deleted() {
    let fake = FakeSandbox::start(fake_config(3)).await.expect("fake");
    let raw = client(&fake, Duration::from_secs(10));
    // Left behind by the older worker before the upgrade: one of ours, one of another backend.
    let spec = spec();
    let old = raw
        .create(&legacy_request(&spec, "vm-worker-1"))
        .await
        .expect("legacy sandbox");
    let mut other_backend = legacy_request(&self::spec(), "vm-worker-2");
    other_backend.metadata.insert(
        jr_protocol::labels::legacy_sandbox::BACKEND.to_owned(),
        "gpu".to_owned(),
    );
    let theirs = raw
        .create(&other_backend)
        .await
        .expect("another backend's legacy sandbox");

    // After the upgrade, recovery lists it as this attempt's workload.
    let backend = backend(&fake);
    let listed = backend.list().await.expect("list");
    assert_eq!(
        listed
            .iter()
            .map(|o| (
                o.workload.as_str(),
                o.assignment_id,
                o.attempt,
                o.phase,
                o.worker.as_str()
            ))
            .collect::<Vec<_>>(),
        vec![(
            old.id.as_str(),
            spec.assignment_id,
            1,
            WorkloadPhase::Running,
            "vm-worker-1"
        )]
    );

    // A redelivery of its attempt adopts it instead of making a second sandbox.
    assert_eq!(backend.create(&spec).await.expect("adopts"), old.id);
    assert_eq!(fake.created().len(), 2, "no sandbox was made");

    // It is observed and deleted like any other.
    let mut observer = Observer::start(&backend);
    let mut seen = Vec::new();
    let running = observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == old.id && o.phase == WorkloadPhase::Running
    })
    .await;
    assert_eq!(
        (running.assignment_id, running.attempt),
        (spec.assignment_id, 1)
    );
    backend
        .delete(&old.id)
        .await
        .expect("ours under the legacy keys");
    observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == old.id && o.phase == WorkloadPhase::Gone
    })
    .await;

    // Another backend's legacy sandbox is not ours.
    let refused = backend.delete(&theirs.id).await;
    assert!(
        matches!(refused, Err(BackendError::Permanent { .. })),
        "{refused:?}"
    );
    assert_eq!(
        fake.sandbox(&theirs.id).map(|s| s.state),
        Some(SandboxState::Running)
    );

    // With none of ours left under the legacy keys, polling stops asking for them.
    let asked = legacy_list_requests(&fake);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(legacy_list_requests(&fake), asked);
    observer.shutdown().await;
}

/// Deletes wake the poller early, but wakes within `woken_gap` of the last poll are served by
/// one list: ten deletes in a row cost at most two lists, not one each, and the change they
/// make is still seen without waiting for the (here one minute) steady interval.
#[tokio::test]
async fn wakes_within_the_gap_are_served_by_one_list() {
    const SANDBOXES: usize = 10;
    let fake = FakeSandbox::start(fake_config(SANDBOXES))
        .await
        .expect("fake");
    let backend = backend_with(&fake, Duration::from_secs(10), |config| {
        config.poll = PollConfig {
            active: Duration::from_secs(60),
            steady: Duration::from_secs(60),
            max_backoff: Duration::from_secs(60),
            woken_gap: Duration::from_secs(2),
            ..PollConfig::default()
        };
    });
    let mut ids = Vec::new();
    for _ in 0..SANDBOXES {
        ids.push(backend.create(&spec()).await.expect("create"));
    }
    let before_observer = fake.list_requests().len();
    let mut observer = Observer::start(&backend);
    let mut seen = Vec::new();
    observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == ids[SANDBOXES - 1] && o.phase == WorkloadPhase::Running
    })
    .await;
    let first = fake.list_requests().len();
    assert!(first > before_observer, "the observer listed");
    for id in &ids {
        backend.delete(id).await.expect("delete");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = fake.list_requests().len() - first;
    assert!(
        during <= 2,
        "{during} lists for {SANDBOXES} deletes within the gap"
    );
    // The wakes are not lost: the deletes are seen long before the steady interval.
    observe_until(&mut observer.rx, &mut seen, |o| {
        o.workload == ids[SANDBOXES - 1] && o.phase != WorkloadPhase::Running
    })
    .await;
    observer.shutdown().await;
}
