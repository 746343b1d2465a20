//! Fetch pacing against the fake forge and a real nats-server: tasks are taken only while a
//! backend has room, one FetchTask is in flight per registration, waiting tasks are kept alive
//! and withdrawn when the forge ends them, and Forgejo's request key recovers a lost reply.

mod support;

use std::time::Duration;

use futures::StreamExt as _;
use jr_bus::ConsumerSpec;
use jr_bus::async_nats::jetstream::consumer;
use jr_fake_forge::{DropMode, FaultConfig, JobSpec, Rpc};
use jr_forge::proto::runner::v1::FetchTaskRequest;
use jr_protocol::{
    AssignmentId, BackendName, Kind, Message, STREAM_ASSIGNMENTS, STREAM_EVENTS, TerminalSource,
    subject,
};
use support::{World, assert_published_exactly_once, eventually, expected_backends};

fn job(label: &str) -> JobSpec {
    JobSpec {
        runs_on: vec![label.to_owned()],
        ..JobSpec::default()
    }
}

fn forge_config(behaviour: jr_fake_forge::Behaviour) -> jr_fake_forge::Config {
    jr_fake_forge::Config {
        behaviour,
        ..jr_fake_forge::Config::default()
    }
}

/// Takes (acks) one assignment from `backend`'s worker consumer, as a worker with one free
/// slot would.
async fn take_one(world: &World, backend: &str) {
    let backend = BackendName::new(backend).expect("backend");
    let durable = ConsumerSpec::worker_assignments(&backend).durable;
    let stream = world
        .bus
        .jetstream()
        .get_stream(STREAM_ASSIGNMENTS)
        .await
        .expect("stream");
    let consumer = stream
        .get_consumer::<consumer::pull::Config>(&durable)
        .await
        .expect("worker consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .messages()
        .await
        .expect("fetch");
    let message = tokio::time::timeout(Duration::from_secs(5), batch.next())
        .await
        .expect("an assignment waits")
        .expect("one message")
        .expect("message");
    message.ack().await.expect("ack");
}

/// Starts the fetchers with stand-in workers taking everything, and waits until the forge's
/// queue is empty and `expected` assignments were acknowledged.
async fn drain_the_forge(world: &World, expected: u64) -> support::Fetchers {
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;
    world
        .forge
        .wait_until(|s| s.queued_count() == 0, Duration::from_secs(60))
        .await
        .expect("the queue drains");
    eventually(
        "assignments acknowledged",
        Duration::from_secs(20),
        || async {
            fetchers
                .dispatcher
                .stats
                .dispatched
                .load(std::sync::atomic::Ordering::Relaxed)
                >= expected
        },
    )
    .await;
    fetchers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lookahead_waits_for_a_full_backend_and_the_backlog_stays_at_the_forge() {
    let world = World::start_layout(jr_fake_forge::Config::default(), &[], "per-backend", "").await;
    world.forge.enqueue_jobs(job("pod"), 10);
    world.forge.enqueue_jobs(job("vm"), 10);
    // No worker takes anything: each backend gets its lookahead (2) and no more.
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;
    world
        .forge
        .wait_until(|s| s.tasks.len() == 4, Duration::from_secs(20))
        .await
        .expect("two tasks per backend are fetched");
    let overshoot = world
        .forge
        .wait_until(|s| s.tasks.len() > 4, Duration::from_secs(2))
        .await;
    assert!(overshoot.is_err(), "fetched beyond the lookahead");
    assert_eq!(
        world.forge.queued_count(),
        16,
        "the backlog stays at the forge"
    );
    assert_eq!(world.waiting_for("pod").await, 2);
    assert_eq!(world.waiting_for("vm").await, 2);

    // One runner per backend, each declaring only its own labels.
    let snapshot = world.forge.snapshot();
    let mut declared: Vec<Vec<String>> =
        snapshot.runners.iter().map(|r| r.labels.clone()).collect();
    declared.sort();
    assert_eq!(
        declared,
        vec![vec!["pod".to_owned()], vec!["vm".to_owned()]]
    );
    let file = &world.config.forge.credentials_file;
    for backend in ["pod", "vm"] {
        let per_backend = file.with_file_name(format!("runner.{backend}.json"));
        assert!(per_backend.exists(), "{} persisted", per_backend.display());
    }

    // A worker frees one slot of pod: exactly one more pod task is taken.
    take_one(&world, "pod").await;
    world
        .forge
        .wait_until(|s| s.tasks.len() == 5, Duration::from_secs(10))
        .await
        .expect("one more task once a pod slot is free");
    let snapshot = world.forge.snapshot();
    let pod_tasks = snapshot
        .tasks
        .iter()
        .filter(|t| snapshot.job(t.job_id).is_some_and(|j| j.runs_on == ["pod"]))
        .count();
    assert_eq!(pod_tasks, 3);
    fetchers.stop().await.expect("fetchers stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_fetches_lose_on_gitea_so_the_scheduler_keeps_one_in_flight() {
    let behaviour = jr_fake_forge::Behaviour {
        fetch_race: true,
        ..Default::default()
    };
    let world = World::start_with(forge_config(behaviour), &[]).await;
    world.forge.set_faults(FaultConfig {
        latency_ms: 30,
        only: vec![Rpc::FetchTask],
        ..FaultConfig::default()
    });
    world.forge.enqueue_jobs(job("pod"), 4);

    // The fake is strict: two overlapping fetches of one runner, one of them loses although
    // jobs wait.
    let forges = world.establish().await;
    let client = forges.registrations()[0].client.clone();
    let request = FetchTaskRequest {
        tasks_version: 0,
        ..Default::default()
    };
    let (a, b) = tokio::join!(client.fetch_task(&request), client.fetch_task(&request));
    let got = [a.expect("fetch a"), b.expect("fetch b")]
        .iter()
        .filter(|r| r.task.is_some())
        .count();
    assert_eq!(got, 1, "one of two racing fetches gets no task");
    assert_eq!(world.forge.snapshot().faults.lost_fetch_races, 1);
    assert!(world.forge.snapshot().faults.max_concurrent_fetches >= 2);

    // The scheduler's fetcher never races itself: every job is dispatched, none is lost.
    let forge_before = world.forge.snapshot();
    world.forge.enqueue_jobs(job("pod"), 60);
    world.forge.enqueue_jobs(job("vm"), 40);
    let _workers = world.drain_workers();
    let fetchers = drain_the_forge(&world, 103).await;
    let dispatcher = fetchers.dispatcher.clone();
    fetchers.stop().await.expect("fetchers stop");
    let after = world.forge.snapshot();
    assert_eq!(
        after.faults.lost_fetch_races, forge_before.faults.lost_fetch_races,
        "no fetch of the scheduler lost a race"
    );
    assert_eq!(
        dispatcher
            .stats
            .max_in_flight
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // Every job but the one the race demonstration took itself.
    let mut expected = expected_backends(&after);
    for t in &forge_before.tasks {
        expected.remove(&t.id);
    }
    assert_eq!(expected.len(), 103);
    assert_published_exactly_once(&world, &expected).await;
}

/// Fetch loops polling every 50 ms and the keepalive loop of their unclaimed tasks, stopped
/// together by the fetchers' shutdown.
async fn fetchers_with_keepalive(
    world: &World,
) -> (
    support::Fetchers,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;
    let keepalive = tokio::spawn(jr_gitea_intake::unclaimed::run_keepalive(
        fetchers.dispatcher.unclaimed.clone(),
        fetchers.dispatcher.forges.clone(),
        world.bus.clone(),
        fetchers.shutdown.clone(),
    ));
    (fetchers, keepalive)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_tasks_outlive_the_zombie_timeout_and_a_cancelled_one_is_withdrawn() {
    let behaviour = jr_fake_forge::Behaviour {
        zombie_timeout: Duration::from_secs(3),
        ..Default::default()
    };
    let config = jr_fake_forge::Config {
        behaviour,
        reap_interval: Some(Duration::from_millis(250)),
        ..jr_fake_forge::Config::default()
    };
    let mut world = World::start_layout(config, &[], "per-backend", "").await;
    world.config.forge.keepalive_interval = Duration::from_secs(1);
    let jobs = world.forge.enqueue_jobs(job("pod"), 3);
    let (fetchers, keepalive) = fetchers_with_keepalive(&world).await;
    // Two tasks wait in JetStream (no worker): they live on well past the 3 s zombie timeout.
    let snapshot = world
        .forge
        .wait_until(
            |s| s.tasks.len() == 2 && s.tasks.iter().all(|t| t.heartbeats >= 6),
            Duration::from_secs(20),
        )
        .await
        .expect("waiting tasks get heartbeats");
    assert!(
        snapshot.tasks.iter().all(|t| t.stop_cause.is_none()),
        "no waiting task was reaped: {:?}",
        snapshot.tasks
    );
    assert_eq!(fetchers.dispatcher.unclaimed.len(), 2);

    // A user cancels the first job while it waits: the assignment is withdrawn.
    let first = snapshot.job(jobs[0]).expect("job").task_ids[0];
    assert!(world.forge.cancel_task(first));
    let id = AssignmentId::for_task(&world.forge_instance(), first);
    let pod = BackendName::new("pod").expect("backend");
    eventually("withdrawn terminal", Duration::from_secs(10), || async {
        matches!(
            world
                .bus
                .last_on_subject(STREAM_EVENTS, &subject::event(&pod, id, Kind::Terminal))
                .await,
            Ok(Some((_, e))) if matches!(&e.message, Message::Terminal(t) if t.source == TerminalSource::Withdrawn)
        )
    })
    .await;
    assert_eq!(fetchers.dispatcher.unclaimed.len(), 1);
    let cancelled = world.forge.snapshot();
    let task = cancelled.task(first).expect("task");
    let log_len = task.log.len();
    assert_eq!(log_len, 0, "nothing written to the cancelled task's log");
    fetchers.stop().await.expect("fetchers stop");
    keepalive.await.expect("no panic").expect("keepalive ends");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_claimed_through_another_replicas_facade_gets_no_more_heartbeats_here() {
    let mut world =
        World::start_layout(forge_config(Default::default()), &[], "per-backend", "").await;
    world.config.forge.keepalive_interval = Duration::from_secs(1);
    let jobs = world.forge.enqueue_jobs(job("pod"), 2);
    let (fetchers, keepalive) = fetchers_with_keepalive(&world).await;
    let snapshot = world
        .forge
        .wait_until(|s| s.tasks.len() == 2, Duration::from_secs(20))
        .await
        .expect("both tasks fetched");
    eventually(
        "both tasks wait for a claim",
        Duration::from_secs(10),
        || async { fetchers.dispatcher.unclaimed.len() == 2 },
    )
    .await;
    let (claimed, waiting) = (
        snapshot.job(jobs[0]).expect("job").task_ids[0],
        snapshot.job(jobs[1]).expect("job").task_ids[0],
    );
    // The other scheduler replica's facade claims the first task: only the bus knows.
    let pod = BackendName::new("pod").expect("backend");
    let id = AssignmentId::for_task(&world.forge_instance(), claimed);
    let envelope = jr_protocol::Envelope::new(
        format!("claimed:{id}:1:other-replica"),
        jr_protocol::now_ms(),
        id,
        1,
        Message::Claimed(jr_protocol::Claimed {
            forge_task_id: claimed,
            executor: "token".to_owned(),
        }),
    );
    world
        .bus
        .publish_once(&subject::event(&pod, id, Kind::Claimed), &envelope)
        .await
        .expect("claimed published");
    let before = world.forge.snapshot();
    let beats = |s: &jr_fake_forge::Snapshot, task| s.task(task).expect("task").heartbeats;
    let (claimed_before, waiting_before) = (beats(&before, claimed), beats(&before, waiting));
    // Three more heartbeats of the task still waiting: none more for the claimed one.
    let after = world
        .forge
        .wait_until(
            |s| beats(s, waiting) >= waiting_before + 3,
            Duration::from_secs(20),
        )
        .await
        .expect("the waiting task keeps getting heartbeats");
    assert_eq!(
        beats(&after, claimed),
        claimed_before,
        "a task claimed elsewhere got heartbeats from this replica"
    );
    assert_eq!(fetchers.dispatcher.unclaimed.len(), 1);
    fetchers.stop().await.expect("fetchers stop");
    keepalive.await.expect("no panic").expect("keepalive ends");
}

/// A Forgejo forge and a scheduler using its request keys, one registration per backend.
async fn forgejo_world(task_capacity: usize) -> World {
    let behaviour = jr_fake_forge::Behaviour {
        forgejo: true,
        error_style: jr_fake_forge::ErrorStyle::Forgejo,
        ..Default::default()
    };
    let mut world = World::start_layout(forge_config(behaviour), &[], "per-backend", "").await;
    world.config.forge.flavor = jr_config::ForgeFlavor::Forgejo;
    world.config.forge.task_capacity = task_capacity;
    world
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgejo_lost_fetch_reply_is_recovered_by_the_request_key() {
    let world = forgejo_world(4).await;
    world.forge.enqueue_jobs(job("pod"), 12);
    world.forge.enqueue_jobs(job("vm"), 12);
    // The first fetch (of either registration: both have jobs) is processed by the forge, but its reply never arrives.
    world.forge.set_faults(FaultConfig {
        drop_next: 1,
        drop_mode: DropMode::Abort,
        only: vec![Rpc::FetchTask],
        ..FaultConfig::default()
    });
    let _workers = world.drain_workers();
    let fetchers = drain_the_forge(&world, 24).await;
    fetchers.stop().await.expect("fetchers stop");
    let snapshot = world.forge.snapshot();
    assert_eq!(snapshot.faults.dropped_replies, 1);
    assert!(
        snapshot.faults.replayed_request_keys >= 1,
        "the key was replayed"
    );
    assert_eq!(snapshot.tasks.len(), 24, "one task per job");
    assert!(
        snapshot.tasks.iter().any(|t| t.handed_out == 2),
        "the lost reply's tasks were handed out again"
    );
    // Every task the forge handed out has its assignment: nothing lost to the dropped reply.
    let assignments = world.read_assignments().await;
    let published: std::collections::BTreeSet<i64> = assignments
        .iter()
        .map(|a| a.assignment.forge_task_id)
        .collect();
    let handed_out: std::collections::BTreeSet<i64> = snapshot.tasks.iter().map(|t| t.id).collect();
    assert_eq!(published, handed_out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_request_key_whose_tasks_all_ended_is_replaced_not_repeated_forever() {
    let world = forgejo_world(2).await;
    world.forge.enqueue_jobs(job("pod"), 6);
    // An earlier scheduler fetched two tasks under a key it stored, and those tasks ended (here:
    // cancelled) while no scheduler ran: a repeat of the key now brings nothing.
    let forges = world.establish().await;
    let pod = BackendName::new("pod").expect("backend");
    let client = forges.client(&pod).expect("pod registration");
    let stale = "7b0c5a1e-0000-4000-8000-000000000001";
    let reply = client
        .fetch_tasks(
            &FetchTaskRequest {
                tasks_version: 0,
                task_capacity: Some(2),
            },
            Some(stale),
        )
        .await
        .expect("fetch");
    let ended: Vec<i64> = reply
        .task
        .iter()
        .chain(reply.additional_tasks.iter())
        .map(|t| t.id)
        .collect();
    assert_eq!(ended.len(), 2);
    for id in &ended {
        assert!(world.forge.cancel_task(*id));
    }
    jr_gitea_intake::request_key::open_bucket(&world.bus)
        .await
        .expect("bucket")
        .put("request-key.pod", stale.into())
        .await
        .expect("stored key");

    // The scheduler starts with that key, gets an empty replay, replaces the key and fetches
    // the four jobs still waiting.
    let _workers = world.drain_workers();
    let fetchers = drain_the_forge(&world, 4).await;
    fetchers.stop().await.expect("fetchers stop");
    let snapshot = world.forge.snapshot();
    assert!(
        snapshot.faults.replayed_request_keys >= 1,
        "the stored key was tried first"
    );
    assert_eq!(snapshot.tasks.len(), 6, "every job was handed out once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_forges_capabilities_are_kept_per_registration_for_the_facade() {
    let behaviour = jr_fake_forge::Behaviour {
        capabilities: Some("cancelling".into()),
        ..Default::default()
    };
    let world = World::start_layout(forge_config(behaviour), &[], "per-backend", "").await;
    let forges = world.establish().await;
    for backend in ["pod", "vm"] {
        let backend = BackendName::new(backend).expect("backend");
        assert_eq!(forges.capabilities(&backend).as_deref(), Some("cancelling"));
    }
}
