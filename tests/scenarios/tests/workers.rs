//! Worker scenarios on the whole system: capacity is never exceeded while work waits in
//! JetStream, kill -9 of a worker at random points loses, duplicates and leaks nothing, a
//! create call that times out on the client adopts the sandbox the server made, a pool smaller
//! than demand never spends an attempt, and one backend stalling (worker dead, API down) does
//! not hold up the other (its jobs complete while the stalled backend's cannot; how long they
//! take is printed, not asserted: timing belongs to the benchmark).
//!
//! Needs the service binaries: `cargo build --bins -p scheduler -p pod-worker -p vm-worker -p
//! reconciler`, then `cargo test -p jr-scenarios --test workers -- --test-threads=1`. The
//! `#[ignore]`d `full_size_*` tests run the issue sizes (500 pod jobs / capacity 20, 300 vm
//! jobs / pool 15, 360 vm jobs with a pool of 6 three times): `-- --ignored --test-threads=1`. `JR_SEED=<n>` replays the random kill points.

use std::time::{Duration, Instant};

use jr_fake_forge::JobId;
use jr_scenarios::consistency::wait_projection_settled;
use jr_scenarios::system::sandbox_meta;
use jr_scenarios::{System, SystemSpec, Touched};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

/// Fails with the system's log tails attached.
async fn check<T>(system: &mut System, what: &str, result: anyhow::Result<T>) -> anyhow::Result<T> {
    match result {
        Ok(v) => Ok(v),
        Err(e) => {
            save_logs(system);
            anyhow::bail!("{what}: {e:#}\n{}", system.logs())
        }
    }
}

/// With `JR_SAVE_LOGS=<dir>`, keeps the services' full logs of a scenario (at its end or
/// failure) there.
fn save_logs(system: &mut System) {
    if let Some(dir) = std::env::var_os("JR_SAVE_LOGS") {
        match system.save_logs(std::path::Path::new(&dir)) {
            Ok(()) => eprintln!("service logs saved to {}", dir.to_string_lossy()),
            Err(e) => eprintln!("could not save the service logs: {e:#}"),
        }
    }
}

/// Every job final, every workload gone, then no end invariant violated.
async fn settle(system: &mut System, timeout: Duration) -> anyhow::Result<()> {
    let all = system.wait_all_final(timeout).await;
    check(system, "waiting for every job to be final", all).await?;
    let gone = system.wait_no_workloads(Duration::from_secs(90)).await;
    check(system, "waiting for every workload to be deleted", gone).await?;
    let violations = system.violations();
    save_logs(system);
    assert!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
    // No fault touches a job here: every result must be the one its executor was told.
    let outcomes = system.outcome_violations(&Touched::default()).await?;
    assert!(
        outcomes.violations.is_empty() && outcomes.touched == 0,
        "{outcomes:#?}\n{}",
        system.logs()
    );
    Ok(())
}

