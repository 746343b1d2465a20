//! Forge pacing with the whole system: a backlog longer than the forge's zombie timeout
//! succeeds with a registration per backend and with one existing runner shared by both
//! backends, on Gitea and on Forgejo, at most one FetchTask per registration is in flight and racing picks hide no job,
//! Forgejo's request key survives a scheduler killed between the forge's reply and the PubAck,
//! and a job cancelled while it waits never runs. Needs `cargo build --workspace --bins` first.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt as _;
use jr_fake_forge::{FaultConfig, Outcome, Rpc, Status, StopCause};
use jr_protocol::{AssignmentId, Message};
use jr_scenarios::{System, SystemSpec};

/// Forge task ids of every `claimed` event, collected from a plain NATS subscription (the harness
/// sees the bus independently of the services).
fn watch_claims(system: &System) -> Arc<Mutex<BTreeSet<i64>>> {
    let claimed = Arc::new(Mutex::new(BTreeSet::new()));
    let (url, sink) = (system.nats.url(), claimed.clone());
    tokio::spawn(async move {
        let Ok(client) = jr_bus::async_nats::connect(url).await else {
            return;
        };
        let Ok(mut sub) = client.subscribe("jr.event.*.*.claimed").await else {
            return;
        };
        while let Some(message) = sub.next().await {
            if let Ok(envelope) = jr_protocol::decode(&message.payload)
                && let Message::Claimed(c) = envelope.message
                && let Ok(mut set) = sink.lock()
            {
                set.insert(c.forge_task_id);
            }
        }
    });
    claimed
}

/// Jobs whose final state is anything but success, with that state.
fn jobs_not_succeeded(snapshot: &jr_fake_forge::Snapshot) -> Vec<(jr_fake_forge::JobId, Status)> {
    snapshot
        .jobs
        .iter()
        .filter(|j| j.status != Status::Done(Outcome::Success))
        .map(|j| (j.id, j.status))
        .collect()
}

/// How the scheduler is registered at the forge in a backlog run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// One runner per backend, registered by the scheduler (the default).
    PerBackend,
    /// One runner for both backends from an existing runner's uuid and token (the migration
    /// path): the forge may hand out a job of either backend to every fetch.
    SharedPremade,
}

