//! High availability: two replicas of every service run 500 mixed jobs while the replica that
//! fetches (per forge registration), the one that projects and plans, and the pod-worker and
//! vm-worker replicas with the most workloads are killed with SIGKILL in turn. The standby
//! takes over within the lease's free time and a surviving worker replica takes over the dead
//! one's slots and workloads: no job is lost or run twice, fetching resumes within 5 s
//! (measured from the kill to the forge's next hand-out to that registration), executors keep
//! talking to a facade (the surviving replica, through the stand-in for a Kubernetes Service),
//! the two worker replicas of a backend together never exceed its capacity by the backends' own
//! records, and nothing is left behind. Needs the service binaries built; run with
//! `--test-threads=1`.

use std::time::{Duration, Instant, SystemTime};

use jr_scenarios::consistency::{check_projection, wait_projection_settled};
use jr_scenarios::{System, SystemSpec, Touched};

const POD_JOBS: u32 = 330;
const VM_JOBS: u32 = 170;
/// The bound on the gap in fetching after the fetching replica dies.
const RESUME_WITHIN: Duration = Duration::from_secs(5);

/// The value of a metric line `name{…label…} value` on the ops port, if present.
async fn metric(port: u16, name: &str, label: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Which scheduler replica ("scheduler" or "scheduler-b") fetches for `registration`.
async fn fetch_leader(system: &System, registration: &str) -> Option<&'static str> {
    let label = format!("registration=\"{registration}\"");
    let mut leaders = Vec::new();
    for (name, port) in [
        ("scheduler", system.ports.scheduler_ops),
        ("scheduler-b", system.ports.scheduler_b_ops),
    ] {
        if metric(port, "jetrunner_scheduler_fetch_leader", &label).await == Some(1.0) {
            leaders.push(name);
        }
    }
    assert!(
        leaders.len() <= 1,
        "two scheduler replicas fetch for {registration}: {leaders:?}"
    );
    leaders.first().copied()
}

/// Which reconciler replica holds the lease.
async fn reconciler_leader(system: &System) -> Option<&'static str> {
    let mut leaders = Vec::new();
    for (name, port) in [
        ("reconciler", system.ports.reconciler_ops),
        ("reconciler-b", system.ports.reconciler_b_ops),
    ] {
        if metric(port, "jetrunner_reconciler_leader", "").await == Some(1.0) {
            leaders.push(name);
        }
    }
    assert!(leaders.len() <= 1, "two reconcilers lead: {leaders:?}");
    leaders.first().copied()
}

/// Waits until both worker replicas of `backend` hold part of its capacity (one record holds
/// every replica's share) and checks they hold at most all of it together.
async fn both_hold_slots(
    system: &System,
    backend: &str,
    capacity: usize,
) -> anyhow::Result<Vec<usize>> {
    let nats = async_nats::connect(system.nats.url()).await?;
    let js = async_nats::jetstream::new(nats);
    let bucket = js.get_key_value(format!("JR_WORKLOADS_{backend}")).await?;
    let policy = jr_lease::Policy::new(6_000, 500)?;
    let held = wait_for(
        "both worker replicas hold slots",
        Duration::from_secs(30),
        || {
            let bucket = bucket.clone();
            async move {
                let value = bucket.get("slots").await.ok()??;
                let record: jr_lease::Slots = serde_json::from_slice(&value).ok()?;
                let now = jr_protocol::now_ms();
                // Holdings of killed processes not taken over yet are not replicas.
                let held: Vec<usize> = record
                    .held
                    .values()
                    .filter(|h| now < h.expires(&policy))
                    .map(|h| h.slots)
                    .collect();
                (held.len() == 2 && held.iter().all(|h| *h >= 1)).then_some(held)
            }
        },
    )
    .await?;
    anyhow::ensure!(
        held.iter().sum::<usize>() <= capacity,
        "{backend} worker replicas hold {held:?} of {capacity} slots"
    );
    Ok(held)
}

