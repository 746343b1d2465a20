//! The fake executor against a minimal in-test RunnerService stand-in (`support`) that records
//! every call; these tests check the executor contract's ordering and the ack/retry rules.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use jr_fake_executor::{
    ExecutorConfig, ExecutorError, ExecutorReport, Misbehaviour, TaskReport, VAR_DURATION_MS,
    VAR_OUTCOME, VAR_OUTPUTS, VAR_STEPS, run_one_shot,
};
use jr_forge::Code;
use jr_forge::proto::runner::v1::Result as TaskResult;
use support::{Call, Facade, Knobs, TASK_ID, TASKS_VERSION, TOKEN, UUID, start};

fn config(url: &str) -> ExecutorConfig {
    let mut cfg = ExecutorConfig::new(url, UUID, TOKEN);
    cfg.poll_interval = Duration::from_millis(20);
    cfg.give_up_after = Duration::from_secs(3);
    cfg.request_timeout = Duration::from_secs(2);
    cfg
}

/// Runs the executor with a liveness bound (not a speed assertion).
async fn run(cfg: ExecutorConfig) -> Result<ExecutorReport, ExecutorError> {
    tokio::time::timeout(Duration::from_secs(20), run_one_shot(cfg))
        .await
        .expect("executor finishes")
}

fn finished(report: ExecutorReport) -> TaskReport {
    match report {
        ExecutorReport::Finished(report) => report,
        other => panic!("expected a finished task, got {other:?}"),
    }
}

/// The contract every well-behaved run obeys: Declare first; no log gaps; the last
/// UpdateLog(no_more) before the first final UpdateTask; no UpdateLog after it.
fn assert_contract(f: &Facade) {
    let r = f.recorded.lock().expect("lock");
    assert!(
        matches!(r.calls.first(), Some(Call::Declare)),
        "first call must be Declare: {:?}",
        r.calls.first()
    );
    assert_eq!(r.gaps, 0, "UpdateLog skipped rows");
    let final_log = r
        .calls
        .iter()
        .rposition(|c| matches!(c, Call::Log { no_more: true, .. }))
        .expect("final UpdateLog");
    let final_update = r
        .calls
        .iter()
        .position(
            |c| matches!(c, Call::Update { result, .. } if *result != TaskResult::Unspecified),
        )
        .expect("final UpdateTask");
    assert!(
        final_log < final_update,
        "UpdateLog(no_more) at {final_log} must precede final UpdateTask at {final_update}"
    );
    assert!(
        !r.calls[final_update..]
            .iter()
            .any(|c| matches!(c, Call::Log { .. })),
        "UpdateLog after the final state"
    );
    for call in &r.calls[final_update..] {
        if let Call::Update { stopped_at, .. } = call {
            assert!(stopped_at, "final UpdateTask without stopped_at");
        }
    }
    assert!(r.archived, "log not archived");
}

fn expected_log(steps: usize, step_results: &[&str], job: &str) -> Vec<String> {
    let mut rows = Vec::new();
    for (i, result) in step_results.iter().enumerate().take(steps) {
        rows.push(format!("::group::step {i}"));
        rows.push(format!("step {i}: {result}"));
    }
    rows.push(format!("Job finished: {job}"));
    rows
}

