//! UpdateTask, UpdateLog, cancellation and reapers.

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{CallError, Client, reply_result, start_with_runner};
use jr_fake_forge::{Behaviour, Clock, Config, JobSpec, ManualClock, Outcome, Status, StopCause};
use jr_forge::proto::runner::v1 as pb;

fn pod_job() -> JobSpec {
    JobSpec {
        runs_on: vec!["pod".into()],
        steps: 2,
        ..JobSpec::default()
    }
}

fn step(id: i64, result: pb::Result, log_index: i64, log_length: i64) -> pb::StepState {
    pb::StepState {
        id,
        result: result as i32,
        started_at: Some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 0,
        }),
        stopped_at: None,
        log_index,
        log_length,
    }
}

#[tokio::test]
async fn update_log_acks_deduplicates_and_refuses_after_archive() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    forge.enqueue_job(pod_job());
    let task = runner.fetch_task().await;

    assert_eq!(
        runner
            .log(task.id, 0, &["a", "b", "c"], false)
            .await
            .expect("log"),
        3
    );
    assert_eq!(
        runner
            .log(task.id, 1, &["b", "c", "d"], false)
            .await
            .expect("overlap"),
        4,
        "overlap is de-duplicated"
    );
    assert_eq!(
        runner.log(task.id, 10, &["x"], false).await.expect("gap"),
        4,
        "a gap is not stored"
    );
    assert_eq!(
        runner
            .log(task.id, 0, &["a", "b"], false)
            .await
            .expect("resend"),
        4,
        "already stored"
    );
    assert_eq!(runner.log(task.id, 4, &[], false).await.expect("empty"), 4);
    assert_eq!(
        runner.log(task.id, 4, &["e"], true).await.expect("final"),
        5
    );

    let Err(CallError::Status {
        status,
        code,
        message,
    }) = runner.log(task.id, 5, &["late"], false).await
    else {
        panic!("archived log must refuse new rows");
    };
    assert_eq!((status, code.as_str()), (500, "unknown"));
    assert_eq!(
        message,
        "rpc error: code = AlreadyExists desc = log file has been archived"
    );
    assert_eq!(
        runner
            .log(task.id, 3, &["d", "e"], false)
            .await
            .expect("stored resend"),
        5
    );

    let snap = forge.snapshot();
    let record = snap.task(task.id).expect("task");
    assert_eq!(record.log, vec!["a", "b", "c", "d", "e"]);
    assert!(record.log_archived);
}

#[tokio::test]
async fn empty_final_log_archives_only_when_the_fix_is_enabled() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    forge.enqueue_jobs(pod_job(), 2);
    let quirky = runner.fetch_task().await;
    assert_eq!(
        runner
            .log(quirky.id, 0, &[], true)
            .await
            .expect("empty final"),
        0
    );
    assert!(
        !forge.snapshot().task(quirky.id).expect("task").log_archived,
        "old Gitea ignores no_more here"
    );

    forge.set_behaviour(Behaviour {
        archive_on_empty_final: true,
        ..forge.behaviour()
    });
    let fixed = runner.fetch_task().await;
    assert_eq!(
        runner
            .log(fixed.id, 0, &[], true)
            .await
            .expect("empty final"),
        0
    );
    assert!(forge.snapshot().task(fixed.id).expect("task").log_archived);
}