/// Kills the replica of `kind` ("pod-worker" or "vm-worker") with the most workloads while it
/// has some, and waits until the other replica has taken it over. Returns the replica killed
/// and how long the takeover took.
async fn kill_busiest_worker(
    system: &mut System,
    kind: &str,
) -> anyhow::Result<(String, Duration)> {
    let (port_a, port_b) = match kind {
        "pod-worker" => (system.ports.pod_ops, system.ports.pod_b_ops),
        _ => (system.ports.vm_ops, system.ports.vm_b_ops),
    };
    let replicas = [(kind.to_owned(), port_a), (format!("{kind}-b"), port_b)];
    let (victim, survivor_port) = wait_for(
        "a worker replica with workloads",
        Duration::from_secs(30),
        || {
            let replicas = replicas.clone();
            async move {
                let mut used = Vec::new();
                for (name, port) in &replicas {
                    let n = metric(*port, "jetrunner_worker_slots_used", "").await?;
                    used.push((n, name.clone(), *port));
                }
                used.sort_by(|a, b| b.0.total_cmp(&a.0));
                (used[0].0 >= 1.0).then(|| (used[0].1.clone(), used[1].2))
            }
        },
    )
    .await?;
    let before = metric(survivor_port, "jetrunner_worker_takeovers_total", "")
        .await
        .unwrap_or(0.0);
    system.service(&victim).expect("worker replica").kill9();
    let killed_at = Instant::now();
    wait_for(
        "the surviving replica takes the killed one over",
        Duration::from_secs(30),
        || async move {
            let now = metric(survivor_port, "jetrunner_worker_takeovers_total", "").await?;
            (now > before).then_some(())
        },
    )
    .await?;
    Ok((victim, killed_at.elapsed()))
}

