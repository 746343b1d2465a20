//! The worker driver against a real nats-server and an in-process scripted backend: what the
//! state machine decides actually reaches the bus and the backend.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jr_bus::testing::NatsServer;
use jr_bus::{Bus, Topology};
use jr_protocol::{
    Assignment, AssignmentId, BackendName, Envelope, Kind, Message, STREAM_EVENTS, SealedTask,
    TaskResult, Terminal, TerminalSource, WorkloadPhase, subject,
};
use jr_worker::{
    Backend, BackendError, ObservedWorkload, TokenKey, Worker, WorkerSettings, WorkloadSpec,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// A workload the scripted backend holds: its attempt and its worker label.
type LiveWorkload = (AssignmentId, u32, String);

/// A backend whose create answers are scripted; records every call.
#[derive(Clone, Default)]
struct Scripted {
    answers: Arc<Mutex<VecDeque<Result<(), BackendError>>>>,
    creates: Arc<Mutex<Vec<(AssignmentId, u32)>>>,
    live: Arc<Mutex<BTreeMap<String, LiveWorkload>>>,
}

impl Scripted {
    fn creates(&self) -> Vec<(AssignmentId, u32)> {
        self.creates.lock().expect("lock").clone()
    }
}

impl Backend for Scripted {
    async fn create(&self, spec: &WorkloadSpec) -> Result<String, BackendError> {
        self.creates
            .lock()
            .expect("lock")
            .push((spec.assignment_id, spec.attempt));
        let answer = self
            .answers
            .lock()
            .expect("lock")
            .pop_front()
            .unwrap_or(Ok(()));
        answer?;
        self.live.lock().expect("lock").insert(
            spec.name(),
            (spec.assignment_id, spec.attempt, spec.worker_id.clone()),
        );
        Ok(spec.name())
    }

    async fn delete(&self, workload: &str) -> Result<(), BackendError> {
        self.live.lock().expect("lock").remove(workload);
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ObservedWorkload>, BackendError> {
        Ok(self
            .live
            .lock()
            .expect("lock")
            .iter()
            .map(|(name, (id, attempt, worker))| ObservedWorkload {
                workload: name.clone(),
                assignment_id: *id,
                attempt: *attempt,
                phase: WorkloadPhase::Running,
                reason: None,
                worker: worker.clone(),
            })
            .collect())
    }

    async fn observe(
        &self,
        _tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        shutdown.await
    }
}

fn backend_name() -> BackendName {
    BackendName::new("vm").expect("name")
}

fn settings() -> WorkerSettings {
    WorkerSettings {
        backend: backend_name(),
        capacity: 2,
        worker_id: "vm-worker-test".into(),
        facade_url: "http://facade.test".into(),
        token_key: TokenKey::from_base64("ZGV2LXRva2VuLWtleS1kZXYtdG9rZW4ta2V5LWRldiE=")
            .expect("key"),
        resync_interval: Duration::from_secs(60),
        stray_grace: Duration::from_secs(60),
        publish_requested: false,
        warm: None,
    }
}

fn assignment(task: i64, attempt: u32) -> (String, Envelope) {
    let id = AssignmentId::for_task("https://forge.test", task);
    let message = Message::Assignment(Assignment {
        forge_instance: "https://forge.test".into(),
        forge_task_id: task,
        backend: backend_name(),
        provider: None,
        placement: None,
        labels: vec!["vm".into()],
        repository: "o/r".into(),
        workflow: None,
        job_name: "build".into(),
        max_duration_secs: 600,
        fetched_at: 0,
        sealed_task: SealedTask {
            key_id: "k".into(),
            nonce: vec![0; 24],
            ciphertext: vec![1, 2, 3],
        },
    });
    (
        subject::assignment(&backend_name(), id),
        Envelope::new(
            format!("assignment:{id}:{attempt}"),
            0,
            id,
            attempt,
            message,
        ),
    )
}

async fn start() -> (NatsServer, Bus) {
    let nats = NatsServer::start().await.expect("nats-server on PATH");
    let bus = Bus::connect(&nats.url(), "test", None).await.expect("bus");
    bus.ensure_topology(&Topology::new())
        .await
        .expect("streams");
    (nats, bus)
}

async fn last(bus: &Bus, id: AssignmentId, kind: Kind) -> Option<Envelope> {
    bus.last_on_subject(STREAM_EVENTS, &subject::event(&backend_name(), id, kind))
        .await
        .expect("read")
        .map(|(_, e)| e)
}

async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn run(bus: &Bus, backend: &Scripted) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let stop = CancellationToken::new();
    let worker = Worker::new(bus.clone(), backend.clone(), settings());
    let token = stop.clone();
    let task = tokio::spawn(async move {
        worker.run(|_| {}, token).await.expect("worker ran");
    });
    (stop, task)
}

#[tokio::test]
async fn a_full_backend_delays_the_attempt_without_any_failure_event() {
    let (_nats, bus) = start().await;
    let backend = Scripted::default();
    backend.answers.lock().expect("lock").extend([
        Err(BackendError::Full {
            op: "create",
            retry_after: Duration::from_secs(1),
        }),
        Err(BackendError::Full {
            op: "create",
            retry_after: Duration::from_secs(1),
        }),
    ]);
    let (subject, envelope) = assignment(1, 1);
    bus.publish(&subject, &envelope).await.expect("assignment");
    let id = envelope.assignment_id;
    let (stop, task) = run(&bus, &backend);
    let created = wait_for("workload-created", async || {
        last(&bus, id, Kind::WorkloadCreated).await
    })
    .await;
    assert_eq!(created.attempt, 1, "back-pressure spent an attempt");
    assert_eq!(backend.creates(), vec![(id, 1), (id, 1), (id, 1)]);
    assert!(
        last(&bus, id, Kind::Released).await.is_none(),
        "a full pool was reported released"
    );
    assert!(
        last(&bus, id, Kind::WorkloadObserved).await.is_none(),
        "a full pool was reported as an observed workload"
    );
    stop.cancel();
    task.await.expect("worker task");
}

#[tokio::test]
async fn superseded_and_terminal_assignments_are_acked_without_a_backend_call() {
    let (_nats, bus) = start().await;
    let backend = Scripted::default();
    // Task 1: attempt 2 was published after attempt 1; only attempt 2 gets a workload.
    let (subject, first) = assignment(1, 1);
    bus.publish(&subject, &first).await.expect("attempt 1");
    let (_, second) = assignment(1, 2);
    bus.publish(&subject, &second).await.expect("attempt 2");
    // Task 2: withdrawn by the forge while it waited (a terminal exists).
    let (subject2, waiting) = assignment(2, 1);
    bus.publish(&subject2, &waiting).await.expect("task 2");
    let withdrawn = Envelope::new(
        "terminal-2",
        0,
        waiting.assignment_id,
        1,
        Message::Terminal(Terminal {
            forge_task_id: 2,
            result: TaskResult::Cancelled,
            source: TerminalSource::Withdrawn,
            log_closed: true,
            reason: None,
        }),
    );
    bus.publish(
        &subject::event(&backend_name(), waiting.assignment_id, Kind::Terminal),
        &withdrawn,
    )
    .await
    .expect("terminal");
    // Task 3 comes last; once it has its workload, the earlier messages were handled.
    let (subject3, last_one) = assignment(3, 1);
    bus.publish(&subject3, &last_one).await.expect("task 3");
    let (stop, task) = run(&bus, &backend);
    wait_for("task 3's workload", async || {
        last(&bus, last_one.assignment_id, Kind::WorkloadCreated).await
    })
    .await;
    let id = first.assignment_id;
    assert_eq!(
        backend.creates(),
        vec![(id, 2), (last_one.assignment_id, 1)],
        "a superseded or terminal assignment reached the backend"
    );
    stop.cancel();
    task.await.expect("worker task");
}
