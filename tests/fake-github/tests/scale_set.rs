//! The scale set client against the strict fake: the protocol's paths, faults and quirks.

use std::time::Duration;

use jr_fake_github::{FakeGitHub, Fault, JobSpec, JobState, Route};
use jr_github::wire::JobMessage;
use jr_github::{Credentials, MessageSession, RetryPolicy, ScaleSetClient, Settings};

const PAT: &str = "ghp_test_token";

fn client(fake: &FakeGitHub, pat: &str) -> ScaleSetClient {
    ScaleSetClient::new(Settings {
        url: "https://github.com/acme".into(),
        api: Some(fake.url()),
        credentials: Credentials::Pat(pat.into()),
        retry: RetryPolicy {
            attempts: 4,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(5),
        },
        user_agent: "jetrunner-test".into(),
    })
    .expect("client")
}

async fn setup(name: &str) -> (FakeGitHub, ScaleSetClient, MessageSession) {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    fake.set_poll_hold(Duration::from_millis(300));
    let client = client(&fake, PAT);
    let set = client
        .ensure_scale_set("default", name, &["linux".to_owned()])
        .await
        .expect("scale set");
    let session = client
        .create_session(set.id, "jr-test")
        .await
        .expect("session");
    (fake, client, session)
}

/// Polls until a message with job messages arrives (or `tries` polls came back empty).
async fn next_jobs(session: &mut MessageSession, tries: usize) -> (i64, Vec<JobMessage>) {
    for _ in 0..tries {
        if let Some(message) = session.next_message(10).await.expect("poll") {
            if !message.jobs.is_empty() {
                return (message.id, message.jobs);
            }
            session.delete_message(message.id).await.expect("delete");
        }
    }
    panic!("no job message after {tries} polls");
}

#[tokio::test]
async fn a_job_is_assigned_started_and_completed_through_one_session() {
    let (fake, client, mut session) = setup("jr-linux").await;
    let request = fake.enqueue(JobSpec::push(&["jr-linux"]));
    let (id, jobs) = next_jobs(&mut session, 3).await;
    assert!(
        matches!(&jobs[..], [JobMessage::Assigned(f)] if f.runner_request_id == request),
        "{jobs:?}"
    );
    session.delete_message(id).await.expect("delete");
    assert_eq!(fake.max_capacity(session.scale_set()), Some(10));
    assert!(session.statistics().total_assigned_jobs >= 1);

    let jit = client
        .generate_jit_config(session.scale_set(), "jr-runner-1", "_work")
        .await
        .expect("jit");
    let (runner, job) = fake.start_runner(&jit.encoded).expect("runner starts");
    assert_eq!((runner, job), (jit.runner.id, Some(request)));
    assert!(
        fake.start_runner(&jit.encoded).is_err(),
        "a JIT config started a second runner"
    );
    let (id, jobs) = next_jobs(&mut session, 3).await;
    assert!(
        matches!(&jobs[..], [JobMessage::Started { runner_id, .. }] if *runner_id == runner),
        "{jobs:?}"
    );
    session.delete_message(id).await.expect("delete");

    fake.finish_runner(runner, "succeeded").expect("finish");
    let (id, jobs) = next_jobs(&mut session, 3).await;
    assert!(
        matches!(&jobs[..], [JobMessage::Completed { result, .. }] if result == "succeeded"),
        "{jobs:?}"
    );
    session.delete_message(id).await.expect("delete");
    assert!(
        session.next_message(10).await.expect("poll").is_none(),
        "a deleted message came back"
    );
    session.close().await.expect("close");
    assert_eq!(fake.session(jit.runner.runner_scale_set_id), None);
}

