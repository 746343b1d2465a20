//! The GitHub scale set listener with the scheduler's JetStream ledger, against a real
//! nats-server and the strict fake GitHub: every assigned job is one assignment carrying its
//! sealed JIT config, claimed and terminal once each; no JIT config is readable on the bus; a
//! restarted listener resumes its session from the cursor in `JR_SCHEDULER`; jobs github.com
//! sends with `runnerRequestId` 0 are named by their job in every message.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use jr_fake_github::{FakeGitHub, JobSpec, JobState};
use jr_github::wire::JobFacts;
use jr_github::{Credentials, Listener, RetryPolicy, ScaleSetClient, Settings};
use jr_github_intake::ledger::{JetStreamSink, assignment_id};
use jr_protocol::RunnerRegistration as GitHubTask;
use jr_protocol::{
    AssignmentId, BackendName, Kind, Message, STREAM_ASSIGNMENTS, STREAM_EVENTS, TaskResult,
    subject,
};
use jr_seal::{SealScope, Sealer};
use support::World;
use tokio_util::sync::CancellationToken;

const PAT: &str = "ghp_scheduler";
const FORGE: &str = "gh-acme";

fn pod() -> BackendName {
    BackendName::new("pod").expect("name")
}

fn client(fake: &FakeGitHub) -> ScaleSetClient {
    ScaleSetClient::new(Settings {
        url: "https://github.com/acme".into(),
        api: Some(fake.url()),
        credentials: Credentials::Pat(PAT.into()),
        retry: RetryPolicy {
            attempts: 4,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(2),
        },
        user_agent: "jetrunner-test".into(),
    })
    .expect("client")
}

async fn raw_last(world: &World, stream: &str, subject: &str) -> Option<Vec<u8>> {
    let stream = world
        .bus
        .jetstream()
        .get_stream(stream)
        .await
        .expect("stream");
    stream
        .direct_get_last_for_subject(subject)
        .await
        .ok()
        .map(|m| m.payload.to_vec())
}

async fn count(world: &World, stream: &str, subject: &str) -> u64 {
    let stream = world
        .bus
        .jetstream()
        .get_stream(stream)
        .await
        .expect("stream");
    let info = stream.info_with_subjects(subject).await.expect("info");
    let mut total = 0;
    let mut info = info;
    while let Some(entry) = futures::StreamExt::next(&mut info).await {
        total += entry.expect("subject count").1 as u64;
    }
    total
}

/// The assignments the sink published: the subjects of `JR_ASSIGNMENTS` on the backend.
async fn published(world: &World) -> BTreeSet<String> {
    let stream = world
        .bus
        .jetstream()
        .get_stream(STREAM_ASSIGNMENTS)
        .await
        .expect("stream");
    let mut info = stream
        .info_with_subjects("jr.assignment.pod.>")
        .await
        .expect("info");
    let mut ids = BTreeSet::new();
    while let Some(entry) = futures::StreamExt::next(&mut info).await {
        let (subject, _) = entry.expect("subject");
        let id = subject.rsplit('.').next().expect("id").to_owned();
        ids.insert(assignment_id(&id).expect("id").0.simple().to_string());
    }
    ids
}

