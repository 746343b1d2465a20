//! Client of the OpenSandbox Lifecycle API (`/v1`), written against the API's specification and
//! the 1.1.x server on its Kubernetes runtime.

mod labels;
mod model;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{Method, RequestBuilder, StatusCode};
use serde::de::DeserializeOwned;
use time::OffsetDateTime;

pub use labels::{
    RESERVED_PREFIX, encode_metadata_filter, is_label_value, label_key_problem,
    sanitize_label_value,
};
pub use model::{
    Allocation, CreateSandbox, ImageSpec, Pagination, Sandbox, SandboxPage, SandboxState,
    SandboxStatus,
};

use model::{CreateSandboxBody, Expiration, parse_error_body};

/// Header carrying the API key.
pub const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";
/// Largest `pageSize` the server accepts (`le=200`).
pub const MAX_PAGE_SIZE: u32 = 200;
/// Smallest TTL the server accepts.
pub const MIN_TIMEOUT_SECS: u64 = 60;
/// Retry-After to assume when a 429 carries none (the server's default acquisition timeout).
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(30);
/// Guard against a server that keeps saying `hasNextPage`.
const MAX_PAGES: u32 = 10_000;

#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Server base URL without `/v1`, e.g. `http://opensandbox.sandbox.svc:8080`.
    pub base_url: String,
    /// `None` only for a server started with `OPENSANDBOX_INSECURE_SERVER=YES`.
    pub api_key: Option<String>,
    /// Timeout of every call except create.
    pub request_timeout: Duration,
    /// Timeout of create, which blocks until the pod is Running. Must exceed the server's
    /// `sandbox_create_timeout_seconds` + `pool_acquisition_timeout_seconds` (60 + 30 by default).
    pub create_timeout: Duration,
}

impl ClientConfig {
    pub fn new(base_url: impl Into<String>, api_key: Option<String>) -> Self {
        Self {
            base_url: base_url.into(),
            api_key,
            request_timeout: Duration::from_secs(15),
            create_timeout: Duration::from_secs(120),
        }
    }
}