#[tokio::test]
async fn a_second_session_conflicts_and_the_first_is_resumed_by_id() {
    let (fake, client, session) = setup("jr-conflict").await;
    let set = session.scale_set();
    let error = match client.create_session(set, "other").await {
        Ok(_) => panic!("a second session was opened"),
        Err(error) => error,
    };
    assert!(error.is_session_conflict(), "{error}");
    assert_eq!(error.status(), Some(409));
    // A restarted listener takes its own session over by id and goes on after its cursor.
    let request = fake.enqueue(JobSpec::push(&["jr-conflict"]));
    let mut resumed = client
        .resume_session(set, session.id(), 0)
        .await
        .expect("resume");
    let (_, jobs) = next_jobs(&mut resumed, 3).await;
    assert_eq!(jobs[0].facts().map(|f| f.runner_request_id), Some(request));
    // The old handle's queue token was replaced: the service refuses it, so the handle
    // refreshes and goes on with a new token rather than failing.
    drop(session);
    resumed.close().await.expect("close");
    client
        .create_session(set, "after-close")
        .await
        .expect("a closed session frees the set");
}

#[tokio::test]
async fn an_undeleted_message_comes_again_until_it_is_deleted() {
    let (fake, client, mut session) = setup("jr-redeliver").await;
    fake.enqueue(JobSpec::push(&["jr-redeliver"]));
    let (first, _) = next_jobs(&mut session, 3).await;
    // Not deleted: a listener that restarts from the session (cursor 0) gets it again.
    let mut again = client
        .resume_session(session.scale_set(), session.id(), 0)
        .await
        .expect("resume");
    let (second, _) = next_jobs(&mut again, 3).await;
    assert_eq!(first, second);
    again.delete_message(second).await.expect("delete");
    assert!(again.next_message(10).await.expect("poll").is_none());
    assert_eq!(again.last_message_id(), second);
}

#[tokio::test]
async fn acquire_grants_only_offered_jobs_and_may_grant_fewer() {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    fake.set_poll_hold(Duration::from_millis(300));
    fake.set_acquire_step(true);
    fake.set_acquire_limit(Some(1));
    let client = client(&fake, PAT);
    let set = client
        .ensure_scale_set("Default", "jr-ghes", &[])
        .await
        .expect("set");
    let mut session = client.create_session(set.id, "jr").await.expect("session");
    let a = fake.enqueue(JobSpec::push(&["jr-ghes"]));
    let b = fake.enqueue(JobSpec::push(&["jr-ghes"]));
    let (id, jobs) = next_jobs(&mut session, 3).await;
    let offered: Vec<i64> = jobs
        .iter()
        .filter_map(|j| match j {
            JobMessage::Available(f) => Some(f.runner_request_id),
            _ => None,
        })
        .collect();
    assert_eq!(offered, vec![a, b]);
    session.delete_message(id).await.expect("delete");
    let granted = session.acquire(&[a, b, 999_999]).await.expect("acquire");
    assert_eq!(granted, vec![a], "the fake grants at most one");
    assert_eq!(
        fake.job(b).map(|j| j.state),
        Some(JobState::Available { scale_set: set.id })
    );
    let (_, jobs) = next_jobs(&mut session, 3).await;
    assert!(
        matches!(&jobs[..], [JobMessage::Assigned(f)] if f.runner_request_id == a),
        "{jobs:?}"
    );
}

#[tokio::test]
async fn expired_tokens_are_renewed_and_early_enough() {
    let (fake, client, mut session) = setup("jr-tokens").await;
    let before = client.admin_renewals();
    // A revoked admin token: the call is refused once, the client renews and goes on.
    fake.revoke_admin_tokens();
    client
        .runner_by_name("nobody")
        .await
        .expect("lookup after revocation");
    assert_eq!(client.admin_renewals(), before + 1);
    // An expired queue token: the session is refreshed and the poll goes on.
    fake.expire_queue_tokens();
    assert!(
        session
            .next_message(10)
            .await
            .expect("poll after expiry")
            .is_none()
    );
    assert_eq!(fake.count(Route::RefreshSession), 1);
    // Tokens that live less than the renewal margin are renewed before each use: no call
    // is ever made with a token about to expire.
    fake.set_admin_ttl(Duration::from_secs(30));
    fake.revoke_admin_tokens();
    client.runner_by_name("a").await.expect("lookup");
    let renewed = client.admin_renewals();
    client.runner_by_name("b").await.expect("lookup");
    assert_eq!(
        client.admin_renewals(),
        renewed + 1,
        "a token with 30 s left was used"
    );
    let refused = fake.requests().iter().filter(|r| r.status == 401).count();
    assert_eq!(
        refused, 3,
        "only the two revocations and the expired queue token were refused"
    );
}

