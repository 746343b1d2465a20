//! Connect unary client for `ping.v1.PingService` and `runner.v1.RunnerService` over HTTP/1.1.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;

use crate::code::parse_connect_error;
use crate::error::ForgeError;
use crate::proto::ping::v1::{PingRequest, PingResponse};
use crate::proto::runner::v1::{
    DeclareRequest, DeclareResponse, FetchTaskRequest, FetchTaskResponse, RegisterRequest,
    RegisterResponse, UpdateLogRequest, UpdateLogResponse, UpdateTaskRequest, UpdateTaskResponse,
};
use crate::wire::{
    CONNECT_PROTOCOL_VERSION, CONTENT_TYPE_PROTO, HEADER_CONNECT_PROTOCOL_VERSION,
    HEADER_CONNECT_TIMEOUT_MS, HEADER_REQUEST_KEY, HEADER_RUNNER_TOKEN, HEADER_RUNNER_UUID,
    PING_SERVICE, RUNNER_SERVICE,
};

/// Longest part of a non-Connect error body kept in [`ForgeError::Http`].
const BODY_SNIPPET_CHARS: usize = 200;

/// Runner credentials sent as `x-runner-uuid` / `x-runner-token`.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub uuid: String,
    pub token: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("uuid", &self.uuid)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// A Connect unary client for one forge (or one facade). Cloning is cheap and shares the
/// connection pool.
#[derive(Clone)]
pub struct ForgeClient {
    http: reqwest::Client,
    /// `<instance root>/api/actions`, no trailing slash.
    rpc_base: Arc<str>,
    /// `rpc_base` parsed once, so a call does not parse (and IDNA-map) the URL again; `None`
    /// when it does not parse as a base, and each call then reports that error.
    rpc_url: Option<Arc<reqwest::Url>>,
    credentials: Option<Credentials>,
    timeout: Duration,
}

