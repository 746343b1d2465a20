//! The facade's executor contract (docs/architecture.md, "The facade") over plain HTTP in token
//! mode, against a recording fake forge and the MemoryLedger.

mod facade_support;

use std::sync::Arc;

use facade_support::*;
use jr_facade::{AuthMode, AuthRefusal, Facade};
use jr_forge::proto::ping::v1::PingRequest;
use jr_forge::proto::runner::v1::{
    DeclareRequest, FetchTaskRequest, LogRow, RegisterRequest, Result as ForgeResult, TaskState,
    UpdateLogRequest, UpdateTaskRequest,
};
use jr_forge::{Code, ForgeClient, ForgeError};
use jr_protocol::{AssignmentId, TaskResult, TerminalSource};

const TOKEN: &str = "executor-token-of-attempt-1";

fn code_of<T: std::fmt::Debug>(result: Result<T, ForgeError>) -> Code {
    result
        .expect_err("call must fail")
        .code()
        .expect("a Connect error")
}

async fn fetch(executor: &ForgeClient) -> Option<jr_forge::proto::runner::v1::Task> {
    let reply = executor
        .fetch_task(&FetchTaskRequest {
            tasks_version: 0,
            ..Default::default()
        })
        .await
        .expect("FetchTask");
    assert_eq!(
        reply.tasks_version, 1,
        "never 0 (would look like a pre-1.21 forge)"
    );
    reply.task
}

fn rows(n: usize) -> Vec<LogRow> {
    (0..n)
        .map(|i| LogRow {
            time: None,
            content: format!("line {i}"),
        })
        .collect()
}

fn log(task_id: i64, index: i64, n: usize, no_more: bool) -> UpdateLogRequest {
    UpdateLogRequest {
        task_id,
        index,
        rows: rows(n),
        no_more,
    }
}

fn state(task_id: i64, result: ForgeResult) -> UpdateTaskRequest {
    UpdateTaskRequest {
        state: Some(TaskState {
            id: task_id,
            result: result as i32,
            stopped_at: (result != ForgeResult::Unspecified).then_some(prost_types::Timestamp {
                seconds: 1_700_000_000,
                nanos: 0,
            }),
            ..TaskState::default()
        }),
        outputs: Default::default(),
    }
}

/// An assignment whose executor has already fetched (claimed) its task.
async fn claimed(h: &Harness, forge_task_id: i64) -> (AssignmentId, ForgeClient) {
    let id = add_assignment(h, forge_task_id, Some(TOKEN));
    let executor = executor(&h.url, id, TOKEN);
    assert!(
        fetch(&executor).await.is_some(),
        "first fetch delivers the task"
    );
    // Before handing the task out the facade asked the forge whether it is still wanted: one
    // heartbeat without result or outputs. Later assertions count only the executor's calls.
    let mut forge = h.forge.lock().expect("lock");
    let checks: Vec<_> = forge.update_tasks.drain(..).collect();
    assert_eq!(checks.len(), 1, "one liveness check before the claim");
    let check = checks[0].state.as_ref().expect("state");
    assert_eq!((check.id, check.result), (forge_task_id, 0));
    assert!(checks[0].outputs.is_empty());
    drop(forge);
    (id, executor)
}

