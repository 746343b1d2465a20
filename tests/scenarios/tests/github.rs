//! GitHub Actions as a second forge, next to Gitea: the four service binaries, real NATS and
//! PostgreSQL, the fake GitHub, and Pods that run the executor image's entrypoint, which fetches
//! the runner config from the facade and starts the runner stand-in. Needs `cargo build
//! --workspace --bins` first (the README's test command does it).

use std::collections::HashSet;
use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

/// Waits for both forges' jobs to end and for the workloads to go, then checks every invariant:
/// each job final once with its runner's result, capacity kept, no runner, workload or Secret
/// left, and no runner config readable on the bus.
async fn finish_and_check(system: &mut System, touched: &HashSet<i64>) -> anyhow::Result<()> {
    let waited = async {
        system.wait_all_final(Duration::from_secs(180)).await?;
        system.wait_github_final(Duration::from_secs(180)).await?;
        system.wait_no_workloads(Duration::from_secs(90)).await
    }
    .await;
    if let Err(e) = waited {
        let executors = system.executor_log();
        let tail: Vec<&str> = executors.lines().rev().take(40).collect();
        anyhow::bail!(
            "{e}\nGitHub: {:#?}\nexecutors (last lines first):\n{}\n{}",
            system.github_violations(touched),
            tail.join("\n"),
            system.logs()
        );
    }
    let mut violations = system.violations();
    violations.extend(system.github_violations(touched));
    violations.extend(system.github_bus_violations().await?);
    anyhow::ensure!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn github_and_gitea_jobs_side_by_side_finish_once_and_leave_nothing_behind()
-> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 3,
        github: true,
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", 6, &[("JR_FAKE_DURATION_MS", "200")]);
    system.enqueue("vm", 4, &[("JR_FAKE_DURATION_MS", "200")]);
    let jobs = system.enqueue_github(12);
    // Two runs are cancelled at once: before or after a runner was made for them, nothing may
    // be left of them.
    let github = system.github.as_ref().expect("github");
    let cancelled: HashSet<i64> = jobs.iter().take(2).copied().collect();
    for id in &cancelled {
        github.cancel(*id);
    }
    finish_and_check(&mut system, &cancelled).await?;
    // The jobs that ran went through the entrypoint's GitHub path: a runner config from the
    // facade, then the runner.
    let log = system.executor_log();
    let starts = log
        .lines()
        .filter(|l| l.contains("starting the GitHub runner"))
        .count();
    assert!(
        starts >= jobs.len() - cancelled.len(),
        "{starts} GitHub runner starts for {} jobs:\n{log}",
        jobs.len() - cancelled.len()
    );
    Ok(())
}
