//! Wire types of the Lifecycle API. Responses omit null fields, so everything optional
//! is `#[serde(default)]`; unknown fields and unknown states are tolerated.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// A sandbox state. The API treats states as free strings ("clients should tolerate unknown
/// values"), and the Kubernetes runtime reports the non-spec `Allocated`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum SandboxState {
    Pending,
    Allocated,
    Running,
    Pausing,
    Paused,
    Resuming,
    Stopping,
    Terminated,
    Failed,
    /// `Unknown` as reported by the Docker runtime.
    Unknown,
    /// Any other string, kept verbatim.
    Other(String),
}

impl SandboxState {
    pub fn as_str(&self) -> &str {
        match self {
            SandboxState::Pending => "Pending",
            SandboxState::Allocated => "Allocated",
            SandboxState::Running => "Running",
            SandboxState::Pausing => "Pausing",
            SandboxState::Paused => "Paused",
            SandboxState::Resuming => "Resuming",
            SandboxState::Stopping => "Stopping",
            SandboxState::Terminated => "Terminated",
            SandboxState::Failed => "Failed",
            SandboxState::Unknown => "Unknown",
            SandboxState::Other(s) => s,
        }
    }

    /// Lifecycle rule: `Terminated` and `Failed` are terminal (and so is a 404).
    pub fn is_terminal(&self) -> bool {
        matches!(self, SandboxState::Terminated | SandboxState::Failed)
    }
}

impl From<String> for SandboxState {
    fn from(s: String) -> Self {
        match s.to_ascii_lowercase().as_str() {
            "pending" => SandboxState::Pending,
            "allocated" => SandboxState::Allocated,
            "running" => SandboxState::Running,
            "pausing" => SandboxState::Pausing,
            "paused" => SandboxState::Paused,
            "resuming" => SandboxState::Resuming,
            "stopping" => SandboxState::Stopping,
            "terminated" => SandboxState::Terminated,
            "failed" => SandboxState::Failed,
            "unknown" => SandboxState::Unknown,
            _ => SandboxState::Other(s),
        }
    }
}

impl From<SandboxState> for String {
    fn from(s: SandboxState) -> Self {
        s.as_str().to_owned()
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    pub state: SandboxState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "time::serde::rfc3339::option"
    )]
    pub last_transition_at: Option<OffsetDateTime>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSpec {
    pub uri: String,
}

/// Pool allocation confirmed by the controller (1.1.1+).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub pool_ref: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
}

/// `Sandbox` (GET, list items) and `CreateSandboxResponse` (same fields, fewer present).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub id: String,
    pub status: SandboxStatus,
    /// Required by the spec; optional here so one odd item cannot fail a whole list page.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "time::serde::rfc3339::option"
    )]
    pub created_at: Option<OffsetDateTime>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "time::serde::rfc3339::option"
    )]
    pub expires_at: Option<OffsetDateTime>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Absent on a pooled create response, `[]` on a pooled GET.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// `{"uri":"unknown"}` for pooled sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extensions: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation: Option<Allocation>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pagination {
    pub page: u32,
    pub page_size: u32,
    #[serde(default)]
    pub total_items: u64,
    #[serde(default)]
    pub total_pages: u32,
    pub has_next_page: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxPage {
    pub items: Vec<Sandbox>,
    pub pagination: Pagination,
}

/// A pooled create (`extensions.poolRef`). Image, resources and runtime class come from the Pool.
/// `Debug` shows env keys only: the env carries the executor token.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct CreateSandbox {
    pub pool: String,
    /// TTL in seconds (≥ 60), or `None` for no expiry.
    pub timeout_secs: Option<u64>,
    pub metadata: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
    /// Command for the pool task; `None` lets the pool run `tail -f /dev/null`.
    pub entrypoint: Option<Vec<String>>,
}

impl fmt::Debug for CreateSandbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreateSandbox")
            .field("pool", &self.pool)
            .field("timeout_secs", &self.timeout_secs)
            .field("metadata", &self.metadata)
            .field("env_keys", &self.env.keys().collect::<Vec<_>>())
            .field("entrypoint", &self.entrypoint)
            .finish()
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct CreateSandboxBody<'a> {
    pub extensions: BTreeMap<&'static str, &'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: &'a BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<&'a [String]>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Expiration {
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
}