#[tokio::test]
async fn final_result_is_sticky_and_outputs_are_first_write_wins() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    let job_id = forge.enqueue_job(pod_job());
    let task = runner.fetch_task().await;

    let beat = runner
        .update(
            task.id,
            pb::Result::Unspecified,
            vec![
                step(0, pb::Result::Success, 0, 2),
                step(1, pb::Result::Unspecified, 2, 1),
                step(9, pb::Result::Success, 0, 0),
            ],
            &[("a", "1")],
        )
        .await
        .expect("heartbeat");
    assert_eq!(reply_result(&beat), pb::Result::Unspecified);
    assert_eq!(beat.sent_outputs, vec!["a"]);

    let long_key = "k".repeat(256);
    let done = runner
        .update(
            task.id,
            pb::Result::Success,
            vec![],
            &[("a", "2"), ("b", "3"), (long_key.as_str(), "x")],
        )
        .await
        .expect("final");
    assert_eq!(reply_result(&done), pb::Result::Success);
    assert_eq!(
        done.sent_outputs,
        vec!["a", "b"],
        "all stored keys, oversized key ignored"
    );

    let again = runner
        .update(task.id, pb::Result::Failure, vec![], &[("c", "4")])
        .await
        .expect("late final");
    assert_eq!(
        reply_result(&again),
        pb::Result::Success,
        "the first final result sticks"
    );
    assert_eq!(
        again.sent_outputs,
        vec!["a", "b", "c"],
        "outputs are accepted after the end"
    );

    let snap = forge.snapshot();
    let record = snap.task(task.id).expect("task");
    assert_eq!(record.status, Status::Done(Outcome::Success));
    assert_eq!(
        record.final_reports,
        vec![Outcome::Success, Outcome::Failure]
    );
    assert_eq!((record.final_accepted, record.heartbeats), (1, 1));
    assert_eq!(record.outputs.get("a").map(String::as_str), Some("1"));
    assert_eq!(record.steps[0].status, Status::Done(Outcome::Success));
    assert_eq!(
        (record.steps[1].status, record.steps[1].log_index),
        (Status::Running, 2)
    );
    assert_eq!(
        record.stopped_at,
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000))
    );
    assert_eq!(
        snap.job(job_id).expect("job").status,
        Status::Done(Outcome::Success)
    );
    assert!(forge.all_final());
}

#[tokio::test]
async fn cancellation_reaches_the_runner_through_update_task() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    let job_id = forge.enqueue_job(pod_job());
    let task = runner.fetch_task().await;
    assert!(forge.cancel_task(task.id));
    assert!(!forge.cancel_task(task.id), "already final");

    let beat = runner
        .update(task.id, pb::Result::Unspecified, vec![], &[])
        .await
        .expect("heartbeat");
    assert_eq!(reply_result(&beat), pb::Result::Cancelled);
    assert_eq!(
        runner
            .log(task.id, 0, &["bye"], true)
            .await
            .expect("logs still accepted after user cancel"),
        1
    );
    let last = runner
        .update(task.id, pb::Result::Failure, vec![], &[])
        .await
        .expect("final");
    assert_eq!(reply_result(&last), pb::Result::Cancelled);

    let snap = forge.snapshot();
    let record = snap.task(task.id).expect("task");
    assert_eq!(
        (record.status, record.stop_cause),
        (Status::Done(Outcome::Cancelled), Some(StopCause::Cancelled))
    );
    assert_eq!((record.final_accepted, record.final_reports.len()), (0, 1));
    assert_eq!(
        snap.job(job_id).expect("job").status,
        Status::Done(Outcome::Cancelled)
    );

    // A waiting job is cancelled without ever being handed out.
    let waiting = forge.enqueue_job(pod_job());
    assert!(forge.cancel_job(waiting));
    assert!(runner.fetch(0).await.expect("fetch").task.is_none());
}

#[tokio::test]
async fn tasks_of_other_runners_and_unknown_tasks_are_refused() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    forge.enqueue_job(pod_job());
    let task = runner.fetch_task().await;
    let other = Client::new(forge.url())
        .register(&forge.registration_token(), "other", &["pod"])
        .await
        .expect("register");
    let err = other
        .update(task.id, pb::Result::Success, vec![], &[])
        .await
        .expect_err("not its task");
    assert!(
        matches!(err, CallError::Status { ref message, .. } if message.contains("invalid runner for task")),
        "{err:?}"
    );
    let err = other
        .log(task.id, 0, &["x"], false)
        .await
        .expect_err("not its task");
    assert!(
        matches!(err, CallError::Status { ref message, .. } if message.contains("invalid runner for task")),
        "{err:?}"
    );
    let err = runner
        .update(999, pb::Result::Success, vec![], &[])
        .await
        .expect_err("no such task");
    assert!(
        matches!(err, CallError::Status { ref message, .. } if message.contains("update task: resource does not exist")),
        "{err:?}"
    );
    assert_eq!(
        forge.snapshot().task(task.id).expect("task").status,
        Status::Running
    );
}

