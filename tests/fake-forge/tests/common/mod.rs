//! A minimal Connect unary client (reqwest + prost) for exercising the fake over HTTP.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::time::Duration;

use jr_fake_forge::{Config, FakeForge, Rpc};
use jr_forge::proto::runner::v1 as pb;
use prost::Message;

#[derive(Debug)]
pub enum CallError {
    /// A Connect error reply.
    Status {
        status: u16,
        code: String,
        message: String,
    },
    /// No usable reply (connection cut, timeout, …).
    Transport(String),
}

impl CallError {
    pub fn code(&self) -> &str {
        match self {
            Self::Status { code, .. } => code,
            Self::Transport(_) => "transport",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    pub uuid: String,
    pub token: String,
}

impl Client {
    pub fn new(base: &str) -> Self {
        Self::with_timeout(base, Duration::from_secs(10))
    }

    pub fn with_timeout(base: &str, timeout: Duration) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .expect("build reqwest client");
        Self {
            http,
            base: base.to_owned(),
            uuid: String::new(),
            token: String::new(),
        }
    }

    pub fn authed(&self, uuid: &str, token: &str) -> Self {
        Self {
            uuid: uuid.to_owned(),
            token: token.to_owned(),
            ..self.clone()
        }
    }

    pub async fn call<Req: Message, Resp: Message + Default>(
        &self,
        rpc: Rpc,
        req: &Req,
    ) -> Result<Resp, CallError> {
        let mut request = self
            .http
            .post(format!("{}{}", self.base, rpc.path()))
            .header("content-type", "application/proto")
            .header("connect-protocol-version", "1")
            .body(req.encode_to_vec());
        if !self.uuid.is_empty() {
            request = request
                .header("x-runner-uuid", &self.uuid)
                .header("x-runner-token", &self.token);
        }
        let reply = request
            .send()
            .await
            .map_err(|e| CallError::Transport(e.to_string()))?;
        let status = reply.status().as_u16();
        let body = reply
            .bytes()
            .await
            .map_err(|e| CallError::Transport(e.to_string()))?;
        if status == 200 {
            return Resp::decode(body).map_err(|e| CallError::Transport(e.to_string()));
        }
        let json: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| CallError::Transport(e.to_string()))?;
        Err(CallError::Status {
            status,
            code: json["code"].as_str().unwrap_or_default().to_owned(),
            message: json["message"].as_str().unwrap_or_default().to_owned(),
        })
    }

    /// Registers with `labels` and returns a client carrying the new credentials.
    pub async fn register(
        &self,
        registration_token: &str,
        name: &str,
        labels: &[&str],
    ) -> Result<Self, CallError> {
        let req = pb::RegisterRequest {
            name: name.to_owned(),
            token: registration_token.to_owned(),
            version: "test".to_owned(),
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
            ..Default::default()
        };
        let reply: pb::RegisterResponse = self.call(Rpc::Register, &req).await?;
        let runner = reply.runner.expect("register reply carries a runner");
        Ok(self.authed(&runner.uuid, &runner.token))
    }

    pub async fn declare(&self, labels: &[&str]) -> Result<pb::DeclareResponse, CallError> {
        let req = pb::DeclareRequest {
            version: "test".to_owned(),
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
            ..Default::default()
        };
        self.call(Rpc::Declare, &req).await
    }

    pub async fn fetch(&self, tasks_version: i64) -> Result<pb::FetchTaskResponse, CallError> {
        self.call(
            Rpc::FetchTask,
            &pb::FetchTaskRequest {
                tasks_version,
                ..Default::default()
            },
        )
        .await
    }

    /// Fetches with version 0 and expects a task.
    pub async fn fetch_task(&self) -> pb::Task {
        self.fetch(0)
            .await
            .expect("fetch succeeds")
            .task
            .expect("a task is assigned")
    }

    pub async fn log(
        &self,
        task_id: i64,
        index: i64,
        rows: &[&str],
        no_more: bool,
    ) -> Result<i64, CallError> {
        let req = pb::UpdateLogRequest {
            task_id,
            index,
            rows: rows
                .iter()
                .map(|r| pb::LogRow {
                    time: None,
                    content: (*r).to_owned(),
                })
                .collect(),
            no_more,
        };
        let reply: pb::UpdateLogResponse = self.call(Rpc::UpdateLog, &req).await?;
        Ok(reply.ack_index)
    }

    pub async fn update(
        &self,
        task_id: i64,
        result: pb::Result,
        steps: Vec<pb::StepState>,
        outputs: &[(&str, &str)],
    ) -> Result<pb::UpdateTaskResponse, CallError> {
        let stopped_at = (result != pb::Result::Unspecified).then_some(prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 0,
        });
        let req = pb::UpdateTaskRequest {
            state: Some(pb::TaskState {
                id: task_id,
                result: result as i32,
                started_at: None,
                stopped_at,
                steps,
            }),
            outputs: outputs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        self.call(Rpc::UpdateTask, &req).await
    }
}

pub fn reply_result(reply: &pb::UpdateTaskResponse) -> pb::Result {
    pb::Result::try_from(reply.state.as_ref().map_or(0, |s| s.result)).expect("known result")
}

pub async fn start(config: Config) -> (FakeForge, Client) {
    let forge = FakeForge::start(config).await.expect("fake forge starts");
    let client = Client::new(forge.url());
    (forge, client)
}

/// A forge plus one registered runner that declared `labels`.
pub async fn start_with_runner(config: Config, labels: &[&str]) -> (FakeForge, Client) {
    let (forge, anon) = start(config).await;
    let runner = anon
        .register(&forge.registration_token(), "runner-1", labels)
        .await
        .expect("register");
    runner.declare(labels).await.expect("declare");
    (forge, runner)
}
