//! The reconciler's decisions, seen from outside on the whole system: retry of workloads that
//! fail before their executor claims the task, failure of work lost after the claim, orphan
//! cleanup, cancellation, and the projection (equal to the streams' fold, rebuilt identically
//! from the streams, caught up after a Postgres outage). Needs the service binaries built
//! (`cargo build --bins -p scheduler -p pod-worker -p vm-worker -p reconciler`); run with
//! `--test-threads=1`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use jr_fake_forge::{JobSpec, Outcome, Snapshot, Status, StopCause, TaskView};
use jr_fake_kube::{Fault, FaultRule, PodSelector};
use jr_scenarios::chaos::respawn_with_env;
use jr_scenarios::consistency::{
    check_projection, json_differences, settled_dump, wait_projection_settled,
};
use jr_scenarios::system::JOBS_NAMESPACE;
use jr_scenarios::{System, SystemSpec};
use jr_store::{AssignmentRecord, AssignmentState, Store};

/// Fails with the services' logs attached.
fn fail(system: &mut System, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{what}\n{}", system.logs())
}

/// Every job final, no workload left, and the projection has seen it all.
async fn wait_done(system: &mut System, final_within: Duration) -> anyhow::Result<Snapshot> {
    let snapshot = match system.wait_all_final(final_within).await {
        Ok(s) => s,
        Err(e) => return Err(fail(system, e)),
    };
    if let Err(e) = system.wait_no_workloads(Duration::from_secs(60)).await {
        return Err(fail(system, e));
    }
    if let Err(e) = wait_projection_settled(&system.database_url, Duration::from_secs(30)).await {
        return Err(fail(system, e));
    }
    Ok(snapshot)
}

fn assert_no_violations(system: &mut System) {
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
}

/// Attempts of the jetrunner Pods ever created, per assignment id (Pod names are
/// `jr-<assignment>-<attempt>`).
fn pod_attempts(system: &System) -> BTreeMap<String, Vec<u32>> {
    let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for name in system.kube.records().created {
        let name = name.rsplit('/').next().unwrap_or_default();
        let Some((rest, attempt)) = name.strip_prefix("jr-").and_then(|n| n.rsplit_once('-'))
        else {
            continue;
        };
        if let Ok(attempt) = attempt.parse() {
            out.entry(rest.to_owned()).or_default().push(attempt);
        }
    }
    out
}

async fn records(system: &System) -> anyhow::Result<Vec<AssignmentRecord>> {
    Ok(Store::connect(&system.database_url)
        .await?
        .records()
        .await?)
}

async fn assert_consistent(
    system: &mut System,
) -> anyhow::Result<jr_scenarios::consistency::ConsistencyReport> {
    let report = match check_projection(
        &system.nats.url(),
        &system.database_url,
        Duration::from_secs(30),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return Err(fail(system, e)),
    };
    assert!(
        report.is_consistent(),
        "projection differs from the streams: {:#?}",
        report.differences
    );
    Ok(report)
}

fn task_of<'a>(snapshot: &'a Snapshot, job_name: &str) -> &'a TaskView {
    let job = snapshot
        .jobs
        .iter()
        .find(|j| j.name == job_name)
        .expect("job enqueued");
    let id = *job.task_ids.last().expect("job was fetched");
    snapshot.task(id).expect("task exists")
}

fn enqueue_named(system: &System, name: &str, label: &str, vars: &[(&str, &str)]) {
    system.forge.enqueue_job(JobSpec {
        repo: "acme/widgets".into(),
        name: name.into(),
        runs_on: vec![label.into()],
        vars: vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        steps: 2,
        ..Default::default()
    });
}

