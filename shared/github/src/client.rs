//! The client: the token chain and the Actions service calls made with the admin token.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use reqwest::{Method, Response, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::GitHubError;
use crate::app::{AppKey, InstallationToken};
use crate::retry::{RetryPolicy, refused};
use crate::scope::ConfigUrl;
use crate::session::MessageSession;
use crate::wire::{
    JitConfig, List, RunOrigin, RunnerGroup, RunnerReference, RunnerScaleSet, Session,
};

pub(crate) const API_VERSION: &str = "6.0-preview";
/// An admin token is renewed when it has less than this left.
const ADMIN_MARGIN_SECS: u64 = 60;
/// Longer than the service holds a poll (about 50 s).
pub(crate) const POLL_TIMEOUT: Duration = Duration::from_secs(120);
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The GitHub credential that gets registration tokens.
#[derive(Clone)]
pub enum Credentials {
    /// A personal access token (classic: `repo`, `admin:org` or `manage_runners:enterprise`
    /// for the three scopes; fine-grained: self-hosted runners read/write).
    Pat(String),
    /// A GitHub App installation: `issuer` is the App's client id (or numeric App id),
    /// `private_key_pem` its private key.
    App {
        issuer: String,
        installation_id: u64,
        private_key_pem: String,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Pat(_) => f.write_str("Pat(<secret>)"),
            Credentials::App {
                issuer,
                installation_id,
                ..
            } => {
                write!(
                    f,
                    "App {{ issuer: {issuer:?}, installation_id: {installation_id}, private_key_pem: <secret> }}"
                )
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct Settings {
    /// `https://github.com/ORG`, `…/OWNER/REPO` or `…/enterprises/NAME`.
    pub url: String,
    /// REST API base when it is not the one `url` implies.
    pub api: Option<String>,
    pub credentials: Credentials,
    pub retry: RetryPolicy,
    pub user_agent: String,
}

struct Admin {
    service: url::Url,
    token: String,
    /// Expiry of `token` (unix seconds), read from its payload.
    exp: u64,
}

/// The credential, ready to use.
enum Auth {
    Pat(String),
    App {
        issuer: String,
        installation_id: u64,
        key: Box<AppKey>,
        token: tokio::sync::Mutex<Option<InstallationToken>>,
    },
}

struct Inner {
    http: reqwest::Client,
    config: ConfigUrl,
    auth: Auth,
    retry: RetryPolicy,
    admin: tokio::sync::Mutex<Option<Admin>>,
    renewals: AtomicU64,
}

/// A scale set client; cheap to clone.
#[derive(Clone)]
pub struct ScaleSetClient {
    inner: Arc<Inner>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `exp` of a JWT's payload, read without checking the signature (the client only needs to
/// know when to renew; the service checks the token).
pub(crate) fn jwt_exp(token: &str) -> Option<u64> {
    let payload = token.split('.').nth(1)?;
    let bytes = URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    serde_json::from_slice::<Value>(&bytes)
        .ok()?
        .get("exp")?
        .as_u64()
}

/// Reads a JSON answer (a leading byte-order mark is allowed).
pub(crate) async fn decode<T: DeserializeOwned>(
    op: &'static str,
    response: Response,
) -> Result<T, GitHubError> {
    let text = response
        .text()
        .await
        .map_err(|source| GitHubError::Transport { op, source })?;
    serde_json::from_str(text.trim_start_matches('\u{feff}')).map_err(|e| GitHubError::Decode {
        op,
        detail: e.to_string(),
    })
}

impl ScaleSetClient {
    pub fn new(settings: Settings) -> Result<ScaleSetClient, GitHubError> {
        let config = ConfigUrl::parse(&settings.url, settings.api.as_deref())?;
        // reqwest is built without a default TLS provider; the process needs one (a second
        // install is a no-op).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let auth = match settings.credentials {
            Credentials::Pat(token) if token.trim().is_empty() => {
                return Err(GitHubError::Config("the GitHub token is empty".into()));
            }
            Credentials::Pat(token) => Auth::Pat(token),
            Credentials::App {
                issuer,
                installation_id,
                private_key_pem,
            } => Auth::App {
                issuer,
                installation_id,
                key: Box::new(AppKey::from_pem(&private_key_pem)?),
                token: tokio::sync::Mutex::new(None),
            },
        };
        let http = reqwest::Client::builder()
            .user_agent(settings.user_agent)
            .connect_timeout(Duration::from_secs(10))
            // Every call carries a credential, which a followed redirect would send elsewhere.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| GitHubError::Config(format!("http client: {e}")))?;
        Ok(ScaleSetClient {
            inner: Arc::new(Inner {
                http,
                config,
                auth,
                retry: settings.retry,
                admin: tokio::sync::Mutex::new(None),
                renewals: AtomicU64::new(0),
            }),
        })
    }

    pub(crate) fn http(&self) -> &reqwest::Client {
        &self.inner.http
    }

    pub(crate) fn retry(&self) -> &RetryPolicy {
        &self.inner.retry
    }

    /// How many times the admin token was obtained (the first time included).
    pub fn admin_renewals(&self) -> u64 {
        self.inner.renewals.load(Ordering::Relaxed)
    }

    /// The token REST calls carry: the PAT, or an installation token minted with the App's
    /// JWT and kept until shortly before it expires.
    async fn credential(&self, fresh: bool) -> Result<String, GitHubError> {
        const OP: &str = "installation token";
        let (issuer, installation_id, key, cached) = match &self.inner.auth {
            Auth::Pat(token) => return Ok(token.clone()),
            Auth::App {
                issuer,
                installation_id,
                key,
                token,
            } => (issuer, installation_id, key, token),
        };
        let mut cached = cached.lock().await;
        if let Some(token) = cached.as_ref().filter(|t| !fresh && t.fresh()) {
            return Ok(token.token.clone());
        }
        let url = self.inner.config.rest_url(&format!(
            "/app/installations/{installation_id}/access_tokens"
        ));
        let jwt = key.jwt(issuer, unix_now())?;
        let response = self
            .inner
            .retry
            .send(OP, || {
                self.inner
                    .http
                    .post(&url)
                    .bearer_auth(&jwt)
                    .header("Accept", "application/vnd.github+json")
                    .timeout(CALL_TIMEOUT)
            })
            .await?;
        #[derive(serde::Deserialize)]
        struct Minted {
            token: String,
            expires_at: String,
        }
        let minted: Minted = Self::expect(OP, response, StatusCode::CREATED).await?;
        let token = InstallationToken::parse(minted.token, &minted.expires_at)?;
        let value = token.token.clone();
        *cached = Some(token);
        Ok(value)
    }

    /// A GitHub REST call with the credential. A 401 with an App's cached installation token
    /// (revoked, or the App installed again) mints a new one and tries once more.
    async fn rest(
        &self,
        op: &'static str,
        method: Method,
        url: &str,
    ) -> Result<Response, GitHubError> {
        let mut fresh = false;
        loop {
            let credential = self.credential(fresh).await?;
            let response = self
                .inner
                .retry
                .send(op, || {
                    self.inner
                        .http
                        .request(method.clone(), url)
                        .bearer_auth(&credential)
                        .header("Accept", "application/vnd.github+json")
                        .timeout(CALL_TIMEOUT)
                })
                .await?;
            if response.status() == StatusCode::UNAUTHORIZED
                && !fresh
                && matches!(self.inner.auth, Auth::App { .. })
            {
                fresh = true;
                continue;
            }
            return Ok(response);
        }
    }

    /// Registration token, then the Actions service URL and admin token for it.
    async fn renew_admin(&self) -> Result<Admin, GitHubError> {
        let config = &self.inner.config;
        let url = config.registration_token_url();
        let response = self.rest("registration token", Method::POST, &url).await?;
        if response.status() != StatusCode::CREATED {
            return Err(refused("registration token", response).await);
        }
        #[derive(serde::Deserialize)]
        struct Token {
            token: String,
        }
        let registration: Token = decode("registration token", response).await?;
        let url = config.runner_registration_url();
        let body = json!({"url": config.url, "runner_event": "register"});
        let response = self
            .inner
            .retry
            .send("runner registration", || {
                self.inner
                    .http
                    .post(&url)
                    .header(
                        "Authorization",
                        format!("RemoteAuth {}", registration.token),
                    )
                    .json(&body)
                    .timeout(CALL_TIMEOUT)
            })
            .await?;
        if !response.status().is_success() {
            return Err(refused("runner registration", response).await);
        }
        #[derive(serde::Deserialize)]
        struct Registration {
            url: String,
            token: String,
        }
        let registration: Registration = decode("runner registration", response).await?;
        if registration.url.is_empty() || registration.token.is_empty() {
            return Err(GitHubError::Decode {
                op: "runner registration",
                detail: "empty url or token".into(),
            });
        }
        let mut service = url::Url::parse(&registration.url).map_err(|e| GitHubError::Decode {
            op: "runner registration",
            detail: format!("service url: {e}"),
        })?;
        if !service.path().ends_with('/') {
            let path = format!("{}/", service.path());
            service.set_path(&path);
        }
        let exp = jwt_exp(&registration.token).ok_or_else(|| GitHubError::Decode {
            op: "runner registration",
            detail: "admin token carries no exp".into(),
        })?;
        self.inner.renewals.fetch_add(1, Ordering::Relaxed);
        Ok(Admin {
            service,
            token: registration.token,
            exp,
        })
    }

    /// The Actions service URL and a token with more than a minute left.
    pub(crate) async fn admin(&self, force: bool) -> Result<(url::Url, String), GitHubError> {
        let mut admin = self.inner.admin.lock().await;
        let fresh = admin
            .as_ref()
            .is_some_and(|a| !force && a.exp > unix_now() + ADMIN_MARGIN_SECS);
        if !fresh {
            *admin = Some(self.renew_admin().await?);
        }
        match admin.as_ref() {
            Some(a) => Ok((a.service.clone(), a.token.clone())),
            None => Err(GitHubError::Config("admin token missing".into())),
        }
    }

    /// The Actions service URL for `path` with `query` and the API version.
    pub(crate) fn service_url(
        service: &url::Url,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<url::Url, GitHubError> {
        let mut url = service
            .join(path)
            .map_err(|e| GitHubError::Config(format!("service url {path}: {e}")))?;
        {
            let mut pairs = url.query_pairs_mut();
            for (k, v) in query {
                pairs.append_pair(k, v);
            }
            pairs.append_pair("api-version", API_VERSION);
        }
        Ok(url)
    }

    /// One Actions service call with the admin token; a 401 renews the token and tries once
    /// more.
    pub(crate) async fn call(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<Response, GitHubError> {
        let mut force = false;
        loop {
            let (service, token) = self.admin(force).await?;
            let url = Self::service_url(&service, path, query)?;
            let response = self
                .inner
                .retry
                .send(op, || {
                    let request = self
                        .inner
                        .http
                        .request(method.clone(), url.clone())
                        .bearer_auth(&token)
                        .timeout(CALL_TIMEOUT);
                    match body {
                        Some(body) => request.json(body),
                        None => request,
                    }
                })
                .await?;
            if response.status() == StatusCode::UNAUTHORIZED && !force {
                force = true;
                continue;
            }
            return Ok(response);
        }
    }

    async fn expect<T: DeserializeOwned>(
        op: &'static str,
        response: Response,
        ok: StatusCode,
    ) -> Result<T, GitHubError> {
        if response.status() != ok {
            return Err(refused(op, response).await);
        }
        decode(op, response).await
    }

    pub async fn runner_group(&self, name: &str) -> Result<RunnerGroup, GitHubError> {
        const OP: &str = "runner group";
        let response = self
            .call(
                OP,
                Method::GET,
                "_apis/runtime/runnergroups/",
                &[("groupName", name.to_owned())],
                None,
            )
            .await?;
        let list: List<RunnerGroup> = Self::expect(OP, response, StatusCode::OK).await?;
        match (list.count, list.value.into_iter().next()) {
            (1, Some(group)) => Ok(group),
            (0, _) => Err(GitHubError::Config(format!(
                "runner group {name:?} does not exist"
            ))),
            (n, _) => Err(GitHubError::Decode {
                op: OP,
                detail: format!("{n} runner groups named {name:?}"),
            }),
        }
    }

    pub async fn scale_set(
        &self,
        group_id: i64,
        name: &str,
    ) -> Result<Option<RunnerScaleSet>, GitHubError> {
        const OP: &str = "scale set lookup";
        let response = self
            .call(
                OP,
                Method::GET,
                "_apis/runtime/runnerscalesets",
                &[
                    ("runnerGroupId", group_id.to_string()),
                    ("name", name.to_owned()),
                ],
                None,
            )
            .await?;
        let list: List<RunnerScaleSet> = Self::expect(OP, response, StatusCode::OK).await?;
        match list.count {
            0 => Ok(None),
            1 => Ok(list.value.into_iter().next()),
            n => Err(GitHubError::Decode {
                op: OP,
                detail: format!("{n} scale sets named {name:?}"),
            }),
        }
    }

    /// The scale set `name` in runner group `group`, created with `labels` (the name is always
    /// one) when it does not exist.
    pub async fn ensure_scale_set(
        &self,
        group: &str,
        name: &str,
        labels: &[String],
    ) -> Result<RunnerScaleSet, GitHubError> {
        const OP: &str = "scale set create";
        let group = self.runner_group(group).await?;
        if let Some(set) = self.scale_set(group.id, name).await? {
            return Ok(set);
        }
        let mut all = vec![name.to_owned()];
        for label in labels {
            if !all.iter().any(|l| l.eq_ignore_ascii_case(label)) {
                all.push(label.clone());
            }
        }
        let body = json!({
            "name": name,
            "runnerGroupId": group.id,
            "labels": all.iter().map(|l| json!({"type": "System", "name": l})).collect::<Vec<_>>(),
            "RunnerSetting": {"disableUpdate": true},
        });
        let response = self
            .call(
                OP,
                Method::POST,
                "_apis/runtime/runnerscalesets",
                &[],
                Some(&body),
            )
            .await?;
        Self::expect(OP, response, StatusCode::OK).await
    }

    /// Opens the scale set's message session. A 409 means another session holds it (a
    /// listener that did not close, or a second one running): see
    /// [`GitHubError::is_session_conflict`] and [`ScaleSetClient::resume_session`].
    pub async fn create_session(
        &self,
        scale_set: i64,
        owner: &str,
    ) -> Result<MessageSession, GitHubError> {
        const OP: &str = "session create";
        let body = json!({"ownerName": owner});
        let path = format!("_apis/runtime/runnerscalesets/{scale_set}/sessions");
        let response = self.call(OP, Method::POST, &path, &[], Some(&body)).await?;
        let session: Session = Self::expect(OP, response, StatusCode::OK).await?;
        Ok(MessageSession::new(self.clone(), scale_set, session, 0))
    }

    /// Takes over a session this deployment opened before (after a restart or a leader
    /// change): refreshing it yields a new queue token; polling goes on after `last_message_id`.
    pub async fn resume_session(
        &self,
        scale_set: i64,
        session_id: &str,
        last_message_id: i64,
    ) -> Result<MessageSession, GitHubError> {
        let session = self.refresh_session(scale_set, session_id).await?;
        Ok(MessageSession::new(
            self.clone(),
            scale_set,
            session,
            last_message_id,
        ))
    }

    pub(crate) async fn refresh_session(
        &self,
        scale_set: i64,
        session_id: &str,
    ) -> Result<Session, GitHubError> {
        const OP: &str = "session refresh";
        let path = format!("_apis/runtime/runnerscalesets/{scale_set}/sessions/{session_id}");
        let response = self.call(OP, Method::PATCH, &path, &[], None).await?;
        Self::expect(OP, response, StatusCode::OK).await
    }

    /// Deletes a session; one that is already gone or expired counts as deleted.
    pub async fn delete_session(
        &self,
        scale_set: i64,
        session_id: &str,
    ) -> Result<(), GitHubError> {
        const OP: &str = "session delete";
        let path = format!("_apis/runtime/runnerscalesets/{scale_set}/sessions/{session_id}");
        let response = self.call(OP, Method::DELETE, &path, &[], None).await?;
        match response.status() {
            StatusCode::NO_CONTENT | StatusCode::OK | StatusCode::NOT_FOUND => Ok(()),
            _ => {
                let error = refused(OP, response).await;
                if error.is_exception("RunnerScaleSetSessionExpiredException") {
                    Ok(())
                } else {
                    Err(error)
                }
            }
        }
    }

    /// A one-use runner registration named `name` (unique per scale set).
    pub async fn generate_jit_config(
        &self,
        scale_set: i64,
        name: &str,
        work_folder: &str,
    ) -> Result<JitConfig, GitHubError> {
        const OP: &str = "jit config";
        let path = format!("_apis/runtime/runnerscalesets/{scale_set}/generatejitconfig");
        let body = json!({"name": name, "workFolder": work_folder});
        let response = self.call(OP, Method::POST, &path, &[], Some(&body)).await?;
        Self::expect(OP, response, StatusCode::OK).await
    }

    pub async fn runner_by_name(&self, name: &str) -> Result<Option<RunnerReference>, GitHubError> {
        const OP: &str = "runner lookup";
        let response = self
            .call(
                OP,
                Method::GET,
                "_apis/distributedtask/pools/0/agents",
                &[("agentName", name.to_owned())],
                None,
            )
            .await?;
        let list: List<RunnerReference> = Self::expect(OP, response, StatusCode::OK).await?;
        match list.count {
            0 => Ok(None),
            1 => Ok(list.value.into_iter().next()),
            n => Err(GitHubError::Decode {
                op: OP,
                detail: format!("{n} runners named {name:?}"),
            }),
        }
    }

    /// Removes a runner: `Ok` means the service holds no runner `runner` any more. The
    /// service answers 204 both when it removed the runner and when it had none by that id
    /// (an ephemeral runner is gone after its job), so success does not say whether the
    /// runner ever took a job: whoever needs to know looks the runner up first
    /// ([`ScaleSetClient::runner_by_name`]). A runner running a job is refused (400
    /// `JobStillRunningException`). A 404 `AgentNotFoundException`, which the service is not
    /// known to send here, would mean the same as the 204 and is taken as such.
    pub async fn remove_runner(&self, runner: i64) -> Result<(), GitHubError> {
        const OP: &str = "runner remove";
        let path = format!("_apis/distributedtask/pools/0/agents/{runner}");
        let response = self.call(OP, Method::DELETE, &path, &[], None).await?;
        match response.status() {
            StatusCode::NO_CONTENT | StatusCode::OK => Ok(()),
            _ => {
                let error = refused(OP, response).await;
                if error.status() == Some(404) && error.is_exception("AgentNotFoundException") {
                    Ok(())
                } else {
                    Err(error)
                }
            }
        }
    }

    /// Cancels a workflow run (REST, with the GitHub credential). A run already over is not an
    /// error (409).
    pub async fn cancel_run(
        &self,
        owner: &str,
        repo: &str,
        run_id: i64,
    ) -> Result<(), GitHubError> {
        const OP: &str = "cancel run";
        let url = self.inner.config.rest_url(&format!(
            "/repos/{owner}/{repo}/actions/runs/{run_id}/cancel"
        ));
        let response = self.rest(OP, Method::POST, &url).await?;
        match response.status() {
            StatusCode::ACCEPTED | StatusCode::OK | StatusCode::CONFLICT => Ok(()),
            _ => Err(refused(OP, response).await),
        }
    }

    /// Where a workflow run's code comes from (REST, with the GitHub credential).
    pub async fn run_origin(
        &self,
        owner: &str,
        repo: &str,
        run_id: i64,
    ) -> Result<RunOrigin, GitHubError> {
        const OP: &str = "workflow run";
        let url = self
            .inner
            .config
            .rest_url(&format!("/repos/{owner}/{repo}/actions/runs/{run_id}"));
        let response = self.rest(OP, Method::GET, &url).await?;
        let run: Value = Self::expect(OP, response, StatusCode::OK).await?;
        let text = |path: &[&str]| {
            let mut v = &run;
            for p in path {
                v = v.get(p)?;
            }
            v.as_str().map(str::to_owned)
        };
        match (
            text(&["event"]),
            text(&["repository", "full_name"]),
            text(&["head_repository", "full_name"]),
        ) {
            (Some(event), Some(repository), Some(head_repository)) => Ok(RunOrigin {
                event,
                repository,
                head_repository,
                actor: text(&["triggering_actor", "login"])
                    .or_else(|| text(&["actor", "login"]))
                    .unwrap_or_default(),
            }),
            _ => Err(GitHubError::Decode {
                op: OP,
                detail: "event, repository or head_repository missing".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_read_from_the_payload() {
        let payload = URL_SAFE_NO_PAD.encode(br#"{"exp":1700000000,"sub":"x"}"#);
        assert_eq!(jwt_exp(&format!("h.{payload}.s")), Some(1_700_000_000));
        assert_eq!(jwt_exp("not-a-jwt"), None);
    }
}
