//! GitHub Actions as a second forge, next to Gitea: the four service binaries, real NATS and
//! PostgreSQL, the fake GitHub, and Pods that run the executor image's entrypoint, which fetches
//! the runner config from the facade and starts the runner stand-in. Needs `cargo build
//! --workspace --bins` first (the README's test command does it).

use std::collections::HashSet;
use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

/// The failure with what explains it: the GitHub side's state, the ledger's GitHub messages,
/// the executors' last lines and the services' logs (kept in full under /tmp).
async fn failure(
    system: &mut System,
    touched: &HashSet<i64>,
    e: impl std::fmt::Display,
) -> anyhow::Error {
    let kept = jr_scenarios::chaos::keep_logs(system, "github")
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    let ledger = system.github_ledger_dump().await.unwrap_or_default();
    let executors = system.executor_log();
    let tail: Vec<&str> = executors.lines().rev().take(40).collect();
    anyhow::anyhow!(
        "{e}\nGitHub: {:#?}\nGitHub ledger:\n{ledger}\nexecutors (last lines first):\n{}\n{}\nfull logs in {kept}",
        system.github_violations(touched),
        tail.join("\n"),
        system.logs()
    )
}

/// Waits for both forges' jobs to end and for the workloads to go, then checks every invariant:
/// each job final once with its runner's result, capacity kept, no runner, workload or Secret
/// left, and no runner config readable on the bus.
async fn finish_and_check(system: &mut System, touched: &HashSet<i64>) -> anyhow::Result<()> {
    let gitea_jobs = !system.forge.snapshot().jobs.is_empty();
    let waited = async {
        if gitea_jobs {
            system.wait_all_final(Duration::from_secs(180)).await?;
        }
        system.wait_github_final(Duration::from_secs(180)).await?;
        system.wait_no_workloads(Duration::from_secs(90)).await
    }
    .await;
    if let Err(e) = waited {
        return Err(failure(system, touched, e).await);
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
    // The listener's metrics count what happened: every job that ran completed, and it made a
    // runner for each of them.
    let metrics = reqwest::get(format!(
        "http://127.0.0.1:{}/metrics",
        system.ports.scheduler_ops
    ))
    .await?
    .text()
    .await?;
    let sample = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}{{forge=\"gh\"}} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let ran = (jobs.len() - cancelled.len()) as u64;
    assert!(
        sample("jetrunner_github_jobs_completed_total") >= ran,
        "completed: {metrics}"
    );
    assert!(
        sample("jetrunner_github_runners_made_total") >= ran,
        "runners made: {metrics}"
    );
    assert!(sample("jetrunner_github_sessions_total") >= 1, "{metrics}");
    Ok(())
}

/// The scale set id of the harness's `[[github]]` entry.
fn scale_set(system: &System) -> i64 {
    system
        .github
        .as_ref()
        .and_then(|g| g.scale_set_by_name("jetrunner"))
        .map(|(id, _)| id)
        .expect("the listener made its scale set")
}

/// Pacing as on Gitea: the listener announces as its capacity the jobs it holds plus the room
/// the backend has (its lookahead less the assignments waiting for a slot), so GitHub never
/// has more jobs assigned to the scale set than the backend can run plus its lookahead, even
/// with a `max_runners` far above that.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn github_assigns_no_more_jobs_than_capacity_and_lookahead() -> anyhow::Result<()> {
    let (capacity, lookahead) = (3, 2);
    let mut system = System::start(SystemSpec {
        pod_capacity: capacity,
        lookahead,
        github: true,
        github_max_runners: Some(100),
        log_filter: "info,jr_github=debug".into(),
        ..Default::default()
    })
    .await?;
    let jobs = system.enqueue_github(20);
    finish_and_check(&mut system, &HashSet::new()).await?;
    let peak = system
        .github
        .as_ref()
        .expect("github")
        .peak_open(scale_set(&system));
    if peak > capacity + lookahead {
        let _ = jr_scenarios::chaos::keep_logs(&system, "github-pacing");
    }
    assert!(
        peak <= capacity + lookahead,
        "{peak} jobs assigned to the scale set at once; capacity {capacity} + lookahead {lookahead}"
    );
    assert_eq!(jobs.len(), 20);
    Ok(())
}

/// HA: two replicas of every service. The scheduler replica leading the GitHub listener is
/// killed with SIGKILL in the middle; the other takes the lease over and resumes the message
/// session from the saved cursor, and every invariant holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn github_jobs_survive_the_leading_scheduler_killed() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 3,
        github: true,
        standbys: true,
        ..Default::default()
    })
    .await?;
    let mut jobs = system.enqueue_github(8);
    system.enqueue("pod", 4, &[("JR_FAKE_DURATION_MS", "300")]);
    system.enqueue("vm", 2, &[("JR_FAKE_DURATION_MS", "300")]);
    let github = system.github.clone().expect("github");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while github
        .jobs()
        .iter()
        .filter(|j| matches!(j.state, jr_fake_github::JobState::Completed { .. }))
        .count()
        < 3
    {
        if tokio::time::Instant::now() > deadline {
            return Err(failure(
                &mut system,
                &HashSet::new(),
                "fewer than 3 GitHub jobs finished",
            )
            .await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The leader holds the session; which replica leads is whoever took the lease first.
    let session_before = github.session(scale_set(&system));
    for name in ["scheduler", "scheduler-b"] {
        let leads = system
            .service(name)
            .map(|p| {
                std::fs::read_to_string(p.log_path())
                    .unwrap_or_default()
                    .contains("leading the GitHub scale set")
            })
            .unwrap_or(false);
        if leads {
            system.service(name).expect("scheduler").kill9();
            break;
        }
    }
    jobs.extend(system.enqueue_github(8));
    finish_and_check(&mut system, &HashSet::new()).await?;
    // The new leader resumed the session the killed one left (no second session, no 409 loop).
    assert_eq!(
        github.session(scale_set(&system)),
        session_before,
        "the message session was not resumed"
    );
    assert_eq!(jobs.len(), 16);
    Ok(())
}

/// The chaos suite's service, NATS and PostgreSQL faults and Pod evictions while GitHub jobs
/// arrive in waves: every job final once (with its runner's result, or `failed` where its
/// runner was evicted mid-job), no runner, workload or runner config left behind. A runner
/// evicted before it took a job is made again, so every job still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn github_jobs_under_chaos_keep_every_invariant() -> anyhow::Result<()> {
    use jr_scenarios::chaos::{Chaos, ChaosConfig, SERVICES, keep_logs, seed_from_env};
    let seed = seed_from_env();
    println!("chaos seed {seed} (replay with JR_CHAOS_SEED={seed})");
    let mut system = System::start(SystemSpec {
        pod_capacity: 5,
        vm_capacity: 3,
        github: true,
        claim_timeout: Duration::from_secs(15),
        keepalive: Duration::from_secs(5),
        ..Default::default()
    })
    .await?;
    // `JR_GITHUB_CHAOS_SECS` lengthens the run (scripts/soak.sh); a wave of jobs every 5 s.
    let secs: u64 = std::env::var("JR_GITHUB_CHAOS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
        .max(30);
    let wave_count = u32::try_from(secs / 5).unwrap_or(6).max(6) - 2;
    let mut config = ChaosConfig::new(seed, Duration::from_secs(secs));
    config.kinds = vec![
        "kill-service",
        "restart-nats",
        "restart-postgres",
        "evict-pod",
    ];
    let mut chaos = Chaos::new(config);
    let mut waves = 0u32;
    let mut jobs = Vec::new();
    let run = chaos
        .run(&mut system, |system, elapsed| {
            while waves < wave_count && elapsed >= Duration::from_secs(5) * waves {
                jobs.extend(system.enqueue_github(6));
                waves += 1;
            }
        })
        .await;
    let settled = match run {
        Ok(()) => chaos.settle(&mut system, Duration::from_secs(60)).await,
        Err(e) => Err(e),
    };
    let checked = match settled {
        Ok(()) => finish_and_check(&mut system, &HashSet::new()).await,
        Err(e) => Err(e),
    };
    if let Err(e) = checked {
        let kept = keep_logs(&system, &format!("github-chaos-{seed}"))
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        anyhow::bail!("{e}\n{}\nlogs kept in {kept}", chaos.log());
    }
    for service in SERVICES {
        assert!(
            chaos.killed(service) > 0,
            "{service} was never killed\n{}",
            chaos.log()
        );
    }
    for kind in ["restart-nats", "restart-postgres"] {
        assert!(chaos.count(kind) > 0, "no {kind}\n{}", chaos.log());
    }
    // Evictions are drawn like the other faults, but a runner's Pod lives about a second here:
    // a run may find none running when one is drawn (the log says so).
    println!("Pods evicted: {}", chaos.count("evict-pod"));
    assert_eq!(jobs.len(), 6 * wave_count as usize);
    Ok(())
}

/// Warm executors wait for Gitea jobs; GitHub jobs never go to them (each needs the runner made
/// for it) and run in Pods of their own next to them, and the warm ones are still there, idle,
/// at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn github_jobs_run_next_to_warm_executors_without_taking_them() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 3,
        github: true,
        warm_idle: 1,
        ..Default::default()
    })
    .await?;
    let jobs = system.enqueue_github(8);
    system.enqueue("pod", 4, &[("JR_FAKE_DURATION_MS", "300")]);
    system.enqueue("vm", 2, &[("JR_FAKE_DURATION_MS", "300")]);
    finish_and_check(&mut system, &HashSet::new()).await?;
    // Every GitHub job ran in a Pod made for a GitHub assignment (attempt 1), none in a warm one.
    let starts = system
        .executor_log()
        .lines()
        .filter(|l| l.contains("starting the GitHub runner"))
        .count();
    assert_eq!(starts, jobs.len(), "GitHub runner starts");
    Ok(())
}

