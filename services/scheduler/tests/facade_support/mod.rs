//! Shared pieces of the facade tests: a minimal recording fake forge, a facade over a
//! MemoryLedger served on a local port, and helpers to create assignments and executors.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use jr_facade::{
    AssignmentView, AuthMode, Facade, FacadeSettings, MemoryLedger, TlsSettings, serve,
};
use jr_forge::proto::runner::v1::{
    Result as ForgeResult, Task, TaskState, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest,
    UpdateTaskResponse,
};
use jr_forge::{Code, Credentials, ForgeClient, connect_error_body};
use jr_protocol::{AssignmentId, BackendName, TokenHash};
use jr_seal::Sealer;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const FORGE_UUID: &str = "5c8f9a10-0000-4000-8000-00000000f0f0";
pub const FORGE_TOKEN: &str = "scheduler-real-runner-token";

pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// What the fake forge saw and how it answers.
#[derive(Default)]
pub struct ForgeState {
    pub update_tasks: Vec<UpdateTaskRequest>,
    pub update_logs: Vec<UpdateLogRequest>,
    /// Forgejo job summaries received: (task id, summary).
    pub summaries: Vec<(i64, String)>,
    /// Final result per task id (sticky, as in Gitea).
    pub results: BTreeMap<i64, i32>,
    /// Rows stored per task id.
    pub log_rows: BTreeMap<i64, i64>,
    /// Tasks whose user cancelled them: heartbeats are answered with CANCELLED.
    pub cancelled: Vec<i64>,
    /// Headers of proxied requests.
    pub proxied_headers: Vec<HeaderMap>,
    /// Error for the next RPC, if any.
    pub next_error: Option<(Code, String)>,
}

pub type Forge = Arc<Mutex<ForgeState>>;

fn connect_error(code: Code, message: &str) -> Response {
    (
        StatusCode::from_u16(code.http_status()).expect("status"),
        [(header::CONTENT_TYPE, "application/json")],
        connect_error_body(code, message),
    )
        .into_response()
}

fn proto(message: &impl Message) -> Response {
    (
        [(header::CONTENT_TYPE, "application/proto")],
        message.encode_to_vec(),
    )
        .into_response()
}

/// Checks the scheduler's credentials and the injected error.
fn precheck(forge: &Forge, headers: &HeaderMap) -> Option<Response> {
    let uuid = headers.get("x-runner-uuid").and_then(|v| v.to_str().ok());
    let token = headers.get("x-runner-token").and_then(|v| v.to_str().ok());
    if uuid != Some(FORGE_UUID) || token != Some(FORGE_TOKEN) {
        return Some(connect_error(Code::Unauthenticated, "unregistered runner"));
    }
    let next = forge.lock().expect("lock").next_error.take();
    next.map(|(code, message)| connect_error(code, &message))
}

async fn update_task(State(forge): State<Forge>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(refusal) = precheck(&forge, &headers) {
        return refusal;
    }
    let request = UpdateTaskRequest::decode(body).expect("UpdateTaskRequest");
    let mut f = forge.lock().expect("lock");
    f.update_tasks.push(request.clone());
    let state = request.state.unwrap_or_default();
    if state.result != ForgeResult::Unspecified as i32 {
        let cancelled = f.cancelled.contains(&state.id);
        let stored = if cancelled {
            ForgeResult::Cancelled as i32
        } else {
            state.result
        };
        f.results.entry(state.id).or_insert(stored);
    }
    let result = match f.results.get(&state.id) {
        Some(r) => *r,
        None if f.cancelled.contains(&state.id) => ForgeResult::Cancelled as i32,
        None => ForgeResult::Unspecified as i32,
    };
    proto(&UpdateTaskResponse {
        state: Some(TaskState {
            id: state.id,
            result,
            ..TaskState::default()
        }),
        sent_outputs: request.outputs.into_keys().collect(),
    })
}

async fn update_log(State(forge): State<Forge>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(refusal) = precheck(&forge, &headers) {
        return refusal;
    }
    let request = UpdateLogRequest::decode(body).expect("UpdateLogRequest");
    let mut f = forge.lock().expect("lock");
    f.update_logs.push(request.clone());
    let stored = f.log_rows.entry(request.task_id).or_insert(0);
    let end = request.index + request.rows.len() as i64;
    if request.index <= *stored && end > *stored {
        *stored = end;
    }
    proto(&UpdateLogResponse { ack_index: *stored })
}