/// Plays the workloads: opens each assignment's sealed task from the bus and starts its JIT
/// runner on the fake, which then finishes its job (`failed` for every third).
async fn workloads(
    world: &World,
    sealer: &Sealer,
    fake: &FakeGitHub,
    started: &mut BTreeSet<String>,
) {
    for listener_id in published(world).await {
        if started.contains(&listener_id) {
            continue;
        }
        let id = assignment_id(&listener_id).expect("id");
        let Some((_, envelope)) = world
            .bus
            .last_on_subject(STREAM_ASSIGNMENTS, &subject::assignment(&pod(), id))
            .await
            .expect("read")
        else {
            continue;
        };
        let Message::Assignment(assignment) = envelope.message else {
            panic!("not an assignment");
        };
        let plain = sealer
            .open(SealScope::of(id, &assignment), &assignment.sealed_task)
            .expect("the workload's scope opens its task");
        let task: GitHubTask = serde_json::from_slice(&plain).expect("task");
        started.insert(listener_id);
        let (runner, job) = fake.start_runner(&task.jit_config).expect("runner starts");
        let job = match job {
            Some(job) => job,
            None => loop {
                if let Some(job) = fake.poll_runner(runner) {
                    break job;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            },
        };
        let result = if job % 3 == 0 { "failed" } else { "succeeded" };
        fake.finish_runner(runner, result).expect("finish");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_jobs_become_sealed_assignments_claimed_and_final_once() {
    let world = World::start().await;
    let sealer = Arc::new(jr_scheduler::service::sealer_from_config(&world.config).expect("key"));
    let store = jr_gitea_intake::request_key::open_bucket(&world.bus)
        .await
        .expect("bucket");
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    fake.set_poll_hold(Duration::from_millis(100));
    let set = client(&fake)
        .ensure_scale_set("default", "jetrunner", &[])
        .await
        .expect("scale set");
    let listener = || Listener {
        stats: Default::default(),
        client: client(&fake),
        scale_set: set.id,
        owner: "scheduler-test".into(),
        forge: FORGE.into(),
        max_capacity: 10,
        min_idle: 0,
        work_folder: "_work".into(),
        guard: None,
        sink: JetStreamSink {
            bus: world.bus.clone(),
            kv: store.clone(),
            assignments: jr_intake::sink::AssignmentSink::new(world.bus.clone(), sealer.clone()),
            forge: FORGE.into(),
            scope: "acme".into(),
            labels: vec!["jetrunner".into()],
            backend: pod(),
            max_duration: Duration::from_secs(3600),
            room: jr_github_intake::ledger::Room::Fixed(10),
            records: Default::default(),
        },
    };

    let stop = CancellationToken::new();
    let first = listener();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { first.run(stop, true).await })
    };
    let mut jobs: Vec<i64> = (0..5)
        .map(|_| fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    let mut started = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let all_final = |jobs: &[i64]| {
        jobs.iter().all(|j| {
            matches!(
                fake.job(*j).map(|j| j.state),
                Some(JobState::Completed { .. })
            )
        })
    };
    while !all_final(&jobs) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "jobs not final in time"
        );
        workloads(&world, &sealer, &fake, &mut started).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Stopped without deleting the session, as a crash leaves it; a new listener resumes it.
    stop.cancel();
    running.await.expect("join").expect("listener");
    let session = fake.session(set.id).expect("session kept");
    let stop = CancellationToken::new();
    let second = listener();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { second.run(stop, false).await })
    };
    jobs.extend((0..3).map(|_| fake.enqueue(JobSpec::push(&["jetrunner"]))));
    while !all_final(&jobs) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "jobs after the restart not final in time"
        );
        workloads(&world, &sealer, &fake, &mut started).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The last terminals may still be on their way to the bus.
    let ids: Vec<AssignmentId> = published(&world)
        .await
        .iter()
        .map(|i| assignment_id(i).expect("id"))
        .collect();
    assert_eq!(ids.len(), jobs.len(), "one runner per job");
    // On the stream itself: as many assignment messages as jobs, one per subject.
    assert_eq!(
        count(&world, STREAM_ASSIGNMENTS, "jr.assignment.pod.>").await,
        jobs.len() as u64,
        "assignment messages"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut missing = 0;
        for id in &ids {
            if raw_last(
                &world,
                STREAM_EVENTS,
                &subject::event(&pod(), *id, Kind::Terminal),
            )
            .await
            .is_none()
            {
                missing += 1;
            }
        }
        if missing == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{missing} terminals missing"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    running.await.expect("join").expect("listener");
    assert!(
        fake.session(set.id).is_none(),
        "the session was not deleted on shutdown"
    );
    let cursor = store
        .get(format!("github.{FORGE}.cursor"))
        .await
        .expect("get")
        .expect("cursor");
    assert!(
        String::from_utf8_lossy(&cursor).starts_with(&session),
        "the restart opened a new session"
    );

    let secrets: Vec<String> = fake
        .removed_runners()
        .iter()
        .map(|r| r.encoded_jit_config.clone())
        .collect();
    assert_eq!(secrets.len(), jobs.len(), "runners that ran");
    let mut finished = Vec::new();
    for id in &ids {
        for (stream, subject) in [
            (STREAM_ASSIGNMENTS, subject::assignment(&pod(), *id)),
            (STREAM_EVENTS, subject::event(&pod(), *id, Kind::Claimed)),
            (STREAM_EVENTS, subject::event(&pod(), *id, Kind::Terminal)),
        ] {
            assert_eq!(count(&world, stream, &subject).await, 1, "{subject}");
            let raw = raw_last(&world, stream, &subject).await.expect("message");
            for secret in &secrets {
                assert!(
                    !raw.windows(secret.len()).any(|w| w == secret.as_bytes()),
                    "a JIT config is readable on {subject}"
                );
            }
        }
        let (_, terminal) = world
            .bus
            .last_on_subject(STREAM_EVENTS, &subject::event(&pod(), *id, Kind::Terminal))
            .await
            .expect("read")
            .expect("terminal");
        let Message::Terminal(terminal) = terminal.message else {
            panic!("not a terminal");
        };
        let expected = if terminal.forge_task_id % 3 == 0 {
            TaskResult::Failure
        } else {
            TaskResult::Success
        };
        assert_eq!(terminal.result, expected, "job {}", terminal.forge_task_id);
        // The claim and the terminal of a runner's assignment name the job that runner took.
        let (_, claimed) = world
            .bus
            .last_on_subject(STREAM_EVENTS, &subject::event(&pod(), *id, Kind::Claimed))
            .await
            .expect("read")
            .expect("claimed");
        let Message::Claimed(claimed) = claimed.message else {
            panic!("not a claim");
        };
        assert_eq!(claimed.forge_task_id, terminal.forge_task_id, "{id}");
        finished.push(terminal.forge_task_id);
    }
    // Every job final once, whichever runner took it.
    finished.sort_unstable();
    let mut expected = jobs.clone();
    expected.sort_unstable();
    assert_eq!(finished, expected, "jobs final once each");
}

