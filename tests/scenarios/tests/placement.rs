//! Providers inside the Pod backend: placement by weight, a provider answering "full" (a
//! ResourceQuota), a provider drained mid-run. Two providers in two namespaces of the fake
//! Kubernetes API; which one ran a job is read from where the Pods were created. Needs
//! `cargo build --workspace --bins` first; run with `--test-threads=1`.

use std::time::Duration;

use jr_scenarios::system::JOBS_NAMESPACE;
use jr_scenarios::{System, SystemSpec};
use jr_store::Store;

const OTHER_NAMESPACE: &str = "jetrunner-jobs-b";

fn providers(weight_a: u32, weight_b: u32, b_disabled: bool) -> String {
    format!(
        r#"
[[backend.pod.providers]]
name = "a"
weight = {weight_a}
kubernetes = {{ namespace = "{JOBS_NAMESPACE}" }}

[[backend.pod.providers]]
name = "b"
weight = {weight_b}
disabled = {b_disabled}
kubernetes = {{ namespace = "{OTHER_NAMESPACE}" }}
"#
    )
}

/// Pods created in each provider's namespace so far: (a, b).
fn created(system: &System) -> (usize, usize) {
    let created = system.kube.records().created;
    let count = |ns: &str| {
        created
            .iter()
            .filter(|p| p.split_once('/').is_some_and(|(n, _)| n == ns))
            .count()
    };
    (count(JOBS_NAMESPACE), count(OTHER_NAMESPACE))
}