#[tokio::test]
async fn successful_task_uploads_logs_in_order_then_final_state_with_outputs() {
    let vars = [
        (VAR_STEPS, "3"),
        (VAR_DURATION_MS, "60"),
        (VAR_OUTPUTS, "artifact=a.tgz,digest=sha"),
    ];
    let (facade, url) = start(Knobs::default(), &vars).await;
    let report = finished(run(config(&url)).await.expect("run"));

    assert_eq!(report.task_id, TASK_ID);
    assert_eq!(report.final_result, TaskResult::Success);
    assert_eq!(report.forge_result, TaskResult::Success);
    assert_eq!(report.rows_sent, 7);
    assert!(!report.cancelled);
    assert!(report.final_log_sent);
    assert_eq!(
        report.outputs_acknowledged,
        vec!["artifact".to_owned(), "digest".to_owned()]
    );
    assert_contract(&facade);

    let r = facade.recorded.lock().expect("lock");
    let ok = "RESULT_SUCCESS";
    assert_eq!(r.log, expected_log(3, &[ok, ok, ok], ok));
    assert_eq!(r.result, Some(TaskResult::Success));
    assert_eq!(r.outputs.get("artifact").map(String::as_str), Some("a.tgz"));
    let updates: Vec<&BTreeMap<String, String>> = r
        .calls
        .iter()
        .filter_map(|c| {
            if let Call::Update { outputs, .. } = c {
                Some(outputs)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(
        updates.first().map(|o| o.len()),
        Some(2),
        "outputs go with the first UpdateTask"
    );
    assert!(
        updates.last().is_some_and(|o| o.is_empty()),
        "acknowledged outputs are not resent"
    );
    let Some(Call::Update { steps, .. }) = r.calls.last() else {
        panic!("last call must be UpdateTask")
    };
    let layout: Vec<(i64, i64, i64, i32)> = steps
        .iter()
        .map(|s| (s.id, s.log_index, s.log_length, s.result))
        .collect();
    let success = TaskResult::Success as i32;
    assert_eq!(
        layout,
        vec![(0, 0, 2, success), (1, 2, 2, success), (2, 4, 2, success)]
    );
    assert!(
        steps
            .iter()
            .all(|s| s.started_at.is_some() && s.stopped_at.is_some())
    );
}

#[tokio::test]
async fn failure_outcome_fails_the_last_step_and_the_job() {
    let (facade, url) = start(Knobs::default(), &[(VAR_OUTCOME, "failure")]).await;
    let report = finished(run(config(&url)).await.expect("run"));
    assert_eq!(report.final_result, TaskResult::Failure);
    assert_contract(&facade);
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(
        r.log,
        expected_log(2, &["RESULT_SUCCESS", "RESULT_FAILURE"], "RESULT_FAILURE")
    );
    assert_eq!(r.result, Some(TaskResult::Failure));
}

#[tokio::test]
async fn cancelled_reply_stops_the_job_and_reports_cancelled() {
    let knobs = Knobs {
        cancel_after_updates: Some(1),
        ..Knobs::default()
    };
    // 5 steps of 4 s each: finishing them all would take 20 s, past the liveness bound.
    let (facade, url) = start(knobs, &[(VAR_STEPS, "5"), (VAR_DURATION_MS, "20000")]).await;
    let report = finished(run(config(&url)).await.expect("run"));
    assert!(report.cancelled);
    assert_eq!(report.final_result, TaskResult::Cancelled);
    assert_eq!(report.forge_result, TaskResult::Cancelled);
    assert_contract(&facade);
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(
        r.log,
        expected_log(1, &["RESULT_CANCELLED"], "RESULT_CANCELLED")
    );
    let Some(Call::Update { steps, .. }) = r.calls.last() else {
        panic!("last call must be UpdateTask")
    };
    assert_eq!(
        steps.iter().filter(|s| s.started_at.is_some()).count(),
        1,
        "only the first step started"
    );
    assert!(
        steps
            .iter()
            .all(|s| s.result == TaskResult::Cancelled as i32)
    );
}

#[tokio::test]
async fn partial_log_acks_are_resent_from_the_acknowledged_index() {
    let knobs = Knobs {
        max_rows_per_call: Some(2),
        logs_unavailable_until_no_more: true,
        ..Knobs::default()
    };
    let (facade, url) = start(knobs, &[(VAR_STEPS, "3"), (VAR_DURATION_MS, "0")]).await;
    let report = finished(run(config(&url)).await.expect("run"));
    assert_eq!(report.rows_sent, 7);
    assert_contract(&facade);
    let r = facade.recorded.lock().expect("lock");
    let ok = "RESULT_SUCCESS";
    assert_eq!(r.log, expected_log(3, &[ok, ok, ok], ok));
    // 7 rows buffered while uploads failed, stored 2 per call: each retry starts at the ack
    // and carries exactly the rows not yet acknowledged.
    let expected = expected_log(3, &[ok, ok, ok], ok);
    let mut final_indexes = Vec::new();
    for call in &r.calls {
        if let Call::Log {
            index,
            rows,
            no_more: true,
        } = call
        {
            let start = usize::try_from(*index).expect("non-negative");
            assert_eq!(rows.as_slice(), &expected[start..]);
            final_indexes.push(*index);
        }
    }
    assert_eq!(final_indexes, vec![0, 2, 4, 6]);
}

#[tokio::test]
async fn final_state_is_resent_until_outputs_are_acknowledged() {
    let knobs = Knobs {
        drop_outputs_of_first_final: true,
        ..Knobs::default()
    };
    // No steps: outputs are first sent with the final UpdateTask.
    let (facade, url) = start(knobs, &[(VAR_STEPS, "0"), (VAR_OUTPUTS, "k=v")]).await;
    let report = finished(run(config(&url)).await.expect("run"));
    assert_eq!(report.outputs_acknowledged, vec!["k".to_owned()]);
    assert_contract(&facade);
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(r.finals, 2);
    assert_eq!(r.outputs.get("k").map(String::as_str), Some("v"));
}

#[tokio::test]
async fn declare_is_retried_and_tasks_version_is_kept_between_polls() {
    let knobs = Knobs {
        declare_failures: 2,
        empty_fetches: 2,
        ..Knobs::default()
    };
    let (facade, url) = start(knobs, &[]).await;
    finished(run(config(&url)).await.expect("run"));
    assert_contract(&facade);
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(r.declares, 3);
    let versions: Vec<i64> = r
        .calls
        .iter()
        .filter_map(|c| {
            if let Call::Fetch { tasks_version } = c {
                Some(*tasks_version)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(versions, vec![0, TASKS_VERSION, TASKS_VERSION]);
}

#[tokio::test]
async fn no_task_before_give_up_reports_no_task() {
    let (facade, url) = start(
        Knobs {
            no_task: true,
            ..Knobs::default()
        },
        &[],
    )
    .await;
    let mut cfg = config(&url);
    cfg.give_up_after = Duration::from_millis(300);
    assert_eq!(run(cfg).await.expect("run"), ExecutorReport::NoTask);
    let r = facade.recorded.lock().expect("lock");
    assert!(r.fetches >= 2, "polled more than once");
    assert!(
        !r.calls
            .iter()
            .any(|c| matches!(c, Call::Log { .. } | Call::Update { .. }))
    );
}

#[tokio::test]
async fn wrong_credentials_end_the_run_as_unregistered() {
    let (_facade, url) = start(Knobs::default(), &[]).await;
    let mut cfg = config(&url);
    cfg.give_up_after = Duration::from_millis(200);
    cfg.token = "stolen".into();
    let err = run(cfg).await.expect_err("refused");
    // Declare is retried until give-up, then reported with the facade's code.
    assert!(
        matches!(&err, ExecutorError::Declare(source) if source.is_unregistered()),
        "{err:?}"
    );
}

#[tokio::test]
async fn wrong_task_id_is_refused_and_surfaces_as_an_error() {
    let (facade, url) = start(Knobs::default(), &[(VAR_DURATION_MS, "0")]).await;
    let mut cfg = config(&url);
    cfg.misbehaviour = Some(Misbehaviour::WrongTaskId);
    let err = run(cfg).await.expect_err("refused");
    assert!(
        matches!(&err, ExecutorError::Rpc { call: "UpdateLog", source } if source.code() == Some(Code::PermissionDenied)),
        "{err:?}"
    );
    let r = facade.recorded.lock().expect("lock");
    assert_eq!(r.result, None);
    assert!(r.log.is_empty());
}

#[tokio::test]
async fn crash_after_claim_reports_nothing() {
    let (facade, url) = start(Knobs::default(), &[]).await;
    let mut cfg = config(&url);
    cfg.misbehaviour = Some(Misbehaviour::CrashAfterClaim);
    assert_eq!(
        run(cfg).await.expect("run"),
        ExecutorReport::Abandoned { task_id: TASK_ID }
    );
    let r = facade.recorded.lock().expect("lock");
    assert!(r.task_given);
    assert!(
        !r.calls
            .iter()
            .any(|c| matches!(c, Call::Log { .. } | Call::Update { .. }))
    );
}

#[tokio::test]
async fn no_final_log_skips_the_no_more_upload_but_reports_the_result() {
    let (facade, url) = start(Knobs::default(), &[(VAR_DURATION_MS, "0")]).await;
    let mut cfg = config(&url);
    cfg.misbehaviour = Some(Misbehaviour::NoFinalLog);
    let report = finished(run(cfg).await.expect("run"));
    assert!(!report.final_log_sent);
    let r = facade.recorded.lock().expect("lock");
    assert!(
        !r.calls
            .iter()
            .any(|c| matches!(c, Call::Log { no_more: true, .. }))
    );
    assert!(!r.archived);
    assert_eq!(r.result, Some(TaskResult::Success));
}

#[tokio::test]
async fn malformed_fake_vars_fail_the_task_with_a_log_line() {
    let (facade, url) = start(Knobs::default(), &[(VAR_STEPS, "two")]).await;
    let report = finished(run(config(&url)).await.expect("run"));
    assert_eq!(report.final_result, TaskResult::Failure);
    assert_contract(&facade);
    let r = facade.recorded.lock().expect("lock");
    assert!(
        r.log.first().is_some_and(|row| row.contains(VAR_STEPS)),
        "{:?}",
        r.log
    );
}

#[tokio::test]
async fn binary_runs_one_task_from_the_environment_and_exits_zero() {
    let (facade, url) = start(Knobs::default(), &[(VAR_DURATION_MS, "0")]).await;
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_fake-executor"))
        .env("JETRUNNER_FACADE_URL", &url)
        .env("JETRUNNER_ASSIGNMENT_ID", UUID)
        .env("JETRUNNER_RUNNER_TOKEN", TOKEN)
        .env("JETRUNNER_FAKE_POLL_MS", "20")
        .env("JETRUNNER_FAKE_GIVE_UP_SECS", "5")
        .status();
    let status = tokio::time::timeout(Duration::from_secs(20), status)
        .await
        .expect("exits")
        .expect("spawn");
    assert_eq!(status.code(), Some(0));
    assert_contract(&facade);
    assert_eq!(
        facade.recorded.lock().expect("lock").result,
        Some(TaskResult::Success)
    );
}

#[tokio::test]
async fn binary_without_its_environment_exits_one() {
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_fake-executor"))
        .env_remove("JETRUNNER_FACADE_URL")
        .env_remove("JETRUNNER_ASSIGNMENT_ID")
        .env_remove("JETRUNNER_RUNNER_TOKEN")
        .status();
    let status = tokio::time::timeout(Duration::from_secs(20), status)
        .await
        .expect("exits")
        .expect("spawn");
    assert_eq!(status.code(), Some(1));
}

#[tokio::test]
async fn forgejo_reporting_sends_the_result_before_closing_the_log_and_stops_on_failure() {
    let (facade, url) = start(Knobs::default(), &[]).await;
    let mut cfg = config(&url);
    cfg.forgejo_reporting = true;
    let report = finished(run(cfg).await.expect("run"));
    assert_eq!(report.final_result, TaskResult::Success);
    {
        let r = facade.recorded.lock().expect("lock");
        let final_update = r
            .calls
            .iter()
            .position(
                |c| matches!(c, Call::Update { result, .. } if *result != TaskResult::Unspecified),
            )
            .expect("final UpdateTask");
        let final_log = r
            .calls
            .iter()
            .rposition(|c| matches!(c, Call::Log { no_more: true, .. }))
            .expect("final UpdateLog");
        assert!(
            final_update < final_log,
            "result first, then the last log upload"
        );
    }

    // A reaper failed the task: forgejo-runner stops on FAILURE as act_runner does on CANCELLED.
    let knobs = Knobs {
        fail_after_updates: Some(1),
        ..Knobs::default()
    };
    let (_, url) = start(knobs, &[(VAR_STEPS, "5"), (VAR_DURATION_MS, "20000")]).await;
    let mut cfg = config(&url);
    cfg.forgejo_reporting = true;
    let report = finished(run(cfg).await.expect("run"));
    assert!(report.cancelled, "stopped on the FAILURE reply");
    assert_eq!(report.forge_result, TaskResult::Failure);
}