async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        anyhow::ensure!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kills the replica fetching for `registration` and returns how long the forge handed out
/// nothing to that registration's runner afterwards, and the replica killed.
async fn kill_fetch_leader(
    system: &mut System,
    registration: &str,
) -> anyhow::Result<(Duration, &'static str)> {
    let leader = wait_for(
        "a fetching scheduler replica",
        Duration::from_secs(15),
        || fetch_leader(system, registration),
    )
    .await?;
    let runner = format!("jetrunner-scenario-{registration}");
    let waiting = system
        .forge
        .snapshot()
        .jobs
        .iter()
        .filter(|j| j.fetch_count == 0 && j.runs_on.iter().any(|l| l == registration))
        .count();
    anyhow::ensure!(
        waiting > 0,
        "jobs must wait at the forge when the fetching replica dies (to time the resumption)"
    );
    system.service(leader).expect("scheduler replica").kill9();
    let killed_at = SystemTime::now();
    let resumed = wait_for(
        "a hand-out to the registration after the kill",
        Duration::from_secs(30),
        || {
            let first = system
                .forge
                .snapshot()
                .tasks
                .iter()
                .filter(|t| t.runner_name == runner && t.started_at > killed_at)
                .map(|t| t.started_at)
                .min();
            async move { first }
        },
    )
    .await;
    let resumed = match resumed {
        Ok(at) => at,
        Err(e) => {
            let kept = jr_scenarios::chaos::keep_logs(system, "ha")?;
            anyhow::bail!("{e} (service logs kept in {})", kept.display());
        }
    };
    let gap = resumed.duration_since(killed_at).unwrap_or_default();
    let survivor = fetch_leader(system, registration).await;
    anyhow::ensure!(
        survivor.is_some() && survivor != Some(leader),
        "the other replica fetches for {registration} (leader now {survivor:?})"
    );
    Ok((gap, leader))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leaders_killed_in_turn_lose_no_job_and_fetching_resumes_within_five_seconds()
-> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        standbys: true,
        // Replicas on a multi-thread runtime (`[runtime] threads`), as a larger deployment runs
        // them; every other scenario runs the default single thread.
        runtime_threads: 2,
        pod_capacity: 8,
        vm_capacity: 4,
        // Forgejo's request key: the replica that takes over repeats the dead replica's last
        // fetch, so even a task handed out the moment before the kill is not lost.
        forge_flavor: "forgejo",
        task_capacity: 2,
        pod_executor_in_process: true,
        keepalive: Duration::from_secs(5),
        forge_behaviour: jr_fake_forge::Behaviour {
            zombie_timeout: Duration::from_secs(60),
            ..Default::default()
        },
        ..Default::default()
    })
    .await?;
    let duration = [(jr_fake_executor::VAR_DURATION_MS, "30")];
    system.enqueue("pod", POD_JOBS, &duration);
    system.enqueue("vm", VM_JOBS, &duration);
    let total = (POD_JOBS + VM_JOBS) as usize;

    let progress = |system: &System, n: usize| {
        let done = system.final_count(
            &system
                .forge
                .snapshot()
                .jobs
                .iter()
                .map(|j| j.id)
                .collect::<Vec<_>>(),
        );
        async move { (done >= n).then_some(done) }
    };
    wait_for("the first jobs finish", Duration::from_secs(60), || {
        progress(&system, 40)
    })
    .await?;

    // Only the lease holders fetch: the forge never saw two fetches of one runner at once.
    assert_eq!(
        system.forge.snapshot().faults.max_concurrent_fetches,
        1,
        "two FetchTask calls of one runner were in flight at once"
    );

    // Worker replicas share their backend's capacity: both hold part of it, never more than
    // all of it together.
    for (backend, capacity) in [("pod", 8), ("vm", 4)] {
        let held = both_hold_slots(&system, backend, capacity).await?;
        println!("{backend}: slots held by the two worker replicas {held:?}");
    }

    // 1. The replica fetching for the pod registration.
    let (pod_gap, killed) = kill_fetch_leader(&mut system, "pod").await?;
    println!("pod registration: fetching resumed {pod_gap:?} after its fetching replica died");
    system.service(killed).expect("replica").restart()?;
    wait_for("more jobs finish", Duration::from_secs(60), || {
        progress(&system, 120)
    })
    .await?;

    // 2. The reconciler that projects and plans.
    let leader = wait_for("a leading reconciler", Duration::from_secs(15), || {
        reconciler_leader(&system)
    })
    .await?;
    system.service(leader).expect("reconciler").kill9();
    let killed_at = Instant::now();
    let next = wait_for(
        "the standby reconciler leads",
        Duration::from_secs(15),
        || reconciler_leader(&system),
    )
    .await?;
    println!(
        "reconciler: {next} took over {:?} after {leader} died",
        killed_at.elapsed()
    );
    assert_ne!(next, leader);
    system.service(leader).expect("reconciler").restart()?;
    wait_for("more jobs finish", Duration::from_secs(60), || {
        progress(&system, 220)
    })
    .await?;

    // 3. The pod-worker replica with the most workloads.
    let (killed, took) = kill_busiest_worker(&mut system, "pod-worker").await?;
    println!("pod-worker: {killed} taken over {took:?} after it died");
    system.service(&killed).expect("worker").restart()?;
    // The restarted replica gets its share back from the one that took everything over.
    let held = both_hold_slots(&system, "pod", 8).await?;
    println!("pod: after the restart the replicas hold {held:?}");
    wait_for("more jobs finish", Duration::from_secs(60), || {
        progress(&system, 280)
    })
    .await?;

    // 4. The replica fetching for the vm registration (whichever it is now).
    let (vm_gap, killed) = kill_fetch_leader(&mut system, "vm").await?;
    println!("vm registration: fetching resumed {vm_gap:?} after its fetching replica died");
    system.service(killed).expect("replica").restart()?;

    // 5. The vm-worker replica with the most workloads.
    let (killed, took) = kill_busiest_worker(&mut system, "vm-worker").await?;
    println!("vm-worker: {killed} taken over {took:?} after it died");
    system.service(&killed).expect("worker").restart()?;
    let held = both_hold_slots(&system, "vm", 4).await?;
    println!("vm: after the restart the replicas hold {held:?}");

    let kept = jr_scenarios::chaos::keep_logs(&system, "ha")?;
    println!("service logs kept in {}", kept.display());
    for (registration, gap) in [("pod", pod_gap), ("vm", vm_gap)] {
        assert!(
            gap < RESUME_WITHIN,
            "{registration}: fetching resumed only {gap:?} after the fetching replica died"
        );
    }

    if let Err(e) = system.wait_all_final(Duration::from_secs(300)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    system.wait_no_workloads(Duration::from_secs(90)).await?;
    wait_projection_settled(&system.database_url, Duration::from_secs(90)).await?;
    let violations = system.violations();
    assert!(
        violations.is_empty(),
        "invariants violated: {violations:#?}\n{}",
        system.logs()
    );
    let snapshot = system.forge.snapshot();
    assert_eq!(snapshot.jobs.len(), total);
    // One replica fetches per registration: the forge never saw two fetches of one runner at
    // the same moment (both replicas fetching would overlap within a few polls).
    assert_eq!(
        snapshot.faults.max_concurrent_fetches, 1,
        "two FetchTask calls of one runner were in flight at once"
    );
    let outcomes = system.outcome_violations(&Touched::default()).await?;
    assert_eq!(outcomes.checked, total, "every job's result was compared");
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
    // Afterwards: one replica fetches per registration and one reconciler leads.
    for registration in ["pod", "vm"] {
        wait_for("one fetching replica", Duration::from_secs(15), || {
            fetch_leader(&system, registration)
        })
        .await?;
    }
    wait_for("one leading reconciler", Duration::from_secs(15), || {
        reconciler_leader(&system)
    })
    .await?;
    Ok(())
}