async fn finish(system: &mut System, timeout: Duration) -> anyhow::Result<()> {
    if let Err(e) = system.wait_all_final(timeout).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    if let Err(e) = system.wait_no_workloads(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let violations = system.violations();
    anyhow::ensure!(violations.is_empty(), "{violations:#?}\n{}", system.logs());
    let outcomes = system.outcome_violations(&Default::default()).await?;
    anyhow::ensure!(outcomes.violations.is_empty(), "{:#?}", outcomes.violations);
    Ok(())
}

/// Every assignment ran on its first attempt: placement never spent one.
async fn attempts_spent(system: &System) -> anyhow::Result<usize> {
    let records = Store::connect(&system.database_url)
        .await?
        .records()
        .await?;
    Ok(records
        .iter()
        .map(|r| r.attempts.keys().max().copied().unwrap_or(1) as usize - 1)
        .sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_providers_weighted_three_to_one_share_400_jobs_75_25() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 16,
        pod_executor_in_process: true,
        extra_toml: providers(3, 1, false),
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", 400, &[("JR_FAKE_DURATION_MS", "20")]);
    finish(&mut system, Duration::from_secs(300)).await?;
    let (a, b) = created(&system);
    println!("provider a: {a} Pods, provider b: {b} Pods");
    assert_eq!(a + b, 400, "one Pod per job");
    // 75 % ± 10 % of that share.
    let share = a as f64 / 400.0;
    assert!(
        (0.675..=0.825).contains(&share),
        "provider a ran {a} of 400 jobs ({:.1} %), want 75 % ± 10 %",
        share * 100.0
    );
    assert_eq!(attempts_spent(&system).await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_answering_full_passes_work_to_the_other_without_spending_attempts()
-> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 8,
        extra_toml: providers(1, 3, false),
        ..Default::default()
    })
    .await?;
    // The preferred provider's namespace holds two Pods at most: the API server refuses the
    // third with 403 "exceeded quota".
    system.kube.set_pod_quota(OTHER_NAMESPACE, Some(2));
    system.enqueue("pod", 24, &[("JR_FAKE_DURATION_MS", "1500")]);
    finish(&mut system, Duration::from_secs(180)).await?;
    let (a, b) = created(&system);
    println!(
        "provider a: {a} Pods, provider b: {b} Pods, {} creates refused by the quota",
        system.kube.quota_refusals()
    );
    assert!(
        system.kube.quota_refusals() > 0,
        "the quota never refused a create: the test did not exercise a full provider"
    );
    assert_eq!(a + b, 24, "one Pod per job");
    assert!(
        a > b,
        "the lighter provider took the overflow: a {a}, b {b}"
    );
    assert!(
        b >= 2,
        "the preferred provider ran work up to its quota: b {b}"
    );
    assert_eq!(
        attempts_spent(&system).await?,
        0,
        "a full provider spent attempts"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_provider_drained_mid_run_gets_no_new_work_and_its_running_work_finishes()
-> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 8,
        extra_toml: providers(1, 1, false),
        ..Default::default()
    })
    .await?;
    let first = system.enqueue_ids("pod", 6, &[("JR_FAKE_DURATION_MS", "4000")]);
    // Wait until both providers run some of the first jobs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while created(&system).1 == 0 || created(&system).0 == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the first jobs did not reach both providers: {:?}\n{}",
            created(&system),
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Drain "b": the configuration changes and the worker restarts, as a rollout does.
    let path = system.config_path();
    let text = std::fs::read_to_string(&path)?;
    anyhow::ensure!(
        text.contains("disabled = false"),
        "no drain switch in the config"
    );
    std::fs::write(&path, text.replace("disabled = false", "disabled = true"))?;
    system.pod_worker.restart()?;
    system
        .pod_worker
        .wait_ready(Duration::from_secs(30))
        .await?;
    let before = created(&system);
    system.enqueue("pod", 10, &[("JR_FAKE_DURATION_MS", "200")]);
    finish(&mut system, Duration::from_secs(180)).await?;
    let after = created(&system);
    println!("before the drain: {before:?}, after the run: {after:?}");
    assert_eq!(after.1, before.1, "the drained provider got new work");
    assert_eq!(after.0 + after.1, 16, "one Pod per job");
    // The first jobs, including the ones running on "b" while it was drained, succeeded.
    assert_eq!(system.final_count(&first), first.len());
    assert_eq!(attempts_spent(&system).await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_provider_is_held_then_written_off_and_its_jobs_run_elsewhere()
-> anyhow::Result<()> {
    // Provider "b" is its own cluster: a second API server whose Pods never start, so its
    // jobs wait there until the cluster becomes unreachable.
    let cluster_b = jr_fake_kube::FakeKube::start(jr_fake_kube::SimConfig::passive()).await?;
    let hold = Duration::from_secs(4);
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        claim_timeout: Duration::from_secs(120),
        resync_interval: Some(Duration::from_millis(300)),
        stray_grace: Some(Duration::from_secs(1)),
        unreachable_hold: Some(hold),
        extra_toml: format!(
            r#"
[[backend.pod.providers]]
name = "a"
kubernetes = {{ namespace = "{JOBS_NAMESPACE}" }}

[[backend.pod.providers]]
name = "b"
kubernetes = {{ namespace = "{OTHER_NAMESPACE}", api_url = "{}" }}
"#,
            cluster_b.url()
        ),
        ..Default::default()
    })
    .await?;
    let jobs = system.enqueue_ids("pod", 4, &[("JR_FAKE_DURATION_MS", "300")]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while cluster_b.records().created.len() < 2 || system.final_count(&jobs) < 2 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "expected two jobs done in a and two waiting in b: {} created in b, {} final\n{}",
            cluster_b.records().created.len(),
            system.final_count(&jobs),
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cut = tokio::time::Instant::now();
    cluster_b.set_unavailable(true);
    if let Err(e) = system.wait_all_final(Duration::from_secs(90)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let took = cut.elapsed();
    println!("the jobs held in b finished in a {took:?} after b became unreachable");
    assert!(
        took >= hold,
        "b's jobs were written off before the hold ({took:?} < {hold:?})"
    );
    assert_eq!(
        cluster_b.records().created.len(),
        2,
        "b got new work while unreachable"
    );
    let records = Store::connect(&system.database_url)
        .await?
        .records()
        .await?;
    let runs: Vec<_> = records
        .iter()
        .map(|r| {
            (
                r.attempts.keys().copied().collect::<Vec<_>>(),
                r.workloads
                    .keys()
                    .map(|(_, w)| w.clone())
                    .collect::<Vec<_>>(),
                r.redispatches
                    .values()
                    .map(|d| format!("{d:?}"))
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    assert_eq!(
        attempts_spent(&system).await?,
        2,
        "each job held in b ran again, once: {runs:#?}\n{}",
        system.logs()
    );
    // Back again: b's leftover Pods are strays of old attempts and are deleted.
    cluster_b.set_unavailable(false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while cluster_b.records().live > 0 || cluster_b.records().secrets > 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "b's leftovers were not deleted: {:?}\n{}",
            cluster_b.records(),
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    finish(&mut system, Duration::from_secs(30)).await?;
    Ok(())
}
