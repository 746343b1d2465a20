//! The crate error, and RPC errors rendered as Connect JSON in Gitea or Forgejo style.

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

/// Errors of the fake forge's own API (not RPC replies).
#[derive(Debug, thiserror::Error)]
pub enum FakeForgeError {
    #[error("bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("wait_until: condition not met within {0:?}")]
    WaitTimeout(std::time::Duration),
    #[error("server task failed: {0}")]
    Serve(String),
}

impl FakeForgeError {
    /// Low-cardinality name for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Bind { .. } => "bind",
            Self::WaitTimeout(_) => "wait_timeout",
            Self::Serve(_) => "serve",
        }
    }
}

/// How RPC errors look on the wire (Connect error JSON).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorStyle {
    /// Code `unknown` (HTTP 500); gRPC-status errors as `rpc error: code = X desc = msg`.
    #[default]
    Gitea,
    /// Proper Connect codes with their HTTP status.
    Forgejo,
}

impl std::str::FromStr for ErrorStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gitea" => Ok(Self::Gitea),
            "forgejo" => Ok(Self::Forgejo),
            other => Err(format!("unknown error style {other:?} (gitea|forgejo)")),
        }
    }
}

/// Connect error codes used by the fake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    Unauthenticated,
    Internal,
    Unknown,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid_argument",
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::PermissionDenied => "permission_denied",
            Self::Unauthenticated => "unauthenticated",
            Self::Internal => "internal",
            Self::Unknown => "unknown",
        }
    }

    /// HTTP status per the current Connect spec.
    pub fn http_status(self) -> StatusCode {
        match self {
            Self::InvalidArgument => StatusCode::BAD_REQUEST,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::AlreadyExists => StatusCode::CONFLICT,
            Self::PermissionDenied => StatusCode::FORBIDDEN,
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::Internal | Self::Unknown => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The Go gRPC `codes.Code` name that appears inside Gitea's messages.
    fn grpc_name(self) -> &'static str {
        match self {
            Self::InvalidArgument => "InvalidArgument",
            Self::NotFound => "NotFound",
            Self::AlreadyExists => "AlreadyExists",
            Self::PermissionDenied => "PermissionDenied",
            Self::Unauthenticated => "Unauthenticated",
            Self::Internal => "Internal",
            Self::Unknown => "Unknown",
        }
    }
}

/// Whether Gitea builds this error with the gRPC `status` package or as a plain Go error;
/// that decides its message text in Gitea style.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GiteaForm {
    GrpcStatus,
    Plain,
}

/// An RPC failure decided by the state machine, rendered later in the active style.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RpcError {
    pub code: Code,
    pub message: String,
    pub form: GiteaForm,
}

/// The Connect unary error body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectErrorBody {
    pub code: String,
    pub message: String,
}

impl RpcError {
    fn grpc(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            form: GiteaForm::GrpcStatus,
        }
    }

    fn plain(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            form: GiteaForm::Plain,
        }
    }

    pub fn unregistered() -> Self {
        Self::grpc(Code::Unauthenticated, "unregistered runner")
    }

    pub fn missing_register_fields() -> Self {
        Self::plain(Code::InvalidArgument, "missing runner token, name")
    }

    pub fn registration_token_not_found() -> Self {
        Self::plain(Code::InvalidArgument, "runner registration token not found")
    }

    pub fn registration_token_invalidated() -> Self {
        Self::plain(
            Code::InvalidArgument,
            "runner registration token has been invalidated, please use the latest one",
        )
    }

    pub fn log_archived() -> Self {
        Self::grpc(Code::AlreadyExists, "log file has been archived")
    }

    /// UpdateTask (plain Go error in Gitea).
    pub fn update_invalid_runner(task_id: i64) -> Self {
        Self::plain(Code::Internal, format!("invalid runner for task {task_id}"))
    }

    /// UpdateLog (gRPC status in Gitea).
    pub fn log_invalid_runner() -> Self {
        Self::grpc(Code::Internal, "invalid runner for task")
    }

    pub fn update_task_not_found(task_id: i64) -> Self {
        Self::plain(
            Code::Internal,
            format!("update task: resource does not exist [id: {task_id}]"),
        )
    }

    pub fn log_task_not_found(task_id: i64) -> Self {
        Self::grpc(
            Code::Internal,
            format!("get task: resource does not exist [id: {task_id}]"),
        )
    }

    /// Forgejo: another call holds the same request key.
    pub fn request_key_locked() -> Self {
        Self::grpc(
            Code::Internal,
            "request key is currently locked; retry soon",
        )
    }

    pub fn runner_removed() -> Self {
        Self::plain(Code::Internal, "pick task: runner has been removed")
    }

    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::grpc(Code::InvalidArgument, message)
    }

    /// Status and body as the client sees them.
    pub fn render(&self, style: ErrorStyle) -> (StatusCode, ConnectErrorBody) {
        match style {
            ErrorStyle::Forgejo => (
                self.code.http_status(),
                ConnectErrorBody {
                    code: self.code.as_str().to_owned(),
                    message: self.message.clone(),
                },
            ),
            ErrorStyle::Gitea => {
                let message = match self.form {
                    GiteaForm::GrpcStatus => {
                        format!(
                            "rpc error: code = {} desc = {}",
                            self.code.grpc_name(),
                            self.message
                        )
                    }
                    GiteaForm::Plain => self.message.clone(),
                };
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ConnectErrorBody {
                        code: Code::Unknown.as_str().to_owned(),
                        message,
                    },
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unregistered_runner_renders_per_style() {
        let (status, body) = RpcError::unregistered().render(ErrorStyle::Gitea);
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body.code, "unknown");
        assert_eq!(
            body.message,
            "rpc error: code = Unauthenticated desc = unregistered runner"
        );
        let (status, body) = RpcError::unregistered().render(ErrorStyle::Forgejo);
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(body.code, "unauthenticated");
        assert_eq!(body.message, "unregistered runner");
    }

    #[test]
    fn plain_gitea_errors_keep_their_text() {
        let (_, body) = RpcError::registration_token_not_found().render(ErrorStyle::Gitea);
        assert_eq!(body.message, "runner registration token not found");
        let (status, body) = RpcError::registration_token_not_found().render(ErrorStyle::Forgejo);
        assert_eq!(
            (status, body.code.as_str()),
            (StatusCode::BAD_REQUEST, "invalid_argument")
        );
    }
}
