use std::time::Duration;

/// Why a scale set call failed, named after the operation.
#[derive(Debug, thiserror::Error)]
pub enum GitHubError {
    /// The configuration cannot work (a URL that names no organisation, repository or
    /// enterprise, …).
    #[error("configuration: {0}")]
    Config(String),
    /// No answer (connection refused, reset, timed out) after every retry.
    #[error("{op}: transport: {source}")]
    Transport {
        op: &'static str,
        #[source]
        source: reqwest::Error,
    },
    /// The service refused. `type_name` is the Actions service's exception type when it sent
    /// one (`RunnerScaleSetSessionConflictException`, `AgentExistsException`, …).
    #[error("{op}: HTTP {status}{}: {message}", type_name.as_deref().map(|t| format!(" {t}")).unwrap_or_default())]
    Status {
        op: &'static str,
        status: u16,
        type_name: Option<String>,
        message: String,
        /// `Retry-After` of the last answer, when it had one.
        retry_after: Option<Duration>,
    },
    /// The answer could not be read as the protocol describes it.
    #[error("{op}: unexpected answer: {detail}")]
    Decode { op: &'static str, detail: String },
}

impl GitHubError {
    /// The service's exception type contains `name`.
    pub fn is_exception(&self, name: &str) -> bool {
        matches!(self, GitHubError::Status { type_name: Some(t), .. } if t.contains(name))
    }

    /// Another session holds the scale set's queue (409).
    pub fn is_session_conflict(&self) -> bool {
        self.is_exception("RunnerScaleSetSessionConflictException")
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            GitHubError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Rate limited or overloaded: wait, do not count it as the job's failure.
    pub fn is_backpressure(&self) -> bool {
        match self {
            GitHubError::Status {
                status,
                retry_after,
                ..
            } => *status == 429 || *status == 503 || (*status == 403 && retry_after.is_some()),
            _ => false,
        }
    }

    /// Worth trying again later (backpressure, a server error, no answer).
    pub fn is_transient(&self) -> bool {
        match self {
            GitHubError::Transport { .. } => true,
            GitHubError::Status { status, .. } => {
                self.is_backpressure() || (*status >= 500 && *status != 501)
            }
            GitHubError::Config(_) | GitHubError::Decode { .. } => false,
        }
    }
}
