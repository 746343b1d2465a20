//! Registration, Declare, FetchTask: the registration and fetch flow over real HTTP.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{CallError, Client, start, start_with_runner};
use jr_fake_forge::{Config, ErrorStyle, JobSpec, Rpc, Status};
use jr_forge::proto::{ping::v1 as ping, runner::v1 as pb};
use prost_types::value::Kind;

fn job(runs_on: &[&str]) -> JobSpec {
    JobSpec {
        runs_on: runs_on.iter().map(|l| (*l).to_owned()).collect(),
        ..JobSpec::default()
    }
}

fn context_str<'a>(task: &'a pb::Task, key: &str) -> &'a str {
    match task
        .context
        .as_ref()
        .and_then(|c| c.fields.get(key))
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StringValue(s)) => s,
        other => panic!("context key {key} is not a string: {other:?}"),
    }
}

#[tokio::test]
async fn register_declare_fetch_flow_hands_out_a_complete_task() {
    let (forge, anon) = start(Config::default()).await;
    let pong: ping::PingResponse = anon
        .call(Rpc::Ping, &ping::PingRequest { data: "r1".into() })
        .await
        .expect("ping");
    assert_eq!(pong.data, "Hello, r1!");

    let reg: pb::RegisterResponse = anon
        .call(
            Rpc::Register,
            &pb::RegisterRequest {
                name: "r1".into(),
                token: forge.registration_token(),
                labels: vec!["old".into()],
                ..Default::default()
            },
        )
        .await
        .expect("register");
    let runner = reg.runner.expect("runner");
    assert_eq!(runner.uuid.len(), 36);
    assert!(
        runner.token.len() == 40
            && runner
                .token
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );
    assert_eq!(runner.labels, vec!["old".to_owned()]);

    let client = anon.authed(&runner.uuid, &runner.token);
    let declared = client
        .declare(&["pod", "self-hosted"])
        .await
        .expect("declare")
        .runner
        .expect("runner");
    assert_eq!(
        declared.labels,
        vec!["pod".to_owned(), "self-hosted".to_owned()]
    );
    assert!(
        declared.token.is_empty(),
        "Declare never returns the token again"
    );

    let spec = JobSpec {
        repo: "acme/app".into(),
        name: "unit".into(),
        runs_on: vec!["pod".into()],
        vars: BTreeMap::from([("REGION".into(), "eu".into())]),
        secrets: BTreeMap::from([("DEPLOY_KEY".into(), "s3cret".into())]),
        steps: 3,
        ..Default::default()
    };
    let job_id = forge.enqueue_job(spec);
    let reply = client.fetch(0).await.expect("fetch");
    assert!(reply.tasks_version >= 1);
    let task = reply.task.expect("task");
    let yaml = String::from_utf8(task.workflow_payload.clone().expect("payload")).expect("utf8");
    assert!(yaml.contains("jobs:\n  unit:\n"), "{yaml}");
    assert_eq!(yaml.matches("- name:").count(), 3);
    let token = context_str(&task, "token");
    assert_eq!(token.len(), 40);
    assert_eq!(
        task.secrets.get("GITHUB_TOKEN").map(String::as_str),
        Some(token)
    );
    assert_eq!(
        task.secrets.get("GITEA_TOKEN").map(String::as_str),
        Some(token)
    );
    assert_eq!(
        task.secrets.get("DEPLOY_KEY").map(String::as_str),
        Some("s3cret")
    );
    assert_eq!(task.vars.get("REGION").map(String::as_str), Some("eu"));
    assert_eq!(context_str(&task, "repository"), "acme/app");
    assert_eq!(
        context_str(&task, "server_url"),
        format!("{}/", forge.url())
    );
    assert_eq!(context_str(&task, "run_attempt"), "1");

    let snap = forge.snapshot();
    let job = snap.job(job_id).expect("job");
    assert_eq!(
        (job.status, job.fetch_count, job.attempt),
        (Status::Running, 1, 1)
    );
    let recorded = snap.task(task.id).expect("task record");
    assert_eq!(recorded.runner_uuid, runner.uuid);
    assert_eq!(recorded.steps.len(), 3);
}

#[tokio::test]
async fn registration_tokens_are_reusable_until_rotated() {
    let (forge, anon) = start(Config::default()).await;
    let old = forge.registration_token();
    anon.register(&old, "a", &[]).await.expect("first use");
    anon.register(&old, "b", &[])
        .await
        .expect("the same token works again");
    let new = forge.rotate_registration_token();
    assert_ne!(new, old);
    let Err(CallError::Status {
        status,
        code,
        message,
    }) = anon.register(&old, "c", &[]).await
    else {
        panic!("a rotated token must be refused");
    };
    assert_eq!((status, code.as_str()), (500, "unknown"));
    assert_eq!(
        message,
        "runner registration token has been invalidated, please use the latest one"
    );
    let err = anon
        .register("nope", "d", &[])
        .await
        .expect_err("unknown token");
    assert!(
        matches!(err, CallError::Status { ref message, .. } if message == "runner registration token not found")
    );
    anon.register(&new, "e", &[])
        .await
        .expect("the new token works");
    assert_eq!(forge.snapshot().runners.len(), 3);
}