#[tokio::test]
async fn backpressure_is_retried_as_retry_after_says() {
    let (fake, client, session) = setup("jr-limits").await;
    fake.inject(
        Route::GenerateJitConfig,
        Fault::Status {
            status: 429,
            retry_after: Some(1),
        },
    );
    let jit = client
        .generate_jit_config(session.scale_set(), "r-1", "")
        .await
        .expect("jit after 429");
    assert_eq!(jit.runner.name, "r-1");
    let times: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.route == Route::GenerateJitConfig)
        .collect();
    assert_eq!(times.len(), 2);
    assert!(
        times[1].at.duration_since(times[0].at) >= Duration::from_millis(950),
        "Retry-After not honoured"
    );
    // A secondary rate limit (403 with Retry-After) on REST is retried too.
    let request = fake.enqueue(JobSpec::push(&["jr-limits"]));
    let run = fake.job(request).expect("job").run_id;
    fake.inject(
        Route::WorkflowRun,
        Fault::Status {
            status: 403,
            retry_after: Some(0),
        },
    );
    client
        .run_origin("acme", "app", run)
        .await
        .expect("run after 403");
    // Backpressure that outlasts the retries comes back as backpressure, not as a failure.
    for _ in 0..4 {
        fake.inject(
            Route::GenerateJitConfig,
            Fault::Status {
                status: 503,
                retry_after: None,
            },
        );
    }
    let error = client
        .generate_jit_config(session.scale_set(), "r-2", "")
        .await
        .expect_err("503s");
    assert!(error.is_backpressure() && error.is_transient(), "{error}");
    // A plain 403 (no Retry-After) is not retried: it is a permission problem.
    fake.inject(
        Route::WorkflowRun,
        Fault::Status {
            status: 403,
            retry_after: None,
        },
    );
    let before = fake.count(Route::WorkflowRun);
    let error = client
        .run_origin("acme", "app", run)
        .await
        .expect_err("403");
    assert_eq!(
        (error.status(), fake.count(Route::WorkflowRun)),
        (Some(403), before + 1)
    );
    assert!(!error.is_transient());
}

