//! Full-system scenarios: the four service binaries, real NATS and PostgreSQL, fake forge and
//! backends. Needs `cargo build --workspace --bins` first (the README's test command does it).

use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_pod_and_vm_jobs_all_finish_once_and_leave_nothing_behind() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec { pod_capacity: 4, vm_capacity: 3, ..Default::default() }).await?;
    system.enqueue("pod", 20, &[("JR_FAKE_DURATION_MS", "200")]);
    system.enqueue("vm", 10, &[("JR_FAKE_DURATION_MS", "200"), ("JR_FAKE_OUTCOME", "failure")]);
    let done = system.wait_all_final(Duration::from_secs(120)).await;
    if let Err(e) = done {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    if let Err(e) = system.wait_no_workloads(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    let failures = snapshot.tasks.iter().filter(|t| t.final_reports.iter().any(|r| matches!(r, jr_fake_forge::Outcome::Failure))).count();
    assert_eq!(failures, 10, "the vm jobs report the failure their executor produced");
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
    Ok(())
}