async fn update_job_summary(
    State(forge): State<Forge>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refusal) = precheck(&forge, &headers) {
        return refusal;
    }
    let request = jr_forge::proto::runner::v1::UpdateJobSummaryRequest::decode(body)
        .expect("UpdateJobSummaryRequest");
    forge
        .lock()
        .expect("lock")
        .summaries
        .push((request.task_id, request.summary));
    proto(&jr_forge::proto::runner::v1::UpdateJobSummaryResponse {})
}

/// Echoes the request body back as a stream, with a marker header.
async fn artifact(
    State(forge): State<Forge>,
    OriginalUri(uri): OriginalUri,
    request: Request,
) -> Response {
    forge
        .lock()
        .expect("lock")
        .proxied_headers
        .push(request.headers().clone());
    let path = uri.path().to_owned();
    let query = uri.query().unwrap_or("").to_owned();
    let method = request.method().to_string();
    let mut response = Response::new(Body::new(request.into_body()));
    *response.status_mut() = StatusCode::CREATED;
    let h = response.headers_mut();
    h.insert(
        "x-forge-saw",
        format!("{method} {path}?{query}").parse().expect("header"),
    );
    response
}

/// Starts the fake forge (mounted under `/gitea`, as an instance with a sub-path). Returns its
/// base URL and state.
pub async fn start_forge() -> (String, Forge) {
    let forge: Forge = Arc::default();
    let inner = Router::new()
        .route(
            "/api/actions/runner.v1.RunnerService/UpdateTask",
            post(update_task),
        )
        .route(
            "/api/actions/runner.v1.RunnerService/UpdateLog",
            post(update_log),
        )
        .route(
            "/api/actions/runner.v1.RunnerService/UpdateJobSummary",
            post(update_job_summary),
        )
        .route("/_apis/{*rest}", any(artifact))
        .route("/api/actions_pipeline/{*rest}", any(artifact))
        .with_state(forge.clone());
    let app = Router::new().nest("/gitea", inner);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind forge");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("forge serve") });
    (format!("http://{addr}/gitea/"), forge)
}

/// A facade over a MemoryLedger, served on a local port.
pub struct Harness {
    pub facade: Arc<Facade<Arc<MemoryLedger>>>,
    pub ledger: Arc<MemoryLedger>,
    pub sealer: Arc<Sealer>,
    pub forge: Forge,
    pub forge_url: String,
    /// `http://…` or `https://localhost:…`.
    pub url: String,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<Result<(), jr_facade::FacadeError>>>,
}

impl Harness {
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.expect("join").expect("serve ended cleanly");
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            server.abort();
        }
    }
}

pub fn sealer() -> Arc<Sealer> {
    let keys = BTreeMap::from([("k1".to_owned(), Sealer::generate_key())]);
    Arc::new(Sealer::new("k1", &keys).expect("sealer"))
}

pub fn settings(
    mode: AuthMode,
    forge_url: &str,
    sealer: Arc<Sealer>,
    insecure_plain_http: bool,
) -> FacadeSettings {
    let credentials = Credentials {
        uuid: FORGE_UUID.into(),
        token: FORGE_TOKEN.into(),
    };
    FacadeSettings {
        mode,
        trust_domain: Some("ci.example.org".into()),
        forges: std::sync::Arc::new(jr_gitea_intake::forges::Forges::shared(
            ForgeClient::new(forge_url, Some(credentials), Duration::from_secs(10))
                .expect("forge client"),
            vec![
                BackendName::new("pod").expect("backend"),
                BackendName::new("vm").expect("backend"),
            ],
        )),
        forge_base_url: forge_url.to_owned(),
        sealer,
        token_keys: Default::default(),
        limits: Default::default(),
        spiffe_path: "/jetrunner/executor/{assignment}".into(),
        insecure_plain_http,
    }
}

/// Plain-HTTP token-mode facade.
pub async fn start() -> Harness {
    start_with(AuthMode::Token, None).await
}

pub async fn start_with(mode: AuthMode, tls: Option<TlsSettings>) -> Harness {
    start_keyed(mode, tls, BTreeMap::new()).await
}

