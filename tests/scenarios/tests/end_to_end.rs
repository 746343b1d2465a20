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
