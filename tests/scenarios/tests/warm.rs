//! Warm executors end to end: both backends keep two idle executors started ahead of demand;
//! jobs are bound to them (no create call) while each of the four services is killed with
//! SIGKILL in turn and restarted. Afterwards no job is lost or run twice (on Gitea a task handed
//! out to the killed scheduler before its assignment was durable is left to the forge's zombie
//! reaper and recognised exactly), every other job ends with its executor's result, capacity (warm and job workloads together) was never exceeded by the
//! fake Kubernetes API's and OpenSandbox's own counts, no job workload is left, exactly
//! `min_idle` warm executors idle per backend, and the projection equals the streams. Needs
//! the service binaries built; run with `--test-threads=1`.

use std::time::Duration;

use jr_protocol::{Message, STREAM_EVENTS};
use jr_scenarios::chaos::{diagnose, fetch_window_losses, keep_logs, published_tasks};
use jr_scenarios::consistency::{check_projection, read_stream, wait_projection_settled};
use jr_scenarios::system::Touched;
use jr_scenarios::{System, SystemSpec};

const WARM: usize = 2;
const WAVES: [&str; 4] = ["pod-worker", "scheduler", "vm-worker", "reconciler"];
const POD_JOBS: u32 = 6;
const VM_JOBS: u32 = 3;
const ZOMBIE_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits until the forge has handed out at least `n` tasks.
async fn handed_out(system: &System, n: usize, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let fetched = system
            .forge
            .snapshot()
            .jobs
            .iter()
            .filter(|j| j.fetch_count > 0)
            .count();
        if fetched >= n {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "only {fetched} of {n} tasks handed out after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warm_executors_take_jobs_while_every_service_is_killed_and_return_to_min_idle()
-> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 5,
        vm_capacity: 4,
        warm_idle: WARM,
        claim_timeout: Duration::from_secs(15),
        keepalive: Duration::from_secs(5),
        // On Gitea a task handed out to a scheduler killed before its assignment was durable
        // is left to the forge's zombie reaper (see the chaos suite); such a loss is recognised
        // exactly below and every other one fails the run.
        forge_behaviour: jr_fake_forge::Behaviour {
            zombie_timeout: ZOMBIE_TIMEOUT,
            ..Default::default()
        },
        ..Default::default()
    })
    .await?;
    // Started ahead of demand, before any job exists.
    system.wait_no_workloads(Duration::from_secs(60)).await?;

    let started = std::time::Instant::now();
    let mut scheduler_kills = Vec::new();
    let mut total = 0;
    for service in WAVES {
        for i in 0..POD_JOBS + VM_JOBS {
            let label = if i < POD_JOBS { "pod" } else { "vm" };
            let duration = (300 + 150 * (i % 7)).to_string();
            system.enqueue(label, 1, &[("JR_FAKE_DURATION_MS", duration.as_str())]);
        }
        // Killed while this wave's first jobs are being bound.
        handed_out(&system, total + 2, Duration::from_secs(30)).await?;
        total += (POD_JOBS + VM_JOBS) as usize;
        let process = system.service(service).expect("service");
        process.kill9();
        if service == "scheduler" {
            scheduler_kills.push(std::time::SystemTime::now());
        }
        process.restart()?;
        process.wait_ready(Duration::from_secs(60)).await?;
    }

    let snapshot = match system.wait_all_final(Duration::from_secs(120)).await {
        Ok(snapshot) => snapshot,
        Err(e) => {
            let kept = keep_logs(&system, "warm")?;
            anyhow::bail!(
                "{e}\nunfinished:\n{}\nlogs in {}",
                diagnose(&system).await,
                kept.display()
            );
        }
    };
    assert_eq!(snapshot.jobs.len(), total);
    println!("all jobs final after {:?}", started.elapsed());
    // A pod-worker killed between a warm executor's Secret and its Pod leaves a Secret that
    // its listing deletes two minutes later.
    if let Err(e) = system.wait_no_workloads(Duration::from_secs(180)).await {
        let kept = keep_logs(&system, "warm")?;
        anyhow::bail!("{e}\nlogs in {}", kept.display());
    }
    println!(
        "back to {WARM} idle warm executors each after {:?}",
        started.elapsed()
    );
    wait_projection_settled(&system.database_url, Duration::from_secs(90)).await?;
    println!("projection settled after {:?}", started.elapsed());
    let violations = system.violations();
    assert!(
        violations.is_empty(),
        "invariants violated: {violations:#?}\n{}",
        system.logs()
    );
    let published = published_tasks(&system.database_url).await?;
    let zombies = fetch_window_losses(&snapshot, &scheduler_kills, &published);
    assert!(
        zombies.violations.is_empty(),
        "tasks stopped without an explanation: {:#?}",
        zombies.violations
    );
    println!(
        "tasks lost in the Gitea fetch window (failed by the forge's reaper): {:?}",
        zombies.fetch_window
    );
    let touched = Touched {
        tasks: zombies.fetch_window.iter().copied().collect(),
        ..Touched::default()
    };
    let outcomes = system.outcome_violations(&touched).await?;
    assert_eq!(
        outcomes.checked + outcomes.touched,
        total,
        "every job's result was compared"
    );
    assert!(
        outcomes.violations.is_empty(),
        "results differ from the executors' instructions: {:#?}",
        outcomes.violations
    );
    let consistency = check_projection(
        &system.nats.url(),
        &system.database_url,
        Duration::from_secs(60),
    )
    .await?;
    assert!(
        consistency.is_consistent(),
        "projection differs from the streams: {:#?}",
        consistency.differences
    );

    // Jobs went to warm executors on both backends (the binding is in `workload-created`).
    let client = jr_bus::async_nats::connect(system.nats.url()).await?;
    let js = jr_bus::async_nats::jetstream::new(client);
    let (events, _) = read_stream(&js, STREAM_EVENTS).await?;
    let bound: Vec<String> = events
        .iter()
        .filter_map(|(_, e)| match &e.message {
            Message::WorkloadCreated(c) if c.warm.is_some() => Some(c.backend.to_string()),
            _ => None,
        })
        .collect();
    for backend in ["pod", "vm"] {
        let n = bound.iter().filter(|b| *b == backend).count();
        println!("{backend}: {n} jobs bound to warm executors");
        assert!(
            n >= WARM,
            "{backend}: only {n} jobs bound to warm executors"
        );
    }
    Ok(())
}