impl fmt::Debug for ForgeClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForgeClient")
            .field("rpc_base", &self.rpc_base)
            .field("credentials", &self.credentials)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ForgeClient {
    /// `base_url` is the instance root (what act_runner calls `address`), e.g.
    /// `https://gitea.example.com/` or `http://127.0.0.1:3000/sub/path`; calls go to
    /// `<base_url>/api/actions/<pkg.Service>/<Method>`. `timeout` bounds each whole call.
    pub fn new(
        base_url: &str,
        credentials: Option<Credentials>,
        timeout: Duration,
    ) -> Result<ForgeClient, ForgeError> {
        // reqwest is built with `rustls-no-provider`; installing twice is a harmless no-op error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            // Every call carries the runner token in a header, which reqwest would re-send to
            // wherever a redirect points; a redirect is an error instead.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("jetrunner/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(ForgeError::Build)?;
        let rpc_base = format!("{}/api/actions", base_url.trim_end_matches('/'));
        let rpc_url = reqwest::Url::parse(&rpc_base)
            .ok()
            .filter(|url| !url.cannot_be_a_base())
            .map(Arc::new);
        Ok(ForgeClient {
            http,
            rpc_url,
            rpc_base: rpc_base.into(),
            credentials,
            timeout,
        })
    }

    /// The same client (same connection pool, base URL, timeout) with other credentials.
    pub fn with_credentials(&self, credentials: Credentials) -> ForgeClient {
        ForgeClient {
            credentials: Some(credentials),
            ..self.clone()
        }
    }

    /// The credentials this client sends, if any.
    pub fn credentials(&self) -> Option<&Credentials> {
        self.credentials.as_ref()
    }

    /// `<base>/api/actions`, the prefix of every RPC path.
    pub fn rpc_base(&self) -> &str {
        &self.rpc_base
    }

    /// `ping.v1.PingService/Ping` (no auth).
    pub async fn ping(&self, request: &PingRequest) -> Result<PingResponse, ForgeError> {
        self.call(PING_SERVICE, "Ping", request, false).await
    }

    /// `Register` (no auth headers; the registration token is in the body).
    pub async fn register(
        &self,
        request: &RegisterRequest,
    ) -> Result<RegisterResponse, ForgeError> {
        self.call(RUNNER_SERVICE, "Register", request, false).await
    }

    /// `Declare` (authenticated).
    pub async fn declare(&self, request: &DeclareRequest) -> Result<DeclareResponse, ForgeError> {
        self.call(RUNNER_SERVICE, "Declare", request, true).await
    }

    /// `FetchTask` (authenticated).
    pub async fn fetch_task(
        &self,
        request: &FetchTaskRequest,
    ) -> Result<FetchTaskResponse, ForgeError> {
        self.call(RUNNER_SERVICE, "FetchTask", request, true).await
    }

    /// `FetchTask` as a runner that must not lose a task: with Forgejo's request key (a
    /// repeated key returns the tasks assigned under it again), and refusing a reply that
    /// carries a field this client does not know — a task under an unknown field number would
    /// be handed out by the forge and silently dropped here.
    pub async fn fetch_tasks(
        &self,
        request: &FetchTaskRequest,
        request_key: Option<&str>,
    ) -> Result<FetchTaskResponse, ForgeError> {
        let headers: Vec<(&str, &str)> = request_key
            .map(|k| vec![(HEADER_REQUEST_KEY, k)])
            .unwrap_or_default();
        let (body, _) = self
            .call_raw(RUNNER_SERVICE, "FetchTask", request, true, &headers)
            .await?;
        let unknown = crate::wire::unknown_fields(&body, &[1, 2, 3]);
        if !unknown.is_empty() {
            return Err(ForgeError::UnexpectedFields {
                message: "FetchTaskResponse",
                fields: unknown,
            });
        }
        FetchTaskResponse::decode(body.as_ref()).map_err(|source| ForgeError::DecodeResponse {
            message: "FetchTask",
            source,
        })
    }

    /// `UpdateTask` (authenticated).
    pub async fn update_task(
        &self,
        request: &UpdateTaskRequest,
    ) -> Result<UpdateTaskResponse, ForgeError> {
        self.call(RUNNER_SERVICE, "UpdateTask", request, true).await
    }

    /// `UpdateLog` (authenticated).
    pub async fn update_log(
        &self,
        request: &UpdateLogRequest,
    ) -> Result<UpdateLogResponse, ForgeError> {
        self.call(RUNNER_SERVICE, "UpdateLog", request, true).await
    }

    /// One Connect unary call: `POST <base>/api/actions/<service>/<method>` with a protobuf body.
    /// Public so callers can reach methods this client does not wrap (e.g. Forgejo extensions).
    pub async fn call<Req, Resp>(
        &self,
        service: &str,
        method: &'static str,
        request: &Req,
        authenticated: bool,
    ) -> Result<Resp, ForgeError>
    where
        Req: Message,
        Resp: Message + Default,
    {
        let (body, _) = self
            .call_raw(service, method, request, authenticated, &[])
            .await?;
        Resp::decode(body.as_ref()).map_err(|source| ForgeError::DecodeResponse {
            message: method,
            source,
        })
    }

    /// `<rpc_base>/<service>/<method>` from the parsed base.
    fn method_url(&self, service: &str, method: &str) -> Option<reqwest::Url> {
        let mut url = self.rpc_url.as_deref()?.clone();
        url.path_segments_mut().ok()?.push(service).push(method);
        Some(url)
    }

    /// A call with extra request headers, returning the successful reply's raw body and
    /// headers (e.g. Declare's capabilities header, which the facade relays).
    pub async fn call_raw<Req: Message>(
        &self,
        service: &str,
        method: &'static str,
        request: &Req,
        authenticated: bool,
        extra_headers: &[(&str, &str)],
    ) -> Result<(bytes::Bytes, reqwest::header::HeaderMap), ForgeError> {
        let request_builder = match self.method_url(service, method) {
            Some(url) => self.http.post(url),
            None => self
                .http
                .post(format!("{}/{service}/{method}", self.rpc_base)),
        };
        let mut builder = request_builder
            .header(reqwest::header::CONTENT_TYPE, CONTENT_TYPE_PROTO)
            .header(HEADER_CONNECT_PROTOCOL_VERSION, CONNECT_PROTOCOL_VERSION)
            .header(
                HEADER_CONNECT_TIMEOUT_MS,
                self.timeout.as_millis().to_string(),
            )
            .body(request.encode_to_vec());
        for (name, value) in extra_headers {
            builder = builder.header(*name, *value);
        }
        if authenticated {
            let credentials = self
                .credentials
                .as_ref()
                .ok_or(ForgeError::MissingCredentials { method })?;
            builder = builder
                .header(HEADER_RUNNER_UUID, credentials.uuid.as_str())
                .header(HEADER_RUNNER_TOKEN, credentials.token.as_str());
        }
        let response = builder.send().await.map_err(ForgeError::from_reqwest)?;
        let status = response.status();
        let headers = response.headers().clone();
        // reqwest advertises gzip and transparently decodes `content-encoding: gzip` bodies.
        let body = response.bytes().await.map_err(ForgeError::from_reqwest)?;
        if status.is_success() {
            return Ok((body, headers));
        }
        let err = match parse_connect_error(&body) {
            Some(connect) => ForgeError::Connect {
                code: connect.code,
                message: connect.message,
                unwrapped_from_unknown: connect.unwrapped_from_unknown,
            },
            None => ForgeError::Http {
                status: status.as_u16(),
                body_snippet: snippet(&body),
            },
        };
        tracing::debug!(method, status = status.as_u16(), kind = err.kind(), error = %err, "forge call failed");
        Err(err)
    }
}

/// The first characters of a body, lossily decoded, for error messages.
fn snippet(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .chars()
        .take(BODY_SNIPPET_CHARS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_urls_are_the_base_path_joined_with_service_and_method() {
        for (base, expected) in [
            (
                "http://127.0.0.1:3000/sub/path/",
                "http://127.0.0.1:3000/sub/path/api/actions/runner.v1.RunnerService/FetchTask",
            ),
            (
                "https://gitea.example.com",
                "https://gitea.example.com/api/actions/runner.v1.RunnerService/FetchTask",
            ),
        ] {
            let client = ForgeClient::new(base, None, Duration::from_secs(1)).expect("client");
            let url = client
                .method_url(RUNNER_SERVICE, "FetchTask")
                .expect("a base URL takes path segments");
            assert_eq!(url.as_str(), expected);
            assert_eq!(
                format!("{}/{RUNNER_SERVICE}/FetchTask", client.rpc_base()),
                expected
            );
        }
        // Not a URL at all: no parsed base, and the call reports the error itself.
        let client = ForgeClient::new("not a url", None, Duration::from_secs(1)).expect("client");
        assert!(client.method_url(RUNNER_SERVICE, "FetchTask").is_none());
    }
}
