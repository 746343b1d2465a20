//! The one error type of this crate.

use crate::code::Code;

/// Why a forge call (or a server-side request decode) failed.
#[derive(Debug, thiserror::Error)]
pub enum ForgeError {
    /// The server answered with a Connect error. For Gitea's `unknown` +
    /// `rpc error: code = X desc = …` form, `code` is the inner `X`.
    #[error("forge replied {code}: {message}")]
    Connect {
        code: Code,
        message: String,
        unwrapped_from_unknown: bool,
    },
    /// A non-2xx reply whose body is not a Connect error (reverse proxy page, load balancer).
    #[error("HTTP {status} without a Connect error body: {body_snippet}")]
    Http { status: u16, body_snippet: String },
    /// The request did not complete in time (client timeout).
    #[error("forge call timed out: {}", sources(.0))]
    Timeout(#[source] reqwest::Error),
    /// Connection refused/reset, DNS, TLS, or a broken body stream.
    #[error("forge transport error: {}", sources(.0))]
    Transport(#[source] reqwest::Error),
    /// A 200 reply whose body is not the expected protobuf message.
    #[error("cannot decode {message} reply")]
    DecodeResponse {
        message: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    /// A 200 reply carrying fields this client does not know. For FetchTask that may be tasks
    /// the forge handed out under a field number jetrunner cannot read.
    #[error(
        "{message} reply carries unknown fields {fields:?}; refusing it so no handed-out task goes unseen \
         (set forge.task_capacity = 1 if this forge's multi-task fields differ)"
    )]
    UnexpectedFields {
        message: &'static str,
        fields: Vec<u32>,
    },
    /// An authenticated RunnerService call was attempted on a client without credentials.
    #[error("no runner credentials for {method}")]
    MissingCredentials { method: &'static str },
    /// Building the HTTP client or a request failed (bad base URL, header value not ASCII).
    #[error("cannot build forge request: {}", sources(.0))]
    Build(#[source] reqwest::Error),
    /// Server side: the request's content type is not a supported Connect unary codec.
    #[error("unsupported content type {0:?}")]
    UnsupportedContentType(String),
    /// Server side: the request body is not a valid protobuf message.
    #[error("cannot decode request body")]
    DecodeRequest(#[source] prost::DecodeError),
}

/// A transport error and what lies under it (`error sending request for url (…): client
/// error (Connect): tcp connect error: Connection refused`): reqwest's own message names the
/// URL, its sources tell why, and a log needs both.
fn sources(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

impl ForgeError {
    /// The Connect code, if the error carries one (`DecodeRequest` counts as `invalid_argument`).
    pub fn code(&self) -> Option<Code> {
        match self {
            ForgeError::Connect { code, .. } => Some(*code),
            ForgeError::DecodeRequest(_) => Some(Code::InvalidArgument),
            ForgeError::Http { .. }
            | ForgeError::Timeout(_)
            | ForgeError::Transport(_)
            | ForgeError::DecodeResponse { .. }
            | ForgeError::UnexpectedFields { .. }
            | ForgeError::MissingCredentials { .. }
            | ForgeError::Build(_)
            | ForgeError::UnsupportedContentType(_) => None,
        }
    }

    /// The runner credentials are dead ("unregistered runner"): a proper `unauthenticated`, or
    /// Gitea's `unknown` wrapping `code = Unauthenticated`. A bare HTTP 401 from a proxy is not.
    pub fn is_unregistered(&self) -> bool {
        matches!(
            self,
            ForgeError::Connect {
                code: Code::Unauthenticated,
                ..
            }
        )
    }

    /// The same request may succeed later unchanged. `unknown` counts as retryable because Gitea
    /// reports its transient database failures that way; callers bound their retries.
    pub fn is_retryable(&self) -> bool {
        match self {
            ForgeError::Connect { code, .. } => matches!(
                code,
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::Internal
                    | Code::Unknown
                    | Code::Canceled
            ),
            ForgeError::Http { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            ForgeError::Timeout(_) | ForgeError::Transport(_) => true,
            ForgeError::DecodeResponse { .. }
            | ForgeError::UnexpectedFields { .. }
            | ForgeError::MissingCredentials { .. }
            | ForgeError::Build(_)
            | ForgeError::UnsupportedContentType(_)
            | ForgeError::DecodeRequest(_) => false,
        }
    }

    /// A low-cardinality label for metrics: the Connect code name, or the failure class.
    pub fn kind(&self) -> &'static str {
        match self {
            ForgeError::Connect { code, .. } => code.as_str(),
            ForgeError::Http { .. } => "http",
            ForgeError::Timeout(_) => "timeout",
            ForgeError::Transport(_) => "transport",
            ForgeError::DecodeResponse { .. } => "decode_response",
            ForgeError::UnexpectedFields { .. } => "unexpected_fields",
            ForgeError::MissingCredentials { .. } => "missing_credentials",
            ForgeError::Build(_) => "build",
            ForgeError::UnsupportedContentType(_) => "unsupported_content_type",
            ForgeError::DecodeRequest(_) => "decode_request",
        }
    }

    /// Classifies a reqwest error from sending a request or reading its body.
    pub(crate) fn from_reqwest(err: reqwest::Error) -> ForgeError {
        if err.is_timeout() {
            ForgeError::Timeout(err)
        } else if err.is_builder() {
            ForgeError::Build(err)
        } else {
            ForgeError::Transport(err)
        }
    }
}
