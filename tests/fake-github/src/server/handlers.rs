//! The handlers, one per endpoint of the real service.

#![allow(
    clippy::result_large_err,
    reason = "a check that fails returns the HTTP answer itself; its size does not matter in a fake"
)]

use super::queue::*;
use super::*;

pub(super) fn router(shared: Arc<Shared>) -> Router {
    const S: &str = "/actions-service/_apis";
    // The REST side, served where api.github.com has it (the root) and where a GitHub
    // Enterprise Server has it (`/api/v3`), so a client that derives the API base from a
    // server's URL reaches it only at the right port and path.
    let rest = Router::new()
        .route(
            "/app/installations/{installation}/access_tokens",
            post(access_token),
        )
        .route(
            "/orgs/{org}/actions/runners/registration-token",
            post(registration_token_org),
        )
        .route(
            "/repos/{owner}/{repo}/actions/runners/registration-token",
            post(registration_token_repo),
        )
        .route(
            "/enterprises/{enterprise}/actions/runners/registration-token",
            post(registration_token_enterprise),
        )
        .route("/actions/runner-registration", post(runner_registration))
        .route(
            "/repos/{owner}/{repo}/actions/runs/{run}",
            get(workflow_run),
        )
        .route(
            "/repos/{owner}/{repo}/actions/runs/{run}/cancel",
            post(cancel_run),
        );
    Router::new()
        .merge(super::admin::routes())
        .merge(rest.clone())
        .nest("/api/v3", rest)
        .route(&format!("{S}/runtime/runnergroups/"), get(runner_groups))
        .route(
            &format!("{S}/runtime/runnerscalesets"),
            get(find_scale_set).post(create_scale_set),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}"),
            get(get_scale_set).delete(delete_scale_set),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}/sessions"),
            post(create_session),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}/sessions/{{sid}}"),
            patch(refresh_session).delete(delete_session),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}/messages"),
            get(get_message),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}/messages/{{mid}}"),
            delete(delete_message),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}/acquirejobs"),
            post(acquire_jobs),
        )
        .route(
            &format!("{S}/runtime/runnerscalesets/{{id}}/generatejitconfig"),
            post(generate_jit),
        )
        .route(
            &format!("{S}/distributedtask/pools/0/agents"),
            get(find_runner),
        )
        .route(
            &format!("{S}/distributedtask/pools/0/agents/{{rid}}"),
            get(get_runner).delete(delete_runner),
        )
        .with_state(shared)
}

pub(super) type St = State<Arc<Shared>>;

/// Whose runners a registration token registers: `org:NAME`, `repo:OWNER/NAME` or
/// `enterprise:NAME`, lower-cased (GitHub's names are case-insensitive).
fn scope_key(kind: &str, name: &str) -> String {
    format!("{kind}:{}", name.to_ascii_lowercase())
}

/// The scope a config URL (the `url` of a runner registration) names, read as
/// actions/scaleset reads it; `None` for a URL that names none.
fn url_scope(url: &str) -> Option<String> {
    let (_, rest) = url.split_once("://")?;
    let path = rest.split_once('/').map_or("", |(_, path)| path);
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match segments.as_slice() {
        [kind, name] if kind.eq_ignore_ascii_case("enterprises") => {
            Some(scope_key("enterprise", name))
        }
        [org] => Some(scope_key("org", org)),
        [owner, repo] => Some(scope_key("repo", &format!("{owner}/{repo}"))),
        _ => None,
    }
}

fn registration_token(shared: &Shared, headers: &HeaderMap, scope: String) -> Response {
    if let Some(r) = shared.fault(Route::RegistrationToken) {
        return shared.record(Route::RegistrationToken, r);
    }
    let response = if shared.pat_ok(headers) {
        let token = random_token("REG");
        lock(&shared.tokens)
            .registration
            .insert(token.clone(), scope);
        json_reply(
            StatusCode::CREATED,
            &json!({"token": token, "expires_at": "2099-01-01T00:00:00Z"}),
        )
    } else {
        json_reply(
            StatusCode::UNAUTHORIZED,
            &json!({"message": "Bad credentials"}),
        )
    };
    shared.record(Route::RegistrationToken, response)
}

