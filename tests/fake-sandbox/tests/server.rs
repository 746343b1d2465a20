//! The fake's observable behaviour, checked with a plain HTTP client against the reference doc.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use jr_fake_sandbox::{FakeConfig, FakeSandbox, Runner, SandboxRun, SandboxState};
use serde_json::{Value, json};

const KEY: &str = "k";

fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
}

fn config() -> FakeConfig {
    FakeConfig {
        api_key: Some(KEY.into()),
        pools: BTreeMap::from([("ci-vm".to_owned(), 2)]),
        pool_acquisition_timeout: Duration::from_millis(100),
        stopping_for: Duration::from_millis(100),
        ..FakeConfig::default()
    }
}

async fn call(
    fake: &FakeSandbox,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = http()
        .request(method, format!("{}{path}", fake.base_url()))
        .header("OPEN-SANDBOX-API-KEY", KEY);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::Null),
        headers,
    )
}

async fn create(fake: &FakeSandbox, metadata: Value) -> (u16, Value, reqwest::header::HeaderMap) {
    let body =
        json!({ "extensions": { "poolRef": "ci-vm" }, "timeout": 3600, "metadata": metadata });
    call(fake, reqwest::Method::POST, "/v1/sandboxes", Some(body)).await
}

async fn wait_until(mut condition: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("condition within 10 s");
}

#[tokio::test]
async fn api_key_is_required_except_on_health() {
    let fake = FakeSandbox::start(config()).await.expect("fake");
    let missing = http()
        .get(format!("{}/v1/sandboxes", fake.base_url()))
        .send()
        .await
        .expect("request");
    assert_eq!(missing.status().as_u16(), 401);
    assert!(missing.headers().contains_key("x-request-id"));
    assert_eq!(
        missing.json::<Value>().await.expect("json")["code"],
        "MISSING_API_KEY"
    );
    let wrong = http()
        .get(format!("{}/v1/sandboxes", fake.base_url()))
        .header("OPEN-SANDBOX-API-KEY", "x")
        .send()
        .await
        .expect("request");
    assert_eq!(
        wrong.json::<Value>().await.expect("json")["code"],
        "INVALID_API_KEY"
    );
    let health = http()
        .get(format!("{}/health", fake.base_url()))
        .send()
        .await
        .expect("request");
    assert_eq!(health.status().as_u16(), 200);
}

#[tokio::test]
async fn pooled_create_answers_202_running_without_entrypoint() {
    let fake = FakeSandbox::start(config()).await.expect("fake");
    let (status, body, headers) =
        create(&fake, json!({ "ci.example.com/assignment": "job-42" })).await;
    assert_eq!(status, 202);
    assert!(!headers.contains_key("location"));
    assert_eq!(body["status"]["state"], "Running");
    assert!(body.get("entrypoint").is_none());
    assert_eq!(body["metadata"]["ci.example.com/assignment"], "job-42");
    let id = body["id"].as_str().expect("id");
    let (status, got, _) = call(
        &fake,
        reqwest::Method::GET,
        &format!("/sandboxes/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 200, "routes are mounted at / too");
    assert_eq!(got["entrypoint"], json!([]));
    assert_eq!(got["image"]["uri"], "unknown");
}

#[tokio::test]
async fn invalid_requests_get_the_documented_error_shapes() {
    let fake = FakeSandbox::start(config()).await.expect("fake");
    let (status, body, _) = create(&fake, json!({ "opensandbox.io/id": "x" })).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("SANDBOX::INVALID_METADATA_LABEL"))
    );
    let (status, body, _) = create(&fake, json!({ "k": "not a label" })).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("SANDBOX::INVALID_METADATA_LABEL"))
    );

    let (status, body, _) = call(
        &fake,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(
        body["detail"][0]["msg"],
        "Value error, Exactly one of image or snapshotId must be provided."
    );
    let short = json!({ "extensions": { "poolRef": "ci-vm" }, "timeout": 30 });
    let (status, body, _) = call(&fake, reqwest::Method::POST, "/v1/sandboxes", Some(short)).await;
    assert_eq!(
        (status, body["detail"][0]["type"].as_str()),
        (422, Some("greater_than_equal"))
    );
    let with_volumes = json!({ "extensions": { "poolRef": "ci-vm" }, "volumes": [] });
    let (status, body, _) = call(
        &fake,
        reqwest::Method::POST,
        "/v1/sandboxes",
        Some(with_volumes),
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("SANDBOX::INVALID_PARAMETER"))
    );
    let no_pool = json!({ "extensions": { "poolRef": "gpu" } });
    let (status, body, _) =
        call(&fake, reqwest::Method::POST, "/v1/sandboxes", Some(no_pool)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("KUBERNETES::POOL_NOT_FOUND"))
    );
    let (status, body, _) = call(
        &fake,
        reqwest::Method::GET,
        "/v1/sandboxes?pageSize=201",
        None,
    )
    .await;
    assert_eq!(
        (status, body["detail"][0]["type"].as_str()),
        (422, Some("less_than_equal"))
    );
    let (status, body, _) = call(
        &fake,
        reqwest::Method::GET,
        "/v1/sandboxes?metadata=novalue",
        None,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (400, Some("INVALID_METADATA_FORMAT"))
    );
    assert!(fake.created().is_empty());
}

