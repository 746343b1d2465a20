//! Backend isolation with the whole system: one backend's trouble never stalls the other's work,
//! with a registration per backend and with one existing runner shared by both backends, on
//! Gitea and on Forgejo.
//!
//! - The pod-worker is SIGKILLed while Pod and VM jobs wait at the forge and stays down for a
//!   minute: every VM job still becomes final before the pod-worker comes back (a shared
//!   registration must stop asking the forge for Pod jobs instead of pausing altogether), and
//!   after the restart every Pod job succeeds. The forge's zombie reaper runs at 20 s, so a task
//!   fetched and then left without heartbeats during the outage would be failed by it: none is.
//! - Only the pod-worker is deployed although the VM backend is configured: Pod jobs succeed
//!   within a deadline, and VM jobs simply wait at the forge (never handed out, so never reaped).
//!
//! Every run ends with every job it expects to finish succeeded, no task reaped by the forge
//! (zombie or endless), no workload left and no end invariant violated. Needs
//! `cargo build --workspace --bins` first.

use std::time::{Duration, Instant};

use jr_fake_forge::{JobId, Outcome, Snapshot, Status, StopCause};
use jr_scenarios::{System, SystemSpec};

/// Whether the scheduler's `/readyz` details, its metric `jetrunner_scheduler_backend_blocked`
/// and the reconciler's status API all say that `registration` takes no work for the Pod
/// backend because it has no live worker.
async fn no_worker_signalled(system: &System, registration: &str) -> bool {
    let get = |url: String| async move {
        match reqwest::get(&url).await {
            Ok(response) => response.text().await.ok(),
            Err(_) => None,
        }
    };
    let ops = system.ports.scheduler_ops;
    let ready = get(format!("http://127.0.0.1:{ops}/readyz")).await;
    let readyz = ready
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| {
            v["details"][format!("intake.{registration}")]
                .as_str()
                .map(str::to_owned)
        })
        .is_some_and(|d| d.contains("backend pod") && d.contains("no live worker"));
    let metric = format!(
        "jetrunner_scheduler_backend_blocked{{registration=\"{registration}\",backend=\"pod\",reason=\"no-worker\"}} 1"
    );
    let metrics = get(format!("http://127.0.0.1:{ops}/metrics"))
        .await
        .is_some_and(|text| text.lines().any(|l| l == metric));
    let status = get(format!(
        "http://127.0.0.1:{}/api/status",
        system.ports.status
    ))
    .await
    .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
    .is_some_and(|v| {
        v["intakes"].as_array().is_some_and(|intakes| {
            intakes.iter().any(|i| {
                i["registration"] == registration
                    && i["backends"].as_array().is_some_and(|b| {
                        b.iter()
                            .any(|b| b["backend"] == "pod" && b["blocked"] == "no-worker")
                    })
            })
        })
    });
    readyz && metrics && status
}

/// How the scheduler is registered at the forge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// One runner per backend, registered by the scheduler (the default).
    PerBackend,
    /// One runner for both backends from an existing runner's uuid and token (the migration
    /// path): the forge may hand out a job of either backend to every fetch unless the scheduler
    /// withdraws a backend's labels.
    SharedPremade,
}

const POD_CAPACITY: usize = 3;
const VM_CAPACITY: usize = 2;
const LOOKAHEAD: usize = 2;
/// The forge fails a running task without a heartbeat for this long.
const ZOMBIE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the pod-worker stays down.
const OUTAGE: Duration = Duration::from_secs(60);

fn forge_name(forgejo: bool) -> &'static str {
    if forgejo { "Forgejo" } else { "Gitea" }
}

