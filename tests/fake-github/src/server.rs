//! HTTP surface of the fake: credentials, faults, the request log and the test-facing handle.

#![allow(
    clippy::result_large_err,
    reason = "a check that fails returns the HTTP answer itself; its size does not matter in a fake"
)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::state::{JobSpec, JobState, Runner, ScaleSet, Session, World};

mod admin;
mod handlers;
mod queue;
use handlers::router;

/// The endpoints a fault can be set on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    AccessToken,
    RegistrationToken,
    RunnerRegistration,
    WorkflowRun,
    CancelRun,
    RunnerGroups,
    GetScaleSet,
    CreateScaleSet,
    CreateSession,
    RefreshSession,
    DeleteSession,
    GetMessage,
    DeleteMessage,
    AcquireJobs,
    GenerateJitConfig,
    GetRunner,
    DeleteRunner,
}

/// What the next request(s) to a route get instead of being served.
#[derive(Clone, Debug)]
pub enum Fault {
    /// This status with an empty JSON error body and, when set, `Retry-After` (seconds).
    Status {
        status: u16,
        retry_after: Option<u64>,
    },
    /// 200 with an empty body (seen on the real message queue).
    EmptyOk,
    /// 200 with this body as it is (a message the client cannot read).
    RawOk(String),
    /// 404 `RunnerAdminException`: the broker evicted the session (for refresh).
    SessionEvicted,
}

/// One request the fake answered.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    pub route: Route,
    pub at: Instant,
    pub status: u16,
}

/// The GitHub App the fake knows: its issuer, installation and public key (RSAPublicKey DER).
pub(crate) struct App {
    pub issuer: String,
    pub installation_id: u64,
    pub public_key: Vec<u8>,
}

pub(crate) struct Tokens {
    pat: String,
    pub app: Option<App>,
    /// Installation tokens handed out (accepted like the PAT).
    pub installation: HashSet<String>,
    /// Registration tokens handed out → the scope each registers runners for (see
    /// `handlers::scope_key`).
    registration: HashMap<String, String>,
    /// Admin token → expiry (unix seconds).
    admin: HashMap<String, u64>,
    admin_ttl: Duration,
}

pub(crate) struct Shared {
    world: Mutex<World>,
    tokens: Mutex<Tokens>,
    faults: Mutex<HashMap<Route, VecDeque<Fault>>>,
    log: Mutex<Vec<RequestRecord>>,
    changed: Notify,
    poll_hold: Mutex<Duration>,
    base: String,
    addr: SocketAddr,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn random_token(prefix: &str) -> String {
    format!("{prefix}{}", hex::encode(rand::random::<[u8; 16]>()))
}

/// A JWT-shaped token whose payload carries `exp`, as the real admin and queue tokens do.
fn jwt(exp: u64) -> String {
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode(
        json!({"exp": exp, "jti": random_token("")})
            .to_string()
            .as_bytes(),
    );
    let signature = URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>());
    format!("{header}.{payload}.{signature}")
}

/// The Actions service's error shape: a .NET type name and a message.
fn exception(status: StatusCode, type_name: &str, message: &str) -> Response {
    let body = json!({
        "typeName": format!("GitHub.Actions.Runtime.WebApi.{type_name}, GitHub.Actions.Runtime.WebApi"),
        "message": message,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn json_reply(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::HeaderName::from_static("activityid"),
                HeaderValue::from_static("00000000-0000-0000-0000-000000000001"),
            ),
        ],
        body.to_string(),
    )
        .into_response()
}

fn bearer(headers: &HeaderMap, scheme: &str) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (s, token) = value.split_once(' ')?;
    s.eq_ignore_ascii_case(scheme)
        .then(|| token.trim().to_owned())
}

type Q = Query<HashMap<String, String>>;

impl Shared {
    /// The test-facing handle over this state.
    fn handle(self: &Arc<Self>) -> FakeGitHub {
        FakeGitHub {
            shared: self.clone(),
            addr: self.addr,
        }
    }