/// What went wrong talking to the Lifecycle API. `op` names the call (`create`, `get`, `list`,
/// `delete`, `renew`).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{op}: pool capacity exhausted, retry after {retry_after:?}: {message}")]
    CapacityExhausted {
        op: &'static str,
        retry_after: Duration,
        message: String,
    },
    #[error("{op}: pool not found: {message}")]
    PoolNotFound { op: &'static str, message: String },
    #[error("{op}: quota exceeded: {message}")]
    QuotaExceeded { op: &'static str, message: String },
    #[error("{op}: forbidden ({code:?}): {message}")]
    Forbidden {
        op: &'static str,
        code: Option<String>,
        message: String,
    },
    /// 504: the sandbox did not become ready in time; the server deletes what it made.
    #[error("{op}: sandbox not ready in time: {message}")]
    ReadyTimeout { op: &'static str, message: String },
    /// 400/422 from the server (`status` set) or refused before sending (`status` = None).
    #[error("{op}: invalid request ({status:?} {code:?}): {message}")]
    Invalid {
        op: &'static str,
        status: Option<u16>,
        code: Option<String>,
        message: String,
    },
    #[error("{op}: not found ({code:?}): {message}")]
    NotFound {
        op: &'static str,
        code: Option<String>,
        message: String,
    },
    #[error("{op}: unauthorized ({code:?}): {message}")]
    Unauthorized {
        op: &'static str,
        code: Option<String>,
        message: String,
    },
    #[error("{op}: conflict ({code:?}): {message}")]
    Conflict {
        op: &'static str,
        code: Option<String>,
        message: String,
    },
    #[error("{op}: server error {status} ({code:?}): {message}")]
    Server {
        op: &'static str,
        status: u16,
        code: Option<String>,
        message: String,
    },
    /// The connection could not be made, so the request was not sent.
    #[error("{op}: cannot connect: {source}")]
    Connect {
        op: &'static str,
        source: reqwest::Error,
    },
    /// The connection failed after the request may have reached the server.
    #[error("{op}: transport error: {source}")]
    Transport {
        op: &'static str,
        source: reqwest::Error,
    },
    /// No answer within the client-side timeout; the server may still act on the request.
    #[error("{op}: timed out")]
    Timeout { op: &'static str },
    #[error("{op}: unexpected response body: {message}")]
    Decode { op: &'static str, message: String },
    #[error("{op}: unexpected status {status} ({code:?}): {message}")]
    Unexpected {
        op: &'static str,
        status: u16,
        code: Option<String>,
        message: String,
    },
    #[error("client configuration: {0}")]
    Config(String),
}

impl SandboxError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            SandboxError::CapacityExhausted { .. } => "capacity_exhausted",
            SandboxError::PoolNotFound { .. } => "pool_not_found",
            SandboxError::QuotaExceeded { .. } => "quota",
            SandboxError::Forbidden { .. } => "forbidden",
            SandboxError::ReadyTimeout { .. } => "ready_timeout",
            SandboxError::Invalid { .. } => "invalid",
            SandboxError::NotFound { .. } => "not_found",
            SandboxError::Unauthorized { .. } => "unauthorized",
            SandboxError::Conflict { .. } => "conflict",
            SandboxError::Server { .. } | SandboxError::Connect { .. } => "transient",
            SandboxError::Transport { .. } => "transient",
            SandboxError::Timeout { .. } => "timeout",
            SandboxError::Decode { .. } => "decode",
            SandboxError::Unexpected { .. } => "unexpected",
            SandboxError::Config(_) => "config",
        }
    }

    /// For a failed create: the server may nevertheless have made (and kept) a sandbox, so the
    /// caller must look for it by metadata. 504/429/500-with-cleanup still list it briefly as
    /// `Stopping`, which callers skip.
    pub fn create_outcome_unknown(&self) -> bool {
        matches!(
            self,
            SandboxError::Timeout { .. }
                | SandboxError::Transport { .. }
                | SandboxError::Server { .. }
                | SandboxError::Decode { .. }
        )
    }

    fn from_reqwest(op: &'static str, source: reqwest::Error) -> Self {
        if source.is_timeout() {
            SandboxError::Timeout { op }
        } else if source.is_connect() {
            SandboxError::Connect { op, source }
        } else {
            SandboxError::Transport { op, source }
        }
    }

    fn from_response(
        op: &'static str,
        status: StatusCode,
        headers: &HeaderMap,
        body: &str,
    ) -> Self {
        let (code, message) = parse_error_body(body);
        let code_has = |needle: &str| code.as_deref().is_some_and(|c| c.contains(needle));
        let status_u16 = status.as_u16();
        match status_u16 {
            429 => SandboxError::CapacityExhausted {
                op,
                retry_after: retry_after(headers).unwrap_or(DEFAULT_RETRY_AFTER),
                message,
            },
            404 if code_has("POOL_NOT_FOUND") => SandboxError::PoolNotFound { op, message },
            404 => SandboxError::NotFound { op, code, message },
            403 if code_has("QUOTA") => SandboxError::QuotaExceeded { op, message },
            403 => SandboxError::Forbidden { op, code, message },
            504 => SandboxError::ReadyTimeout { op, message },
            400 | 422 => SandboxError::Invalid {
                op,
                status: Some(status_u16),
                code,
                message,
            },
            401 => SandboxError::Unauthorized { op, code, message },
            409 => SandboxError::Conflict { op, code, message },
            500..=599 => SandboxError::Server {
                op,
                status: status_u16,
                code,
                message,
            },
            _ => SandboxError::Unexpected {
                op,
                status: status_u16,
                code,
                message,
            },
        }
    }
}

/// `Retry-After` in delta-seconds (the only form the server sends).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let secs: f64 = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.ceil()))
}

/// A sandbox id as one URL path segment: every byte outside `[A-Za-z0-9_~-]` is
/// percent-encoded (`/` and `.` included), so an id such as `../pools/ci-vm` can never reach
/// another API path with the API key. Empty, oversized and dot-only ids are refused.
pub fn id_segment(op: &'static str, id: &str) -> Result<String, SandboxError> {
    if id.is_empty() || id.len() > 256 || id.bytes().all(|b| b == b'.') {
        return Err(SandboxError::Invalid {
            op,
            status: None,
            code: None,
            message: format!("{id:?} is not a sandbox id"),
        });
    }
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Ok(out)
}

/// A Lifecycle API client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SandboxClient {
    http: reqwest::Client,
    base: String,
    create_timeout: Duration,
}