/// Capacity 3 Pods and 2 VMs, lookahead 2, the forge's zombie reaper at 20 s and heartbeats of
/// fetched-but-unclaimed tasks every 5 s.
fn spec(layout: Layout, forgejo: bool, no_vm_worker: bool) -> SystemSpec {
    SystemSpec {
        pod_capacity: POD_CAPACITY,
        vm_capacity: VM_CAPACITY,
        vm_pool: Some(VM_CAPACITY + 2),
        lookahead: LOOKAHEAD,
        forge_flavor: if forgejo { "forgejo" } else { "gitea" },
        task_capacity: if forgejo { 3 } else { 1 },
        forge_behaviour: jr_fake_forge::Behaviour {
            zombie_timeout: ZOMBIE_TIMEOUT,
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
        no_vm_worker,
        ..Default::default()
    }
}

/// How many of `jobs` are final in `snapshot`.
fn final_among(snapshot: &Snapshot, jobs: &[JobId]) -> usize {
    jobs.iter()
        .filter(|id| snapshot.job(**id).is_some_and(|j| j.status.is_final()))
        .count()
}

/// How many of `jobs` the forge has not handed out to any runner yet.
fn never_handed_out(snapshot: &Snapshot, jobs: &[JobId]) -> usize {
    jobs.iter()
        .filter(|id| {
            snapshot
                .job(**id)
                .is_some_and(|j| j.status == Status::Waiting && j.task_ids.is_empty())
        })
        .count()
}

/// Tasks the forge's reapers failed (no heartbeat for the zombie timeout, or running too long).
fn reaped(snapshot: &Snapshot) -> Vec<i64> {
    snapshot
        .tasks
        .iter()
        .filter(|t| matches!(t.stop_cause, Some(StopCause::Zombie | StopCause::Endless)))
        .map(|t| t.id)
        .collect()
}

/// Each live runner's name and the labels it has declared to the forge.
fn runner_labels(snapshot: &Snapshot) -> Vec<(String, Vec<String>)> {
    snapshot
        .runners
        .iter()
        .filter(|r| !r.deleted)
        .map(|r| (r.name.clone(), r.labels.clone()))
        .collect()
}

/// Those of `jobs` whose status is anything but success, with that status.
fn not_succeeded(snapshot: &Snapshot, jobs: &[JobId]) -> Vec<(JobId, Option<Status>)> {
    jobs.iter()
        .map(|id| (*id, snapshot.job(*id).map(|j| j.status)))
        .filter(|(_, status)| *status != Some(Status::Done(Outcome::Success)))
        .collect()
}

/// 12 Pod jobs of 2 s and 30 VM jobs of 1 s, queued at the forge as one Pod job then two VM
/// jobs, six VM jobs last. Once the first jobs of both kinds are done (Pod jobs are left at the
/// forge), the pod-worker is SIGKILLed and restarted 60 s later. Every VM job is final before
/// the restart; after it every Pod job succeeds; nothing is reaped, no invariant is broken and
/// no workload is left.
async fn pod_worker_outage(layout: Layout, forgejo: bool) -> anyhow::Result<()> {
    let mut system = System::start(spec(layout, forgejo, false)).await?;
    let started = Instant::now();
    let (mut pod_jobs, mut vm_jobs) = (Vec::new(), Vec::new());
    for _ in 0..12 {
        pod_jobs.extend(system.enqueue_ids("pod", 1, &[("JR_FAKE_DURATION_MS", "2000")]));
        vm_jobs.extend(system.enqueue_ids("vm", 2, &[("JR_FAKE_DURATION_MS", "1000")]));
    }
    vm_jobs.extend(system.enqueue_ids("vm", 6, &[("JR_FAKE_DURATION_MS", "1000")]));

    // The system runs: Pods and VMs have completed jobs.
    let running = system
        .forge
        .wait_until(
            |s| final_among(s, &pod_jobs) >= 1 && final_among(s, &vm_jobs) >= 2,
            Duration::from_secs(90),
        )
        .await;
    let at_kill = match running {
        Ok(snapshot) => snapshot,
        Err(e) => anyhow::bail!("no Pod and VM jobs done: {e}\n{}", system.logs()),
    };
    system.pod_worker.kill9();
    let killed = Instant::now();
    let before = killed.duration_since(started);
    let vm_at_kill = final_among(&at_kill, &vm_jobs);
    let pod_at_kill = final_among(&at_kill, &pod_jobs);
    let pod_left_at_forge = never_handed_out(&at_kill, &pod_jobs);
    println!(
        "{layout:?} on {}: pod-worker killed after {:.1} s with {vm_at_kill}/{} VM jobs final \
         ({:.2}/s), {pod_at_kill}/{} Pod jobs final, {pod_left_at_forge} Pod jobs not handed out",
        forge_name(forgejo),
        before.as_secs_f64(),
        vm_jobs.len(),
        vm_at_kill as f64 / before.as_secs_f64(),
        pod_jobs.len(),
    );
    anyhow::ensure!(
        pod_left_at_forge > 0,
        "every Pod job was handed out before the kill: the outage would test nothing"
    );

    // The outage: the pod-worker stays down for a minute; VM jobs are sampled meanwhile, and
    // so is what the system says about the Pod backend.
    let registration = match layout {
        Layout::PerBackend => "pod",
        Layout::SharedPremade => "shared",
    };
    let mut vm_all_final_after: Option<Duration> = None;
    let mut signalled_after: Option<Duration> = None;
    while killed.elapsed() < OUTAGE {
        if vm_all_final_after.is_none()
            && final_among(&system.forge.snapshot(), &vm_jobs) == vm_jobs.len()
        {
            vm_all_final_after = Some(killed.elapsed());
        }
        if signalled_after.is_none() && no_worker_signalled(&system, registration).await {
            signalled_after = Some(killed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let Some(signalled_after) = signalled_after else {
        anyhow::bail!(
            "the Pod backend without a worker was not reported in /readyz, the metrics and the \
             status API during the outage\n{}",
            system.logs()
        );
    };
    println!(
        "{layout:?} on {}: the missing pod worker was reported {:.1} s after the kill",
        forge_name(forgejo),
        signalled_after.as_secs_f64()
    );
    let at_restart = system.forge.snapshot();
    let vm_at_restart = final_among(&at_restart, &vm_jobs);
    let pod_at_restart = final_among(&at_restart, &pod_jobs);
    let vm_during = vm_at_restart - vm_at_kill;
    println!(
        "{layout:?} on {}: during the {} s outage {vm_during} VM jobs became final{}; \
         {vm_at_restart}/{} VM jobs final at the restart; {pod_at_restart}/{} Pod jobs final",
        forge_name(forgejo),
        OUTAGE.as_secs(),
        match vm_all_final_after {
            Some(d) => format!(
                ", the last {:.1} s after the kill ({:.2}/s)",
                d.as_secs_f64(),
                vm_during as f64 / d.as_secs_f64()
            ),
            None => format!(" ({:.2}/s)", vm_during as f64 / OUTAGE.as_secs_f64()),
        },
        vm_jobs.len(),
        pod_jobs.len(),
    );
    system.pod_worker.restart()?;
    let restarted = Instant::now();
    if vm_at_restart < vm_jobs.len() {
        anyhow::bail!(
            "only {vm_at_restart} of {} VM jobs final after the pod-worker was down {} s \
             ({vm_during} during the outage, {} still waiting at the forge; runners {:?}): the \
             VM backend stalled with the Pod backend\n{}",
            vm_jobs.len(),
            OUTAGE.as_secs(),
            never_handed_out(&at_restart, &vm_jobs),
            runner_labels(&at_restart),
            system.logs()
        );
    }
    if let Err(e) = system.pod_worker.wait_ready(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    if let Err(e) = system
        .wait_jobs_final(&pod_jobs, Duration::from_secs(120))
        .await
    {
        anyhow::bail!("Pod jobs after the restart: {e}\n{}", system.logs());
    }
    let pods_after = restarted.elapsed();
    if let Err(e) = system.wait_all_final(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    let reaped = reaped(&snapshot);
    println!(
        "{layout:?} on {}: every Pod job final {:.1} s after the restart; {} reaped; \
         zombie timeout {} s",
        forge_name(forgejo),
        pods_after.as_secs_f64(),
        reaped.len(),
        ZOMBIE_TIMEOUT.as_secs(),
    );
    assert!(
        reaped.is_empty(),
        "{} tasks failed by the forge's reaper: {reaped:?}",
        reaped.len()
    );
    let all: Vec<JobId> = snapshot.jobs.iter().map(|j| j.id).collect();
    let failed = not_succeeded(&snapshot, &all);
    assert!(failed.is_empty(), "jobs not succeeded: {failed:?}");
    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:?}");
    Ok(())
}

/// No vm-worker is ever started, the VM backend stays configured. Two VM jobs and four Pod jobs
/// of 1 s are queued (a VM job first): the Pod jobs succeed within 30 s of being queued, the VM
/// jobs are never handed out (watched for 3 s more), nothing is reaped and no Pod work is left.
async fn pod_worker_alone(layout: Layout, forgejo: bool) -> anyhow::Result<()> {
    const POD_DEADLINE: Duration = Duration::from_secs(30);
    const WATCH_AFTER: Duration = Duration::from_secs(3);
    let mut system = System::start(spec(layout, forgejo, true)).await?;
    let started = Instant::now();
    let (mut pod_jobs, mut vm_jobs) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        vm_jobs.extend(system.enqueue_ids("vm", 1, &[("JR_FAKE_DURATION_MS", "1000")]));
        pod_jobs.extend(system.enqueue_ids("pod", 2, &[("JR_FAKE_DURATION_MS", "1000")]));
    }
    // Sampled until the Pod jobs are final and a little longer: no VM job is handed out.
    let mut pods_final_after: Option<Duration> = None;
    let mut vm_handed_out = 0;
    loop {
        let snapshot = system.forge.snapshot();
        vm_handed_out = vm_handed_out.max(vm_jobs.len() - never_handed_out(&snapshot, &vm_jobs));
        match pods_final_after {
            None if final_among(&snapshot, &pod_jobs) == pod_jobs.len() => {
                pods_final_after = Some(started.elapsed());
            }
            None if started.elapsed() > POD_DEADLINE => anyhow::bail!(
                "{} of {} Pod jobs final {} s after they were queued with no vm-worker \
                 ({} not handed out; runners {:?})\n{}",
                final_among(&snapshot, &pod_jobs),
                pod_jobs.len(),
                POD_DEADLINE.as_secs(),
                never_handed_out(&snapshot, &pod_jobs),
                runner_labels(&snapshot),
                system.logs()
            ),
            Some(at) if started.elapsed() >= at + WATCH_AFTER => break,
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snapshot = system.forge.snapshot();
    let reaped = reaped(&snapshot);
    let labels = runner_labels(&snapshot);
    println!(
        "{layout:?} on {}, no vm-worker: {} Pod jobs final after {:.1} s; {} VM jobs waiting at \
         the forge, {vm_handed_out} handed out; {} reaped; runners {labels:?}",
        forge_name(forgejo),
        pod_jobs.len(),
        pods_final_after.unwrap_or_default().as_secs_f64(),
        never_handed_out(&snapshot, &vm_jobs),
        reaped.len(),
    );
    assert!(
        reaped.is_empty(),
        "{} tasks failed by the forge's reaper: {reaped:?}",
        reaped.len()
    );
    let failed = not_succeeded(&snapshot, &pod_jobs);
    assert!(failed.is_empty(), "Pod jobs not succeeded: {failed:?}");
    assert_eq!(
        vm_handed_out, 0,
        "VM jobs were handed out with no vm-worker to run them"
    );
    system.wait_no_workloads(Duration::from_secs(30)).await?;
    // The VM jobs are expected to wait, unfetched: only their own entries are left out.
    let waiting: Vec<String> = vm_jobs.iter().map(|id| format!("job {id:?} ")).collect();
    let violations: Vec<String> = system
        .violations()
        .into_iter()
        .filter(|v| !waiting.iter().any(|w| v.starts_with(w)))
        .collect();
    assert!(violations.is_empty(), "{violations:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_jobs_keep_completing_while_the_pod_worker_is_down_for_a_minute_with_a_registration_per_backend_on_gitea()
-> anyhow::Result<()> {
    pod_worker_outage(Layout::PerBackend, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_jobs_keep_completing_while_the_pod_worker_is_down_for_a_minute_with_a_registration_per_backend_on_forgejo()
-> anyhow::Result<()> {
    pod_worker_outage(Layout::PerBackend, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_jobs_keep_completing_while_the_pod_worker_is_down_for_a_minute_with_an_existing_shared_runner_on_gitea()
-> anyhow::Result<()> {
    pod_worker_outage(Layout::SharedPremade, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_jobs_keep_completing_while_the_pod_worker_is_down_for_a_minute_with_an_existing_shared_runner_on_forgejo()
-> anyhow::Result<()> {
    pod_worker_outage(Layout::SharedPremade, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_jobs_succeed_with_only_the_pod_worker_deployed_and_a_registration_per_backend_on_gitea()
-> anyhow::Result<()> {
    pod_worker_alone(Layout::PerBackend, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_jobs_succeed_with_only_the_pod_worker_deployed_and_a_registration_per_backend_on_forgejo()
-> anyhow::Result<()> {
    pod_worker_alone(Layout::PerBackend, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_jobs_succeed_with_only_the_pod_worker_deployed_and_an_existing_shared_runner_on_gitea()
-> anyhow::Result<()> {
    pod_worker_alone(Layout::SharedPremade, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_jobs_succeed_with_only_the_pod_worker_deployed_and_an_existing_shared_runner_on_forgejo()
-> anyhow::Result<()> {
    pod_worker_alone(Layout::SharedPremade, true).await
}