    /// Takes the next fault for `route`, if one is set.
    fn fault(&self, route: Route) -> Option<Response> {
        let fault = lock(&self.faults).get_mut(&route)?.pop_front()?;
        Some(match fault {
            Fault::Status {
                status,
                retry_after,
            } => {
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut response = (status, "{}").into_response();
                if let Some(after) = retry_after {
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from(after));
                }
                response
            }
            Fault::EmptyOk => StatusCode::OK.into_response(),
            Fault::RawOk(body) => (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response(),
            Fault::SessionEvicted => exception(
                StatusCode::NOT_FOUND,
                "RunnerAdminException",
                "session ID that doesn't exist in redis",
            ),
        })
    }

    fn record(&self, route: Route, response: Response) -> Response {
        lock(&self.log).push(RequestRecord {
            route,
            at: Instant::now(),
            status: response.status().as_u16(),
        });
        response
    }

    /// The REST credential: the PAT or an installation token.
    fn pat_ok(&self, headers: &HeaderMap) -> bool {
        let Some(token) = bearer(headers, "Bearer").or_else(|| bearer(headers, "token")) else {
            return false;
        };
        let tokens = lock(&self.tokens);
        token == tokens.pat || tokens.installation.contains(&token)
    }

    /// The admin token of an Actions service call, valid and unexpired.
    fn admin_ok(
        &self,
        headers: &HeaderMap,
        query: &HashMap<String, String>,
    ) -> Result<(), Response> {
        if query.get("api-version").map(String::as_str) != Some("6.0-preview") {
            return Err(exception(
                StatusCode::BAD_REQUEST,
                "VssInvalidApiVersionException",
                "api-version=6.0-preview is required",
            ));
        }
        let token = bearer(headers, "Bearer").unwrap_or_default();
        let tokens = lock(&self.tokens);
        match tokens.admin.get(&token) {
            Some(exp) if *exp > unix_now() => Ok(()),
            _ => Err(exception(
                StatusCode::UNAUTHORIZED,
                "VssUnauthorizedException",
                "admin token invalid or expired",
            )),
        }
    }

    /// The checks an admin-token call passes first: an injected fault for `route`, then the
    /// admin token and the API version. A refusal is recorded and comes back as the answer.
    fn admitted(
        &self,
        route: Route,
        headers: &HeaderMap,
        query: &HashMap<String, String>,
    ) -> Result<(), Response> {
        if let Some(r) = self.fault(route) {
            return Err(self.record(route, r));
        }
        self.admin_ok(headers, query)
            .map_err(|r| self.record(route, r))
    }

    /// The queue token of `set`'s active session.
    fn queue_ok(&self, headers: &HeaderMap, set: i64) -> Result<(), Response> {
        let token = bearer(headers, "Bearer").unwrap_or_default();
        let world = lock(&self.world);
        match world.scale_sets.get(&set).and_then(|s| s.session.as_ref()) {
            Some(session) if session.queue_token == token && !token.is_empty() => Ok(()),
            _ => Err(exception(
                StatusCode::UNAUTHORIZED,
                "VssUnauthorizedException",
                "queue token invalid or expired",
            )),
        }
    }
}

/// The running fake.
#[derive(Clone)]
pub struct FakeGitHub {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl FakeGitHub {
    /// Starts the fake; `pat` is the one personal access token it accepts.
    pub async fn start(pat: &str) -> std::io::Result<FakeGitHub> {
        Self::start_on("127.0.0.1:0".parse().map_err(std::io::Error::other)?, pat).await
    }