#[tokio::test]
async fn list_filters_by_nested_metadata_and_pages() {
    let fake = FakeSandbox::start(FakeConfig {
        pools: BTreeMap::from([("ci-vm".to_owned(), 10)]),
        ..config()
    })
    .await
    .expect("fake");
    for i in 0..5 {
        let owner = if i < 3 { "w1" } else { "w2" };
        assert_eq!(
            create(
                &fake,
                json!({ "jetrunner.io/worker": owner, "n": i.to_string() })
            )
            .await
            .0,
            202
        );
    }
    // `metadata` holds `jetrunner.io%2Fworker=w1`, encoded once more as a parameter value.
    let path = "/v1/sandboxes?metadata=jetrunner.io%252Fworker%3Dw1&pageSize=2&page=2";
    let (status, body, _) = call(&fake, reqwest::Method::GET, path, None).await;
    assert_eq!(status, 200);
    assert_eq!(
        body["pagination"],
        json!({ "page": 2, "pageSize": 2, "totalItems": 3, "totalPages": 2, "hasNextPage": false })
    );
    assert_eq!(body["items"].as_array().map(Vec::len), Some(1));
    let (_, running, _) = call(
        &fake,
        reqwest::Method::GET,
        "/v1/sandboxes?state=running&state=Paused",
        None,
    )
    .await;
    assert_eq!(running["pagination"]["totalItems"], 5);
}

#[tokio::test]
async fn exhausted_pool_answers_429_with_retry_after() {
    let fake = FakeSandbox::start(config()).await.expect("fake");
    assert_eq!(create(&fake, json!({})).await.0, 202);
    assert_eq!(create(&fake, json!({})).await.0, 202);
    let (status, body, headers) = create(&fake, json!({})).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (429, Some("KUBERNETES::POOL_CAPACITY_EXHAUSTED"))
    );
    assert_eq!(
        headers.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert_eq!(fake.max_live(), 2);
    // The refused create waited as a Pending CR: it held a place while it waited.
    assert_eq!(fake.max_held(), 3);
}

#[tokio::test]
async fn a_deleted_sandbox_is_stopping_then_404_and_frees_its_slot() {
    let fake = FakeSandbox::start(FakeConfig {
        pools: BTreeMap::from([("ci-vm".to_owned(), 1)]),
        pool_acquisition_timeout: Duration::from_secs(5),
        // Long enough that the GET and the create below reach the deleted sandbox while it is
        // still stopping, even on a loaded machine (100 ms was missed under a full test run).
        stopping_for: Duration::from_secs(2),
        ..config()
    })
    .await
    .expect("fake");
    let (_, body, _) = create(&fake, json!({})).await;
    let id = body["id"].as_str().expect("id").to_owned();
    let (status, _, _) = call(
        &fake,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 204);
    let (_, got, _) = call(
        &fake,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
    assert_eq!(got["status"]["state"], "Stopping");
    // A create waiting for the pool gets the slot once the deleted sandbox is gone.
    assert_eq!(create(&fake, json!({})).await.0, 202);
    let (status, got, _) = call(
        &fake,
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
    assert_eq!(
        (status, got["code"].as_str()),
        (404, Some("KUBERNETES::SANDBOX_NOT_FOUND"))
    );
    let (status, _, _) = call(
        &fake,
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(fake.max_live(), 1);
    // The stopping VM and the create waiting for its slot existed together.
    assert_eq!(fake.max_held(), 2);
}

#[tokio::test]
async fn simulated_sandboxes_run_the_runner_and_stay_running_after_it() {
    let runs: Arc<Mutex<Vec<SandboxRun>>> = Arc::default();
    let record = runs.clone();
    let runner: Runner = Arc::new(move |run| {
        let record = record.clone();
        async move { record.lock().expect("runs").push(run) }.boxed()
    });
    let fake = FakeSandbox::start(FakeConfig {
        runner: Some(runner),
        ..config()
    })
    .await
    .expect("fake");
    let body = json!({ "extensions": { "poolRef": "ci-vm" }, "env": { "JETRUNNER_ASSIGNMENT_ID": "a1", "DROP": null } });
    let (status, created, _) =
        call(&fake, reqwest::Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(status, 202);
    let id = created["id"].as_str().expect("id").to_owned();
    wait_until(|| !runs.lock().expect("runs").is_empty()).await;
    let run = runs.lock().expect("runs")[0].clone();
    assert_eq!(run.id, id);
    assert_eq!(
        run.env.get("JETRUNNER_ASSIGNMENT_ID").map(String::as_str),
        Some("a1")
    );
    assert_eq!(run.env.get("OPENSANDBOX_ID"), Some(&id));
    assert!(!run.env.contains_key("DROP"));
    assert_eq!(
        fake.sandbox(&id).map(|s| s.state),
        Some(SandboxState::Running)
    );
}

#[tokio::test]
async fn faults_make_the_server_fail_on_demand() {
    let fake = FakeSandbox::start(config()).await.expect("fake");
    fake.set_outage(true);
    assert_eq!(
        call(&fake, reqwest::Method::GET, "/v1/sandboxes", None)
            .await
            .0,
        503
    );
    fake.set_outage(false);
    fake.set_error_rate(1.0);
    let (status, body, _) = call(&fake, reqwest::Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (500, Some("KUBERNETES::API_ERROR"))
    );
    fake.set_error_rate(0.0);
    fake.fail_next_creates_with_ready_timeout(1);
    let (status, body, _) = create(&fake, json!({})).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (504, Some("KUBERNETES::POD_READY_TIMEOUT"))
    );
    assert_eq!(
        fake.sandboxes().first().map(|s| s.state),
        Some(SandboxState::Stopping)
    );
}