/// A backlog of 150 jobs of 1.5 s (90 Pod jobs, then two Pod jobs for every VM job, in that
/// order at the forge) at Pod capacity 4 and VM capacity 2, with the forge's zombie reaper at 20 s: nothing is
/// reaped, every job succeeds, at most one FetchTask of a runner is in flight, and per backend
/// at most `2 × capacity + lookahead` tasks are fetched but not yet claimed at any sample.
async fn backlog_run(layout: Layout, forgejo: bool) -> anyhow::Result<()> {
    let (pod, vm, lookahead) = (4_usize, 2_usize, 2_usize);
    let mut system = System::start(SystemSpec {
        pod_capacity: pod,
        vm_capacity: vm,
        vm_pool: Some(vm + 2),
        lookahead,
        forge_flavor: if forgejo { "forgejo" } else { "gitea" },
        task_capacity: if forgejo { 3 } else { 1 },
        forge_behaviour: jr_fake_forge::Behaviour {
            zombie_timeout: Duration::from_secs(20),
            forgejo,
            error_style: if forgejo {
                jr_fake_forge::ErrorStyle::Forgejo
            } else {
                jr_fake_forge::ErrorStyle::Gitea
            },
            ..Default::default()
        },
        keepalive: Duration::from_secs(5),
        premade_runner: layout == Layout::SharedPremade,
        ..Default::default()
    })
    .await?;
    let claims = watch_claims(&system);
    // First a run of Pod jobs only (the VM backend idle meanwhile: the case in which a room
    // summed over backends fetched everything at once), then both kinds mixed.
    system.enqueue("pod", 90, &[("JR_FAKE_DURATION_MS", "1500")]);
    for _ in 0..20 {
        system.enqueue("pod", 2, &[("JR_FAKE_DURATION_MS", "1500")]);
        system.enqueue("vm", 1, &[("JR_FAKE_DURATION_MS", "1500")]);
    }
    // Fetched but not claimed per backend, from the forge's own view and the claims on the
    // bus, sampled every 250 ms until every job is final.
    let capacity = [("pod", pod), ("vm", vm)];
    let mut max_unclaimed = [0_usize; 2];
    let deadline = Instant::now() + Duration::from_secs(300);
    while !system.forge.all_final() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "jobs not final in time\n{}",
            system.logs()
        );
        let snapshot = system.forge.snapshot();
        let claimed = claims.lock().map(|c| c.clone()).unwrap_or_default();
        for (i, (label, _)) in capacity.iter().enumerate() {
            let unclaimed = snapshot
                .tasks
                .iter()
                .filter(|t| t.status == Status::Running && !claimed.contains(&t.id))
                .filter(|t| {
                    snapshot
                        .job(t.job_id)
                        .is_some_and(|j| j.runs_on.iter().any(|l| l == label))
                })
                .count();
            max_unclaimed[i] = max_unclaimed[i].max(unclaimed);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let snapshot = system.forge.snapshot();
    let reaped: Vec<i64> = snapshot
        .tasks
        .iter()
        .filter(|t| matches!(t.stop_cause, Some(StopCause::Zombie | StopCause::Endless)))
        .map(|t| t.id)
        .collect();
    let live_runners: Vec<_> = snapshot.runners.iter().filter(|r| !r.deleted).collect();
    println!(
        "{layout:?} on {}: fetched-but-unclaimed max pod {} (bound {}), vm {} (bound {}); \
         {} reaped; {} runner(s); 150 jobs of 1.5 s, zombie timeout 20 s",
        if forgejo { "Forgejo" } else { "Gitea" },
        max_unclaimed[0],
        2 * pod + lookahead,
        max_unclaimed[1],
        2 * vm + lookahead,
        reaped.len(),
        live_runners.len(),
    );
    match layout {
        Layout::SharedPremade => {
            // The scheduler used the existing runner and registered none of its own.
            assert_eq!(live_runners.len(), 1, "{live_runners:?}");
            let uuid = &live_runners[0].uuid;
            assert!(
                snapshot.tasks.iter().all(|t| &t.runner_uuid == uuid),
                "every task went to the pre-made runner"
            );
        }
        Layout::PerBackend => assert_eq!(live_runners.len(), 2, "{live_runners:?}"),
    }
    assert!(
        reaped.is_empty(),
        "{} tasks failed by the forge's reaper: {reaped:?}",
        reaped.len()
    );
    let not_success = jobs_not_succeeded(&snapshot);
    assert!(not_success.is_empty(), "{not_success:?}");
    for (i, (label, cap)) in capacity.iter().enumerate() {
        let bound = 2 * cap + lookahead;
        assert!(
            max_unclaimed[i] <= bound,
            "{} fetched-but-unclaimed {label} tasks, more than {bound}",
            max_unclaimed[i]
        );
    }
    assert!(
        max_unclaimed.iter().any(|m| *m > 0),
        "the sampler saw waiting tasks at all"
    );
    assert!(
        snapshot.faults.max_concurrent_fetches <= 1,
        "{} FetchTask calls of one runner at once",
        snapshot.faults.max_concurrent_fetches
    );
    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_longer_than_the_zombie_timeout_succeeds_with_a_registration_per_backend_on_gitea()
-> anyhow::Result<()> {
    backlog_run(Layout::PerBackend, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_longer_than_the_zombie_timeout_succeeds_with_a_registration_per_backend_on_forgejo()
-> anyhow::Result<()> {
    backlog_run(Layout::PerBackend, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_longer_than_the_zombie_timeout_succeeds_with_an_existing_shared_runner_on_gitea()
-> anyhow::Result<()> {
    backlog_run(Layout::SharedPremade, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_longer_than_the_zombie_timeout_succeeds_with_an_existing_shared_runner_on_forgejo()
-> anyhow::Result<()> {
    backlog_run(Layout::SharedPremade, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_picks_on_gitea_hide_no_waiting_job() -> anyhow::Result<()> {
    let poll = Duration::from_millis(200);
    // Capacity well above this light load, so every job arrives while its backend has a free
    // slot (the bound holds only then).
    let mut system = System::start(SystemSpec {
        pod_capacity: 8,
        vm_capacity: 6,
        vm_pool: Some(8),
        forge_poll: poll,
        forge_behaviour: jr_fake_forge::Behaviour {
            fetch_race: true,
            ..Default::default()
        },
        ..Default::default()
    })
    .await?;
    system.forge.set_faults(FaultConfig {
        latency_ms: 40,
        only: vec![Rpc::FetchTask],
        ..FaultConfig::default()
    });
    // Light load, so every backend has a free slot whenever a job arrives.
    let mut enqueued = Vec::new();
    for i in 0..24 {
        let label = if i % 3 == 0 { "vm" } else { "pod" };
        let ids = system.enqueue_ids(label, 1, &[("JR_FAKE_DURATION_MS", "100")]);
        enqueued.push((ids[0], SystemTime::now()));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    if let Err(e) = system.wait_all_final(Duration::from_secs(120)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    let limit = poll * 2 + Duration::from_secs(2);
    let mut worst = Duration::ZERO;
    for (job, at) in enqueued {
        let view = snapshot.job(job).expect("job");
        let task = snapshot.task(view.task_ids[0]).expect("task");
        let waited = task.started_at.duration_since(at).unwrap_or_default();
        worst = worst.max(waited);
        assert!(
            waited <= limit,
            "job {job:?} waited {waited:?} at the forge"
        );
    }
    println!("longest wait at the forge with racing picks: {worst:?} (limit {limit:?})");
    assert_eq!(
        snapshot.faults.lost_fetch_races, 0,
        "no fetch raced another"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forgejo_request_key_recovers_tasks_of_a_scheduler_killed_before_the_pub_ack()
-> anyhow::Result<()> {
    let crashes_wanted: u32 = std::env::var("JR_PACING_CRASHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 2,
        vm_pool: Some(4),
        forge_flavor: "forgejo",
        task_capacity: 3,
        forge_behaviour: jr_fake_forge::Behaviour {
            forgejo: true,
            error_style: jr_fake_forge::ErrorStyle::Forgejo,
            ..Default::default()
        },
        scheduler_env: vec![("JR_FAULT_ABORT_AFTER_FETCH".into(), "0.5".into())],
        ..Default::default()
    })
    .await?;
    let jobs = (crashes_wanted * 4).max(24);
    system.enqueue("pod", jobs * 2 / 3, &[("JR_FAKE_DURATION_MS", "100")]);
    system.enqueue("vm", jobs - jobs * 2 / 3, &[("JR_FAKE_DURATION_MS", "100")]);
    let mut crashes = 0;
    let deadline = Instant::now() + Duration::from_secs(240);
    while !system.forge.all_final() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "jobs not final in time\n{}",
            system.logs()
        );
        if let Some(status) = system.scheduler.exited() {
            crashes += 1;
            println!("scheduler ended ({status}); restart {crashes}");
            if crashes >= crashes_wanted {
                // Enough tries: the rest of the run goes without the fault.
                system.scheduler.remove_env("JR_FAULT_ABORT_AFTER_FETCH");
            }
            // It may abort again on the replayed tasks before it is ready: the loop restarts
            // it as often as needed.
            system.scheduler.restart()?;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("scheduler killed {crashes} times between the forge's reply and the PubAck");
    assert!(crashes >= crashes_wanted.min(1), "the fault hook fired");
    let snapshot = system.forge.snapshot();
    let failed = jobs_not_succeeded(&snapshot);
    assert!(failed.is_empty(), "jobs lost or failed: {failed:?}");
    assert!(
        snapshot.jobs.iter().all(|j| j.task_ids.len() == 1),
        "every job ran as the one task the forge handed out"
    );
    assert!(snapshot.faults.replayed_request_keys >= 1);
    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_cancelled_while_it_waits_never_runs() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 1,
        vm_capacity: 1,
        keepalive: Duration::from_secs(1),
        ..Default::default()
    })
    .await?;
    // One long job holds the only pod slot; the next two wait in JetStream (lookahead 2).
    let long = system.enqueue_ids("pod", 1, &[("JR_FAKE_DURATION_MS", "6000")]);
    let waiting = system.enqueue_ids("pod", 2, &[("JR_FAKE_DURATION_MS", "100")]);
    let snapshot = system
        .forge
        .wait_until(
            |s| {
                waiting
                    .iter()
                    .all(|j| s.job(*j).is_some_and(|v| !v.task_ids.is_empty()))
            },
            Duration::from_secs(30),
        )
        .await?;
    assert!(
        snapshot
            .job(long[0])
            .is_some_and(|j| j.status == Status::Running)
    );
    let cancelled_task = snapshot.job(waiting[0]).expect("job").task_ids[0];
    assert!(system.forge.cancel_task(cancelled_task));
    if let Err(e) = system.wait_all_final(Duration::from_secs(90)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    system.wait_no_workloads(Duration::from_secs(30)).await?;
    let snapshot = system.forge.snapshot();
    let task = snapshot.task(cancelled_task).expect("task");
    assert!(
        task.final_reports.is_empty() && task.log.is_empty() && task.outputs.is_empty(),
        "the forge recorded something after the cancel: {task:?}"
    );
    let id = AssignmentId::for_task(system.forge.url().trim_end_matches('/'), cancelled_task);
    let created = system.kube.records().created;
    let pods: Vec<_> = created
        .iter()
        .filter(|n| n.contains(&id.to_string()))
        .collect();
    assert!(
        pods.is_empty(),
        "a workload was created for the withdrawn assignment: {pods:?}"
    );
    let other = snapshot.job(waiting[1]).expect("job");
    assert_eq!(other.status, Status::Done(Outcome::Success));
    Ok(())
}