    /// Starts the fake on `listen`.
    pub async fn start_on(listen: SocketAddr, pat: &str) -> std::io::Result<FakeGitHub> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            world: Mutex::new(World::new()),
            tokens: Mutex::new(Tokens {
                pat: pat.to_owned(),
                app: None,
                installation: HashSet::new(),
                registration: HashMap::new(),
                admin: HashMap::new(),
                admin_ttl: Duration::from_secs(600),
            }),
            faults: Mutex::new(HashMap::new()),
            log: Mutex::new(Vec::new()),
            changed: Notify::new(),
            poll_hold: Mutex::new(Duration::from_secs(50)),
            base: format!("http://{addr}"),
            addr,
        });
        let app = router(shared.clone());
        // Runners that went silent mid-job are found without waiting for a request.
        let sweeper = Arc::downgrade(&shared);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let Some(shared) = sweeper.upgrade() else {
                    return;
                };
                let swept = lock(&shared.world).sweep_lost_runners(std::time::Instant::now());
                if swept {
                    shared.changed.notify_waiters();
                }
            }
        });
        tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::error!(%error, "fake GitHub server stopped");
            }
        });
        Ok(FakeGitHub { shared, addr })
    }

    /// `http://127.0.0.1:port`: the REST API base (GHES-like, without `/api/v3`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn world(&self) -> MutexGuard<'_, World> {
        lock(&self.shared.world)
    }

    fn changed(&self) {
        self.shared.changed.notify_waiters();
    }

    /// A runner silent `after` while it runs a job is lost: its job ends `failed` (default:
    /// never).
    pub fn set_runner_lost_after(&self, after: Option<Duration>) {
        self.world().runner_lost_after = after;
    }

    /// Queues a job; returns its `runnerRequestId`.
    pub fn enqueue(&self, spec: JobSpec) -> i64 {
        let id = self.world().enqueue(spec);
        self.changed();
        id
    }

    /// Cancels a job's workflow run.
    pub fn cancel(&self, request_id: i64) {
        self.world().cancel(request_id);
        self.changed();
    }

    /// The assigned job's runner never started in time (see [`crate::MAX_ASSIGNMENTS`]).
    pub fn assignment_lapsed(&self, request_id: i64) -> bool {
        let lapsed = self.world().assignment_lapsed(request_id);
        self.changed();
        lapsed
    }

    /// GHES style (`JobAvailable` + acquire) instead of github.com's direct assignment.
    pub fn set_acquire_step(&self, on: bool) {
        self.world().acquire_step = on;
    }

    /// github.com as seen since 2025: job messages carry `runnerRequestId` 0 and name the job
    /// by `jobId` only (for jobs queued from now on; the fake still knows every job by the id
    /// [`FakeGitHub::enqueue`] returns). Offers of such jobs cannot be acquired, so this goes
    /// with direct assignment, not [`FakeGitHub::set_acquire_step`].
    pub fn set_zero_request_ids(&self, on: bool) {
        self.world().zero_request_ids = on;
    }

    pub fn set_acquire_limit(&self, limit: Option<usize>) {
        self.world().acquire_limit = limit;
    }

    /// Accepts GitHub App `issuer` of installation `installation_id` whose key is
    /// `private_key_pem` (PKCS#1; the fake keeps only the public half).
    pub fn set_app(
        &self,
        issuer: &str,
        installation_id: u64,
        private_key_pem: &str,
    ) -> Result<(), String> {
        use rustls_pki_types::pem::PemObject;
        let der = rustls_pki_types::PrivatePkcs1KeyDer::from_pem_slice(private_key_pem.as_bytes())
            .map_err(|e| e.to_string())?;
        let key = ring::signature::RsaKeyPair::from_der(der.secret_pkcs1_der())
            .map_err(|e| e.to_string())?;
        let public_key = ring::signature::KeyPair::public_key(&key).as_ref().to_vec();
        lock(&self.shared.tokens).app = Some(App {
            issuer: issuer.to_owned(),
            installation_id,
            public_key,
        });
        Ok(())
    }

    /// How long an admin token lives from now on.
    pub fn set_admin_ttl(&self, ttl: Duration) {
        lock(&self.shared.tokens).admin_ttl = ttl;
    }

    /// How long a poll is held when there is no message (about 50 s on the real service).
    pub fn set_poll_hold(&self, hold: Duration) {
        *lock(&self.shared.poll_hold) = hold;
    }

    /// The personal access token accepted from now on (the configured one revoked or
    /// replaced at GitHub: calls with it get 401).
    pub fn set_pat(&self, pat: &str) {
        lock(&self.shared.tokens).pat = pat.to_owned();
    }

    /// Every admin token handed out so far stops working (401).
    pub fn revoke_admin_tokens(&self) {
        lock(&self.shared.tokens).admin.clear();
    }

    /// Every session's queue token stops working (401) until the session is refreshed.
    pub fn expire_queue_tokens(&self) {
        for set in self.world().scale_sets.values_mut() {
            if let Some(session) = set.session.as_mut() {
                session.queue_token = random_token("expired-");
            }
        }
    }

    /// The next request(s) to `route` get `fault` (queued: one fault per request).
    pub fn inject(&self, route: Route, fault: Fault) {
        lock(&self.shared.faults)
            .entry(route)
            .or_default()
            .push_back(fault);
    }

    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.log).clone()
    }

    pub fn count(&self, route: Route) -> usize {
        lock(&self.shared.log)
            .iter()
            .filter(|r| r.route == route)
            .count()
    }

    pub fn job(&self, request_id: i64) -> Option<crate::Job> {
        self.world().jobs.get(&request_id).cloned()
    }

    /// The most jobs assigned to `scale_set` or running on it at once so far.
    pub fn peak_open(&self, scale_set: i64) -> usize {
        self.world().peak_open.get(&scale_set).copied().unwrap_or(0)
    }

    /// Every job, oldest first.
    pub fn jobs(&self) -> Vec<crate::Job> {
        self.world().jobs.values().cloned().collect()
    }

    pub fn runners(&self) -> Vec<Runner> {
        self.world().runners.values().cloned().collect()
    }

    pub fn removed_runners(&self) -> Vec<Runner> {
        self.world().removed_runners.clone()
    }

    /// Job messages of `scale_set` not yet deleted by its listener (formed or not).
    pub fn undelivered(&self, scale_set: i64) -> usize {
        self.world().scale_sets.get(&scale_set).map_or(0, |s| {
            s.queue.iter().map(|m| m.body.len()).sum::<usize>() + s.pending.len()
        })
    }

    /// The scale set's active session id, if any.
    pub fn session(&self, scale_set: i64) -> Option<String> {
        self.world()
            .scale_sets
            .get(&scale_set)
            .and_then(|s| s.session.as_ref().map(|s| s.id.clone()))
    }

    pub fn scale_set_by_name(&self, name: &str) -> Option<(i64, Vec<String>)> {
        self.world()
            .scale_sets
            .values()
            .find(|s| s.name == name)
            .map(|s| (s.id, s.labels.clone()))
    }

    /// The last `X-ScaleSetMaxCapacity` a poll of `scale_set` sent.
    pub fn max_capacity(&self, scale_set: i64) -> Option<u64> {
        self.world()
            .scale_sets
            .get(&scale_set)
            .and_then(|s| s.max_capacity)
    }

    /// What `actions/runner --jitconfig` does: registers and takes the oldest assigned job of
    /// its scale set. `Ok((runner, job))`; `Err` for an unknown or used config.
    pub fn start_runner(&self, encoded: &str) -> Result<(i64, Option<i64>), &'static str> {
        let mut world = self.world();
        let started = world.runner_started(encoded)?;
        drop(world);
        self.changed();
        match started {
            Some((runner, job)) => Ok((runner, Some(job))),
            None => {
                let runner = self
                    .world()
                    .runners
                    .values()
                    .find(|r| r.encoded_jit_config == encoded)
                    .map(|r| r.id)
                    .ok_or("runner vanished")?;
                Ok((runner, None))
            }
        }
    }

    /// A started runner without a job looks for one again.
    pub fn poll_runner(&self, runner: i64) -> Option<i64> {
        let job = self.world().runner_poll(runner);
        self.changed();
        job
    }

    /// The runner's job ended (`succeeded`, `failed`, …); the runner goes away.
    pub fn finish_runner(&self, runner: i64, result: &str) -> Result<(), &'static str> {
        let r = self.world().runner_finished(runner, result);
        self.changed();
        r
    }
}
