//! A stand-in for GitHub's `actions/runner` started with a just-in-time config, against the
//! fake GitHub's runner side (`/_fake/runner/…` of `jr-fake-github`): it starts the runner
//! the config registers, waits for the scale set to hand it a job, "runs" it and reports how
//! it ended, then exits, as an ephemeral JIT runner does.
//!
//! The result of a job is `failed` when its request id is a multiple of three, else
//! `succeeded`, so that a test can tell which result each job must end with.

use std::time::Duration;

use serde_json::{Value, json};

/// Where the fake GitHub is, and the pacing of the stand-in.
#[derive(Clone, Debug)]
pub struct GitHubRunnerConfig {
    /// The fake GitHub's base URL (a real JIT config names its server itself).
    pub server: String,
    /// `encodedJITConfig`, as GitHub made it for this runner.
    pub jit_config: String,
    pub poll_interval: Duration,
    pub give_up_after: Duration,
    /// How long the job "runs".
    pub job_time: Duration,
}

/// How a run ended.
#[derive(Debug, PartialEq, Eq)]
pub enum GitHubRunnerReport {
    /// The runner took job `request_id` and reported `result`.
    Finished { request_id: i64, result: String },
    /// No job came within the give-up time (or the runner was removed while idle).
    NoJob,
}

/// The result the stand-in reports for job `request_id`.
pub fn github_result(request_id: i64) -> &'static str {
    if request_id % 3 == 0 {
        "failed"
    } else {
        "succeeded"
    }
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Result<Value, String> {
    let response = http
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let status = response.status();
    let text = response.text().await.map_err(|e| format!("{url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("{url}: {status}: {text}"));
    }
    if text.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&text).map_err(|e| format!("{url}: {e}"))
}

/// Starts the runner, runs the one job it gets, and reports it.
pub async fn run_github_runner(cfg: GitHubRunnerConfig) -> Result<GitHubRunnerReport, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    let base = cfg.server.trim_end_matches('/').to_owned();
    let started = post(
        &http,
        format!("{base}/_fake/runner/start"),
        json!({"jitconfig": cfg.jit_config}),
    )
    .await?;
    let runner = started["runner"]
        .as_i64()
        .ok_or_else(|| format!("start answered {started}"))?;
    let deadline = tokio::time::Instant::now() + cfg.give_up_after;
    let mut job = started["job"].as_i64();
    while job.is_none() {
        if tokio::time::Instant::now() >= deadline {
            return Ok(GitHubRunnerReport::NoJob);
        }
        tokio::time::sleep(cfg.poll_interval).await;
        let polled = post(
            &http,
            format!("{base}/_fake/runner/{runner}/poll"),
            json!({}),
        )
        .await?;
        job = polled["job"].as_i64();
    }
    let request_id = job.unwrap_or_default();
    // The job "runs"; the runner keeps renewing it, as the real one does, so a runner that
    // stops (its workload killed) is found lost.
    let done = tokio::time::Instant::now() + cfg.job_time;
    while tokio::time::Instant::now() < done {
        let pause = cfg.poll_interval.min(done - tokio::time::Instant::now());
        tokio::time::sleep(pause).await;
        post(
            &http,
            format!("{base}/_fake/runner/{runner}/poll"),
            json!({}),
        )
        .await?;
    }
    let result = github_result(request_id);
    post(
        &http,
        format!("{base}/_fake/runner/{runner}/finish"),
        json!({"result": result}),
    )
    .await?;
    Ok(GitHubRunnerReport::Finished {
        request_id,
        result: result.to_owned(),
    })
}

/// What the executor image's entrypoint does for a GitHub assignment, in one process: fetches
/// the attempt's runner config from the facade with the executor's credentials (`env`:
/// `JETRUNNER_FACADE_URL`, `JETRUNNER_ASSIGNMENT_ID`, `JETRUNNER_RUNNER_TOKEN`), waiting while the
/// facade answers 503 (the workload not yet visible to it), then runs the runner stand-in
/// against the fake GitHub at `server`.
pub async fn run_github_executor(
    env: &std::collections::BTreeMap<String, String>,
    server: &str,
    poll_interval: Duration,
    give_up_after: Duration,
) -> Result<GitHubRunnerReport, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let var = |name: &str| {
        env.get(name)
            .cloned()
            .ok_or_else(|| format!("{name} is not set"))
    };
    let (facade, assignment, token) = (
        var("JETRUNNER_FACADE_URL")?,
        var("JETRUNNER_ASSIGNMENT_ID")?,
        var("JETRUNNER_RUNNER_TOKEN")?,
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    let url = format!(
        "{}/jetrunner/github/v1/runner-config",
        facade.trim_end_matches('/')
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let answer: Value = loop {
        let response = http
            .post(&url)
            .header("x-runner-uuid", &assignment)
            .header("x-runner-token", &token)
            .send()
            .await;
        match response {
            Ok(r) if r.status().is_success() => break r.json().await.map_err(|e| e.to_string())?,
            Ok(r) if r.status().as_u16() != 503 => {
                return Err(format!("runner config refused: {}", r.status()));
            }
            _ if tokio::time::Instant::now() > deadline => {
                return Err("no runner config in time".to_owned());
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let jit_config = answer["jit_config"]
        .as_str()
        .ok_or("no jit_config in the facade's answer")?
        .to_owned();
    run_github_runner(GitHubRunnerConfig {
        server: server.to_owned(),
        jit_config,
        poll_interval,
        give_up_after,
        job_time: Duration::from_millis(200),
    })
    .await
}