/// The message last published on `subject` of `stream`.
async fn last_message(world: &World, stream: &str, subject: &str) -> Message {
    let (_, envelope) = world
        .bus
        .last_on_subject(stream, subject)
        .await
        .expect("read")
        .unwrap_or_else(|| panic!("nothing on {subject}"));
    envelope.message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_without_a_request_id_get_one_assignment_claim_and_terminal_naming_their_job() {
    let world = World::start().await;
    let sealer = Arc::new(jr_scheduler::service::sealer_from_config(&world.config).expect("key"));
    let store = jr_gitea_intake::request_key::open_bucket(&world.bus)
        .await
        .expect("bucket");
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    fake.set_poll_hold(Duration::from_millis(100));
    // github.com as seen since 2025: every job message carries runnerRequestId 0.
    fake.set_zero_request_ids(true);
    let set = client(&fake)
        .ensure_scale_set("default", "jetrunner", &[])
        .await
        .expect("scale set");
    let listener = Listener {
        stats: Default::default(),
        client: client(&fake),
        scale_set: set.id,
        owner: "scheduler-test".into(),
        forge: FORGE.into(),
        max_capacity: 10,
        min_idle: 0,
        work_folder: "_work".into(),
        guard: None,
        sink: JetStreamSink {
            bus: world.bus.clone(),
            kv: store.clone(),
            assignments: jr_intake::sink::AssignmentSink::new(world.bus.clone(), sealer.clone()),
            forge: FORGE.into(),
            scope: "acme".into(),
            labels: vec!["jetrunner".into()],
            backend: pod(),
            max_duration: Duration::from_secs(3600),
            room: jr_github_intake::ledger::Room::Fixed(10),
            records: Default::default(),
        },
    };
    let stop = CancellationToken::new();
    let running = {
        let stop = stop.clone();
        tokio::spawn(async move { listener.run(stop, false).await })
    };
    let jobs: Vec<i64> = (0..6)
        .map(|_| fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    // The number each job must be named by on the bus → the fake's id of the job.
    let named: BTreeMap<i64, i64> = jobs
        .iter()
        .map(|request| {
            let job = fake.job(*request).expect("job");
            assert_eq!(job.message_request_id, 0, "the fake sent a request id");
            let facts = JobFacts {
                runner_request_id: 0,
                job_id: job.job_id,
                ..JobFacts::default()
            };
            (facts.task_id(), *request)
        })
        .collect();
    assert_eq!(named.len(), jobs.len(), "two jobs share a task id");
    let mut started = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let final_on_github = |j: &i64| {
        matches!(
            fake.job(*j).map(|j| j.state),
            Some(JobState::Completed { .. })
        )
    };
    while !jobs.iter().all(final_on_github) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "jobs not final in time"
        );
        workloads(&world, &sealer, &fake, &mut started).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ids: Vec<AssignmentId> = published(&world)
        .await
        .iter()
        .map(|i| assignment_id(i).expect("id"))
        .collect();
    assert_eq!(ids.len(), jobs.len(), "one runner per job");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for id in &ids {
        let terminal = subject::event(&pod(), *id, Kind::Terminal);
        while raw_last(&world, STREAM_EVENTS, &terminal).await.is_none() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no terminal for {id}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    stop.cancel();
    running.await.expect("join").expect("listener");

    let mut ran = BTreeSet::new();
    for id in &ids {
        let subjects = [
            (STREAM_ASSIGNMENTS, subject::assignment(&pod(), *id)),
            (STREAM_EVENTS, subject::event(&pod(), *id, Kind::Claimed)),
            (STREAM_EVENTS, subject::event(&pod(), *id, Kind::Terminal)),
        ];
        for (stream, subject) in &subjects {
            assert_eq!(count(&world, stream, subject).await, 1, "{subject}");
        }
        let Message::Assignment(assignment) =
            last_message(&world, STREAM_ASSIGNMENTS, &subjects[0].1).await
        else {
            panic!("not an assignment");
        };
        let Message::Claimed(claimed) = last_message(&world, STREAM_EVENTS, &subjects[1].1).await
        else {
            panic!("not a claim");
        };
        let Message::Terminal(terminal) = last_message(&world, STREAM_EVENTS, &subjects[2].1).await
        else {
            panic!("not a terminal");
        };
        // A runner is made for the scale set, not for a job: its assignment names none. The
        // claim and the terminal name the job that runner took, which is one of the six.
        assert_eq!(assignment.forge_task_id, 0, "assignment {id} names a job");
        assert_eq!(claimed.forge_task_id, terminal.forge_task_id, "{id}");
        let request = named
            .get(&terminal.forge_task_id)
            .unwrap_or_else(|| panic!("terminal {id} names no job: {}", terminal.forge_task_id));
        let expected = if request % 3 == 0 {
            TaskResult::Failure
        } else {
            TaskResult::Success
        };
        assert_eq!(terminal.result, expected, "job {request}");
        ran.insert(terminal.forge_task_id);
    }
    let every_job: BTreeSet<i64> = named.keys().copied().collect();
    assert_eq!(ran, every_job, "a claim and a terminal for every job");
}
