//! A GitHub runner workload's one call to the facade: its attempt's JIT runner config, opened
//! from the sealed assignment for its own executor only.

mod facade_support;

use facade_support::*;
use jr_facade::AssignmentView;
use jr_protocol::RunnerRegistration as GitHubTask;
use jr_protocol::{AssignmentId, BackendName, TokenHash};
use jr_seal::SealScope;

const TOKEN: &str = "github-executor-token";
const PATH: &str = "/jetrunner/github/v1/runner-config";

fn add_github(h: &Harness, request_id: i64, token: &str) -> AssignmentId {
    let id = AssignmentId::for_task("gh-acme", request_id);
    let pod = BackendName::new("pod").expect("backend");
    let task = GitHubTask {
        runner_name: format!("jr-{}-1", id.0.simple()),
        jit_config: format!("eyJqaXQiOiJjb25maWctb2Yt{request_id}"),
    };
    let sealed = h
        .sealer
        .seal(
            SealScope::new(id, &pod, request_id),
            &serde_json::to_vec(&task).expect("json"),
        )
        .expect("seal");
    h.ledger.insert(AssignmentView {
        id,
        backend: pod,
        attempt: 1,
        forge_task_id: request_id,
        sealed_task: sealed,
        token_hash: Some(TokenHash::of_token(token)),
        claimed: false,
        terminal: false,
        trace: None,
    });
    id
}

async fn ask(
    h: &Harness,
    id: AssignmentId,
    token: &str,
) -> (u16, serde_json::Value, Option<String>) {
    let response = reqwest::Client::new()
        .post(format!("{}{PATH}", h.url.trim_end_matches('/')))
        .header("x-runner-uuid", id.to_string())
        .header("x-runner-token", token)
        .send()
        .await
        .expect("facade answers");
    let status = response.status().as_u16();
    let cache = response
        .headers()
        .get("cache-control")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response.json().await.unwrap_or(serde_json::Value::Null);
    (status, body, cache)
}

#[tokio::test]
async fn only_the_attempts_executor_gets_its_runner_config() {
    let h = start().await;
    let id = add_github(&h, 7001, TOKEN);
    let (status, body, cache) = ask(&h, id, TOKEN).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["jit_config"], "eyJqaXQiOiJjb25maWctb2Yt7001");
    assert_eq!(body["runner_name"], format!("jr-{}-1", id.0.simple()));
    assert_eq!(cache.as_deref(), Some("no-store"));
    // The executor has its credential: the attempt is claimed, as by a FetchTask.
    assert_eq!(
        h.ledger.record(id).expect("record").claimed_by.as_deref(),
        Some("token")
    );
    // Asked again (a lost answer), the same executor gets the same config.
    let (status, again, _) = ask(&h, id, TOKEN).await;
    assert_eq!((status, &again["jit_config"]), (200, &body["jit_config"]));

    // Another token, or another assignment's executor, gets nothing.
    let (status, body, _) = ask(&h, id, "someone-elses-token").await;
    assert_eq!(status, 401, "{body}");
    let other = add_github(&h, 7002, "token-of-7002");
    let (status, body, _) = ask(&h, other, TOKEN).await;
    assert_eq!(status, 401, "{body}");
    assert!(!body.to_string().contains("config-of"), "{body}");
    assert_eq!(h.ledger.record(other).expect("record").claimed_by, None);

    // A Gitea assignment has no runner config.
    let gitea = add_assignment(&h, 7003, Some("gitea-token"));
    let (status, _, _) = ask(&h, gitea, "gitea-token").await;
    assert_eq!(status, 404);

    // Once the job is over, the config is not handed out any more.
    let mut view = h.ledger.record(id).expect("record").view;
    view.terminal = true;
    h.ledger.insert(view);
    let (status, body, _) = ask(&h, id, TOKEN).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("over"), "{body}");
    h.stop().await;
}