#[tokio::test]
async fn tasks_version_fast_path_skips_assignment_until_version_changes() {
    let (forge, runner) = start_with_runner(Config::default(), &["pod"]).await;
    let first = runner.fetch(0).await.expect("fetch");
    assert!(first.task.is_none());
    assert!(first.tasks_version >= 1, "never 0");
    let same = runner.fetch(first.tasks_version).await.expect("fetch");
    assert_eq!(
        (same.task.is_none(), same.tasks_version),
        (true, first.tasks_version)
    );

    // A vm job bumps the version but does not match; then the runner gains the label.
    forge.enqueue_job(job(&["vm"]));
    let after_enqueue = runner.fetch(first.tasks_version).await.expect("fetch");
    assert!(after_enqueue.task.is_none());
    assert!(after_enqueue.tasks_version > first.tasks_version);
    runner.declare(&["pod", "vm"]).await.expect("declare");
    let fast = runner
        .fetch(after_enqueue.tasks_version)
        .await
        .expect("fetch");
    assert!(
        fast.task.is_none(),
        "equal version takes the fast path even though a job now matches"
    );
    assert!(
        runner.fetch(0).await.expect("fetch").task.is_some(),
        "version 0 forces an assignment attempt"
    );
}

#[tokio::test]
async fn runs_on_must_be_a_subset_of_the_runner_labels_oldest_first() {
    let (forge, pod_runner) = start_with_runner(Config::default(), &["pod"]).await;
    let pod = forge.enqueue_job(job(&["pod"]));
    let vm = forge.enqueue_job(job(&["vm"]));
    let gpu = forge.enqueue_job(job(&["pod", "gpu"]));
    let any = forge.enqueue_job(job(&[]));
    let wide = Client::new(forge.url())
        .register(&forge.registration_token(), "wide", &["vm", "gpu", "pod"])
        .await
        .expect("register");

    let mut got = Vec::new();
    while let Some(task) = pod_runner.fetch(0).await.expect("fetch").task {
        got.push(forge.snapshot().task(task.id).expect("task").job_id);
    }
    assert_eq!(got, vec![pod, any]);
    let mut got = Vec::new();
    while let Some(task) = wide.fetch(0).await.expect("fetch").task {
        got.push(forge.snapshot().task(task.id).expect("task").job_id);
    }
    assert_eq!(got, vec![vm, gpu]);
    assert_eq!(forge.queued_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_is_never_handed_out_twice_under_concurrent_fetchers() {
    let (forge, anon) = start(Config::default()).await;
    forge.enqueue_jobs(job(&["pod"]), 200);
    let mut fetchers = Vec::new();
    for i in 0..8 {
        let runner = anon
            .register(
                &forge.registration_token(),
                &format!("r{}", i / 2),
                &["pod"],
            )
            .await
            .expect("register");
        fetchers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            while let Some(task) = runner.fetch(0).await.expect("fetch").task {
                ids.push(task.id);
            }
            ids
        }));
    }
    let mut task_ids = Vec::new();
    for f in fetchers {
        task_ids.extend(f.await.expect("fetcher"));
    }
    let unique: BTreeSet<i64> = task_ids.iter().copied().collect();
    assert_eq!((task_ids.len(), unique.len()), (200, 200));
    let snap = forge.snapshot();
    let jobs_of_tasks: BTreeSet<_> = snap.tasks.iter().map(|t| t.job_id).collect();
    assert_eq!(jobs_of_tasks.len(), 200);
    assert!(
        snap.jobs
            .iter()
            .all(|j| j.fetch_count == 1 && j.attempt == 1 && j.status == Status::Running)
    );
    assert!(snap.tasks.iter().all(|t| t.handed_out == 1));
    assert_eq!(forge.queued_count(), 0);
}

#[tokio::test]
async fn unregistered_runner_errors_follow_the_error_style() {
    let (forge, anon) = start(Config::default()).await;
    let stranger = anon.authed("00000000-0000-4000-8000-000000000000", &"0".repeat(40));
    let Err(CallError::Status {
        status,
        code,
        message,
    }) = stranger.declare(&["pod"]).await
    else {
        panic!("unknown runner must be refused");
    };
    assert_eq!((status, code.as_str()), (500, "unknown"));
    assert_eq!(
        message,
        "rpc error: code = Unauthenticated desc = unregistered runner"
    );
    let err = anon.fetch(0).await.expect_err("no credentials at all");
    assert_eq!(err.code(), "unknown");

    forge.set_error_style(ErrorStyle::Forgejo);
    let Err(CallError::Status {
        status,
        code,
        message,
    }) = stranger.fetch(0).await
    else {
        panic!("unknown runner must be refused");
    };
    assert_eq!(
        (status, code.as_str(), message.as_str()),
        (401, "unauthenticated", "unregistered runner")
    );

    // A removed runner's credentials stop working too; a wrong token never works.
    let runner = anon
        .register(&forge.registration_token(), "r", &["pod"])
        .await
        .expect("register");
    let forged = anon.authed(&runner.uuid, &"f".repeat(40));
    assert_eq!(
        forged.fetch(0).await.expect_err("bad token").code(),
        "unauthenticated"
    );
    assert!(forge.remove_runner(&runner.uuid));
    assert_eq!(
        runner.fetch(0).await.expect_err("removed").code(),
        "unauthenticated"
    );
}