async fn registration_token_org(
    State(s): St,
    Path(org): Path<String>,
    headers: HeaderMap,
) -> Response {
    registration_token(&s, &headers, scope_key("org", &org))
}

async fn registration_token_repo(
    State(s): St,
    Path((owner, repo)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    registration_token(&s, &headers, scope_key("repo", &format!("{owner}/{repo}")))
}

async fn registration_token_enterprise(
    State(s): St,
    Path(enterprise): Path<String>,
    headers: HeaderMap,
) -> Response {
    registration_token(&s, &headers, scope_key("enterprise", &enterprise))
}

async fn runner_registration(State(s): St, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(r) = s.fault(Route::RunnerRegistration) {
        return s.record(Route::RunnerRegistration, r);
    }
    let token = bearer(&headers, "RemoteAuth").unwrap_or_default();
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let token_scope = lock(&s.tokens).registration.get(&token).cloned();
    let url = request
        .get("url")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let response = if token_scope.is_none() {
        json_reply(
            StatusCode::UNAUTHORIZED,
            &json!({"message": "registration token invalid"}),
        )
    } else if request.get("runner_event").and_then(Value::as_str) != Some("register")
        || url.is_empty()
    {
        json_reply(
            StatusCode::BAD_REQUEST,
            &json!({"message": "url and runner_event=register required"}),
        )
    } else if url_scope(url) != token_scope {
        // A registration token registers runners of the scope it was made for; a URL that
        // names another one (or none) is refused.
        json_reply(
            StatusCode::FORBIDDEN,
            &json!({"message": format!("the registration token is not for {url}")}),
        )
    } else {
        let mut tokens = lock(&s.tokens);
        let exp = unix_now() + tokens.admin_ttl.as_secs();
        let admin = jwt(exp);
        tokens.admin.insert(admin.clone(), exp);
        json_reply(
            StatusCode::CREATED,
            &json!({"url": format!("{}/actions-service/", s.base), "token": admin}),
        )
    };
    s.record(Route::RunnerRegistration, response)
}

async fn workflow_run(
    State(s): St,
    Path((owner, repo, run)): Path<(String, String, i64)>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = s.fault(Route::WorkflowRun) {
        return s.record(Route::WorkflowRun, r);
    }
    if !s.pat_ok(&headers) {
        return s.record(
            Route::WorkflowRun,
            json_reply(
                StatusCode::UNAUTHORIZED,
                &json!({"message": "Bad credentials"}),
            ),
        );
    }
    let job = lock(&s.world)
        .jobs
        .values()
        .find(|j| j.run_id == run && j.spec.owner == owner && j.spec.repository == repo)
        .cloned();
    let response = match job {
        None => json_reply(StatusCode::NOT_FOUND, &json!({"message": "Not Found"})),
        Some(job) => {
            let full = format!("{owner}/{repo}");
            let head = if job.spec.from_fork {
                format!("contributor/{repo}")
            } else {
                full.clone()
            };
            json_reply(
                StatusCode::OK,
                &json!({
                    "id": run,
                    "event": job.spec.event_name,
                    "head_sha": "0123456789abcdef0123456789abcdef01234567",
                    "repository": {"full_name": full, "fork": false},
                    "head_repository": {"full_name": head, "fork": job.spec.from_fork},
                    "pull_requests": [],
                }),
            )
        }
    };
    s.record(Route::WorkflowRun, response)
}

async fn runner_groups(State(s): St, Query(q): Q, headers: HeaderMap) -> Response {
    if let Err(r) = s.admitted(Route::RunnerGroups, &headers, &q) {
        return r;
    }
    let name = q.get("groupName").cloned().unwrap_or_default();
    let world = lock(&s.world);
    let value: Vec<Value> = world
        .groups
        .iter()
        .filter(|(_, n)| n.eq_ignore_ascii_case(&name))
        .map(|(id, n)| json!({"id": id, "name": n, "size": 0, "isDefaultGroup": *id == 1}))
        .collect();
    drop(world);
    s.record(
        Route::RunnerGroups,
        json_reply(
            StatusCode::OK,
            &json!({"count": value.len(), "value": value}),
        ),
    )
}

pub(super) fn scale_set_json(set: &ScaleSet, world: &World) -> Value {
    json!({
        "id": set.id,
        "name": set.name,
        "runnerGroupId": set.group_id,
        "runnerGroupName": world.groups.get(&set.group_id).cloned().unwrap_or_default(),
        "labels": set.labels.iter().map(|l| json!({"type": "System", "name": l})).collect::<Vec<_>>(),
        "RunnerSetting": {"disableUpdate": true},
        "createdOn": "2026-12-05T10:00:00Z",
        "statistics": world.statistics(set.id),
    })
}

async fn find_scale_set(State(s): St, Query(q): Q, headers: HeaderMap) -> Response {
    if let Err(r) = s.admitted(Route::GetScaleSet, &headers, &q) {
        return r;
    }
    let group: i64 = q
        .get("runnerGroupId")
        .and_then(|g| g.parse().ok())
        .unwrap_or(0);
    let name = q.get("name").cloned().unwrap_or_default();
    let world = lock(&s.world);
    let value: Vec<Value> = world
        .scale_sets
        .values()
        .filter(|set| set.group_id == group && set.name == name)
        .map(|set| scale_set_json(set, &world))
        .collect();
    drop(world);
    s.record(
        Route::GetScaleSet,
        json_reply(
            StatusCode::OK,
            &json!({"count": value.len(), "value": value}),
        ),
    )
}

async fn get_scale_set(
    State(s): St,
    Path(id): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = s.admitted(Route::GetScaleSet, &headers, &q) {
        return r;
    }
    let world = lock(&s.world);
    let response = match world.scale_sets.get(&id) {
        Some(set) => json_reply(StatusCode::OK, &scale_set_json(set, &world)),
        None => exception(
            StatusCode::NOT_FOUND,
            "RunnerScaleSetNotFoundException",
            "no such scale set",
        ),
    };
    drop(world);
    s.record(Route::GetScaleSet, response)
}

async fn create_scale_set(State(s): St, Query(q): Q, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(r) = s.admitted(Route::CreateScaleSet, &headers, &q) {
        return r;
    }
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let name = request
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let group = request
        .get("runnerGroupId")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let labels: Vec<String> = request
        .get("labels")
        .and_then(Value::as_array)
        .map(|ls| {
            ls.iter()
                .filter_map(|l| l.get("name").and_then(Value::as_str).map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let mut world = lock(&s.world);
    let response = if name.is_empty() {
        exception(
            StatusCode::BAD_REQUEST,
            "ArgumentException",
            "name is required",
        )
    } else if !world.groups.contains_key(&group) {
        exception(
            StatusCode::BAD_REQUEST,
            "RunnerGroupNotFoundException",
            "no such runner group",
        )
    } else if world
        .scale_sets
        .values()
        .any(|set| set.name == name && set.group_id == group)
    {
        exception(
            StatusCode::CONFLICT,
            "RunnerScaleSetExistsException",
            "a scale set with this name exists",
        )
    } else {
        let id = world.fresh_id();
        let set = ScaleSet {
            id,
            name,
            group_id: group,
            labels,
            session: None,
            queue: VecDeque::new(),
            pending: Vec::new(),
            max_capacity: None,
        };
        let reply = scale_set_json(&set, &world);
        world.scale_sets.insert(id, set);
        world.route_queued();
        json_reply(StatusCode::OK, &reply)
    };
    drop(world);
    s.changed.notify_waiters();
    s.record(Route::CreateScaleSet, response)
}

async fn delete_scale_set(
    State(s): St,
    Path(id): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = s.admin_ok(&headers, &q) {
        return r;
    }
    let removed = lock(&s.world).scale_sets.remove(&id).is_some();
    s.changed.notify_waiters();
    if removed {
        StatusCode::NO_CONTENT.into_response()
    } else {
        exception(
            StatusCode::NOT_FOUND,
            "RunnerScaleSetNotFoundException",
            "no such scale set",
        )
    }
}

fn runner_json(r: &Runner) -> Value {
    json!({"id": r.id, "name": r.name, "runnerScaleSetId": r.scale_set, "busy": r.job.is_some(), "ephemeral": true})
}

async fn generate_jit(
    State(s): St,
    Path(id): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(r) = s.admitted(Route::GenerateJitConfig, &headers, &q) {
        return r;
    }
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let name = request
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let mut world = lock(&s.world);
    let response = if name.is_empty() || request.get("workFolder").is_none() {
        exception(
            StatusCode::BAD_REQUEST,
            "ArgumentException",
            "name and workFolder are required",
        )
    } else if !world.scale_sets.contains_key(&id) {
        exception(
            StatusCode::NOT_FOUND,
            "RunnerScaleSetNotFoundException",
            "no such scale set",
        )
    } else if world.runners.values().any(|r| r.name == name) {
        exception(
            StatusCode::CONFLICT,
            "AgentExistsException",
            &format!("Agent {name} already exists"),
        )
    } else {
        let runner_id = world.fresh_id();
        let files = json!({
            ".runner": STANDARD.encode(json!({"agentId": runner_id, "agentName": name, "poolId": id}).to_string()),
            ".credentials": STANDARD.encode(random_token("cred-")),
        });
        let encoded = STANDARD.encode(files.to_string());
        let runner = Runner {
            id: runner_id,
            name,
            scale_set: id,
            encoded_jit_config: encoded.clone(),
            started: false,
            job: None,
            last_seen: None,
        };
        let reply = json!({"runner": runner_json(&runner), "encodedJITConfig": encoded});
        world.runners.insert(runner_id, runner);
        json_reply(StatusCode::OK, &reply)
    };
    drop(world);
    s.record(Route::GenerateJitConfig, response)
}

async fn find_runner(State(s): St, Query(q): Q, headers: HeaderMap) -> Response {
    if let Err(r) = s.admin_ok(&headers, &q) {
        return s.record(Route::GetRunner, r);
    }
    let name = q.get("agentName").cloned().unwrap_or_default();
    let value: Vec<Value> = lock(&s.world)
        .runners
        .values()
        .filter(|r| r.name == name)
        .map(runner_json)
        .collect();
    s.record(
        Route::GetRunner,
        json_reply(
            StatusCode::OK,
            &json!({"count": value.len(), "value": value}),
        ),
    )
}

async fn get_runner(
    State(s): St,
    Path(rid): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = s.admin_ok(&headers, &q) {
        return s.record(Route::GetRunner, r);
    }
    let response = match lock(&s.world).runners.get(&rid) {
        Some(r) => json_reply(StatusCode::OK, &runner_json(r)),
        None => exception(
            StatusCode::NOT_FOUND,
            "AgentNotFoundException",
            "no such runner",
        ),
    };
    s.record(Route::GetRunner, response)
}

async fn delete_runner(
    State(s): St,
    Path(rid): Path<i64>,
    Query(q): Q,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = s.admitted(Route::DeleteRunner, &headers, &q) {
        return r;
    }
    let mut world = lock(&s.world);
    let response = match world.runners.get(&rid).map(|r| r.job.is_some()) {
        // The real service answers a runner it no longer holds (an ephemeral runner is gone
        // after its job) as it answers a removal: 204.
        None => StatusCode::NO_CONTENT.into_response(),
        Some(true) => exception(
            StatusCode::BAD_REQUEST,
            "JobStillRunningException",
            "the runner is running a job",
        ),
        Some(false) => {
            if let Some(r) = world.runners.remove(&rid) {
                world.removed_runners.push(r);
            }
            StatusCode::NO_CONTENT.into_response()
        }
    };
    drop(world);
    s.record(Route::DeleteRunner, response)
}

/// Checks an App JWT as GitHub does: RS256 by the App's key, `iss` the App, issued no later
/// than now (a minute of skew allowed), expiring within ten minutes.
fn app_jwt_ok(app: &App, jwt: &str) -> Result<(), &'static str> {
    let mut parts = jwt.split('.');
    let (Some(header), Some(payload), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("not a JWT");
    };
    let header: Value = URL_SAFE_NO_PAD
        .decode(header)
        .ok()
        .and_then(|h| serde_json::from_slice(&h).ok())
        .ok_or("bad header")?;
    if header.get("alg").and_then(Value::as_str) != Some("RS256") {
        return Err("alg must be RS256");
    }
    let signature = URL_SAFE_NO_PAD
        .decode(signature)
        .map_err(|_| "bad signature encoding")?;
    let key = ring::signature::UnparsedPublicKey::new(
        &ring::signature::RSA_PKCS1_2048_8192_SHA256,
        &app.public_key,
    );
    key.verify(
        format!("{}.{payload}", jwt.split('.').next().unwrap_or_default()).as_bytes(),
        &signature,
    )
    .map_err(|_| "signature does not verify")?;
    let claims: Value = URL_SAFE_NO_PAD
        .decode(payload)
        .ok()
        .and_then(|p| serde_json::from_slice(&p).ok())
        .ok_or("bad payload")?;
    let now = unix_now();
    let (Some(iat), Some(exp), Some(iss)) = (
        claims.get("iat").and_then(Value::as_u64),
        claims.get("exp").and_then(Value::as_u64),
        claims.get("iss").and_then(|v| {
            v.as_str()
                .map(str::to_owned)
                .or_else(|| v.as_u64().map(|n| n.to_string()))
        }),
    ) else {
        return Err("iat, exp and iss are required");
    };
    if iss != app.issuer {
        return Err("iss is not this App");
    }
    if iat > now + 60 || exp <= now || exp > now + 600 {
        return Err("iat in the future or exp not within ten minutes");
    }
    Ok(())
}

async fn access_token(State(s): St, Path(installation): Path<u64>, headers: HeaderMap) -> Response {
    if let Some(r) = s.fault(Route::AccessToken) {
        return s.record(Route::AccessToken, r);
    }
    let jwt = bearer(&headers, "Bearer").unwrap_or_default();
    let mut tokens = lock(&s.tokens);
    let verdict = match tokens.app.as_ref() {
        None => Err("no App configured"),
        Some(app) if app.installation_id != installation => Err("not this App's installation"),
        Some(app) => app_jwt_ok(app, &jwt),
    };
    let response = match verdict {
        Err(why) => json_reply(StatusCode::UNAUTHORIZED, &json!({"message": why})),
        Ok(()) => {
            let token = random_token("ghs_");
            tokens.installation.insert(token.clone());
            let expires = time::OffsetDateTime::now_utc() + time::Duration::hours(1);
            let expires_at = expires
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            json_reply(
                StatusCode::CREATED,
                &json!({"token": token, "expires_at": expires_at, "permissions": {}}),
            )
        }
    };
    drop(tokens);
    s.record(Route::AccessToken, response)
}

async fn cancel_run(
    State(s): St,
    Path((owner, repo, run)): Path<(String, String, i64)>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = s.fault(Route::CancelRun) {
        return s.record(Route::CancelRun, r);
    }
    if !s.pat_ok(&headers) {
        return s.record(
            Route::CancelRun,
            json_reply(
                StatusCode::UNAUTHORIZED,
                &json!({"message": "Bad credentials"}),
            ),
        );
    }
    let jobs: Vec<i64> = lock(&s.world)
        .jobs
        .values()
        .filter(|j| j.run_id == run && j.spec.owner == owner && j.spec.repository == repo)
        .map(|j| j.request_id)
        .collect();
    if jobs.is_empty() {
        return s.record(
            Route::CancelRun,
            json_reply(StatusCode::NOT_FOUND, &json!({"message": "Not Found"})),
        );
    }
    let fake = s.handle();
    for job in jobs {
        fake.cancel(job);
    }
    s.record(
        Route::CancelRun,
        json_reply(StatusCode::ACCEPTED, &json!({})),
    )
}