impl SandboxClient {
    pub fn new(config: ClientConfig) -> Result<Self, SandboxError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut headers = HeaderMap::new();
        if let Some(key) = &config.api_key {
            let mut value = HeaderValue::from_str(key)
                .map_err(|_| SandboxError::Config("API key is not a valid header value".into()))?;
            value.set_sensitive(true);
            headers.insert(API_KEY_HEADER, value);
        }
        let http = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(config.request_timeout)
            .connect_timeout(config.request_timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| SandboxError::Config(format!("building the HTTP client: {e}")))?;
        let base = format!("{}/v1", config.base_url.trim_end_matches('/'));
        Ok(Self {
            http,
            base,
            create_timeout: config.create_timeout,
        })
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base))
    }

    /// `/sandboxes/<id><rest>` with the id as exactly one path segment.
    fn sandbox_path(op: &'static str, id: &str, rest: &str) -> Result<String, SandboxError> {
        Ok(format!("/sandboxes/{}{rest}", id_segment(op, id)?))
    }

    /// Sends and returns the successful response, or the error the status maps to.
    async fn send(
        &self,
        op: &'static str,
        request: RequestBuilder,
    ) -> Result<reqwest::Response, SandboxError> {
        let response = request
            .send()
            .await
            .map_err(|e| SandboxError::from_reqwest(op, e))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.text().await.unwrap_or_default();
        Err(SandboxError::from_response(op, status, &headers, &body))
    }

    async fn json<T: DeserializeOwned>(
        op: &'static str,
        response: reqwest::Response,
    ) -> Result<T, SandboxError> {
        let bytes = response
            .bytes()
            .await
            .map_err(|e| SandboxError::from_reqwest(op, e))?;
        serde_json::from_slice(&bytes).map_err(|e| SandboxError::Decode {
            op,
            message: e.to_string(),
        })
    }

    /// `POST /sandboxes` with `extensions.poolRef`. Blocks until the sandbox is Running (202).
    /// Metadata and the TTL are checked locally first, so a bad label never reaches the server.
    pub async fn create(&self, request: &CreateSandbox) -> Result<Sandbox, SandboxError> {
        const OP: &str = "create";
        let invalid = |message: String| SandboxError::Invalid {
            op: OP,
            status: None,
            code: None,
            message,
        };
        for (key, value) in &request.metadata {
            if let Some(problem) = label_key_problem(key) {
                return Err(invalid(format!("metadata key {key:?}: {problem}")));
            }
            if !is_label_value(value) {
                return Err(invalid(format!(
                    "metadata value {value:?} of {key:?} is not a label value"
                )));
            }
        }
        if request.timeout_secs.is_some_and(|t| t < MIN_TIMEOUT_SECS) {
            return Err(invalid(format!(
                "timeout must be at least {MIN_TIMEOUT_SECS} s"
            )));
        }
        let body = CreateSandboxBody {
            extensions: BTreeMap::from([("poolRef", request.pool.as_str())]),
            timeout: request.timeout_secs,
            metadata: &request.metadata,
            env: &request.env,
            entrypoint: request.entrypoint.as_deref(),
        };
        let builder = self
            .request(Method::POST, "/sandboxes")
            .timeout(self.create_timeout)
            .json(&body);
        let response = self.send(OP, builder).await?;
        Self::json(OP, response).await
    }

    /// `GET /sandboxes/{id}`. A deleted sandbox is [`SandboxError::NotFound`].
    pub async fn get(&self, id: &str) -> Result<Sandbox, SandboxError> {
        let path = Self::sandbox_path("get", id, "")?;
        let response = self.send("get", self.request(Method::GET, &path)).await?;
        Self::json("get", response).await
    }

    /// One page of `GET /sandboxes?metadata=…` (exact-match AND over `filter`).
    pub async fn list_page(
        &self,
        filter: &BTreeMap<String, String>,
        page: u32,
        page_size: u32,
    ) -> Result<SandboxPage, SandboxError> {
        let mut query = vec![
            ("page", page.max(1).to_string()),
            ("pageSize", page_size.clamp(1, MAX_PAGE_SIZE).to_string()),
        ];
        if !filter.is_empty() {
            query.push(("metadata", encode_metadata_filter(filter)));
        }
        let builder = self.request(Method::GET, "/sandboxes").query(&query);
        let response = self.send("list", builder).await?;
        Self::json("list", response).await
    }

    /// Every sandbox matching `filter`, paging with the largest page size while `hasNextPage`.
    /// The list is not a snapshot, so an item shifting across a page boundary is reported once.
    pub async fn list_all(
        &self,
        filter: &BTreeMap<String, String>,
    ) -> Result<Vec<Sandbox>, SandboxError> {
        let mut seen = HashSet::new();
        let mut all = Vec::new();
        for page in 1..=MAX_PAGES {
            let SandboxPage { items, pagination } =
                self.list_page(filter, page, MAX_PAGE_SIZE).await?;
            let empty = items.is_empty();
            for sandbox in items {
                if seen.insert(sandbox.id.clone()) {
                    all.push(sandbox);
                }
            }
            if !pagination.has_next_page || empty {
                break;
            }
        }
        Ok(all)
    }

    /// `DELETE /sandboxes/{id}`: `Ok(true)` when accepted (204), `Ok(false)` when already gone (404).
    pub async fn delete(&self, id: &str) -> Result<bool, SandboxError> {
        let path = Self::sandbox_path("delete", id, "")?;
        match self
            .send("delete", self.request(Method::DELETE, &path))
            .await
        {
            Ok(_) => Ok(true),
            Err(SandboxError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `POST /sandboxes/{id}/renew-expiration` with an absolute time; returns the expiry the
    /// server set (it may cap it).
    pub async fn renew_expiration(
        &self,
        id: &str,
        expires_at: OffsetDateTime,
    ) -> Result<OffsetDateTime, SandboxError> {
        const OP: &str = "renew";
        let body = Expiration {
            expires_at: expires_at.replace_nanosecond(0).unwrap_or(expires_at),
        };
        let path = Self::sandbox_path(OP, id, "/renew-expiration")?;
        let builder = self.request(Method::POST, &path).json(&body);
        let response = self.send(OP, builder).await?;
        Ok(Self::json::<Expiration>(OP, response).await?.expires_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(status: u16, headers: &[(&'static str, &str)], body: &str) -> SandboxError {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, HeaderValue::from_str(value).expect("header value"));
        }
        let status = StatusCode::from_u16(status).expect("status");
        SandboxError::from_response("create", status, &map, body)
    }

    #[test]
    fn statuses_map_to_typed_errors() {
        let exhausted = error(
            429,
            &[("retry-after", "30")],
            r#"{"code":"KUBERNETES::POOL_CAPACITY_EXHAUSTED","message":"no idle pod"}"#,
        );
        assert!(matches!(
            exhausted,
            SandboxError::CapacityExhausted { retry_after, .. } if retry_after == Duration::from_secs(30)
        ));
        let no_header = error(429, &[], r#"{"code":"X","message":"m"}"#);
        assert!(matches!(
            no_header,
            SandboxError::CapacityExhausted { retry_after, .. } if retry_after == DEFAULT_RETRY_AFTER
        ));
        let pool = error(
            404,
            &[],
            r#"{"code":"KUBERNETES::POOL_NOT_FOUND","message":"ci-vm"}"#,
        );
        assert_eq!(pool.kind(), "pool_not_found");
        let gone = error(
            404,
            &[],
            r#"{"code":"KUBERNETES::SANDBOX_NOT_FOUND","message":"x"}"#,
        );
        assert_eq!(gone.kind(), "not_found");
        let quota = error(
            403,
            &[],
            r#"{"code":"KUBERNETES::QUOTA_EXCEEDED","message":"q"}"#,
        );
        assert_eq!(quota.kind(), "quota");
        assert_eq!(
            error(
                504,
                &[],
                r#"{"code":"KUBERNETES::POD_READY_TIMEOUT","message":"t"}"#
            )
            .kind(),
            "ready_timeout"
        );
        let validation = error(
            422,
            &[],
            r#"{"detail":[{"type":"missing","loc":["body"],"msg":"m"}]}"#,
        );
        assert!(matches!(
            validation,
            SandboxError::Invalid {
                status: Some(422),
                code: None,
                ..
            }
        ));
        let label = error(
            400,
            &[],
            r#"{"code":"SANDBOX::INVALID_METADATA_LABEL","message":"bad"}"#,
        );
        assert!(matches!(
            label,
            SandboxError::Invalid {
                status: Some(400),
                code: Some(_),
                ..
            }
        ));
        let server = error(
            503,
            &[],
            r#"{"code":"SANDBOX_LIST_UNAVAILABLE","message":"k8s"}"#,
        );
        assert_eq!(server.kind(), "transient");
        assert!(server.create_outcome_unknown());
        assert!(!error(504, &[], "").create_outcome_unknown());
        assert_eq!(
            error(401, &[], r#"{"code":"INVALID_API_KEY","message":"no"}"#).kind(),
            "unauthorized"
        );
    }

    #[test]
    fn sandbox_ids_stay_one_path_segment() {
        let path = SandboxClient::sandbox_path("delete", "../pools/ci-vm", "").expect("encodes");
        assert_eq!(path, "/sandboxes/%2E%2E%2Fpools%2Fci-vm");
        let url = reqwest::Url::parse(&format!("http://h/v1{path}")).expect("url");
        assert_eq!(url.path(), "/v1/sandboxes/%2E%2E%2Fpools%2Fci-vm");
        assert_eq!(url.path_segments().map(|s| s.count()), Some(3));
        let id = "0f6c3b2e-5c1a-4a55-9a8e-3f1f9d7c2b10";
        assert_eq!(
            SandboxClient::sandbox_path("get", id, "/renew-expiration").expect("plain"),
            format!("/sandboxes/{id}/renew-expiration")
        );
        for bad in ["", ".", "..", "..."] {
            assert!(id_segment("get", bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            id_segment("get", "a?b#c d").expect("encodes"),
            "a%3Fb%23c%20d"
        );
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up() {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(2)));
        headers.insert(RETRY_AFTER, HeaderValue::from_static("0.5"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(1)));
        headers.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2026 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), None);
    }
}