#[tokio::test]
async fn zombie_reaper_fails_silent_tasks_and_archives_their_logs() {
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
    ));
    let config = Config {
        clock: clock.clone(),
        ..Config::default()
    };
    let (forge, runner) = start_with_runner(config, &["pod"]).await;
    forge.enqueue_jobs(pod_job(), 2);
    let alive = runner.fetch_task().await;
    let silent = runner.fetch_task().await;
    runner
        .log(silent.id, 0, &["started"], false)
        .await
        .expect("log");

    clock.advance(Duration::from_secs(6 * 60));
    runner
        .update(alive.id, pb::Result::Unspecified, vec![], &[])
        .await
        .expect("heartbeat");
    assert_eq!(
        forge.reap(clock.now()),
        Default::default(),
        "nothing is 10 min old yet"
    );
    clock.advance(Duration::from_secs(5 * 60));
    let report = forge.reap(clock.now());
    assert_eq!(
        (report.zombie_tasks, report.endless_tasks),
        (vec![silent.id], vec![])
    );

    let snap = forge.snapshot();
    let record = snap.task(silent.id).expect("task");
    assert_eq!(
        (record.status, record.stop_cause),
        (Status::Done(Outcome::Failure), Some(StopCause::Zombie))
    );
    assert!(record.log_archived);
    assert!(
        record
            .steps
            .iter()
            .all(|s| s.status == Status::Done(Outcome::Failure))
    );
    assert_eq!(snap.task(alive.id).expect("task").status, Status::Running);

    let err = runner
        .log(silent.id, 1, &["more"], false)
        .await
        .expect_err("archived by the reaper");
    assert!(
        matches!(err, CallError::Status { ref message, .. } if message.contains("AlreadyExists"))
    );
    let reply = runner
        .update(silent.id, pb::Result::Unspecified, vec![], &[])
        .await
        .expect("heartbeat");
    assert_eq!(reply_result(&reply), pb::Result::Failure);
}

#[tokio::test]
async fn endless_and_abandoned_reapers_use_the_injected_clock() {
    let clock = Arc::new(ManualClock::default());
    let config = Config {
        clock: clock.clone(),
        ..Config::default()
    };
    let (forge, runner) = start_with_runner(config, &["pod"]).await;
    forge.enqueue_job(pod_job());
    let task = runner.fetch_task().await;
    let stuck = forge.enqueue_job(JobSpec {
        runs_on: vec!["nobody".into()],
        ..JobSpec::default()
    });
    for _ in 0..19 {
        clock.advance(Duration::from_secs(9 * 60));
        runner
            .update(task.id, pb::Result::Unspecified, vec![], &[])
            .await
            .expect("heartbeat");
        forge.reap(clock.now());
    }
    assert_eq!(
        forge.snapshot().task(task.id).expect("task").status,
        Status::Running,
        "171 min < 3 h"
    );
    clock.advance(Duration::from_secs(10 * 60));
    assert_eq!(forge.reap(clock.now()).endless_tasks, vec![task.id]);
    clock.advance(Duration::from_secs(21 * 60 * 60));
    assert_eq!(forge.reap(clock.now()).abandoned_jobs, vec![stuck]);
    let snap = forge.snapshot();
    assert_eq!(
        snap.task(task.id).expect("task").stop_cause,
        Some(StopCause::Endless)
    );
    let job = snap.job(stuck).expect("job");
    assert_eq!(
        (job.status, job.abandoned, job.fetch_count),
        (Status::Done(Outcome::Cancelled), true, 0)
    );
}