/// Warm GitHub runners (`min_idle = 2`): two runners are made, registered and idle before any
/// job exists; the first jobs start on them, and when the jobs are over two idle runners are
/// left, each in a workload of its own (and nothing else).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warm_github_runners_take_the_first_jobs_and_min_idle_stays() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 3,
        github: true,
        github_min_idle: 2,
        no_gitea: true,
        ..Default::default()
    })
    .await?;
    let github = system.github.clone().expect("github");
    let online = |github: &jr_fake_github::FakeGitHub| {
        github
            .runners()
            .iter()
            .filter(|r| r.started && r.job.is_none())
            .map(|r| r.id)
            .collect::<HashSet<i64>>()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while online(&github).len() < 2 {
        if tokio::time::Instant::now() > deadline {
            return Err(failure(&mut system, &HashSet::new(), "no two warm runners online").await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let warm = online(&github);
    let jobs = system.enqueue_github(5);
    if let Err(e) = system.wait_github_final(Duration::from_secs(120)).await {
        return Err(failure(&mut system, &HashSet::new(), e).await);
    }
    let on_warm = jobs
        .iter()
        .filter_map(|j| github.job(*j).and_then(|j| j.runner))
        .filter(|r| warm.contains(r))
        .count();
    anyhow::ensure!(
        on_warm == 2,
        "{on_warm} of the jobs ran on the two runners made before them"
    );
    // Two idle runners again, each in its own workload; every job final once.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let idle = online(&github).len();
        let registered = github.runners().len();
        let workloads = system.kube.pods(jr_scenarios::system::JOBS_NAMESPACE).len();
        if idle == 2 && registered == 2 && workloads == 2 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(failure(
                &mut system,
                &HashSet::new(),
                format!("at the end: {idle} idle runners online, {registered} registered, {workloads} Pods"),
            )
            .await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut violations = system.github_violations(&HashSet::new());
    // The two warm runners are meant to stay registered.
    violations.retain(|v| !v.contains("left registered (started true, job None)"));
    violations.extend(system.github_bus_violations().await?);
    anyhow::ensure!(violations.is_empty(), "{violations:#?}");
    Ok(())
}

/// Warm capacity yields, with standbys: two replicas of every service, and every Pod slot held by
/// an idle warm executor (capacity 2, `min_idle = 2`) when GitHub jobs arrive. A GitHub runner
/// cannot bind to a warm executor, so one yields its slot for each runner waiting; every GitHub
/// and Gitea job runs, and the warm executors are back at the end. Seen failing without the
/// yield: the GitHub jobs waited for slots the warm executors held until the scenario gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn warm_executors_yield_their_slots_to_github_runners_with_standbys() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 2,
        vm_capacity: 2,
        github: true,
        warm_idle: 2,
        standbys: true,
        ..Default::default()
    })
    .await?;
    let jobs = system.enqueue_github(4);
    system.enqueue("pod", 2, &[("JR_FAKE_DURATION_MS", "300")]);
    if let Err(e) = system.wait_github_final(Duration::from_secs(180)).await {
        return Err(failure(&mut system, &HashSet::new(), e).await);
    }
    // The GitHub jobs got their slots from warm executors that yielded, not from ones that
    // gave up waiting for a task (an idle warm executor's executor exits after 60 s here).
    let gave_up = system
        .executor_log()
        .lines()
        .filter(|l| l.contains("no task"))
        .count();
    anyhow::ensure!(
        gave_up == 0,
        "{gave_up} warm executors gave up before the GitHub jobs were done: their slots were not yielded"
    );
    finish_and_check(&mut system, &HashSet::new()).await?;
    let starts = system
        .executor_log()
        .lines()
        .filter(|l| l.contains("starting the GitHub runner"))
        .count();
    assert_eq!(starts, jobs.len(), "GitHub runner starts");
    Ok(())
}
