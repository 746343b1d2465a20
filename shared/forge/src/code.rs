//! Connect error codes and the Connect unary error body (`{"code","message"}`).

use std::fmt;

/// Every Connect error code (the gRPC codes minus `ok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// All codes, in gRPC numeric order.
    pub const ALL: [Code; 16] = [
        Code::Canceled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The snake_case name used in the Connect JSON error body.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The CamelCase name Go's gRPC `codes.Code.String()` prints, as found in Gitea's
    /// `rpc error: code = <Name> desc = …` messages.
    pub fn grpc_name(self) -> &'static str {
        match self {
            Code::Canceled => "Canceled",
            Code::Unknown => "Unknown",
            Code::InvalidArgument => "InvalidArgument",
            Code::DeadlineExceeded => "DeadlineExceeded",
            Code::NotFound => "NotFound",
            Code::AlreadyExists => "AlreadyExists",
            Code::PermissionDenied => "PermissionDenied",
            Code::ResourceExhausted => "ResourceExhausted",
            Code::FailedPrecondition => "FailedPrecondition",
            Code::Aborted => "Aborted",
            Code::OutOfRange => "OutOfRange",
            Code::Unimplemented => "Unimplemented",
            Code::Internal => "Internal",
            Code::Unavailable => "Unavailable",
            Code::DataLoss => "DataLoss",
            Code::Unauthenticated => "Unauthenticated",
        }
    }

    /// Parses the snake_case Connect name (`"unauthenticated"`).
    pub fn parse(name: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// Parses the gRPC CamelCase name (`"Unauthenticated"`).
    pub fn parse_grpc_name(name: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.grpc_name() == name)
    }

    /// HTTP status for this code per the current Connect spec (newer connect-go).
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown => 500,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 400,
            Code::Aborted => 409,
            Code::OutOfRange => 400,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::DataLoss => 500,
            Code::Unauthenticated => 401,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The JSON body of a Connect unary error: `{"code":"<code>","message":"<message>"}`.
pub fn connect_error_body(code: Code, message: &str) -> String {
    serde_json::json!({ "code": code.as_str(), "message": message }).to_string()
}

/// The message Gitea produces when a handler returns a gRPC status error that connect-go then wraps
/// as `unknown`: `rpc error: code = <Name> desc = <desc>`. For fake forges in "Gitea legacy" mode.
pub fn gitea_legacy_message(code: Code, desc: &str) -> String {
    format!("rpc error: code = {} desc = {desc}", code.grpc_name())
}

/// A decoded Connect error body, with Gitea's wrapped gRPC status already unwrapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectStatus {
    /// The effective code: the inner gRPC code for Gitea's `unknown` + `rpc error: …` form.
    pub code: Code,
    /// The message as sent by the server (not shortened to the `desc` part).
    pub message: String,
    /// True if `code` was taken from an `rpc error: code = X desc = …` message inside `unknown`.
    pub unwrapped_from_unknown: bool,
}

#[derive(serde::Deserialize)]
struct WireError {
    code: String,
    #[serde(default)]
    message: String,
}

/// Decodes a Connect error body. `None` when the body is not a Connect error (not JSON, no known
/// `code`), e.g. an HTML page from a reverse proxy.
pub fn parse_connect_error(body: &[u8]) -> Option<ConnectStatus> {
    let wire: WireError = serde_json::from_slice(body).ok()?;
    let code = Code::parse(&wire.code)?;
    if code == Code::Unknown
        && let Some(inner) = grpc_code_in_message(&wire.message)
    {
        return Some(ConnectStatus {
            code: inner,
            message: wire.message,
            unwrapped_from_unknown: true,
        });
    }
    Some(ConnectStatus {
        code,
        message: wire.message,
        unwrapped_from_unknown: false,
    })
}

/// Finds `rpc error: code = <Name> desc = ` anywhere in `message` (Gitea sometimes prefixes it,
/// e.g. `pick task: rpc error: …`) and returns the named code.
fn grpc_code_in_message(message: &str) -> Option<Code> {
    const MARKER: &str = "rpc error: code = ";
    let start = message.find(MARKER)? + MARKER.len();
    let rest = &message[start..];
    let name = rest.split_once(" desc = ").map_or(rest, |(name, _)| name);
    Code::parse_grpc_name(name.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_both_names() {
        for code in Code::ALL {
            assert_eq!(Code::parse(code.as_str()), Some(code));
            assert_eq!(Code::parse_grpc_name(code.grpc_name()), Some(code));
        }
        assert_eq!(Code::parse("ok"), None);
    }

    #[test]
    fn gitea_wrapped_unauthenticated_is_unwrapped_and_keeps_message() {
        let body = connect_error_body(
            Code::Unknown,
            "rpc error: code = Unauthenticated desc = unregistered runner",
        );
        let status = parse_connect_error(body.as_bytes()).expect("connect body");
        assert_eq!(status.code, Code::Unauthenticated);
        assert!(status.unwrapped_from_unknown);
        assert_eq!(
            status.message,
            "rpc error: code = Unauthenticated desc = unregistered runner"
        );
    }

    #[test]
    fn prefixed_gitea_message_is_unwrapped() {
        let body = connect_error_body(
            Code::Unknown,
            "update log: rpc error: code = AlreadyExists desc = log file has been archived",
        );
        let status = parse_connect_error(body.as_bytes()).expect("connect body");
        assert_eq!(status.code, Code::AlreadyExists);
    }

    #[test]
    fn plain_unknown_stays_unknown() {
        let body = connect_error_body(Code::Unknown, "update task: resource does not exist");
        let status = parse_connect_error(body.as_bytes()).expect("connect body");
        assert_eq!(status.code, Code::Unknown);
        assert!(!status.unwrapped_from_unknown);
    }

    #[test]
    fn legacy_message_helper_produces_what_the_parser_unwraps() {
        let msg = gitea_legacy_message(Code::PermissionDenied, "nope");
        let status = parse_connect_error(connect_error_body(Code::Unknown, &msg).as_bytes())
            .expect("connect body");
        assert_eq!(status.code, Code::PermissionDenied);
    }

    #[test]
    fn non_connect_bodies_are_rejected() {
        assert_eq!(
            parse_connect_error(b"<html>401 Authorization Required</html>"),
            None
        );
        assert_eq!(parse_connect_error(br#"{"error":"nope"}"#), None);
        assert_eq!(
            parse_connect_error(br#"{"code":"teapot","message":"x"}"#),
            None
        );
    }
}