#[tokio::test]
async fn an_empty_200_and_an_evicted_session_are_survived() {
    let (fake, _client, mut session) = setup("jr-quirks").await;
    fake.inject(Route::GetMessage, Fault::EmptyOk);
    assert!(session.next_message(10).await.expect("empty 200").is_none());
    // A message that cannot be read but names its id is handed out empty, to be deleted,
    // rather than holding the queue.
    fake.inject(
        Route::GetMessage,
        Fault::RawOk(r#"{"messageId": 77, "messageType": 5, "body": [1]}"#.into()),
    );
    let garbled = session
        .next_message(10)
        .await
        .expect("garbled 200")
        .expect("a message");
    assert_eq!((garbled.id, garbled.jobs.len()), (77, 0));
    fake.inject(Route::GetMessage, Fault::RawOk("not json".into()));
    assert!(
        session.next_message(10).await.is_err(),
        "a message without an id cannot be deleted"
    );
    let old = session.id().to_owned();
    fake.expire_queue_tokens();
    fake.inject(Route::RefreshSession, Fault::SessionEvicted);
    let request = fake.enqueue(JobSpec::push(&["jr-quirks"]));
    let (_, jobs) = next_jobs(&mut session, 3).await;
    assert_ne!(session.id(), old, "no new session after the eviction");
    assert_eq!(jobs[0].facts().map(|f| f.runner_request_id), Some(request));
}

#[tokio::test]
async fn a_lapsed_assignment_is_cancelled_then_assigned_again() {
    let (fake, _client, mut session) = setup("jr-lapse").await;
    let request = fake.enqueue(JobSpec::push(&["jr-lapse"]));
    let (id, _) = next_jobs(&mut session, 3).await;
    session.delete_message(id).await.expect("delete");
    assert!(fake.assignment_lapsed(request));
    let (_, jobs) = next_jobs(&mut session, 3).await;
    assert!(
        matches!(&jobs[..], [JobMessage::Completed { result, .. }, JobMessage::Assigned(f)] if result == "canceled" && f.runner_request_id == request),
        "{jobs:?}"
    );
    // A cancel while queued ends it for good.
    fake.cancel(request);
    assert!(
        matches!(fake.job(request).map(|j| j.state), Some(JobState::Completed { result }) if result == "canceled")
    );
}

#[tokio::test]
async fn runners_are_removed_unless_busy_and_names_are_unique() {
    let (fake, client, session) = setup("jr-runners").await;
    let set = session.scale_set();
    let idle = client
        .generate_jit_config(set, "idle", "")
        .await
        .expect("jit");
    let dup = client
        .generate_jit_config(set, "idle", "")
        .await
        .expect_err("duplicate name");
    assert!(
        dup.is_exception("AgentExistsException") && dup.status() == Some(409),
        "{dup}"
    );
    assert_eq!(
        client
            .runner_by_name("idle")
            .await
            .expect("lookup")
            .map(|r| r.id),
        Some(idle.runner.id)
    );
    client.remove_runner(idle.runner.id).await.expect("remove");
    assert!(
        client
            .runner_by_name("idle")
            .await
            .expect("lookup")
            .is_none(),
        "a removed runner is still listed"
    );
    assert!(
        fake.start_runner(&idle.encoded).is_err(),
        "a removed runner's config still works"
    );

    fake.enqueue(JobSpec::push(&["jr-runners"]));
    let busy = client
        .generate_jit_config(set, "busy", "")
        .await
        .expect("jit");
    let (runner, job) = fake.start_runner(&busy.encoded).expect("start");
    assert!(job.is_some());
    let error = client
        .remove_runner(runner)
        .await
        .expect_err("busy runner removed");
    assert!(error.is_exception("JobStillRunningException"), "{error}");
}

#[tokio::test]
async fn a_fork_run_is_told_from_a_base_run() {
    let (fake, client, _session) = setup("jr-forks").await;
    let mut spec = JobSpec::push(&["jr-forks"]);
    spec.event_name = "pull_request_target".into();
    spec.from_fork = true;
    let fork = fake.enqueue(spec);
    let base = fake.enqueue(JobSpec::push(&["jr-forks"]));
    let origin = |id: i64| fake.job(id).expect("job").run_id;
    let fork = client
        .run_origin("acme", "app", origin(fork))
        .await
        .expect("fork run");
    assert!(fork.from_fork() && fork.event == "pull_request_target");
    let base = client
        .run_origin("acme", "app", origin(base))
        .await
        .expect("base run");
    assert!(!base.from_fork());
}

#[tokio::test]
async fn a_wrong_pat_is_refused_without_retries() {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    let client = client(&fake, "ghp_wrong");
    let error = client.runner_group("default").await.expect_err("wrong PAT");
    assert_eq!(error.status(), Some(401));
    assert_eq!(fake.count(Route::RegistrationToken), 1);
}

/// A key made for these tests only (`openssl genrsa -traditional 2048`); it signs nothing else.
const APP_KEY: &str = include_str!("data/app-key.pem");

fn app_client(fake: &FakeGitHub, installation_id: u64) -> ScaleSetClient {
    ScaleSetClient::new(Settings {
        url: "https://github.com/acme".into(),
        api: Some(fake.url()),
        credentials: Credentials::App {
            issuer: "Iv1.jetrunner".into(),
            installation_id,
            private_key_pem: APP_KEY.into(),
        },
        retry: RetryPolicy {
            attempts: 2,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(5),
        },
        user_agent: "jetrunner-test".into(),
    })
    .expect("client")
}

#[tokio::test]
async fn a_github_app_signs_in_with_its_key_and_keeps_its_installation_token() {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    fake.set_app("Iv1.jetrunner", 42, APP_KEY).expect("app");
    let client = app_client(&fake, 42);
    client
        .runner_group("default")
        .await
        .expect("group through the App");
    let request = fake.enqueue(JobSpec::push(&["x"]));
    let run = fake.job(request).expect("job").run_id;
    client
        .run_origin("acme", "app", run)
        .await
        .expect("REST through the App");
    assert_eq!(
        fake.count(Route::AccessToken),
        1,
        "the installation token was not kept"
    );
    // Another installation's id is refused: the JWT alone proves nothing about it.
    let wrong = app_client(&fake, 43);
    let error = wrong
        .runner_group("default")
        .await
        .expect_err("wrong installation");
    assert_eq!(error.status(), Some(401));
    // A key that is not the App's is refused.
    fake.set_app(
        "Iv1.jetrunner",
        42,
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/other-key.pem"
        ))
        .expect("other key"),
    )
    .expect("app");
    let error = app_client(&fake, 42)
        .runner_group("default")
        .await
        .expect_err("wrong key");
    assert_eq!(error.status(), Some(401));
}