/// The test key executor tokens derive from when a facade holds the backends' token keys.
pub fn token_key() -> jr_seal::TokenKey {
    jr_seal::TokenKey::from_base64("ZmFjYWRlLXRlc3QtdG9rZW4ta2V5LWZhY2FkZS10ZXN0IQ==")
        .expect("test token key")
}

/// A facade that checks executor tokens itself with [`token_key`] for `pod` and `vm`.
pub async fn start_with_token_keys() -> Harness {
    let keys = ["pod", "vm"]
        .into_iter()
        .map(|b| (BackendName::new(b).expect("backend"), token_key()))
        .collect();
    start_keyed(AuthMode::Token, None, keys).await
}

pub async fn start_keyed(
    mode: AuthMode,
    tls: Option<TlsSettings>,
    token_keys: BTreeMap<BackendName, jr_seal::TokenKey>,
) -> Harness {
    start_full(mode, tls, token_keys, Default::default()).await
}

/// A token-mode facade with the given resource limits.
pub async fn start_with_limits(limits: jr_facade::FacadeLimits) -> Harness {
    start_full(AuthMode::Token, None, BTreeMap::new(), limits).await
}

pub async fn start_full(
    mode: AuthMode,
    tls: Option<TlsSettings>,
    token_keys: BTreeMap<BackendName, jr_seal::TokenKey>,
    limits: jr_facade::FacadeLimits,
) -> Harness {
    install_crypto();
    let (forge_url, forge) = start_forge().await;
    let sealer = sealer();
    let ledger = Arc::new(MemoryLedger::new());
    let plain = tls.is_none();
    let mut settings = settings(mode, &forge_url, sealer.clone(), plain);
    settings.token_keys = token_keys;
    settings.limits = limits;
    let facade = Arc::new(Facade::new(settings, ledger.clone()).expect("facade"));
    let served = serve_facade(facade.clone(), tls).await;
    Harness {
        facade,
        ledger,
        sealer,
        forge,
        forge_url,
        url: served.url,
        stop: Some(served.stop),
        server: Some(served.server),
    }
}

/// One running `serve`.
pub struct Served {
    pub url: String,
    pub stop: oneshot::Sender<()>,
    pub server: JoinHandle<Result<(), jr_facade::FacadeError>>,
}

pub async fn serve_facade(
    facade: Arc<Facade<Arc<MemoryLedger>>>,
    tls: Option<TlsSettings>,
) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind facade");
    let addr = listener.local_addr().expect("addr");
    let url = if tls.is_none() {
        format!("http://{addr}")
    } else {
        format!("https://localhost:{}", addr.port())
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, facade, tls, stopped));
    Served { url, stop, server }
}

/// The forge task an assignment carries.
pub fn task(forge_task_id: i64) -> Task {
    Task {
        id: forge_task_id,
        workflow_payload: Some(b"name: ci\non: push\njobs:\n  build:\n    runs-on: pod\n".to_vec()),
        secrets: BTreeMap::from([(
            "GITHUB_TOKEN".to_owned(),
            format!("task-token-{forge_task_id}"),
        )]),
        ..Task::default()
    }
}

/// Inserts an assignment for `forge_task_id`; `token` (if any) becomes its published hash.
pub fn add_assignment(h: &Harness, forge_task_id: i64, token: Option<&str>) -> AssignmentId {
    let id = AssignmentId::for_task("http://forge.test", forge_task_id);
    let sealed = h
        .sealer
        .seal(
            jr_seal::SealScope::new(
                id,
                &BackendName::new("pod").expect("backend"),
                forge_task_id,
            ),
            &task(forge_task_id).encode_to_vec(),
        )
        .expect("seal");
    h.ledger.insert(AssignmentView {
        id,
        backend: BackendName::new("pod").expect("backend"),
        attempt: 1,
        forge_task_id,
        sealed_task: sealed,
        token_hash: token.map(TokenHash::of_token),
        claimed: false,
        terminal: false,
        trace: None,
    });
    id
}

/// An act_runner stand-in: the Connect client pointed at the facade with the executor's
/// credentials.
pub fn executor(url: &str, id: AssignmentId, token: &str) -> ForgeClient {
    install_crypto();
    let credentials = Credentials {
        uuid: id.to_string(),
        token: token.to_owned(),
    };
    ForgeClient::new(url, Some(credentials), Duration::from_secs(10)).expect("executor client")
}