/// Commands a dead worker cannot hold: two replicas of every service, Gitea jobs finishing all
/// the time, delete calls that take 2 s, and the pod-worker replica with the most workloads
/// killed with SIGKILL while it handles deletes. Every Pod
/// whose job had ended by the time the surviving replica took the dead one over is deleted
/// within 5 s of that takeover, also when its `delete-workload` had been delivered to the dead
/// replica. Seen failing with the command consumer's former ungated pull of 8 and 60 s ack_wait:
/// such Pods stayed until the reconciler sent their command again, 30 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deletes_due_when_a_worker_replica_dies_are_done_within_five_seconds_of_the_takeover()
-> anyhow::Result<()> {
    const JOBS: u32 = 80;
    let mut system = System::start(SystemSpec {
        standbys: true,
        // A three-node cluster, as production runs: a dead client's pull requests are only
        // forgotten once every node learns it is gone.
        nats_cluster: true,
        pod_capacity: 8,
        vm_capacity: 2,
        pod_executor_in_process: true,
        // A slow API server: each delete call takes 2 s, so when the replica is killed it is
        // handling the deletes of the jobs that just ended.
        kube_delete_delay: Duration::from_secs(2),
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", JOBS, &[(jr_fake_executor::VAR_DURATION_MS, "1500")]);
    let finished = |system: &System| -> Vec<String> {
        system
            .kube
            .pods(jr_scenarios::system::JOBS_NAMESPACE)
            .iter()
            .filter(|p| {
                matches!(
                    p.pointer("/status/phase").and_then(|v| v.as_str()),
                    Some("Succeeded" | "Failed")
                )
            })
            .filter_map(|p| {
                p.pointer("/metadata/name")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned)
            })
            .collect()
    };
    // Jobs are ending: deletes are due.
    wait_for("Pods whose jobs ended", Duration::from_secs(60), || {
        let done = system.final_count(
            &system
                .forge
                .snapshot()
                .jobs
                .iter()
                .map(|j| j.id)
                .collect::<Vec<_>>(),
        );
        async move { (done >= 8).then_some(()) }
    })
    .await?;
    // Pods of jobs that ended and whose deletes are under way (each call takes 2 s) when the
    // replica is killed: some of those deletes are the killed replica's.
    let due = finished(&system);
    let (killed, took) = kill_busiest_worker(&mut system, "pod-worker").await?;
    let takeover = Instant::now();
    println!(
        "pod-worker: {killed} taken over {took:?} after it died; {} Pods of ended jobs at the kill",
        due.len()
    );
    anyhow::ensure!(
        !due.is_empty(),
        "no Pod of an ended job at the kill: the scenario did not kill a replica while deletes were due"
    );
    let bound = Duration::from_secs(5);
    let left = loop {
        let present: std::collections::BTreeSet<String> = system
            .kube
            .pods(jr_scenarios::system::JOBS_NAMESPACE)
            .iter()
            .filter_map(|p| {
                p.pointer("/metadata/name")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned)
            })
            .collect();
        let left: Vec<&String> = due.iter().filter(|p| present.contains(*p)).collect();
        if left.is_empty() || takeover.elapsed() > bound {
            break left.into_iter().cloned().collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if !left.is_empty() {
        let kept = jr_scenarios::chaos::keep_logs(&system, "ha-deletes")?;
        anyhow::bail!(
            "{} Pods of ended jobs still there {bound:?} after the takeover: {left:?}\nlogs kept in {}",
            left.len(),
            kept.display()
        );
    }
    system.service(&killed).expect("worker").restart()?;
    system.wait_all_final(Duration::from_secs(180)).await?;
    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let violations = system.violations();
    anyhow::ensure!(violations.is_empty(), "{violations:#?}");
    Ok(())
}
