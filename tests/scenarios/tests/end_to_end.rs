//! Full-system scenarios: the four service binaries, real NATS and PostgreSQL, fake forge and
//! backends. Needs `cargo build --workspace --bins` first (the README's test command does it).

use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_pod_and_vm_jobs_all_finish_once_and_leave_nothing_behind() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 3,
        ..Default::default()
    })
    .await?;
    system.enqueue(
        "pod",
        20,
        &[
            ("JR_FAKE_DURATION_MS", "200"),
            ("JR_FAKE_OUTPUTS", "artifact=built,sha=abc"),
        ],
    );
    system.enqueue(
        "vm",
        10,
        &[
            ("JR_FAKE_DURATION_MS", "200"),
            ("JR_FAKE_OUTCOME", "failure"),
        ],
    );
    let done = system.wait_all_final(Duration::from_secs(120)).await;
    if let Err(e) = done {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    if let Err(e) = system.wait_no_workloads(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    let failures = snapshot
        .tasks
        .iter()
        .filter(|t| {
            t.final_reports
                .iter()
                .any(|r| matches!(r, jr_fake_forge::Outcome::Failure))
        })
        .count();
    assert_eq!(
        failures, 10,
        "the vm jobs report the failure their executor produced"
    );
    for task in &snapshot.tasks {
        // Every step's rows arrived, in order, and the log was closed by the executor.
        assert!(task.log_archived, "task {} log not closed", task.id);
        let steps: Vec<usize> = ["step 0:", "step 1:", "Job finished"]
            .iter()
            .map(|needle| {
                task.log
                    .iter()
                    .position(|row| row.contains(needle))
                    .unwrap_or(usize::MAX)
            })
            .collect();
        assert!(
            steps.windows(2).all(|w| w[0] < w[1]) && steps[2] != usize::MAX,
            "task {} log out of order: {:?}",
            task.id,
            task.log
        );
    }
    let with_outputs = snapshot
        .tasks
        .iter()
        .filter(|t| {
            t.outputs.get("artifact").map(String::as_str) == Some("built")
                && t.outputs.get("sha").map(String::as_str) == Some("abc")
        })
        .count();
    assert_eq!(
        with_outputs, 20,
        "outputs of every pod job reached the forge"
    );
    // Every Pod ran the executor image's entrypoint, which exec'd the runner in one-shot mode.
    let executor_log = system.executor_log();
    let starts = executor_log
        .lines()
        .filter(|l| {
            l.contains("jetrunner-executor: assignment") && l.contains("act_runner daemon --once")
        })
        .count();
    assert_eq!(
        starts, 20,
        "one entrypoint start per pod job:\n{executor_log}"
    );
    assert!(
        !executor_log.contains("jetrunner-executor: missing"),
        "{executor_log}"
    );
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
    Ok(())
}

/// Trust-aware routing: a pull request from a fork that asks for `runs-on: pod` never runs in a
/// Pod. With one runner for both backends it runs in a microVM; with a runner per backend the
/// pod runner took the task, so it is failed at the forge with the reason. The same job pushed
/// to the repository itself runs in a Pod either way.
async fn fork_pull_request_asking_for_a_pod(shared_registration: bool) -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        shared_registration,
        ..Default::default()
    })
    .await?;
    let job = |fork: Option<&str>| jr_fake_forge::JobSpec {
        repo: "acme/widgets".into(),
        name: "build".into(),
        runs_on: vec!["pod".into()],
        steps: 2,
        pull_request_from_fork: fork.map(str::to_owned),
        ..Default::default()
    };
    let from_fork = system.forge.enqueue_jobs(job(Some("mallory/widgets")), 1);
    let pushed = system.forge.enqueue_jobs(job(None), 1);
    if let Err(e) = system.wait_all_final(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    if let Err(e) = system.wait_no_workloads(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    let status =
        |id: &jr_fake_forge::JobId| snapshot.jobs.iter().find(|j| j.id == *id).map(|j| j.status);
    let success = Some(jr_fake_forge::Status::Done(jr_fake_forge::Outcome::Success));
    assert_eq!(status(&pushed[0]), success, "the pushed job ran");
    let vms = system
        .sandbox
        .created()
        .into_iter()
        .filter(|s| s.allocated)
        .count();
    assert_eq!(
        system.kube.records().created.len(),
        1,
        "one Pod: the pushed job's"
    );
    if shared_registration {
        assert_eq!(status(&from_fork[0]), success, "the fork's job ran");
        assert_eq!(vms, 1, "one microVM: the fork's job");
        // The decision and its reason are on the assignment, in the projection and on the
        // status page's timeline.
        let task = snapshot
            .job(from_fork[0])
            .and_then(|j| j.task_ids.first().copied())
            .ok_or_else(|| anyhow::anyhow!("the fork's job has no task"))?;
        let records = jr_store::Store::connect(&system.database_url)
            .await?
            .records()
            .await?;
        let record = records
            .iter()
            .find(|r| r.info.as_ref().is_some_and(|i| i.forge_task_id == task))
            .ok_or_else(|| anyhow::anyhow!("no assignment for task {task}"))?;
        let placement = record
            .info
            .as_ref()
            .and_then(|i| i.placement.clone())
            .ok_or_else(|| anyhow::anyhow!("no placement recorded"))?;
        assert!(placement.contains("fork"), "{placement}");
        let timeline: serde_json::Value = reqwest::get(format!(
            "http://127.0.0.1:{}/api/assignments/{}",
            system.ports.status, record.id
        ))
        .await?
        .json()
        .await?;
        assert!(
            timeline["timeline"]
                .as_array()
                .is_some_and(|t| t.iter().any(|e| e["step"] == "fetched"
                    && e["detail"].as_str().is_some_and(|d| d.contains(&placement)))),
            "{timeline}"
        );
    } else {
        assert_eq!(
            status(&from_fork[0]),
            Some(jr_fake_forge::Status::Done(jr_fake_forge::Outcome::Failure)),
            "the fork's job is refused"
        );
        assert_eq!(vms, 0);
    }
    assert!(system.violations().is_empty(), "{:?}", system.violations());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fork_pull_request_asking_for_a_pod_runs_on_the_vm_backend() -> anyhow::Result<()> {
    fork_pull_request_asking_for_a_pod(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fork_pull_request_taken_by_the_pod_runner_is_refused_not_run() -> anyhow::Result<()> {
    fork_pull_request_asking_for_a_pod(false).await
}
