//! The harness checks itself: each end invariant the scenarios rely on is shown failing on a
//! run broken on purpose, so a check that cannot fail is caught here rather than trusted.
//!
//! One small system runs a clean batch (no violation may be reported), then is broken in turn:
//! the harness is told a capacity one below what the workers were configured with (a worker
//! allowed one slot too many), a job is made to fail by a fault the harness is not told about,
//! and a Pod and a token Secret are left behind with the workers down. Needs the service
//! binaries; run with `--test-threads=1`.

use std::collections::HashSet;
use std::time::Duration;

use jr_scenarios::system::JOBS_NAMESPACE;
use jr_scenarios::{System, SystemSpec, Touched};
use serde_json::json;

fn any(lines: &[String], needle: &str) -> bool {
    lines.iter().any(|l| l.contains(needle))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_invariant_catches_a_run_broken_on_purpose() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 2,
        vm_capacity: 2,
        vm_pool: Some(4),
        ..Default::default()
    })
    .await?;
    system.enqueue("pod", 6, &[("JR_FAKE_DURATION_MS", "600")]);
    system.enqueue(
        "vm",
        6,
        &[
            ("JR_FAKE_DURATION_MS", "600"),
            ("JR_FAKE_OUTCOME", "failure"),
        ],
    );
    system.wait_all_final(Duration::from_secs(180)).await?;
    system.wait_no_workloads(Duration::from_secs(90)).await?;

    // A correct run: nothing to report, and every job compared.
    let clean = system.violations();
    assert!(clean.is_empty(), "{clean:#?}");
    let outcomes = system.outcome_violations(&Touched::default()).await?;
    assert!(outcomes.violations.is_empty(), "{outcomes:#?}");
    assert_eq!((outcomes.checked, outcomes.touched), (12, 0));
    assert_eq!(
        (system.kube.records().max_live, system.sandbox.max_held()),
        (2, 2),
        "both backends used their whole capacity, so one slot too many would show"
    );

    // 1. Capacity: the workers were allowed 2 each; a harness expecting 1 must see the excess,
    // by the fakes' own counts.
    system.spec.pod_capacity = 1;
    system.spec.vm_capacity = 1;
    let over = system.violations();
    assert!(any(&over, "live Pods at once, capacity 1"), "{over:#?}");
    assert!(
        any(&over, "sandboxes held at once, capacity 1"),
        "{over:#?}"
    );
    system.spec.pod_capacity = 2;
    system.spec.vm_capacity = 2;

    // 2. Outcome: a job told to succeed is made to fail by an eviction nobody records.
    let victim = system.enqueue_ids("pod", 1, &[("JR_FAKE_DURATION_MS", "60000")]);
    let pod = {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let running =
                system.kube.pods(JOBS_NAMESPACE).into_iter().find(|p| {
                    p.pointer("/status/phase").and_then(|v| v.as_str()) == Some("Running")
                });
            if let Some(name) = running
                .as_ref()
                .and_then(|p| p.pointer("/metadata/name"))
                .and_then(|v| v.as_str())
            {
                break name.to_owned();
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the victim's Pod never ran"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // Wait until its executor has sent log lines (it has claimed the task; a heartbeat alone
    // may be the facade's own before the claim), so the eviction is a failure after claim: the
    // job's result.
    let claimed = system
        .forge
        .wait_until(
            |s| {
                s.job(victim[0])
                    .and_then(|j| j.task_ids.first())
                    .and_then(|t| s.task(*t))
                    .is_some_and(|t| !t.log.is_empty())
            },
            Duration::from_secs(60),
        )
        .await;
    anyhow::ensure!(claimed.is_ok(), "the victim was never claimed");
    system.kube.set_pod_status(
        JOBS_NAMESPACE,
        &pod,
        json!({"phase": "Failed", "reason": "Evicted", "message": "unrecorded eviction"}),
    )?;
    system
        .wait_jobs_final(&victim, Duration::from_secs(120))
        .await?;
    system.wait_no_workloads(Duration::from_secs(90)).await?;
    let caught = system.outcome_violations(&Touched::default()).await?;
    assert_eq!(
        caught.violations.len(),
        1,
        "{caught:#?}\n{}\n{}",
        system.logs(),
        system.executor_log()
    );
    assert!(
        caught.violations[0].contains(&format!("{:?}", victim[0])),
        "{caught:#?}"
    );
    // Told about the fault, the harness leaves the job out instead.
    let told = Touched {
        workloads: HashSet::from([pod.clone()]),
        ..Touched::default()
    };
    let excused = system.outcome_violations(&told).await?;
    assert!(excused.violations.is_empty(), "{excused:#?}");
    assert_eq!((excused.checked, excused.touched), (12, 1));

    // 3. Leaks: with the pod-worker down (nobody to clean up), a jetrunner Pod and token
    // Secret left behind are reported.
    assert!(system.violations().is_empty(), "{:#?}", system.violations());
    system.pod_worker.kill9();
    let labels = json!({"app.kubernetes.io/managed-by": "jetrunner"});
    system.kube.create_pod(
        JOBS_NAMESPACE,
        json!({"metadata": {"name": "left-behind", "labels": labels},
               "spec": {"containers": [{"name": "c", "image": "x"}]}}),
    )?;
    system.kube.create_secret(
        JOBS_NAMESPACE,
        json!({"metadata": {"name": "left-behind-token", "labels": labels},
               "stringData": {"token": "t"}}),
    )?;
    let leaks = system.violations();
    assert!(any(&leaks, "1 Pods left"), "{leaks:#?}");
    assert!(any(&leaks, "1 token Secrets left"), "{leaks:#?}");
    Ok(())
}