#[test]
fn a_bad_app_key_is_a_configuration_error() {
    let error = ScaleSetClient::new(Settings {
        url: "https://github.com/acme".into(),
        api: None,
        credentials: Credentials::App {
            issuer: "1".into(),
            installation_id: 1,
            private_key_pem:
                "-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n".into(),
        },
        retry: RetryPolicy::default(),
        user_agent: "t".into(),
    })
    .err()
    .expect("bad key accepted");
    assert!(error.to_string().contains("private key"), "{error}");
}

#[tokio::test]
async fn the_runner_side_and_the_job_queue_work_over_http() {
    let (fake, client, mut session) = setup("jr-http").await;
    let http = reqwest::Client::new();
    let queued: serde_json::Value = http
        .post(format!("{}/_fake/jobs", fake.url()))
        .json(&serde_json::json!({"labels": ["jr-http"]}))
        .send()
        .await
        .expect("enqueue")
        .json()
        .await
        .expect("json");
    let request = queued["runner_request_id"].as_i64().expect("id");
    let (id, _) = next_jobs(&mut session, 3).await;
    session.delete_message(id).await.expect("delete");
    let jit = client
        .generate_jit_config(session.scale_set(), "http-1", "")
        .await
        .expect("jit");
    let start = |config: String| {
        let http = http.clone();
        let url = format!("{}/_fake/runner/start", fake.url());
        async move {
            http.post(url)
                .json(&serde_json::json!({"jitconfig": config}))
                .send()
                .await
                .expect("start")
        }
    };
    let started: serde_json::Value = start(jit.encoded.clone()).await.json().await.expect("json");
    assert_eq!(started["job"].as_i64(), Some(request));
    assert_eq!(
        start(jit.encoded.clone()).await.status(),
        409,
        "a JIT config started twice over HTTP"
    );
    let runner = started["runner"].as_i64().expect("runner");
    let finished = http
        .post(format!("{}/_fake/runner/{runner}/finish", fake.url()))
        .json(&serde_json::json!({"result": "succeeded"}))
        .send()
        .await
        .expect("finish");
    assert_eq!(finished.status(), 204);
    let job: serde_json::Value = http
        .get(format!("{}/_fake/jobs/{request}", fake.url()))
        .send()
        .await
        .expect("job")
        .json()
        .await
        .expect("json");
    assert_eq!(
        (job["state"].as_str(), job["result"].as_str()),
        (Some("completed"), Some("succeeded"))
    );
    let bad = http
        .post(format!("{}/_fake/jobs", fake.url()))
        .json(&serde_json::json!({"labels": []}))
        .send()
        .await
        .expect("bad");
    assert_eq!(bad.status(), 400);
}

/// Statuses the fake answered on `route`, oldest first.
fn statuses(fake: &FakeGitHub, route: Route) -> Vec<u16> {
    fake.requests()
        .iter()
        .filter(|r| r.route == route)
        .map(|r| r.status)
        .collect()
}