/// Waits until the executor of `job_name` is running (its task has sent a heartbeat).
async fn wait_executor_running(
    system: &mut System,
    job_name: &str,
    timeout: Duration,
) -> anyhow::Result<i64> {
    let deadline = Instant::now() + timeout;
    loop {
        let snapshot = system.forge.snapshot();
        if let Some(job) = snapshot.jobs.iter().find(|j| j.name == job_name)
            && let Some(task) = job.task_ids.last().and_then(|id| snapshot.task(*id))
            && task.status == Status::Running
            && task.heartbeats > 0
        {
            return Ok(task.id);
        }
        if Instant::now() > deadline {
            return Err(fail(
                system,
                format!("{job_name}: no running executor after {timeout:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_failing_before_start_are_redispatched_and_the_jobs_succeed() -> anyhow::Result<()> {
    let fault = FaultRule {
        max_times: Some(2),
        ..FaultRule::always(PodSelector::Any, Fault::FailBeforeStart)
    };
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        kube_faults: vec![fault],
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", 4, &[("JR_FAKE_DURATION_MS", "200")]);
    let snapshot = wait_done(&mut system, Duration::from_secs(90)).await?;

    for job in &snapshot.jobs {
        assert_eq!(
            job.status,
            Status::Done(Outcome::Success),
            "job {} ended {:?}",
            job.id,
            job.status
        );
    }
    let attempts = pod_attempts(&system);
    assert_eq!(attempts.len(), 4, "one assignment per job: {attempts:?}");
    let retried: Vec<_> = attempts.iter().filter(|(_, a)| a.len() > 1).collect();
    assert_eq!(
        retried.len(),
        2,
        "the two Pods that failed to start were replaced: {attempts:?}"
    );
    for (_, a) in &retried {
        assert_eq!(
            **a,
            vec![1, 2],
            "attempt 2 replaces attempt 1: {attempts:?}"
        );
    }

    assert_consistent(&mut system).await?;
    for record in records(&system).await? {
        assert_eq!(record.state(), AssignmentState::Completed, "{record:#?}");
        let claim = record.claim.as_ref().expect("claimed");
        let id = record.id.to_string();
        if attempts[&id].len() == 2 {
            assert_eq!(claim.attempt, 2, "the replacement's executor ran the task");
            let redispatch = record.redispatches.get(&2).expect("attempt 2 announced");
            assert!(
                redispatch.reason.contains("start-failed"),
                "reason names the failure: {redispatch:?}"
            );
        } else {
            assert_eq!(claim.attempt, 1);
            assert!(record.redispatches.is_empty());
        }
    }
    assert_no_violations(&mut system);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_that_never_starts_fails_the_task_after_max_attempts() -> anyhow::Result<()> {
    let fault = FaultRule::always(PodSelector::Any, Fault::FailBeforeStart);
    let mut system = System::start(SystemSpec {
        max_attempts: 2,
        kube_faults: vec![fault],
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", 1, &[]);
    let snapshot = wait_done(&mut system, Duration::from_secs(60)).await?;

    let task = &snapshot.tasks[0];
    assert_eq!(snapshot.jobs[0].status, Status::Done(Outcome::Failure));
    assert_eq!(
        task.stop_cause,
        Some(StopCause::Runner),
        "jetrunner reported the failure"
    );
    assert_eq!(task.heartbeats, 0, "no executor ever ran");
    assert!(
        task.log.iter().any(|l| l.starts_with("jetrunner:")
            && l.contains("attempts-exhausted (2)")
            && l.contains("start-failed")),
        "log explains: {:?}",
        task.log
    );
    let attempts: Vec<Vec<u32>> = pod_attempts(&system).into_values().collect();
    assert_eq!(attempts, vec![vec![1, 2]], "exactly max_attempts Pods");
    assert_consistent(&mut system).await?;
    let records = records(&system).await?;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].state(), AssignmentState::Failed);
    assert_no_violations(&mut system);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn work_lost_after_the_claim_fails_the_task_within_the_timeouts() -> anyhow::Result<()> {
    let evict = FaultRule {
        max_times: Some(1),
        ..FaultRule::always(
            PodSelector::Any,
            Fault::Evict {
                after: Duration::from_secs(3),
            },
        )
    };
    let mut system = System::start(SystemSpec {
        kube_faults: vec![evict],
        ..Default::default()
    })
    .await?;
    let started = Instant::now();
    // Long jobs: without jetrunner noticing, they would stay running at the forge until its
    // 10-minute zombie reaper.
    enqueue_named(
        &system,
        "evicted-pod",
        "pod",
        &[("JR_FAKE_DURATION_MS", "60000")],
    );
    enqueue_named(
        &system,
        "crashed-vm",
        "vm",
        &[("JR_FAKE_DURATION_MS", "60000")],
    );
    wait_executor_running(&mut system, "crashed-vm", Duration::from_secs(30)).await?;
    let sandboxes = system.sandbox.sandboxes();
    assert_eq!(sandboxes.len(), 1);
    assert!(
        system
            .sandbox
            .fail_sandbox(&sandboxes[0].id, "SimulatedCrash")
    );

    let snapshot = wait_done(&mut system, Duration::from_secs(60)).await?;
    let elapsed = started.elapsed();
    let spec = &system.spec;
    assert!(
        elapsed < spec.claim_timeout + spec.lost_timeout + Duration::from_secs(10),
        "lost work noticed in {elapsed:?}"
    );
    for name in ["evicted-pod", "crashed-vm"] {
        let task = task_of(&snapshot, name);
        assert_eq!(
            task.status,
            Status::Done(Outcome::Failure),
            "{name}: {task:#?}"
        );
        assert_eq!(
            task.stop_cause,
            Some(StopCause::Runner),
            "{name}: reported by jetrunner, not reaped"
        );
        assert!(
            task.heartbeats > 0,
            "{name}: the executor had claimed and run the task"
        );
        assert_eq!(task.final_accepted, 1);
        let explained = task
            .log
            .iter()
            .find(|l| l.starts_with("jetrunner:") && l.contains("lost-after-claim"));
        assert!(
            explained.is_some(),
            "{name}: log explains the loss: {:?}",
            task.log
        );
        if name == "evicted-pod" {
            assert!(
                explained.is_some_and(|l| l.contains("evicted")),
                "{name}: {explained:?}"
            );
        }
    }
    assert_consistent(&mut system).await?;
    for record in records(&system).await? {
        assert_eq!(record.state(), AssignmentState::Failed, "{record:#?}");
        assert!(
            record
                .failure
                .as_ref()
                .is_some_and(|f| f.reason.starts_with("lost-after-claim")),
            "{record:#?}"
        );
        assert!(
            record.redispatches.is_empty(),
            "claimed work is never redispatched"
        );
    }
    assert_no_violations(&mut system);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orphan_pods_are_deleted_and_cancelled_jobs_cleaned_up() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec::default()).await?;
    let grace = Duration::from_secs(3);
    respawn_with_env(
        &mut system,
        "reconciler",
        &[("JETRUNNER__RECONCILER__ORPHAN_GRACE", "3s")],
    )
    .await?;
    // The worker announces a workload no create of its own made only after its stray grace.
    respawn_with_env(
        &mut system,
        "pod-worker",
        &[("JETRUNNER__POD_WORKER__STRAY_GRACE", "2s")],
    )
    .await?;

    system.enqueue("pod", 3, &[("JR_FAKE_DURATION_MS", "3000")]);
    enqueue_named(
        &system,
        "cancel-me",
        "pod",
        &[("JR_FAKE_DURATION_MS", "60000")],
    );

    // An orphan: a Pod with jetrunner's labels for an assignment jetrunner never had, kept
    // Running (its simulated kubelet is stopped by `mark_running`).
    let orphan_id = random_uuid();
    let orphan = format!("jr-{orphan_id}-1");
    let pod = serde_json::json!({
        "metadata": {"name": orphan, "labels": {
            "app.kubernetes.io/managed-by": "jetrunner",
            "jetrunner.dev/backend": "pod",
            "jetrunner.dev/assignment": orphan_id,
            "jetrunner.dev/attempt": "1",
        }},
        "spec": {"containers": [{"name": "runner", "image": "someone/else:latest"}]},
    });
    system.kube.create_pod(JOBS_NAMESPACE, pod)?;
    let created = Instant::now();
    system.kube.mark_running(JOBS_NAMESPACE, &orphan)?;

    let task_id = wait_executor_running(&mut system, "cancel-me", Duration::from_secs(30)).await?;
    assert!(system.forge.cancel_task(task_id), "the task was running");
    let cancelled = Instant::now();

    let deadline = Instant::now() + Duration::from_secs(30);
    while system.kube.pod(JOBS_NAMESPACE, &orphan).is_some() {
        if Instant::now() > deadline {
            return Err(fail(&mut system, "orphan Pod not deleted within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let orphan_lived = created.elapsed();
    assert!(
        orphan_lived >= grace,
        "orphan deleted after {orphan_lived:?}, before its grace of {grace:?}"
    );

    let snapshot = wait_done(&mut system, Duration::from_secs(60)).await?;
    let cleaned_in = cancelled.elapsed();
    assert!(
        cleaned_in < Duration::from_secs(30),
        "cancelled job's Pod gone {cleaned_in:?} after the cancel (job would run 60 s)"
    );
    let cancel = task_of(&snapshot, "cancel-me");
    assert_eq!(cancel.status, Status::Done(Outcome::Cancelled));
    assert_eq!(cancel.stop_cause, Some(StopCause::Cancelled));
    for job in snapshot.jobs.iter().filter(|j| j.name != "cancel-me") {
        assert_eq!(
            job.status,
            Status::Done(Outcome::Success),
            "other jobs are untouched"
        );
    }

    assert_consistent(&mut system).await?;
    let records = records(&system).await?;
    let orphan_record = records
        .iter()
        .find(|r| r.id.to_string() == orphan_id)
        .expect("the orphan was projected");
    assert!(orphan_record.info.is_none(), "never an assignment of ours");
    assert!(
        orphan_record
            .workloads
            .values()
            .all(|w| w.released_at.is_some()),
        "{orphan_record:#?}"
    );
    assert!(
        orphan_record.redispatches.is_empty() && orphan_record.failure.is_none(),
        "orphans are only deleted"
    );
    for record in records.iter().filter(|r| r.info.is_some()) {
        assert!(record.state().is_finished(), "{record:#?}");
    }
    assert_no_violations(&mut system);
    Ok(())
}

/// A random version-4 UUID in text form.
fn random_uuid() -> String {
    let n: u128 = rand::random();
    let hex = format!("{n:032x}");
    format!(
        "{}-{}-4{}-8{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[17..20],
        &hex[20..32]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_projection_equals_the_streams_and_rebuilds_identically() -> anyhow::Result<()> {
    let fault = FaultRule {
        max_times: Some(2),
        ..FaultRule::always(PodSelector::Any, Fault::FailBeforeStart)
    };
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 3,
        kube_faults: vec![fault],
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", 10, &[("JR_FAKE_DURATION_MS", "300")]);
    system.enqueue(
        "pod",
        2,
        &[
            ("JR_FAKE_DURATION_MS", "300"),
            ("JR_FAKE_OUTCOME", "failure"),
        ],
    );
    system.enqueue("vm", 6, &[("JR_FAKE_DURATION_MS", "300")]);
    wait_done(&mut system, Duration::from_secs(120)).await?;

    let report = assert_consistent(&mut system).await?;
    assert_eq!(report.assignments, 18);
    let before = settled_dump(
        &system.nats.url(),
        &system.database_url,
        Duration::from_secs(30),
    )
    .await?;
    assert_eq!(before["assignments"].as_array().map(Vec::len), Some(18));
    assert_eq!(before["redispatches"].as_array().map(Vec::len), Some(2));

    // Drop the projection and let a fresh reconciler replay both streams.
    system.reconciler.kill9();
    Store::connect(&system.database_url).await?.reset().await?;
    let empty = Store::connect(&system.database_url)
        .await?
        .dump_rows()
        .await?;
    assert_eq!(
        empty["assignments"].as_array().map(Vec::len),
        Some(0),
        "reset emptied the projection"
    );
    system.reconciler.restart()?;
    if let Err(e) = system.reconciler.wait_ready(Duration::from_secs(60)).await {
        return Err(fail(&mut system, e));
    }
    let after = settled_dump(
        &system.nats.url(),
        &system.database_url,
        Duration::from_secs(30),
    )
    .await?;
    let differences = json_differences(&before, &after, 20);
    let rows = |d: &serde_json::Value| -> Vec<String> {
        differences
            .iter()
            .filter_map(|p| {
                p.strip_prefix(".assignments[")
                    .and_then(|r| r.split(']').next())
                    .and_then(|i| i.parse::<usize>().ok())
            })
            .map(|i| d["assignments"][i].to_string())
            .collect()
    };
    assert!(
        before == after,
        "rebuilt projection differs: {differences:#?}\nbefore: {:#?}\nafter: {:#?}",
        rows(&before),
        rows(&after)
    );
    assert_no_violations(&mut system);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_projection_catches_up_after_a_postgres_outage() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 6,
        vm_capacity: 3,
        ..Default::default()
    })
    .await?;
    // Staggered durations, so that whenever Postgres goes down some executors are mid-job.
    for ms in ["1000", "2000", "3000", "4000"] {
        system.enqueue("pod", 4, &[("JR_FAKE_DURATION_MS", ms)]);
    }
    for ms in ["1500", "3000"] {
        system.enqueue("vm", 4, &[("JR_FAKE_DURATION_MS", ms)]);
    }
    let final_count = |system: &System| {
        system
            .forge
            .snapshot()
            .jobs
            .iter()
            .filter(|j| j.status.is_final())
            .count()
    };
    let executing = |system: &System| {
        system
            .forge
            .snapshot()
            .tasks
            .iter()
            .any(|t| t.status == Status::Running && t.heartbeats > 0)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while final_count(&system) < 3 || !executing(&system) {
        if Instant::now() > deadline {
            return Err(fail(&mut system, "never 3 jobs final while others run"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    system.pg.kill()?;
    let at_kill = final_count(&system);
    // The outage itself: ~10 s in which workers and executors keep publishing.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = final_count(&system) - at_kill;
    system.pg.start_server().await?;
    assert!(during > 0, "jobs kept finishing without the projection");

    wait_done(&mut system, Duration::from_secs(120)).await?;
    assert!(
        system.reconciler.exited().is_none(),
        "the same reconciler process caught up"
    );
    let report = assert_consistent(&mut system).await?;
    assert_eq!(report.assignments, 24);
    for record in records(&system).await? {
        assert!(record.state().is_finished(), "{record:#?}");
    }
    assert_no_violations(&mut system);
    Ok(())
}

/// A worker that starts compares the projection's live workloads of its backend with what the
/// backend lists and reports the missing ones gone and released; the planner then fails the
/// claimed task instead of leaving it to the forge's 10-minute zombie reaper.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_deleted_while_its_worker_is_down_fails_the_task() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec::default()).await?;
    enqueue_named(
        &system,
        "vanishing",
        "pod",
        &[("JR_FAKE_DURATION_MS", "60000")],
    );
    wait_executor_running(&mut system, "vanishing", Duration::from_secs(30)).await?;
    system.pod_worker.kill9();
    let pods = system.kube.pods(JOBS_NAMESPACE);
    let name = pods[0]
        .pointer("/metadata/name")
        .and_then(|v| v.as_str())
        .expect("Pod name")
        .to_owned();
    system.kube.delete_pod(JOBS_NAMESPACE, &name)?;
    system.pod_worker.restart()?;
    system
        .pod_worker
        .wait_ready(Duration::from_secs(30))
        .await?;

    let snapshot = wait_done(&mut system, Duration::from_secs(45)).await?;
    let task = task_of(&snapshot, "vanishing");
    assert_eq!(task.status, Status::Done(Outcome::Failure));
    assert!(
        task.log
            .iter()
            .any(|l| l.starts_with("jetrunner:") && l.contains("lost-after-claim")),
        "{:?}",
        task.log
    );
    assert_no_violations(&mut system);
    Ok(())
}
