use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use jr_telemetry::{Shutdown, TaskSet};

/// Sets its flag when dropped: tells whether an aborted task's future was really dropped.
struct DropFlag(Arc<AtomicBool>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn join_all_reports_finished_failed_and_unfinished_tasks() {
    let shutdown = Shutdown::new();
    let mut tasks = TaskSet::new(shutdown.clone());
    let dropped = Arc::new(AtomicBool::new(false));

    let watcher = shutdown.clone();
    tasks.spawn("polite", async move { watcher.cancelled().await });
    let flag = DropFlag(dropped.clone());
    tasks.spawn("stubborn", async move {
        let _flag = flag;
        std::future::pending::<()>().await
    });
    tasks.spawn("broken", async { Err::<(), _>("disk on fire") });

    // The failing task alone brings the service down.
    tokio::time::timeout(Duration::from_secs(5), shutdown.cancelled())
        .await
        .expect("a failed task triggers shutdown");

    let report = tasks.join_all(Duration::from_millis(300)).await;
    assert_eq!(report.finished, vec!["polite".to_owned()]);
    assert_eq!(
        report.failed,
        vec![("broken".to_owned(), "disk on fire".to_owned())]
    );
    assert_eq!(report.unfinished, vec!["stubborn".to_owned()]);
    assert!(!report.is_clean());
    tokio::time::timeout(Duration::from_secs(5), async {
        while !dropped.load(Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the unfinished task was aborted");
}

#[tokio::test]
async fn a_panicking_task_triggers_shutdown_and_is_reported() {
    let shutdown = Shutdown::new();
    let mut tasks = TaskSet::new(shutdown.clone());
    tasks.spawn("panicky", async {
        let empty: Vec<u8> = Vec::new();
        // Index out of bounds, at runtime.
        let _ = empty[usize::from(empty.is_empty())];
    });
    tokio::time::timeout(Duration::from_secs(5), shutdown.cancelled())
        .await
        .expect("a panic triggers shutdown");
    let report = tasks.join_all(Duration::from_secs(1)).await;
    assert_eq!(report.failed.len(), 1);
    assert_eq!(report.failed[0].0, "panicky");
    assert!(
        report.failed[0].1.starts_with("panicked"),
        "{:?}",
        report.failed
    );
}

#[tokio::test]
async fn dropping_the_set_aborts_its_tasks() {
    let dropped = Arc::new(AtomicBool::new(false));
    let mut tasks = TaskSet::new(Shutdown::new());
    let flag = DropFlag(dropped.clone());
    tasks.spawn("forever", async move {
        let _flag = flag;
        std::future::pending::<()>().await
    });
    assert_eq!(tasks.len(), 1);
    drop(tasks);
    tokio::time::timeout(Duration::from_secs(5), async {
        while !dropped.load(Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("dropping the set aborted the task");
}

#[tokio::test]
async fn a_clean_drain_is_clean() {
    let shutdown = Shutdown::new();
    let mut tasks = TaskSet::new(shutdown.clone());
    for name in ["a", "b"] {
        let watcher = shutdown.clone();
        tasks.spawn(name, async move {
            watcher.cancelled().await;
            Ok::<(), std::io::Error>(())
        });
    }
    shutdown.trigger();
    let mut report = tasks.join_all(Duration::from_secs(5)).await;
    report.finished.sort();
    assert!(report.is_clean());
    assert_eq!(report.finished, vec!["a".to_owned(), "b".to_owned()]);
}