#[tokio::test]
async fn ping_answers_hello_and_register_is_refused() {
    let h = start().await;
    let anonymous =
        ForgeClient::new(&h.url, None, std::time::Duration::from_secs(5)).expect("client");
    let pong = anonymous
        .ping(&PingRequest {
            data: "runner-7".into(),
        })
        .await
        .expect("ping");
    assert_eq!(pong.data, "Hello, runner-7!");
    let refused = anonymous
        .register(&RegisterRequest {
            name: "x".into(),
            token: "reg".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(code_of(refused), Code::PermissionDenied);
    h.stop().await;
}

#[tokio::test]
async fn declare_succeeds_for_the_executor_and_echoes_its_labels() {
    let h = start().await;
    let id = add_assignment(&h, 11, Some(TOKEN));
    let reply = executor(&h.url, id, TOKEN)
        .declare(&DeclareRequest {
            version: "v0.2.13".into(),
            labels: vec!["pod".into(), "self-hosted".into()],
            capabilities: vec![],
        })
        .await
        .expect("Declare");
    let runner = reply.runner.expect("runner");
    assert_eq!(runner.uuid, id.to_string());
    assert_eq!(runner.labels, vec!["pod", "self-hosted"]);
    assert_eq!(runner.version, "v0.2.13");
    assert!(runner.token.is_empty(), "never hands out a token");
    h.stop().await;
}

#[tokio::test]
async fn wrong_token_is_unauthenticated_and_counted() {
    let h = start().await;
    let id = add_assignment(&h, 12, Some(TOKEN));
    let intruder = executor(&h.url, id, "not-the-token");
    assert_eq!(
        code_of(intruder.fetch_task(&FetchTaskRequest::default()).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code_of(intruder.declare(&DeclareRequest::default()).await),
        Code::Unauthenticated
    );
    assert_eq!(h.facade.stats().auth_refused(AuthRefusal::WrongToken), 2);
    assert!(
        !h.ledger.record(id).expect("record").view.claimed,
        "no claim for an intruder"
    );
    // The real executor is unaffected.
    assert!(fetch(&executor(&h.url, id, TOKEN)).await.is_some());
    h.stop().await;
}

#[tokio::test]
async fn invisible_assignment_gets_no_task_instead_of_unauthenticated() {
    let h = start().await;
    let future_id = AssignmentId::for_task("http://forge.test", 13);
    let early = executor(&h.url, future_id, TOKEN);
    // Not in the ledger at all yet: Declare passes, FetchTask says "no task".
    early
        .declare(&DeclareRequest::default())
        .await
        .expect("Declare while invisible");
    assert_eq!(fetch(&early).await, None);
    // Assignment visible, token hash not yet.
    let id = add_assignment(&h, 13, None);
    assert_eq!(id, future_id);
    assert_eq!(fetch(&early).await, None);
    assert_eq!(h.facade.stats().fetches_pending, 2);
    assert_eq!(h.facade.stats().auth_refused_total(), 0);
    // Reports cannot be made yet, but are not "unregistered" either.
    assert_eq!(
        code_of(early.update_log(&log(13, 0, 1, false)).await),
        Code::Unavailable
    );
    // The hash arrives: the task is delivered.
    h.ledger
        .set_token_hash(id, Some(jr_protocol::TokenHash::of_token(TOKEN)));
    assert_eq!(fetch(&early).await.map(|t| t.id), Some(13));
    h.stop().await;
}

#[tokio::test]
async fn missing_or_malformed_uuid_is_unauthenticated() {
    let h = start().await;
    let bad = ForgeClient::new(&h.url, None, std::time::Duration::from_secs(5))
        .expect("client")
        .with_credentials(jr_forge::Credentials {
            uuid: "not-a-uuid".into(),
            token: TOKEN.into(),
        });
    assert_eq!(
        code_of(bad.fetch_task(&FetchTaskRequest::default()).await),
        Code::Unauthenticated
    );
    assert_eq!(h.facade.stats().auth_refused(AuthRefusal::InvalidUuid), 1);
    h.stop().await;
}

#[tokio::test]
async fn fetch_task_delivers_the_task_exactly_once() {
    let h = start().await;
    let id = add_assignment(&h, 21, Some(TOKEN));
    let first = executor(&h.url, id, TOKEN);
    let task = fetch(&first).await.expect("task on first fetch");
    assert_eq!(
        task,
        facade_support::task(21),
        "the unsealed forge task, unchanged"
    );
    // Asking again before any report (a lost reply): the same task, still claimed once.
    assert_eq!(fetch(&first).await, Some(facade_support::task(21)));
    first
        .update_log(&log(21, 0, 1, false))
        .await
        .expect("first report");
    assert_eq!(
        fetch(&first).await,
        None,
        "after a report, no task any more"
    );
    let record = h.ledger.record(id).expect("record");
    assert_eq!(record.claimed_by.as_deref(), Some("token"));
    let stats = h.facade.stats();
    assert_eq!(stats.claims_won, 1);
    h.stop().await;
}

#[tokio::test]
async fn concurrent_fetches_across_two_facades_deliver_the_task_once() {
    let h = start().await;
    // A second facade replica over the same ledger: only the ledger can settle the race.
    let twin = Arc::new(
        Facade::new(
            settings(AuthMode::Token, &h.forge_url, h.sealer.clone(), true),
            h.ledger.clone(),
        )
        .expect("facade"),
    );
    let twin_served = serve_facade(twin.clone(), None).await;
    let id = add_assignment(&h, 22, Some(TOKEN));
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..8 {
        let url = if i % 2 == 0 {
            h.url.clone()
        } else {
            twin_served.url.clone()
        };
        calls.spawn(async move { fetch(&executor(&url, id, TOKEN)).await });
    }
    let mut delivered = 0;
    while let Some(result) = calls.join_next().await {
        if result.expect("join").is_some() {
            delivered += 1;
        }
    }
    assert_eq!(delivered, 1);
    assert_eq!(h.facade.stats().claims_won + twin.stats().claims_won, 1);
    let _ = twin_served.stop.send(());
    h.stop().await;
}

#[tokio::test]
async fn reports_for_another_task_or_before_claim_are_refused() {
    let h = start().await;
    let (_, executor_a) = claimed(&h, 31).await;
    let _ = add_assignment(&h, 32, Some("other-token"));
    assert_eq!(
        code_of(
            executor_a
                .update_task(&state(32, ForgeResult::Unspecified))
                .await
        ),
        Code::PermissionDenied
    );
    assert_eq!(
        code_of(executor_a.update_log(&log(32, 0, 1, false)).await),
        Code::PermissionDenied
    );
    let unclaimed = add_assignment(&h, 33, Some(TOKEN));
    let executor_c = executor(&h.url, unclaimed, TOKEN);
    assert_eq!(
        code_of(
            executor_c
                .update_task(&state(33, ForgeResult::Unspecified))
                .await
        ),
        Code::PermissionDenied
    );
    {
        let forge = h.forge.lock().expect("lock");
        assert!(
            forge.update_tasks.is_empty() && forge.update_logs.is_empty(),
            "nothing forwarded"
        );
    }
    assert_eq!(h.facade.stats().permission_denied, 3);
    h.stop().await;
}

#[tokio::test]
async fn forge_reply_is_returned_unchanged_including_cancellation() {
    let h = start().await;
    let (id, executor) = claimed(&h, 41).await;
    h.forge.lock().expect("lock").cancelled.push(41);
    let mut heartbeat = state(41, ForgeResult::Unspecified);
    heartbeat.outputs.insert("artifact".into(), "a.tgz".into());
    let reply = executor.update_task(&heartbeat).await.expect("heartbeat");
    let reply_state = reply.state.expect("state");
    assert_eq!(reply_state.id, 41);
    assert_eq!(
        reply_state.result,
        ForgeResult::Cancelled as i32,
        "cancellation reaches the executor"
    );
    assert_eq!(reply.sent_outputs, vec!["artifact"]);
    {
        let forge = h.forge.lock().expect("lock");
        assert_eq!(forge.update_tasks, vec![heartbeat], "forwarded as sent");
    }
    assert!(
        !h.ledger.record(id).expect("record").view.terminal,
        "a heartbeat is not final"
    );
    // The executor then reports its final state; the forge's CANCELLED becomes the terminal.
    let reply = executor
        .update_task(&state(41, ForgeResult::Failure))
        .await
        .expect("final");
    assert_eq!(
        reply.state.expect("state").result,
        ForgeResult::Cancelled as i32
    );
    let terminal = h
        .ledger
        .record(id)
        .expect("record")
        .terminal
        .expect("terminal");
    assert_eq!(terminal.result, TaskResult::Cancelled);
    h.stop().await;
}

#[tokio::test]
async fn forge_errors_pass_through_with_their_code_and_message() {
    let h = start().await;
    let (id, executor) = claimed(&h, 42).await;
    h.forge.lock().expect("lock").next_error =
        Some((Code::AlreadyExists, "log file has been archived".into()));
    match executor.update_log(&log(42, 0, 2, false)).await {
        Err(ForgeError::Connect { code, message, .. }) => {
            assert_eq!(code, Code::AlreadyExists);
            assert_eq!(message, "log file has been archived");
        }
        other => panic!("expected the forge's error, got {other:?}"),
    }
    // A refused final result is not terminal.
    h.forge.lock().expect("lock").next_error = Some((
        Code::NotFound,
        "update task: resource does not exist".into(),
    ));
    assert_eq!(
        code_of(executor.update_task(&state(42, ForgeResult::Success)).await),
        Code::NotFound
    );
    assert!(h.ledger.record(id).expect("record").terminal.is_none());
    assert_eq!(h.facade.stats().forward_errors, 2);
    h.stop().await;
}

#[tokio::test]
async fn final_result_after_closed_log_publishes_one_terminal_with_log_closed() {
    let h = start().await;
    let (id, executor) = claimed(&h, 51).await;
    let ack = executor
        .update_log(&log(51, 0, 3, false))
        .await
        .expect("log");
    assert_eq!(ack.ack_index, 3);
    let ack = executor
        .update_log(&log(51, 3, 2, true))
        .await
        .expect("closing log");
    assert_eq!(ack.ack_index, 5);
    executor
        .update_task(&state(51, ForgeResult::Success))
        .await
        .expect("final");
    // act_runner retries its final UpdateTask until it succeeds: an idempotent re-send.
    executor
        .update_task(&state(51, ForgeResult::Success))
        .await
        .expect("re-send");
    let record = h.ledger.record(id).expect("record");
    let terminal = record.terminal.expect("terminal");
    assert_eq!(terminal.forge_task_id, 51);
    assert_eq!(terminal.result, TaskResult::Success);
    assert_eq!(terminal.source, TerminalSource::Executor);
    assert!(terminal.log_closed);
    assert_eq!(
        record.refused_publishes, 0,
        "the re-send did not try to publish again"
    );
    assert_eq!(
        record.executor_finished, 0,
        "log_closed on the terminal says it all"
    );
    assert_eq!(h.facade.stats().terminals_published, 1);
    h.stop().await;
}

#[tokio::test]
async fn log_closed_after_final_result_publishes_executor_finished() {
    let h = start().await;
    let (id, executor) = claimed(&h, 52).await;
    executor
        .update_log(&log(52, 0, 2, false))
        .await
        .expect("log");
    executor
        .update_task(&state(52, ForgeResult::Failure))
        .await
        .expect("final first");
    let record = h.ledger.record(id).expect("record");
    let terminal = record.terminal.expect("terminal");
    assert_eq!(terminal.result, TaskResult::Failure);
    assert!(!terminal.log_closed);
    assert_eq!(record.executor_finished, 0);
    // Older act_runner uploads its last rows after the result.
    let ack = executor
        .update_log(&log(52, 2, 4, true))
        .await
        .expect("last rows");
    assert_eq!(ack.ack_index, 6);
    assert_eq!(h.ledger.record(id).expect("record").executor_finished, 1);
    // A re-send of the closing call is accepted and does not publish again.
    executor
        .update_log(&log(52, 2, 4, true))
        .await
        .expect("re-send");
    assert_eq!(h.ledger.record(id).expect("record").executor_finished, 1);
    assert_eq!(h.facade.stats().executor_finished_published, 1);
    h.stop().await;
}

#[tokio::test]
async fn calls_after_terminal_are_refused_except_idempotent_resends() {
    let h = start().await;
    let (_, executor) = claimed(&h, 53).await;
    executor
        .update_log(&log(53, 0, 4, true))
        .await
        .expect("closing log");
    executor
        .update_task(&state(53, ForgeResult::Success))
        .await
        .expect("final");
    let forwarded_before = h.facade.stats().forwarded_calls;

    // A heartbeat after the end reaches the forge, whose answer (the final result) stops a
    // runner that is still going.
    let reply = executor
        .update_task(&state(53, ForgeResult::Unspecified))
        .await
        .expect("heartbeat after terminal");
    assert_eq!(
        reply.state.map(|s| s.result),
        Some(ForgeResult::Success as i32)
    );
    let forwarded_before = forwarded_before + 1;
    assert_eq!(
        code_of(executor.update_task(&state(53, ForgeResult::Failure)).await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code_of(executor.update_log(&log(53, 4, 1, false)).await),
        Code::FailedPrecondition
    );
    assert_eq!(h.facade.stats().refused_after_terminal, 2);
    assert_eq!(
        h.facade.stats().forwarded_calls,
        forwarded_before,
        "refusals never reach the forge"
    );

    executor
        .update_task(&state(53, ForgeResult::Success))
        .await
        .expect("same final result");
    let ack = executor
        .update_log(&log(53, 2, 2, true))
        .await
        .expect("re-send inside the acked range");
    assert_eq!(ack.ack_index, 4);
    assert_eq!(fetch(&executor).await, None);
    h.stop().await;
}

#[tokio::test]
async fn unknown_paths_are_not_found() {
    let h = start().await;
    let http = reqwest::Client::new();
    for path in [
        "/api/v1/repos/o/r",
        "/api/actions/runner.v1.RunnerService/FetchSingleTask",
        "/_apisx/foo",
        "/_apis/../api/v1/admin",
    ] {
        let status = http
            .post(format!("{}{path}", h.url))
            .send()
            .await
            .expect("send")
            .status();
        assert_eq!(status, reqwest::StatusCode::NOT_FOUND, "{path}");
    }
    assert_eq!(h.facade.stats().proxied_requests, 0);
    h.stop().await;
}

#[tokio::test]
async fn proxy_streams_bodies_to_the_forge_and_back_unchanged() {
    let h = start().await;
    let payload: Vec<u8> = (0..(3 * 1024 * 1024 + 17))
        .map(|i| (i % 251) as u8)
        .collect();
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        payload.chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
    let http = reqwest::Client::new();
    let answer = http
        .put(format!(
            "{}/_apis/artifactcache/caches/7?version=abc",
            h.url
        ))
        .header("authorization", "Bearer runtime-token")
        .header("x-runner-token", "must-not-leak")
        .header("x-runner-uuid", "must-not-leak-either")
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .expect("proxied PUT");
    assert_eq!(answer.status(), reqwest::StatusCode::CREATED);
    assert_eq!(
        answer.headers()["x-forge-saw"],
        "PUT /gitea/_apis/artifactcache/caches/7?version=abc"
    );
    let echoed = answer.bytes().await.expect("body");
    assert_eq!(echoed.len(), payload.len());
    assert!(
        echoed.as_ref() == payload.as_slice(),
        "body round-trips unchanged"
    );

    let answer = http
        .get(format!(
            "{}/api/actions_pipeline/_apis/pipelines/workflows/9/artifacts",
            h.url
        ))
        .send()
        .await
        .expect("proxied GET");
    assert_eq!(answer.status(), reqwest::StatusCode::CREATED);
    assert_eq!(
        answer.headers()["x-forge-saw"],
        "GET /gitea/api/actions_pipeline/_apis/pipelines/workflows/9/artifacts?"
    );

    {
        let forge = h.forge.lock().expect("lock");
        let seen = &forge.proxied_headers[0];
        assert_eq!(
            seen["authorization"], "Bearer runtime-token",
            "the caller's own auth is kept"
        );
        assert!(seen.get("x-runner-token").is_none() && seen.get("x-runner-uuid").is_none());
    }
    assert_eq!(h.facade.stats().proxied_requests, 2);
    h.stop().await;
}

#[tokio::test]
async fn with_token_keys_the_facade_checks_tokens_itself_and_ignores_hashes_on_the_bus() {
    let h = start_with_token_keys().await;
    // An attacker published a `workload-created` with the hash of a token of their choice.
    let id = add_assignment(&h, 91, Some("attacker-token"));
    let attacker = executor(&h.url, id, "attacker-token");
    assert_eq!(
        code_of(attacker.declare(&Default::default()).await),
        Code::Unauthenticated
    );
    assert_eq!(
        code_of(
            attacker
                .fetch_task(&FetchTaskRequest {
                    tasks_version: 0,
                    ..Default::default()
                })
                .await
        ),
        Code::Unauthenticated
    );
    // The real executor holds the attempt's derived token and gets its task.
    let real = executor(&h.url, id, &token_key().token(id, 1));
    assert_eq!(fetch(&real).await.map(|t| t.id), Some(91));
    // Another attempt's token is refused.
    let stale = executor(&h.url, id, &token_key().token(id, 2));
    assert_eq!(
        code_of(stale.declare(&Default::default()).await),
        Code::Unauthenticated
    );
    // An id that names no stored assignment is refused, not told to wait.
    let unknown = AssignmentId::for_task("http://forge.test", 999);
    let nobody = executor(&h.url, unknown, &token_key().token(unknown, 1));
    assert_eq!(
        code_of(nobody.declare(&Default::default()).await),
        Code::Unauthenticated
    );
    let stats = h.facade.stats();
    let refused = |r: AuthRefusal| {
        stats
            .auth_refusals
            .iter()
            .find(|(reason, _)| *reason == r)
            .map_or(0, |(_, n)| *n)
    };
    assert_eq!(refused(AuthRefusal::WrongToken), 3);
    assert_eq!(refused(AuthRefusal::UnknownAssignment), 1);
    h.stop().await;
}

#[tokio::test]
async fn fetch_task_is_held_while_the_assignment_is_not_visible_yet() {
    let h = start().await;
    // The id the assignment will have; it is stored only after the executor asked.
    let id = AssignmentId::for_task("http://forge.test", 95);
    let early = executor(&h.url, id, TOKEN);
    let (task, _) = tokio::join!(fetch(&early), async {
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        add_assignment(&h, 95, Some(TOKEN))
    });
    assert_eq!(
        task.map(|t| t.id),
        Some(95),
        "a one-job runner asking early still gets its task in that call"
    );
    h.stop().await;
}

#[tokio::test]
async fn declare_relays_the_forges_capabilities_to_the_executor() {
    let h = start().await;
    let id = add_assignment(&h, 96, Some(TOKEN));
    let mut settings = settings(AuthMode::Token, &h.forge_url, h.sealer.clone(), true);
    let pod = jr_protocol::BackendName::new("pod").expect("backend");
    let client = settings.forges.client(&pod).expect("a client for pod");
    settings.forges = Arc::new(jr_gitea_intake::forges::Forges::new(vec![
        jr_gitea_intake::forges::Registration {
            name: "pod".into(),
            client,
            backends: vec![pod],
            own_backend: None,
            capabilities: Some("cancelling".into()),
        },
    ]));
    let facade = Arc::new(Facade::new(settings, h.ledger.clone()).expect("facade"));
    let served = serve_facade(facade, None).await;
    let response = reqwest::Client::new()
        .post(format!(
            "{}/api/actions/runner.v1.RunnerService/Declare",
            served.url
        ))
        .header("content-type", "application/proto")
        .header("x-runner-uuid", id.to_string())
        .header("x-runner-token", TOKEN)
        .body(Vec::new())
        .send()
        .await
        .expect("declare");
    assert_eq!(response.status(), 200);
    assert_eq!(
        response
            .headers()
            .get("x-gitea-actions-capabilities")
            .and_then(|v| v.to_str().ok()),
        Some("cancelling")
    );
    let _ = served.stop.send(());
    h.stop().await;
}

#[tokio::test]
async fn job_summaries_are_checked_and_forwarded() {
    let h = start().await;
    let (_, executor) = claimed(&h, 97).await;
    let summary = |task_id| jr_forge::proto::runner::v1::UpdateJobSummaryRequest {
        task_id,
        summary: "## all green".into(),
    };
    let call = |request| {
        executor.call::<_, jr_forge::proto::runner::v1::UpdateJobSummaryResponse>(
            jr_forge::wire::RUNNER_SERVICE,
            "UpdateJobSummary",
            request,
            true,
        )
    };
    let (foreign, own) = (summary(98), summary(97));
    assert_eq!(code_of(call(&foreign).await), Code::PermissionDenied);
    call(&own).await.expect("own summary forwarded");
    assert_eq!(
        h.forge.lock().expect("lock").summaries,
        vec![(97, "## all green".to_owned())]
    );
    h.stop().await;
}

#[tokio::test]
async fn a_claim_whose_reply_was_lost_with_its_facade_is_served_again_by_the_next_one() {
    let h = start().await;
    let id = add_assignment(&h, 23, Some(TOKEN));
    // The first facade claims and "dies" before its reply arrives: the executor saw nothing.
    assert!(fetch(&executor(&h.url, id, TOKEN)).await.is_some());
    assert!(h.ledger.record(id).expect("record").view.claimed);
    let restarted = Arc::new(
        Facade::new(
            settings(AuthMode::Token, &h.forge_url, h.sealer.clone(), true),
            h.ledger.clone(),
        )
        .expect("facade"),
    );
    let served = serve_facade(restarted.clone(), None).await;
    let again = executor(&served.url, id, TOKEN);
    assert_eq!(
        fetch(&again).await.map(|t| t.id),
        Some(23),
        "the same attempt's executor gets its task from the restarted facade"
    );
    again
        .update_log(&log(23, 0, 1, false))
        .await
        .expect("report");
    assert_eq!(fetch(&again).await, None, "not once it reports");
    assert_eq!(
        restarted.stats().claims_won,
        0,
        "claimed once, by the first facade"
    );
    let _ = served.stop.send(());
    h.stop().await;
}

/// A warm executor holds the token of attempt 0 of its warm id under its backend's key. Its
/// FetchTask waits until that backend's worker binds it to an attempt, then returns that
/// attempt's task once; it reports as that attempt's executor. A binding written for another
/// backend's job or for a superseded attempt gives it nothing.
#[tokio::test]
async fn a_warm_executor_gets_the_task_its_worker_bound_it_to_and_nothing_else() {
    use jr_bus::warm::WarmBinding;
    use jr_protocol::BackendName;
    let pod = BackendName::new("pod").expect("backend");
    let vm = BackendName::new("vm").expect("backend");
    let vm_key = jr_seal::TokenKey::from_base64("dm0td29ya2VyLWtleS1mb3ItdGhlLWZhY2FkZS10ZXN0cyE=")
        .expect("vm key");
    let keys = [(pod.clone(), token_key()), (vm.clone(), vm_key.clone())]
        .into_iter()
        .collect();
    let h = start_keyed(AuthMode::Token, None, keys).await;

    let warm = AssignmentId::for_task("http://warm.test", 1);
    let exec = executor(&h.url, warm, &token_key().token(warm, 0));
    assert!(exec.declare(&DeclareRequest::default()).await.is_ok());
    // A forged attempt-0 token is refused.
    let forged = executor(&h.url, warm, "not-the-warm-token");
    assert_eq!(
        code_of(forged.declare(&DeclareRequest::default()).await),
        Code::Unauthenticated
    );

    let id = add_assignment(&h, 120, None);
    let (task, _) = tokio::join!(fetch(&exec), async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        h.ledger.bind_warm(
            &pod,
            warm,
            WarmBinding {
                assignment: id,
                attempt: 1,
            },
        );
        h.facade.wake_warm(warm);
    });
    assert_eq!(
        task.map(|t| t.id),
        Some(120),
        "bound while its call was held"
    );
    let record = h.ledger.record(id).expect("record");
    assert_eq!(record.claimed_by, Some(format!("warm:{warm}")));
    // It reports as the attempt's executor; another task id is refused.
    assert!(exec.update_log(&log(120, 0, 2, false)).await.is_ok());
    assert_eq!(
        code_of(exec.update_log(&log(121, 0, 1, false)).await),
        Code::PermissionDenied
    );

    // A vm warm executor bound (in vm's record) to a pod job: never handed out.
    let vm_warm = AssignmentId::for_task("http://warm.test", 2);
    let other = add_assignment(&h, 122, None);
    h.ledger.bind_warm(
        &vm,
        vm_warm,
        WarmBinding {
            assignment: other,
            attempt: 1,
        },
    );
    let vm_exec = executor(&h.url, vm_warm, &vm_key.token(vm_warm, 0));
    assert_eq!(fetch(&vm_exec).await.map(|t| t.id), None);
    // Bound to an attempt the reconciler has replaced: nothing either.
    let stale = AssignmentId::for_task("http://warm.test", 3);
    let moved = add_assignment(&h, 123, None);
    h.ledger.bind_warm(
        &pod,
        stale,
        WarmBinding {
            assignment: moved,
            attempt: 2,
        },
    );
    let stale_exec = executor(&h.url, stale, &token_key().token(stale, 0));
    assert_eq!(fetch(&stale_exec).await.map(|t| t.id), None);
    assert!(h.ledger.record(other).expect("record").claimed_by.is_none());
    assert!(h.ledger.record(moved).expect("record").claimed_by.is_none());
    h.stop().await;
}