fn rng(test: &str) -> StdRng {
    let seed = std::env::var("JR_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: JR_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

fn millis(rng: &mut StdRng, range: std::ops::Range<u64>) -> Duration {
    Duration::from_millis(rng.random_range(range))
}

/// Lines of a service's log containing `needle` (the services log JSON, one event a line).
fn log_count(system: &mut System, service: &str, needle: &str) -> usize {
    let Some(p) = system.service(service) else {
        return 0;
    };
    std::fs::read_to_string(p.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

// ---------------------------------------------------------------------------------------------
// 1. Pod capacity

async fn pod_capacity(jobs: u32, capacity: usize, timeout: Duration) -> anyhow::Result<()> {
    let spec = SystemSpec {
        pod_capacity: capacity,
        ..Default::default()
    };
    let mut system = System::start(spec).await?;
    let started = Instant::now();
    let ids = system.enqueue_ids("pod", jobs, &[("JR_FAKE_DURATION_MS", "100")]);
    settle(&mut system, timeout).await?;
    let records = system.kube.records();
    eprintln!(
        "pod capacity: {jobs} jobs, capacity {capacity}: all final and cleaned up in {:?}; {} Pods created, at most {} live",
        started.elapsed(),
        records.created.len(),
        records.max_live
    );
    assert_eq!(system.final_count(&ids), ids.len());
    // No attempt was redispatched in a healthy run: exactly one Pod per job.
    assert_eq!(records.created.len(), jobs as usize, "one Pod per job");
    // The backlog was deep enough to fill every slot, so the bound above was really tested.
    assert_eq!(
        records.max_live, capacity,
        "the worker used its whole capacity and never more"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_jobs_beyond_capacity_wait_and_never_exceed_it() -> anyhow::Result<()> {
    pod_capacity(150, 10, Duration::from_secs(180)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "full size of the issue (500 jobs, capacity 20): several minutes"]
async fn full_size_pod_capacity() -> anyhow::Result<()> {
    pod_capacity(500, 20, Duration::from_secs(900)).await
}

// ---------------------------------------------------------------------------------------------
// 2. and 4. kill -9 of a worker at random points

/// Kills `service` three times at random points while `jobs` run, restarting it after a short
/// random pause. Returns how many of the jobs were final at each kill.
async fn kill_three_times(
    system: &mut System,
    service: &str,
    jobs: &[JobId],
    rng: &mut StdRng,
) -> anyhow::Result<Vec<usize>> {
    let mut final_at_kill = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(millis(rng, 500..3_000)).await;
        final_at_kill.push(kill_and_restart(system, service, jobs, rng).await?);
    }
    Ok(final_at_kill)
}

/// SIGKILLs `service`, starts it again after a short random pause and waits until it is ready.
/// Returns how many of `jobs` were final at the kill.
async fn kill_and_restart(
    system: &mut System,
    service: &str,
    jobs: &[JobId],
    rng: &mut StdRng,
) -> anyhow::Result<usize> {
    let final_now = system.final_count(jobs);
    let pause = millis(rng, 100..1_500);
    let process = system.service(service).expect("a service of the system");
    process.kill9();
    eprintln!(
        "kill -9 {service} at {final_now} of {} jobs final, restart after {pause:?}",
        jobs.len()
    );
    tokio::time::sleep(pause).await;
    process.restart()?;
    let ready = process.wait_ready(Duration::from_secs(60)).await;
    check(system, "restarted worker ready", ready).await?;
    Ok(final_now)
}

async fn pod_worker_kill(jobs: u32, capacity: usize, timeout: Duration) -> anyhow::Result<()> {
    let mut rng = rng("pod kill -9");
    let mut system = System::start(SystemSpec {
        pod_capacity: capacity,
        ..Default::default()
    })
    .await?;
    let started = Instant::now();
    let ids = system.enqueue_ids("pod", jobs, &[("JR_FAKE_DURATION_MS", "300")]);
    let final_at_kill = kill_three_times(&mut system, "pod-worker", &ids, &mut rng).await?;
    assert!(
        final_at_kill[2] < ids.len(),
        "the last kill came after the run ended: {final_at_kill:?}"
    );
    settle(&mut system, timeout).await?;
    let records = system.kube.records();
    eprintln!(
        "pod kill -9: {jobs} jobs, capacity {capacity}, final at the kills {final_at_kill:?}: done in {:?}; {} Pods created, at most {} live",
        started.elapsed(),
        records.created.len(),
        records.max_live
    );
    assert!(records.max_live <= capacity);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_worker_killed_at_random_points_loses_and_leaks_nothing() -> anyhow::Result<()> {
    pod_worker_kill(120, 10, Duration::from_secs(240)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "full size of the issue (500 jobs, capacity 20): several minutes"]
async fn full_size_pod_worker_kill() -> anyhow::Result<()> {
    pod_worker_kill(500, 20, Duration::from_secs(900)).await
}

async fn vm_worker_kill(jobs: u32, pool: usize, timeout: Duration) -> anyhow::Result<()> {
    let mut rng = rng("vm kill -9");
    let spec = SystemSpec {
        vm_capacity: pool,
        vm_create_timeout: Some(Duration::from_secs(1)),
        ..Default::default()
    };
    let mut system = System::start(spec).await?;
    // Create replies come after the client gave up, so kills also land in the middle of
    // creates whose sandbox exists but was never reported to the worker.
    system
        .sandbox
        .set_create_reply_delay(Duration::from_millis(1_500));
    let started = Instant::now();
    let ids = system.enqueue_ids("vm", jobs, &[("JR_FAKE_DURATION_MS", "300")]);
    let final_at_kill = kill_three_times(&mut system, "vm-worker", &ids, &mut rng).await?;
    assert!(
        final_at_kill[2] < ids.len(),
        "the last kill came after the run ended: {final_at_kill:?}"
    );
    settle(&mut system, timeout).await?;
    let created = system.sandbox.created();
    eprintln!(
        "vm kill -9: {jobs} jobs, pool {pool}, final at the kills {final_at_kill:?}: done in {:?}; {} sandboxes allocated, at most {} live",
        started.elapsed(),
        created.iter().filter(|s| s.allocated).count(),
        system.sandbox.max_live()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_worker_killed_at_random_points_loses_and_leaks_nothing() -> anyhow::Result<()> {
    vm_worker_kill(60, 6, Duration::from_secs(240)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "full size of the issue (300 jobs, pool 15): several minutes"]
async fn full_size_vm_worker_kill() -> anyhow::Result<()> {
    vm_worker_kill(300, 15, Duration::from_secs(900)).await
}

// ---------------------------------------------------------------------------------------------
// 3. VM pool capacity with client-side create timeouts

async fn vm_capacity_with_create_timeouts(
    jobs: u32,
    pool: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let spec = SystemSpec {
        vm_capacity: pool,
        // The OpenSandbox pool is larger than the worker's capacity, so only the worker's own
        // accounting keeps the live count (measured by the fake) at `pool`.
        vm_pool: Some(pool * 2),
        vm_create_timeout: Some(Duration::from_secs(1)),
        ..Default::default()
    };
    let mut system = System::start(spec).await?;
    // Longer than the worker's create timeout: every create call times out on the client while
    // the server has made (and started) the sandbox.
    system
        .sandbox
        .set_create_reply_delay(Duration::from_secs(3));
    let started = Instant::now();
    let ids = system.enqueue_ids("vm", jobs, &[("JR_FAKE_DURATION_MS", "100")]);
    settle(&mut system, timeout).await?;
    let allocated = system
        .sandbox
        .created()
        .iter()
        .filter(|s| s.allocated)
        .count();
    let unknown = log_count(&mut system, "vm-worker", "create outcome unknown");
    eprintln!(
        "vm capacity: {jobs} jobs, pool {pool}, create timeout 1 s < reply delay 3 s: done in {:?}; {allocated} sandboxes allocated, at most {} live, {unknown} creates timed out",
        started.elapsed(),
        system.sandbox.max_live()
    );
    assert_eq!(system.final_count(&ids), ids.len());
    assert_eq!(
        allocated, jobs as usize,
        "one sandbox per job: each timed-out create was adopted, not repeated"
    );
    // A job can end before its create call times out, so up to a pool's worth of calls may
    // still be waiting when the last job is final.
    assert!(
        unknown + pool >= jobs as usize,
        "every create timed out on the client ({unknown} of {jobs} so far)"
    );
    assert_eq!(
        system.sandbox.max_live(),
        pool,
        "the worker used its whole capacity and never more, by the fake's own count"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_jobs_fill_the_pool_and_timed_out_creates_are_adopted() -> anyhow::Result<()> {
    vm_capacity_with_create_timeouts(40, 5, Duration::from_secs(180)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "full size of the issue (300 jobs, pool 15): several minutes"]
async fn full_size_vm_capacity_with_create_timeouts() -> anyhow::Result<()> {
    vm_capacity_with_create_timeouts(300, 15, Duration::from_secs(900)).await
}

// ---------------------------------------------------------------------------------------------
// 4. A pool smaller than the worker's capacity: back-pressure is not failure

/// Kills `service` `n` times while `jobs` run, each when a random share of them (spread over
/// the run) is final, restarting it after a short random pause. Returns how many jobs were
/// final at each kill.
async fn kill_during_run(
    system: &mut System,
    service: &str,
    jobs: &[JobId],
    n: usize,
    rng: &mut StdRng,
    timeout: Duration,
) -> anyhow::Result<Vec<usize>> {
    let mut shares: Vec<f64> = (0..n).map(|_| rng.random_range(0.05..0.85)).collect();
    shares.sort_by(f64::total_cmp);
    let mut final_at_kill = Vec::new();
    for share in shares {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "a share of a few hundred jobs"
        )]
        let target = (share * jobs.len() as f64) as usize;
        let reached = system
            .forge
            .wait_until(
                |s| {
                    jobs.iter()
                        .filter(|id| s.job(**id).is_some_and(|j| j.status.is_final()))
                        .count()
                        >= target
                },
                timeout,
            )
            .await;
        check(
            system,
            "waiting for the next kill point",
            reached.map(|_| ()).map_err(anyhow::Error::from),
        )
        .await?;
        final_at_kill.push(kill_and_restart(system, service, jobs, rng).await?);
    }
    Ok(final_at_kill)
}

/// The projection once it holds `n` assignments and nothing is left to happen to any of them.
async fn projection_with(
    database_url: &str,
    n: usize,
) -> anyhow::Result<Vec<jr_store::AssignmentRecord>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let records = wait_projection_settled(database_url, left).await?;
        let known = records.iter().filter(|r| r.info.is_some()).count();
        if known >= n {
            return Ok(records);
        }
        anyhow::ensure!(
            !left.is_zero(),
            "the projection holds {known} of {n} assignments"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The worker may hold more workloads than the OpenSandbox pool has VMs, so creates wait and end
/// in 429 while the server briefly lists (and then deletes) what it made; the vm-worker is also
/// killed `kills` times. None of that may read as a failed workload: no attempt is spent (no
/// redispatch at all, as no fault touches a workload), every job runs once on attempt 1 with
/// its executor's result, no sandbox is ever created for an attempt other than its
/// assignment's current one, at most one gets a VM per attempt, and the sandboxes held or
/// waiting never exceed the worker's capacity by the server's own count.
async fn vm_pool_smaller_than_capacity(
    jobs: u32,
    capacity: usize,
    pool: usize,
    kills: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let mut rng = rng("vm pool smaller than demand");
    let spec = SystemSpec {
        vm_capacity: capacity,
        vm_pool: Some(pool),
        ..Default::default()
    };
    let mut system = System::start(spec).await?;
    let started = Instant::now();
    let ids = system.enqueue_ids("vm", jobs, &[("JR_FAKE_DURATION_MS", "300")]);
    let final_at_kill =
        kill_during_run(&mut system, "vm-worker", &ids, kills, &mut rng, timeout).await?;
    settle(&mut system, timeout).await?;
    let created = system.sandbox.created();
    let refused = created.iter().filter(|s| !s.allocated).count();
    let allocated = created.iter().filter(|s| s.allocated).count();
    let projected = projection_with(&system.database_url, jobs as usize).await;
    let records = check(&mut system, "waiting for the projection", projected).await?;
    let redispatched: Vec<_> = records
        .iter()
        .filter(|r| !r.redispatches.is_empty() || r.attempts.keys().any(|a| *a != 1))
        .map(|r| r.id)
        .collect();
    let current: std::collections::HashMap<String, u32> = records
        .iter()
        .filter_map(|r| Some((r.id.to_string(), *r.attempts.keys().max()?)))
        .collect();
    let stale: Vec<_> = created
        .iter()
        .filter(|s| {
            let assignment = sandbox_meta(&s.metadata, "assignment").unwrap_or_default();
            let attempt = sandbox_meta(&s.metadata, "attempt").and_then(|a| a.parse().ok());
            attempt.is_none() || current.get(&assignment).copied() != attempt
        })
        .map(|s| s.id.clone())
        .collect();
    eprintln!(
        "vm pool {pool} < capacity {capacity}: {jobs} jobs, vm-worker killed at {final_at_kill:?} final, done in {:?}; {refused} creates refused as full, {allocated} VMs allocated, {} redispatched, {} sandboxes for a superseded attempt, at most {} held (capacity {capacity}), {} with a VM",
        started.elapsed(),
        redispatched.len(),
        stale.len(),
        system.sandbox.max_held(),
        system.sandbox.max_live(),
    );
    assert!(
        refused > 0,
        "the pool never said full: this run proves nothing"
    );
    assert!(
        final_at_kill.iter().all(|n| *n < ids.len()),
        "a kill came after the run ended: {final_at_kill:?}"
    );
    assert_eq!(system.final_count(&ids), ids.len());
    assert!(
        redispatched.is_empty(),
        "attempts spent without a fault: {redispatched:?}"
    );
    assert!(
        stale.is_empty(),
        "sandboxes created for a superseded attempt: {stale:?}"
    );
    assert_eq!(allocated, jobs as usize, "one VM per job");
    assert!(system.sandbox.max_held() <= capacity);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_pool_delays_jobs_but_never_spends_an_attempt() -> anyhow::Result<()> {
    vm_pool_smaller_than_capacity(60, 6, 3, 2, Duration::from_secs(300)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "the issue's acceptance (360 jobs, pool smaller than demand, two kills, three runs): several minutes"]
async fn full_size_full_pool_three_runs() -> anyhow::Result<()> {
    for run in 1..=3 {
        eprintln!("run {run} of 3");
        vm_pool_smaller_than_capacity(360, 12, 6, 2, Duration::from_secs(900)).await?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. Capacity isolation between backends

/// Enqueues `n` jobs and waits until they are final; returns how long that took.
async fn run_batch(
    system: &mut System,
    label: &str,
    n: u32,
    timeout: Duration,
) -> anyhow::Result<(Vec<JobId>, Duration)> {
    let started = Instant::now();
    let ids = system.enqueue_ids(label, n, &[("JR_FAKE_DURATION_MS", "200")]);
    let done = system.wait_jobs_final(&ids, timeout).await;
    check(system, &format!("{n} {label} jobs final"), done).await?;
    Ok((ids, started.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_backend_does_not_hold_up_the_other() -> anyhow::Result<()> {
    let spec = SystemSpec {
        pod_capacity: 4,
        vm_capacity: 4,
        ..Default::default()
    };
    let mut system = System::start(spec).await?;
    let batch = 12;
    let limit = Duration::from_secs(90);

    // Baselines with everything healthy.
    let (_, vm_baseline) = run_batch(&mut system, "vm", batch, limit).await?;
    let (_, pod_baseline) = run_batch(&mut system, "pod", batch, limit).await?;
    eprintln!("isolation: baselines for {batch} jobs: vm {vm_baseline:?}, pod {pod_baseline:?}");

    // The Kubernetes API is down: pod jobs wait, vm jobs run as before.
    system.kube.set_unavailable(true);
    let stuck_pods = system.enqueue_ids("pod", 6, &[("JR_FAKE_DURATION_MS", "200")]);
    let (_, vm_api_down) = run_batch(&mut system, "vm", batch, limit).await?;
    assert_eq!(
        system.final_count(&stuck_pods),
        0,
        "pod jobs cannot finish while the API is down"
    );
    assert!(
        system.kube.rejected_requests() > 0,
        "the pod-worker did meet the outage"
    );

    // The pod-worker is dead as well (not restarted): vm jobs still run.
    system.pod_worker.kill9();
    let (_, vm_worker_dead) = run_batch(&mut system, "vm", batch, limit).await?;
    assert_eq!(
        system.final_count(&stuck_pods),
        0,
        "pod jobs cannot finish without a pod-worker"
    );
    eprintln!(
        "isolation: vm jobs with the Kubernetes API down {vm_api_down:?}, with the pod-worker dead too {vm_worker_dead:?}"
    );

    // Back to health: the stalled pod jobs complete.
    system.kube.set_unavailable(false);
    system.pod_worker.restart()?;
    let ready = system.pod_worker.wait_ready(Duration::from_secs(60)).await;
    check(&mut system, "pod-worker ready again", ready).await?;
    let recovered = Instant::now();
    let done = system.wait_jobs_final(&stuck_pods, limit).await;
    check(&mut system, "stalled pod jobs final after recovery", done).await?;
    eprintln!(
        "isolation: stalled pod jobs final {:?} after recovery",
        recovered.elapsed()
    );

    // OpenSandbox is in outage: vm jobs wait, pod jobs run as before.
    system.sandbox.set_outage(true);
    let stuck_vms = system.enqueue_ids("vm", 6, &[("JR_FAKE_DURATION_MS", "200")]);
    let (_, pod_sandbox_down) = run_batch(&mut system, "pod", batch, limit).await?;
    assert_eq!(
        system.final_count(&stuck_vms),
        0,
        "vm jobs cannot finish while OpenSandbox is down"
    );
    eprintln!("isolation: pod jobs with OpenSandbox down {pod_sandbox_down:?}");

    system.sandbox.set_outage(false);
    let recovered = Instant::now();
    let done = system.wait_jobs_final(&stuck_vms, limit).await;
    check(&mut system, "stalled vm jobs final after recovery", done).await?;
    eprintln!(
        "isolation: stalled vm jobs final {:?} after recovery",
        recovered.elapsed()
    );

    settle(&mut system, limit).await
}
