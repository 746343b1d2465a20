//! Fault injection (dropped replies, injected errors) and the `/_fake/…` admin API.

mod common;

use std::time::Duration;

use common::{CallError, Client, start, start_with_runner};
use jr_fake_forge::{
    ChangedReply, Config, DropMode, EnqueueReply, FaultConfig, JobSpec, Rpc, Snapshot, Stats,
    Status,
};

fn pod_job() -> JobSpec {
    JobSpec {
        runs_on: vec!["pod".into()],
        ..JobSpec::default()
    }
}

#[tokio::test]
async fn aborted_reply_still_assigns_the_task_to_the_runner() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    let job_id = forge.enqueue_job(pod_job());
    forge.set_faults(FaultConfig {
        drop_next: 1,
        drop_mode: DropMode::Abort,
        only: vec![Rpc::FetchTask],
        ..FaultConfig::default()
    });

    let err = runner.fetch(0).await.expect_err("the reply is lost");
    assert!(matches!(err, CallError::Transport(_)), "{err:?}");
    let snap = forge.snapshot();
    let job = snap.job(job_id).expect("job");
    assert_eq!((job.status, job.fetch_count), (Status::Running, 1));
    let task = snap.task(job.task_ids[0]).expect("task");
    assert_eq!(
        (task.runner_uuid.as_str(), task.status),
        (runner.uuid.as_str(), Status::Running)
    );
    assert_eq!(snap.faults.dropped_replies, 1);
    assert!(
        runner.fetch(0).await.expect("fetch").task.is_none(),
        "the job is not handed out again"
    );
}

#[tokio::test]
async fn hung_reply_is_processed_while_the_client_times_out() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    let impatient = Client::with_timeout(forge.url(), Duration::from_millis(300))
        .authed(&runner.uuid, &runner.token);
    forge.enqueue_job(pod_job());
    let task = runner.fetch_task().await;
    forge.set_faults(FaultConfig {
        drop_next: 1,
        drop_mode: DropMode::Hang,
        ..FaultConfig::default()
    });

    let err = impatient
        .log(task.id, 0, &["one", "two"], false)
        .await
        .expect_err("no answer");
    assert!(matches!(err, CallError::Transport(_)), "{err:?}");
    assert_eq!(
        forge.snapshot().task(task.id).expect("task").log,
        vec!["one", "two"]
    );
    assert_eq!(
        runner
            .log(task.id, 0, &["one", "two", "three"], false)
            .await
            .expect("resend"),
        3
    );
    forge
        .shutdown()
        .await
        .expect("shutdown releases the hung handler");
}

#[tokio::test]
async fn injected_errors_are_not_processed() {
    let (forge, anon) = start(Config::default()).await;
    forge.set_faults(FaultConfig {
        error_next: 2,
        only: vec![Rpc::Register],
        ..FaultConfig::default()
    });
    for _ in 0..2 {
        let Err(CallError::Status { status, .. }) =
            anon.register(&forge.registration_token(), "r", &[]).await
        else {
            panic!("injected 500 expected");
        };
        assert_eq!(status, 500);
    }
    assert!(forge.snapshot().runners.is_empty());
    anon.register(&forge.registration_token(), "r", &[])
        .await
        .expect("third call passes");
    let snap = forge.snapshot();
    assert_eq!((snap.runners.len(), snap.faults.injected_errors), (1, 2));
}

#[tokio::test]
async fn admin_api_enqueues_cancels_and_reports_stats() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    let http = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", forge.url());

    let body = serde_json::json!({"runs_on": ["pod"], "steps": 2, "count": 3});
    let reply: EnqueueReply = http
        .post(url("/_fake/jobs"))
        .json(&body)
        .send()
        .await
        .expect("post")
        .json()
        .await
        .expect("json");
    assert_eq!(reply.job_ids.len(), 3);
    let vm: EnqueueReply = http
        .post(url("/_fake/jobs"))
        .json(&serde_json::json!({"runs_on": ["vm"]}))
        .send()
        .await
        .expect("post")
        .json()
        .await
        .expect("json");
    assert_eq!(vm.job_ids.len(), 1);

    let task = runner.fetch_task().await;
    let cancelled: ChangedReply = http
        .post(url(&format!("/_fake/tasks/{}/cancel", task.id)))
        .send()
        .await
        .expect("post")
        .json()
        .await
        .expect("json");
    assert!(cancelled.changed);
    let missing = http
        .post(url("/_fake/tasks/4242/cancel"))
        .send()
        .await
        .expect("post");
    assert_eq!(missing.status().as_u16(), 404);

    let stats: Stats = http
        .get(url("/_fake/stats"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!((stats.queued, stats.running), (3, 0));
    assert_eq!(stats.done.get("cancelled"), Some(&1));
    assert_eq!(
        (
            stats.labels["pod"].queued,
            stats.labels["pod"].done,
            stats.labels["vm"].queued
        ),
        (2, 1, 1)
    );

    let faults = FaultConfig {
        latency_ms: 5,
        ..FaultConfig::default()
    };
    let set: FaultConfig = http
        .put(url("/_fake/faults"))
        .json(&faults)
        .send()
        .await
        .expect("put")
        .json()
        .await
        .expect("json");
    assert_eq!(set, faults);
    assert_eq!(forge.faults(), faults);

    let snap: Snapshot = http
        .get(url("/_fake/snapshot"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(snap, forge.snapshot());
}

#[tokio::test]
async fn wait_until_sees_changes_made_by_runners() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    forge.enqueue_jobs(pod_job(), 3);
    let worker = tokio::spawn(async move {
        while let Some(task) = runner.fetch(0).await.expect("fetch").task {
            runner.log(task.id, 0, &["ok"], true).await.expect("log");
            runner
                .update(
                    task.id,
                    jr_forge::proto::runner::v1::Result::Success,
                    vec![],
                    &[],
                )
                .await
                .expect("final");
        }
    });
    let snap = forge
        .wait_until(Snapshot::all_final, Duration::from_secs(10))
        .await
        .expect("all jobs finish");
    assert!(
        snap.tasks
            .iter()
            .all(|t| t.final_accepted == 1 && t.log_archived)
    );
    worker.await.expect("worker");
    let err = forge
        .wait_until(|s| s.jobs.is_empty(), Duration::from_millis(50))
        .await
        .expect_err("never true");
    assert_eq!(err.kind(), "wait_timeout");
}