/// The two error shapes of the server: `{"code","message"}` and FastAPI's 422 `{"detail":[…]}`.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum ErrorBody {
    Coded {
        code: String,
        #[serde(default)]
        message: String,
    },
    Validation {
        detail: ValidationDetail,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum ValidationDetail {
    Items(Vec<ValidationItem>),
    Text(String),
}

#[derive(Deserialize)]
pub(crate) struct ValidationItem {
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub loc: Vec<serde_json::Value>,
    #[serde(default)]
    pub msg: String,
}

/// `(code, message)` from an error body; unparsable bodies keep their text as the message.
pub(crate) fn parse_error_body(body: &str) -> (Option<String>, String) {
    match serde_json::from_str::<ErrorBody>(body) {
        Ok(ErrorBody::Coded { code, message }) => (Some(code), message),
        Ok(ErrorBody::Validation {
            detail: ValidationDetail::Text(text),
        }) => (None, text),
        Ok(ErrorBody::Validation {
            detail: ValidationDetail::Items(items),
        }) => {
            let message = items
                .iter()
                .map(|item| {
                    let loc = item
                        .loc
                        .iter()
                        .map(|part| match part {
                            serde_json::Value::String(s) => s.clone(),
                            other => other.to_string(),
                        })
                        .collect::<Vec<_>>()
                        .join(".");
                    match &item.kind {
                        Some(kind) => format!("{loc}: {} ({kind})", item.msg),
                        None => format!("{loc}: {}", item.msg),
                    }
                })
                .collect::<Vec<_>>()
                .join("; ");
            (None, message)
        }
        Err(_) => (None, body.chars().take(512).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_pooled_create_response_without_entrypoint() {
        let body = r#"{"id":"0b7f9a0e-2f7e-4a55-9d8c-2d5e7f7e8a11","status":{"state":"Running",
            "reason":"POD_READY_WITH_IP"},"createdAt":"2026-12-02T10:49:26.565933Z",
            "metadata":{"jetrunner.dev/attempt":"1"},"expiresAt":"2026-12-02T11:49:26Z"}"#;
        let sandbox: Sandbox = serde_json::from_str(body).expect("doc-shaped create response");
        assert_eq!(sandbox.status.state, SandboxState::Running);
        assert!(sandbox.entrypoint.is_empty());
        assert_eq!(sandbox.metadata["jetrunner.dev/attempt"], "1");
        let created = sandbox.created_at.expect("createdAt");
        assert_eq!(created.nanosecond(), 565_933_000);
        assert_eq!(sandbox.expires_at.expect("expiresAt").second(), 26);
    }

    #[test]
    fn parses_a_minimal_sandbox_with_only_required_fields() {
        let body = r#"{"id":"x","status":{"state":"Pending"},"createdAt":"2026-12-02T09:49:26Z"}"#;
        let sandbox: Sandbox = serde_json::from_str(body).expect("minimal sandbox");
        assert_eq!(sandbox.status.state, SandboxState::Pending);
        assert_eq!(sandbox.status.reason, None);
        assert_eq!(sandbox.expires_at, None);
        assert!(sandbox.metadata.is_empty());
        assert_eq!(sandbox.allocation, None);
    }

    #[test]
    fn keeps_unknown_states_and_fields() {
        let body = r#"{"id":"x","status":{"state":"Hibernating","reason":"NEW"},
            "createdAt":"2026-12-02T09:49:26Z","someFutureField":{"a":1},
            "image":{"uri":"unknown"},"entrypoint":[],
            "allocation":{"mode":"pool","poolRef":"ci-vm","state":"allocated"}}"#;
        let sandbox: Sandbox = serde_json::from_str(body).expect("unknown state");
        assert_eq!(
            sandbox.status.state,
            SandboxState::Other("Hibernating".into())
        );
        assert!(!sandbox.status.state.is_terminal());
        assert_eq!(sandbox.image.map(|i| i.uri).as_deref(), Some("unknown"));
        assert_eq!(
            sandbox.allocation.and_then(|a| a.pool_ref).as_deref(),
            Some("ci-vm")
        );
        let allocated: SandboxState = serde_json::from_str(r#""Allocated""#).expect("state");
        assert_eq!(allocated, SandboxState::Allocated);
    }

    #[test]
    fn parses_a_list_page() {
        let body = r#"{"items":[{"id":"a","status":{"state":"Stopping","reason":"DELETING"},
            "createdAt":"2026-12-02T09:49:26Z"}],"pagination":{"page":1,"pageSize":200,
            "totalItems":201,"totalPages":2,"hasNextPage":true}}"#;
        let page: SandboxPage = serde_json::from_str(body).expect("list page");
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].status.state, SandboxState::Stopping);
        assert!(page.pagination.has_next_page);
    }

    #[test]
    fn parses_the_coded_error_shape() {
        let (code, message) = parse_error_body(
            r#"{"code":"KUBERNETES::POOL_CAPACITY_EXHAUSTED","message":"pool ci-vm exhausted"}"#,
        );
        assert_eq!(code.as_deref(), Some("KUBERNETES::POOL_CAPACITY_EXHAUSTED"));
        assert_eq!(message, "pool ci-vm exhausted");
    }

    #[test]
    fn parses_the_validation_error_shape() {
        let (code, message) = parse_error_body(
            r#"{"detail":[{"type":"greater_than_equal","loc":["body","timeout"],
              "msg":"Input should be greater than or equal to 60","input":30,"ctx":{"ge":60}}]}"#,
        );
        assert_eq!(code, None);
        assert_eq!(
            message,
            "body.timeout: Input should be greater than or equal to 60 (greater_than_equal)"
        );
        let (_, text) = parse_error_body(r#"{"detail":"Not Found"}"#);
        assert_eq!(text, "Not Found");
        let (_, raw) = parse_error_body("<html>bad gateway</html>");
        assert_eq!(raw, "<html>bad gateway</html>");
    }
}