#[tokio::test]
async fn removing_a_runner_the_service_no_longer_holds_is_answered_204_and_counts_as_removed() {
    let (fake, client, session) = setup("jr-gone").await;
    let set = session.scale_set();
    // A runner that ran its job: the ephemeral runner is gone from the service afterwards.
    let request = fake.enqueue(JobSpec::push(&["jr-gone"]));
    let ran = client
        .generate_jit_config(set, "ran", "")
        .await
        .expect("jit");
    let (runner, job) = fake.start_runner(&ran.encoded).expect("start");
    assert_eq!(job, Some(request));
    fake.finish_runner(runner, "succeeded").expect("finish");
    assert!(
        client
            .runner_by_name("ran")
            .await
            .expect("lookup")
            .is_none(),
        "the runner is listed after its job"
    );
    client
        .remove_runner(runner)
        .await
        .expect("a runner gone after its job counts as removed");
    // An id the service never had is answered alike.
    client
        .remove_runner(999_999)
        .await
        .expect("an unknown runner counts as removed");
    assert_eq!(
        statuses(&fake, Route::DeleteRunner),
        vec![204, 204],
        "the service answers 204 for a runner it does not hold"
    );
    // A busy runner is still refused, and stays registered.
    fake.enqueue(JobSpec::push(&["jr-gone"]));
    let busy = client
        .generate_jit_config(set, "busy", "")
        .await
        .expect("jit");
    let (busy_id, job) = fake.start_runner(&busy.encoded).expect("start");
    assert!(job.is_some());
    let error = client
        .remove_runner(busy_id)
        .await
        .expect_err("busy runner removed");
    assert!(
        error.status() == Some(400) && error.is_exception("JobStillRunningException"),
        "{error}"
    );
    assert!(fake.runners().iter().any(|r| r.id == busy_id));
}

/// A client configured with `url` and no API override, as for a GitHub Enterprise Server.
fn ghes_client(url: String) -> ScaleSetClient {
    ScaleSetClient::new(Settings {
        url,
        api: None,
        credentials: Credentials::Pat(PAT.into()),
        retry: RetryPolicy {
            attempts: 2,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(5),
        },
        user_agent: "jetrunner-test".into(),
    })
    .expect("client")
}

#[tokio::test]
async fn an_enterprise_server_url_with_a_port_reaches_the_rest_api_at_that_port_under_api_v3() {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    // The fake listens on a port of its own (never 80): a client that drops the port, or
    // the `/api/v3` prefix, does not reach it. Each scope's registration token is made on
    // its own path, and the fake lets it register only the scope the URL names.
    for scope in ["acme", "acme/app", "Enterprises/big"] {
        let client = ghes_client(format!("{}/{scope}", fake.url()));
        let group = client
            .runner_group("default")
            .await
            .unwrap_or_else(|e| panic!("{scope}: {e}"));
        assert_eq!(group.id, 1, "{scope}");
    }
    assert_eq!(
        statuses(&fake, Route::RegistrationToken),
        vec![201, 201, 201]
    );
    assert_eq!(
        statuses(&fake, Route::RunnerRegistration),
        vec![201, 201, 201]
    );
}

#[tokio::test]
async fn a_registration_token_registers_only_the_scope_it_was_made_for() {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    let http = reqwest::Client::new();
    let token: serde_json::Value = http
        .post(format!(
            "{}/api/v3/orgs/acme/actions/runners/registration-token",
            fake.url()
        ))
        .bearer_auth(PAT)
        .send()
        .await
        .expect("registration token")
        .json()
        .await
        .expect("json");
    let token = token["token"].as_str().expect("token").to_owned();
    let register = |url: String| {
        let http = http.clone();
        let registration = format!("{}/api/v3/actions/runner-registration", fake.url());
        let token = token.clone();
        async move {
            http.post(registration)
                .header("Authorization", format!("RemoteAuth {token}"))
                .json(&serde_json::json!({"url": url, "runner_event": "register"}))
                .send()
                .await
                .expect("runner registration")
                .status()
                .as_u16()
        }
    };
    let base = fake.url();
    assert_eq!(register(format!("{base}/other")).await, 403, "another org");
    assert_eq!(
        register(format!("{base}/acme/app")).await,
        403,
        "a repository"
    );
    assert_eq!(register(format!("{base}/ACME/")).await, 201, "its own org");
}
