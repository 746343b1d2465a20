//! A shared registration declares only the labels of backends taking work, against the fake
//! forge and a real nats-server: a backend without a live worker, or full, has its labels
//! withdrawn and the other backend keeps fetching; its labels come back with its worker, and
//! its queued jobs are then fetched at once (the next fetch sends `tasks_version` 0).

mod support;

use std::time::Duration;

use jr_bus::intake::Blocked;
use jr_fake_forge::JobSpec;
use support::World;

fn job(label: &str) -> JobSpec {
    JobSpec {
        runs_on: vec![label.to_owned()],
        ..JobSpec::default()
    }
}

/// Tasks the forge handed out for jobs asking for `label`.
fn fetched(snapshot: &jr_fake_forge::Snapshot, label: &str) -> usize {
    snapshot
        .tasks
        .iter()
        .filter(|t| {
            snapshot
                .job(t.job_id)
                .is_some_and(|j| j.runs_on.iter().any(|l| l == label))
        })
        .count()
}

fn runner_labels(world: &World) -> Vec<Vec<String>> {
    world
        .forge
        .snapshot()
        .runners
        .iter()
        .filter(|r| !r.deleted)
        .map(|r| r.labels.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_without_a_worker_has_its_labels_withdrawn_and_the_other_keeps_fetching() {
    let world = World::start().await;
    world.worker_stops("pod").await;
    world.forge.enqueue_jobs(job("pod"), 4);
    world.forge.enqueue_jobs(job("vm"), 4);
    let _workers = world.drain_workers();
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;
    world
        .forge
        .wait_until(|s| fetched(s, "vm") == 4, Duration::from_secs(20))
        .await
        .expect("every vm job is fetched while pod has no worker");
    assert_eq!(runner_labels(&world), vec![vec!["vm".to_owned()]]);
    let early = world
        .forge
        .wait_until(|s| fetched(s, "pod") > 0, Duration::from_secs(2))
        .await;
    assert!(early.is_err(), "a pod job was fetched with no pod worker");
    let intake = fetchers.dispatcher.intakes.snapshot();
    let pod = intake[0]
        .backends
        .iter()
        .find(|b| b.backend == "pod")
        .expect("pod reported");
    assert_eq!(pod.blocked, Some(Blocked::NoWorker));
    assert!(!pod.declared);
    assert!(intake[0].fetching);

    // The worker is back: its labels are declared again and its queued jobs fetched, well
    // before the periodic `tasks_version` 0 (30 s) would find them.
    world.worker_starts("pod");
    world
        .forge
        .wait_until(|s| fetched(s, "pod") == 4, Duration::from_secs(10))
        .await
        .expect("the pod jobs are fetched once the worker lives");
    assert_eq!(
        runner_labels(&world),
        vec![vec!["pod".to_owned(), "vm".to_owned()]]
    );
    assert!(
        fetchers
            .dispatcher
            .stats
            .declares
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_backend_holds_only_its_lookahead_and_never_the_others_jobs() {
    let world = World::start().await;
    // Pod jobs first in the forge's order: the old rule (the smallest room of all backends)
    // fetched the pod lookahead and then nothing at all.
    world.forge.enqueue_jobs(job("pod"), 6);
    world.forge.enqueue_jobs(job("vm"), 6);
    // Only vm's worker takes its assignments; pod's worker lives but has no free slot.
    let _workers = world.drain_workers_of(&["vm"]);
    let fetchers = world
        .start_fetchers(Duration::from_millis(50), Duration::from_millis(200))
        .await;
    world
        .forge
        .wait_until(|s| fetched(s, "vm") == 6, Duration::from_secs(20))
        .await
        .expect("every vm job is fetched while pod is full");
    let snapshot = world.forge.snapshot();
    assert_eq!(
        fetched(&snapshot, "pod"),
        2,
        "pod's lookahead (2) and no more"
    );
    assert_eq!(world.waiting_for("pod").await, 2);
    assert_eq!(runner_labels(&world), vec![vec!["vm".to_owned()]]);
    let intake = fetchers.dispatcher.intakes.snapshot();
    assert!(
        intake[0]
            .backends
            .iter()
            .any(|b| b.backend == "pod" && b.blocked == Some(Blocked::Full))
    );
}
