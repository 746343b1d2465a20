//! The scheduler's forge side against a real nats-server and the in-process fake forge:
//! registration, concurrent fetchers, routing, sealing, durable dispatch through a NATS outage
//! and forge faults, and the `fail-task` command.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use jr_bus::{ConsumerOptions, ConsumerSpec, PublishOnce};
use jr_fake_forge::{ErrorStyle, FaultConfig, JobSpec, Outcome, Rpc, Status, StopCause};
use jr_forge::proto::runner::v1::{FetchTaskRequest, Task};
use jr_gitea_intake::fetcher::FetchError;
use jr_gitea_intake::registration::{RegistrationError, RunnerIdentity, establish};
use jr_protocol::{
    AssignmentId, BackendName, Envelope, FailTask, Kind, Message, STREAM_COMMANDS, STREAM_EVENTS,
    TaskResult, Terminal, TerminalSource, subject,
};
use jr_seal::SealScope;
use prost::Message as _;
use support::{World, assert_published_exactly_once, eventually, expected_backends};
use tokio_util::sync::CancellationToken;

fn job(label: &str) -> JobSpec {
    JobSpec {
        runs_on: vec![label.to_owned()],
        ..JobSpec::default()
    }
}

fn context_string(task: &Task, key: &str) -> String {
    match task
        .context
        .as_ref()
        .and_then(|c| c.fields.get(key))
        .and_then(|v| v.kind.as_ref())
    {
        Some(prost_types::value::Kind::StringValue(s)) => s.clone(),
        other => panic!("context.{key} is not a string: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_jobs_are_dispatched_exactly_once_to_their_backend() {
    let world = World::start().await;
    let _workers = world.drain_workers();
    world.forge.enqueue_jobs(job("pod"), 700);
    world.forge.enqueue_jobs(job("vm"), 300);
    let fetchers = world
        .start_fetchers(Duration::from_millis(100), Duration::from_secs(1))
        .await;

    world
        .forge
        .wait_until(|s| s.queued_count() == 0, Duration::from_secs(60))
        .await
        .expect("the forge's queue drains");
    let dispatcher = fetchers.dispatcher.clone();
    // The fetchers' own count, not the stream's: a PubAck still in flight when the fetchers are
    // cancelled would otherwise be counted as abandoned.
    eventually(
        "1000 assignments acknowledged",
        Duration::from_secs(30),
        || async { dispatcher.stats.dispatched.load(Ordering::Relaxed) >= 1000 },
    )
    .await;
    fetchers.stop().await.expect("fetchers stop cleanly");

    let snapshot = world.forge.snapshot();
    assert_eq!(snapshot.jobs.len(), 1000);
    assert_eq!(snapshot.queued_count(), 0, "nothing left queued");
    for j in &snapshot.jobs {
        assert_eq!(
            j.fetch_count, 1,
            "job {} fetched {} times",
            j.id, j.fetch_count
        );
        assert_eq!(
            j.status,
            Status::Running,
            "job {} is running (handed to jetrunner)",
            j.id
        );
    }
    assert!(snapshot.tasks.iter().all(|t| t.handed_out == 1));
    let expected = expected_backends(&snapshot);
    assert_eq!(expected.values().filter(|b| *b == "pod").count(), 700);
    assert_eq!(expected.values().filter(|b| *b == "vm").count(), 300);
    let stored = assert_published_exactly_once(&world, &expected).await;
    assert_eq!(stored.len(), 1000);
    let stats = &dispatcher.stats;
    assert_eq!(stats.fetched.load(Ordering::Relaxed), 1000);
    assert_eq!(stats.dispatched.load(Ordering::Relaxed), 1000);
    assert_eq!(stats.unroutable.load(Ordering::Relaxed), 0);

    // One assignment opened: the sealed task is the forge's Task, and its secrets are not in clear.
    let one = stored
        .iter()
        .find(|m| m.assignment.backend.as_str() == "vm")
        .expect("a vm assignment");
    let plain = dispatcher
        .sink
        .sealer()
        .open(
            SealScope::of(one.envelope.assignment_id, &one.assignment),
            &one.assignment.sealed_task,
        )
        .expect("opens");
    let task = Task::decode(plain.as_slice()).expect("a runner.v1.Task");
    assert_eq!(task.id, one.assignment.forge_task_id);
    let token = context_string(&task, "token");
    assert_eq!(token.len(), 40, "the fake forge's task token");
    assert_eq!(task.secrets.get("GITHUB_TOKEN"), Some(&token));
    let workflow =
        String::from_utf8(task.workflow_payload.clone().expect("workflow")).expect("utf-8");
    assert!(workflow.contains("runs-on: [\"vm\"]"), "{workflow}");
    assert_eq!(one.assignment.labels, vec!["vm".to_owned()]);
    assert_eq!(one.assignment.repository, "example/repo");
    assert_eq!(one.assignment.job_name, "build");
    assert!(
        !contains(&one.assignment.sealed_task.ciphertext, token.as_bytes()),
        "token in the ciphertext"
    );
    assert!(
        !contains(&one.raw, token.as_bytes()),
        "token in clear in the NATS message"
    );
    assert!(
        !contains(&one.raw, b"echo step 1"),
        "workflow in clear in the NATS message"
    );
    // Sealed for this assignment only.
    let other = AssignmentId::for_task(&world.forge_instance(), one.assignment.forge_task_id + 1);
    assert!(
        dispatcher
            .sink
            .sealer()
            .open(
                SealScope::new(other, &one.assignment.backend, one.assignment.forge_task_id),
                &one.assignment.sealed_task,
            )
            .is_err()
    );
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_job_is_failed_at_the_forge_with_an_explanation_and_never_published() {
    // The pod backend declares `gpu` and the vm backend `vm`, so the shared registration
    // declares both and the forge hands out a job asking for both, but no single backend
    // declares all of its labels.
    let world = World::start_with(jr_fake_forge::Config::default(), &["gpu"]).await;
    assert!(world.router().declared_labels().contains(&"gpu".to_owned()));
    world.forge.enqueue_jobs(job("pod"), 2);
    let gpu = world.forge.enqueue_job(JobSpec {
        runs_on: vec!["gpu".to_owned(), "vm".to_owned()],
        ..JobSpec::default()
    });
    world.forge.enqueue_jobs(job("vm"), 2);
    let _workers = world.drain_workers();
    let fetchers = world
        .start_fetchers(Duration::from_millis(100), Duration::from_secs(1))
        .await;

    let snapshot = world
        .forge
        .wait_until(
            |s| s.job(gpu).is_some_and(|j| j.status.is_final()) && s.queued_count() == 0,
            Duration::from_secs(20),
        )
        .await
        .expect("the gpu job is finished and the queue drained");
    eventually(
        "4 routable assignments stored",
        Duration::from_secs(20),
        || async { world.assignment_count().await >= 4 },
    )
    .await;
    let dispatcher = fetchers.dispatcher.clone();
    fetchers.stop().await.expect("fetchers stop cleanly");

    let gpu_job = snapshot.job(gpu).expect("gpu job");
    assert_eq!(gpu_job.status, Status::Done(Outcome::Failure));
    assert_eq!(gpu_job.fetch_count, 1);
    let task = snapshot.task(gpu_job.task_ids[0]).expect("gpu task");
    assert_eq!(task.final_accepted, 1);
    assert_eq!(
        task.stop_cause,
        Some(StopCause::Runner),
        "failed by jetrunner's report, not a reaper"
    );
    assert!(task.log_archived, "log closed");
    assert_eq!(task.log.len(), 1, "{:?}", task.log);
    let line = &task.log[0];
    assert!(line.starts_with("jetrunner: "), "{line}");
    assert!(
        line.contains("no enabled jetrunner backend declares all of runs-on")
            && line.contains("gpu"),
        "{line}"
    );
    assert!(
        line.contains("enable a backend"),
        "tells the user what to do: {line}"
    );

    let mut expected = expected_backends(&world.forge.snapshot());
    assert_eq!(expected.remove(&task.id).as_deref(), Some("gpu"));
    assert_published_exactly_once(&world, &expected).await;
    assert_eq!(dispatcher.stats.unroutable.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetchers_wait_for_durability_through_a_nats_outage_and_publish_once() {
    let mut world = World::start().await;
    let _workers = world.drain_workers();
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(500))
        .await;
    // Some work before the outage, to see that the fetchers are live.
    world.forge.enqueue_jobs(job("pod"), 5);
    // Acknowledged to the fetchers, so that all of them are idle when NATS goes away.
    let dispatched = || fetchers.dispatcher.stats.dispatched.load(Ordering::Relaxed);
    eventually(
        "5 assignments acknowledged",
        Duration::from_secs(20),
        || async { dispatched() >= 5 },
    )
    .await;

    world.nats.kill();
    world.forge.enqueue_jobs(job("pod"), 30);
    world.forge.enqueue_jobs(job("vm"), 10);
    // Fetchers stop fetching once the client sees the bus down (a task fetched then could not be
    // made durable, and would be lost if the scheduler stopped); one that fetched in the instant
    // before waits for its PubAck instead of fetching again. Watch for longer than the JetStream
    // publish timeout (5 s), so such publishes time out and are retried while NATS is still down.
    let overshoot = world
        .forge
        .wait_until(|s| s.tasks.len() > 5 + 1, Duration::from_secs(6))
        .await;
    assert!(
        overshoot.is_err(),
        "a fetcher fetched again before its assignment was durable"
    );
    assert!(world.forge.queued_count() >= 40 - 1);

    world.nats.restart().await.expect("nats-server restarts");
    world
        .forge
        .wait_until(|s| s.queued_count() == 0, Duration::from_secs(40))
        .await
        .expect("the queue drains after NATS is back");
    eventually("45 assignments stored", Duration::from_secs(30), || async {
        world.assignment_count().await >= 45
    })
    .await;
    fetchers.stop().await.expect("fetchers stop cleanly");

    let snapshot = world.forge.snapshot();
    assert!(
        snapshot.jobs.iter().all(|j| j.fetch_count == 1),
        "no job fetched twice"
    );
    let expected = expected_backends(&snapshot);
    assert_eq!(expected.len(), 45);
    assert_published_exactly_once(&world, &expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forge_errors_and_latency_do_not_lose_or_duplicate_jobs() {
    let world = World::start().await;
    world.forge.set_faults(FaultConfig {
        error_rate: 0.3,
        latency_ms: 15,
        only: vec![Rpc::FetchTask],
        ..FaultConfig::default()
    });
    world.forge.enqueue_jobs(job("pod"), 140);
    world.forge.enqueue_jobs(job("vm"), 60);
    let _workers = world.drain_workers();
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;

    world
        .forge
        .wait_until(|s| s.queued_count() == 0, Duration::from_secs(45))
        .await
        .expect("the queue drains despite injected errors");
    eventually(
        "200 assignments stored",
        Duration::from_secs(20),
        || async { world.assignment_count().await >= 200 },
    )
    .await;
    let dispatcher = fetchers.dispatcher.clone();
    fetchers.stop().await.expect("fetchers stop cleanly");

    let snapshot = world.forge.snapshot();
    assert!(snapshot.faults.injected_errors > 0, "faults were injected");
    assert!(dispatcher.stats.fetch_errors.load(Ordering::Relaxed) > 0);
    assert!(
        snapshot.jobs.iter().all(|j| j.fetch_count == 1),
        "no job fetched twice"
    );
    let expected = expected_backends(&snapshot);
    assert_eq!(expected.len(), 200);
    assert_published_exactly_once(&world, &expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_register_one_runner_and_share_its_sealed_credentials() {
    use jr_gitea_intake::registration::{SharedCredentials, establish_declared};
    let world = World::start().await;
    let labels = world.router().declared_labels().to_vec();
    let shutdown = CancellationToken::new();
    let store = jr_gitea_intake::request_key::open_bucket(&world.bus)
        .await
        .expect("bucket");
    let sealer = std::sync::Arc::new(
        jr_scheduler::service::sealer_from_config(&world.config).expect("seal key"),
    );
    let policy = jr_lease::Policy::new(1500, 100).expect("policy");
    // Two replicas, each with its own empty disk (an emptyDir per Pod), starting at once.
    let replicas: Vec<(RunnerIdentity, SharedCredentials)> = ["a", "b"]
        .iter()
        .map(|me| {
            let mut identity = RunnerIdentity::shared(&world.config.forge);
            identity.credentials_file = world.dir.path().join(format!("{me}/runner.json"));
            let leadership = jr_bus::lease::spawn_lease(
                jr_bus::lease::LeaseSpec {
                    store: store.clone(),
                    key: "lease.shared".to_owned(),
                    me: (*me).to_owned(),
                    policy,
                },
                shutdown.clone(),
            );
            let shared = SharedCredentials {
                store: store.clone(),
                sealer: sealer.clone(),
                leadership,
                registration: "shared".to_owned(),
            };
            (identity, shared)
        })
        .collect();
    let (a, b) = tokio::join!(
        establish_declared(
            &world.config.forge,
            &replicas[0].0,
            &labels,
            Some(&replicas[0].1),
            &shutdown
        ),
        establish_declared(
            &world.config.forge,
            &replicas[1].0,
            &labels,
            Some(&replicas[1].1),
            &shutdown
        ),
    );
    let (a, b) = (a.expect("replica a").0, b.expect("replica b").0);
    let runners = world.forge.snapshot().runners;
    assert_eq!(runners.len(), 1, "one runner registered: {runners:?}");
    for client in [&a, &b] {
        assert_eq!(
            client.credentials().map(|c| c.uuid.as_str()),
            Some(runners[0].uuid.as_str())
        );
    }
    // On the bus the token is sealed: the stored value does not contain it.
    let token = a.credentials().expect("credentials").token.clone();
    let stored = store
        .get("credentials.shared")
        .await
        .expect("read")
        .expect("stored");
    assert!(
        !String::from_utf8_lossy(&stored).contains(&token),
        "the runner token is in the clear on the bus"
    );
    // A scheduler with another seal key cannot use them: a clear error, no new registration.
    let mut other = replicas[0].1.clone();
    other.sealer = std::sync::Arc::new(
        jr_seal::Sealer::new(
            "k9",
            &[("k9".to_owned(), jr_seal::Sealer::generate_key())]
                .into_iter()
                .collect(),
        )
        .expect("keyring"),
    );
    let err = other.load().await.expect_err("sealed with another key");
    assert!(err.to_string().contains("seal_keys"), "{err}");
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_persisted_and_reused_and_a_removed_runner_is_explained() {
    let world = World::start().await;
    let labels = world.router().declared_labels().to_vec();
    assert_eq!(labels, vec!["pod".to_owned(), "vm".to_owned()]);
    let shutdown = CancellationToken::new();
    let file = world.config.forge.credentials_file.clone();
    assert!(!file.exists());
    let identity = RunnerIdentity::shared(&world.config.forge);

    let client = establish(&world.config.forge, &identity, &labels, &shutdown)
        .await
        .expect("registers");
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("credentials persisted"))
            .expect("json");
    let uuid = stored["uuid"].as_str().expect("uuid").to_owned();
    assert_eq!(stored["token"].as_str().map(str::len), Some(40));
    assert_eq!(
        client.credentials().map(|c| c.uuid.as_str()),
        Some(uuid.as_str())
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file)
            .expect("metadata")
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "credentials readable by the owner only"
        );
    }
    let snapshot = world.forge.snapshot();
    assert_eq!(snapshot.runners.len(), 1);
    assert_eq!(snapshot.runners[0].uuid, uuid);
    assert_eq!(snapshot.runners[0].labels, labels, "declared labels");

    // A restart reuses the stored credentials: no second Register, even with the token rotated
    // (a Register with the old token would now be refused).
    world.forge.rotate_registration_token();
    let again = establish(&world.config.forge, &identity, &labels, &shutdown)
        .await
        .expect("reuses credentials");
    assert_eq!(
        again.credentials().map(|c| c.uuid.as_str()),
        Some(uuid.as_str())
    );
    assert_eq!(
        world.forge.snapshot().runners.len(),
        1,
        "one Register in total"
    );

    // The forge forgets the runner: establish says what to do, in both error styles.
    assert!(world.forge.remove_runner(&uuid));
    for style in [ErrorStyle::Gitea, ErrorStyle::Forgejo] {
        world.forge.set_error_style(style);
        let err = establish(&world.config.forge, &identity, &labels, &shutdown)
            .await
            .expect_err("unregistered");
        let RegistrationError::Unregistered { uuid: told, .. } = &err else {
            panic!("expected Unregistered with {style:?}, got {err:?}");
        };
        assert_eq!(told, &uuid);
        let message = err.to_string();
        assert!(
            message.contains(&format!("Remove {}", file.display())),
            "{message}"
        );
        assert!(message.contains("forge.registration_token"), "{message}");
    }
    assert_eq!(
        world.forge.snapshot().runners.len(),
        1,
        "no silent re-registration"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetchers_stop_when_the_forge_forgets_the_runner() {
    let world = World::start().await;
    let _workers = world.drain_workers();
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;
    let uuid = fetchers.dispatcher.forges.registrations()[0]
        .client
        .credentials()
        .expect("credentials")
        .uuid
        .clone();
    assert!(world.forge.remove_runner(&uuid));
    let result = fetchers.finished(Duration::from_secs(10)).await;
    assert!(
        matches!(result, Err(FetchError::Unregistered(_))),
        "{result:?}"
    );
}

fn fail_task_command(instance: &str, task_id: i64, reason: &str, nonce: &str) -> Envelope {
    let id = AssignmentId::for_task(instance, task_id);
    Envelope::new(
        format!("fail-task:{id}:{nonce}"),
        0,
        id,
        1,
        Message::FailTask(FailTask {
            forge_task_id: task_id,
            backend: BackendName::new("pod").expect("name"),
            reason: reason.to_owned(),
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_task_reports_failure_once_and_respects_an_existing_terminal() {
    let world = World::start().await;
    let forges = world.establish().await;
    let forge = forges.registrations()[0].client.clone();
    let instance = world.forge_instance();
    let pod = BackendName::new("pod").expect("name");
    world.forge.enqueue_jobs(job("pod"), 3);
    let dispatcher = world.dispatcher(forges.clone());
    let mut tasks = Vec::new();
    for n in 0..3 {
        let reply = forge
            .fetch_task(&FetchTaskRequest {
                tasks_version: 0,
                ..Default::default()
            })
            .await
            .expect("fetch");
        let task = reply.task.expect("a task");
        tasks.push(task.id);
        // The third task gets no assignment: a fail-task naming it is not the scheduler's.
        if n < 2 {
            let envelope = dispatcher
                .assignment_envelope(
                    &task,
                    &pod,
                    vec!["pod".into()],
                    "build".into(),
                    "test".into(),
                )
                .expect("seal");
            world
                .bus
                .publish(
                    &subject::assignment(&pod, envelope.assignment_id),
                    &envelope,
                )
                .await
                .expect("publish assignment");
        }
    }
    let (lost, finished, foreign) = (tasks[0], tasks[1], tasks[2]);
    let (lost_id, finished_id) = (
        AssignmentId::for_task(&instance, lost),
        AssignmentId::for_task(&instance, finished),
    );

    // The executor of `finished` already reported its result: the facade published `terminal`.
    let executor_terminal = Envelope::new(
        format!("terminal:{finished_id}:executor"),
        0,
        finished_id,
        1,
        Message::Terminal(Terminal {
            forge_task_id: finished,
            result: TaskResult::Success,
            source: TerminalSource::Executor,
            log_closed: true,
            reason: None,
        }),
    );
    let published = world
        .bus
        .publish_once(
            &subject::event(&pod, finished_id, Kind::Terminal),
            &executor_terminal,
        )
        .await
        .expect("publish terminal");
    assert!(matches!(published, PublishOnce::Published { .. }));

    let reason = "workload lost after claim: pod evicted";
    let command_subject = subject::command(subject::SCHEDULER_TARGET, Kind::FailTask);
    for command in [
        fail_task_command(&instance, lost, reason, "1"),
        fail_task_command(&instance, finished, reason, "1"),
        fail_task_command(&instance, foreign, "forged", "1"),
        // The id of `lost`'s assignment but another forge task: refused too.
        {
            let mut c = fail_task_command(&instance, foreign, "forged", "2");
            c.assignment_id = lost_id;
            c
        },
    ] {
        world
            .bus
            .publish(&command_subject, &command)
            .await
            .expect("publish command");
    }

    let stop = CancellationToken::new();
    let consumer = {
        let (bus, stop) = (world.bus.clone(), stop.clone());
        let context = jr_scheduler::commands::Context {
            bus: bus.clone(),
            forges: vec![std::sync::Arc::new(jr_gitea_intake::GiteaCommands {
                bus: bus.clone(),
                forges: forges.clone(),
            })],
            sealer: dispatcher.sink.sealer().clone(),
        };
        tokio::spawn(async move {
            bus.run_consumer(
                &ConsumerSpec::scheduler_commands(),
                move |d| {
                    let context = context.clone();
                    async move { jr_scheduler::commands::handle(&context, d).await }
                },
                ConsumerOptions::default(),
                stop,
            )
            .await
        })
    };
    let commands_done = || async {
        let stream = world
            .bus
            .jetstream()
            .get_stream(STREAM_COMMANDS)
            .await
            .expect("stream");
        stream.cached_info().state.messages == 0
    };
    eventually(
        "all fail-task commands settled",
        Duration::from_secs(20),
        commands_done,
    )
    .await;
    eventually("task-failed published", Duration::from_secs(10), || async {
        let subject = subject::event(&pod, lost_id, Kind::TaskFailed);
        world
            .bus
            .last_on_subject(STREAM_EVENTS, &subject)
            .await
            .expect("read")
            .is_some()
    })
    .await;

    let snapshot = world.forge.snapshot();
    let task = snapshot.task(lost).expect("lost task");
    assert_eq!(task.status, Status::Done(Outcome::Failure));
    assert_eq!(task.final_accepted, 1);
    assert!(task.log_archived);
    assert_eq!(task.log, vec![format!("jetrunner: {reason}")]);

    let terminal = world
        .bus
        .last_on_subject(
            STREAM_EVENTS,
            &subject::event(&pod, lost_id, Kind::Terminal),
        )
        .await
        .expect("read")
        .expect("terminal exists");
    let Message::Terminal(t) = terminal.1.message else {
        panic!("not a terminal")
    };
    assert_eq!(
        (t.source, t.result, t.forge_task_id),
        (TerminalSource::FailTask, TaskResult::Failure, lost)
    );
    assert_eq!(t.reason.as_deref(), Some(reason));
    let failed = world
        .bus
        .last_on_subject(
            STREAM_EVENTS,
            &subject::event(&pod, lost_id, Kind::TaskFailed),
        )
        .await
        .expect("read")
        .expect("task-failed exists");
    assert!(
        matches!(&failed.1.message, Message::TaskFailed(f) if f.forge_task_id == lost && f.reason == reason)
    );

    // Commands naming no assignment of ours for that task changed nothing at the forge.
    let foreign_task = snapshot.task(foreign).expect("foreign task");
    assert_eq!(foreign_task.status, Status::Running);
    assert!(
        foreign_task.final_reports.is_empty() && foreign_task.log.is_empty(),
        "{foreign_task:?}"
    );
    // The task whose terminal came from its executor was left alone at the forge.
    let untouched = snapshot.task(finished).expect("finished task");
    assert_eq!(untouched.status, Status::Running);
    assert!(
        untouched.final_reports.is_empty() && untouched.log.is_empty(),
        "{untouched:?}"
    );
    let terminal = world
        .bus
        .last_on_subject(
            STREAM_EVENTS,
            &subject::event(&pod, finished_id, Kind::Terminal),
        )
        .await
        .expect("read")
        .expect("terminal");
    assert!(matches!(
        terminal.1.message,
        Message::Terminal(Terminal {
            source: TerminalSource::Executor,
            ..
        })
    ));
    let no_failed = world
        .bus
        .last_on_subject(
            STREAM_EVENTS,
            &subject::event(&pod, finished_id, Kind::TaskFailed),
        )
        .await;
    assert!(
        no_failed.expect("read").is_none(),
        "no task-failed for a task that ended on its own"
    );

    // A second fail-task for the already failed task changes nothing the forge shows.
    world
        .bus
        .publish(
            &command_subject,
            &fail_task_command(&instance, lost, "a later reason", "2"),
        )
        .await
        .expect("publish command");
    eventually(
        "second fail-task acked",
        Duration::from_secs(20),
        commands_done,
    )
    .await;
    let task = world
        .forge
        .snapshot()
        .task(lost)
        .cloned()
        .expect("lost task");
    assert_eq!(task.status, Status::Done(Outcome::Failure));
    assert_eq!(task.final_accepted, 1);
    assert_eq!(
        task.log,
        vec![format!("jetrunner: {reason}")],
        "log unchanged"
    );

    stop.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(15), consumer)
        .await
        .expect("consumer stops");
    ended.expect("no panic").expect("consumer ends cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_too_large_for_nats_is_failed_at_the_forge_instead_of_dropped() {
    let world = World::start().await;
    // A secret beyond nats-server's default max_payload (1 MiB) makes the assignment unpublishable.
    let mut spec = job("pod");
    spec.secrets.insert("BIG".into(), "x".repeat(1_100_000));
    let big = world.forge.enqueue_job(spec);
    world.forge.enqueue_jobs(job("pod"), 2);
    let _workers = world.drain_workers();
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;

    let snapshot = world
        .forge
        .wait_until(
            |s| s.job(big).is_some_and(|j| j.status.is_final()) && s.queued_count() == 0,
            Duration::from_secs(20),
        )
        .await
        .expect("the oversized job is failed, not left running");
    eventually("2 assignments stored", Duration::from_secs(10), || async {
        world.assignment_count().await >= 2
    })
    .await;
    fetchers.stop().await.expect("fetchers stop cleanly");

    let job = snapshot.job(big).expect("job");
    assert_eq!(job.status, Status::Done(Outcome::Failure));
    let task = snapshot.task(job.task_ids[0]).expect("task");
    assert_eq!(task.stop_cause, Some(StopCause::Runner));
    assert!(
        task.log
            .iter()
            .any(|l| l.contains("cannot publish the assignment") && l.contains("max payload")),
        "{:?}",
        task.log
    );
    let mut expected = expected_backends(&world.forge.snapshot());
    expected.remove(&task.id);
    assert_published_exactly_once(&world, &expected).await;
}
