//! Connect unary wire constants and helpers shared by the client and by servers speaking the
//! same protocol (the scheduler's facade, the fake forge).

use prost::Message;

use crate::code::{Code, connect_error_body};
use crate::error::ForgeError;

/// Fully qualified name of the runner service.
pub const RUNNER_SERVICE: &str = "runner.v1.RunnerService";
/// Fully qualified name of the ping service.
pub const PING_SERVICE: &str = "ping.v1.PingService";
/// Path prefix of every RPC below the instance root.
pub const API_PREFIX: &str = "/api/actions";

/// Binary protobuf codec content type.
pub const CONTENT_TYPE_PROTO: &str = "application/proto";
/// Content type of Connect error bodies.
pub const CONTENT_TYPE_JSON: &str = "application/json";

pub const HEADER_RUNNER_UUID: &str = "x-runner-uuid";
pub const HEADER_RUNNER_TOKEN: &str = "x-runner-token";
/// Forgejo: a fetch repeated with the same key returns the tasks assigned under it again.
pub const HEADER_REQUEST_KEY: &str = "x-runner-request-key";
/// Gitea's capabilities, sent with its Register and Declare replies (newer runners read them).
pub const HEADER_CAPABILITIES: &str = "x-gitea-actions-capabilities";
pub const HEADER_CONNECT_PROTOCOL_VERSION: &str = "connect-protocol-version";
pub const HEADER_CONNECT_TIMEOUT_MS: &str = "connect-timeout-ms";
pub const CONNECT_PROTOCOL_VERSION: &str = "1";

/// The server route of an RPC, e.g. `rpc_path(RUNNER_SERVICE, "FetchTask")` =
/// `/api/actions/runner.v1.RunnerService/FetchTask`.
pub fn rpc_path(service: &str, method: &str) -> String {
    format!("{API_PREFIX}/{service}/{method}")
}

/// Request codecs a server built on these helpers accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestCodec {
    /// `application/proto` (what connect-go, act_runner and this crate's client send).
    Proto,
}

impl RequestCodec {
    /// The `content-type` to answer a successful call with.
    pub fn content_type(self) -> &'static str {
        match self {
            RequestCodec::Proto => CONTENT_TYPE_PROTO,
        }
    }
}

/// Picks the codec from a request's `content-type` (parameters such as `; charset=` ignored).
/// `application/json` (protojson) is not supported and yields `UnsupportedContentType`.
pub fn request_codec(content_type: Option<&str>) -> Result<RequestCodec, ForgeError> {
    let raw = content_type.unwrap_or("");
    let essence = raw.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case(CONTENT_TYPE_PROTO) {
        Ok(RequestCodec::Proto)
    } else {
        Err(ForgeError::UnsupportedContentType(raw.to_owned()))
    }
}

/// Decodes a Connect unary request body according to its `content-type`.
pub fn decode_request<M: Message + Default>(
    content_type: Option<&str>,
    body: &[u8],
) -> Result<M, ForgeError> {
    match request_codec(content_type)? {
        RequestCodec::Proto => M::decode(body).map_err(ForgeError::DecodeRequest),
    }
}

/// Encodes a successful reply in the request's codec.
pub fn encode_response<M: Message>(codec: RequestCodec, message: &M) -> Vec<u8> {
    match codec {
        RequestCodec::Proto => message.encode_to_vec(),
    }
}

impl ForgeError {
    /// How a server should answer a caller when this error ends its request: HTTP status and a
    /// Connect JSON error body (content type [`CONTENT_TYPE_JSON`]). A forge `Connect` error is
    /// passed through unchanged (so Gitea-wrapped codes reach the caller as their inner code);
    /// transport trouble and 5xx proxy pages become `unavailable` so the caller retries.
    pub fn connect_reply(&self) -> (u16, String) {
        let (code, message) = match self {
            ForgeError::Connect { code, message, .. } => (*code, message.clone()),
            ForgeError::Http { status, .. }
                if *status >= 500 || *status == 429 || *status == 408 =>
            {
                (Code::Unavailable, self.to_string())
            }
            ForgeError::Http { .. } => (Code::Unknown, self.to_string()),
            ForgeError::Timeout(_) => (Code::DeadlineExceeded, self.to_string()),
            ForgeError::Transport(_) => (Code::Unavailable, self.to_string()),
            ForgeError::DecodeRequest(_) => (Code::InvalidArgument, self.to_string()),
            ForgeError::UnsupportedContentType(_) => {
                return (
                    415,
                    connect_error_body(Code::InvalidArgument, &self.to_string()),
                );
            }
            ForgeError::DecodeResponse { .. }
            | ForgeError::UnexpectedFields { .. }
            | ForgeError::MissingCredentials { .. }
            | ForgeError::Build(_) => (Code::Internal, self.to_string()),
        };
        (code.http_status(), connect_error_body(code, &message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::runner::v1::FetchTaskRequest;

    #[test]
    fn proto_content_type_with_parameters_is_accepted() {
        assert_eq!(
            request_codec(Some("application/proto")).ok(),
            Some(RequestCodec::Proto)
        );
        assert_eq!(
            request_codec(Some("Application/Proto; charset=utf-8")).ok(),
            Some(RequestCodec::Proto)
        );
    }

    #[test]
    fn json_and_missing_content_types_are_refused() {
        assert!(matches!(
            request_codec(Some("application/json")),
            Err(ForgeError::UnsupportedContentType(_))
        ));
        assert!(matches!(
            request_codec(None),
            Err(ForgeError::UnsupportedContentType(_))
        ));
    }

    #[test]
    fn garbage_body_is_an_invalid_argument() {
        let err = decode_request::<FetchTaskRequest>(Some(CONTENT_TYPE_PROTO), &[0xff, 0xff])
            .expect_err("garbage");
        assert_eq!(err.code(), Some(Code::InvalidArgument));
        assert_eq!(err.connect_reply().0, 400);
    }

    #[test]
    fn forge_connect_error_is_passed_through() {
        let err = ForgeError::Connect {
            code: Code::Unauthenticated,
            message: "x".into(),
            unwrapped_from_unknown: true,
        };
        let (status, body) = err.connect_reply();
        assert_eq!(status, 401);
        assert_eq!(body, connect_error_body(Code::Unauthenticated, "x"));
    }

    #[test]
    fn rpc_path_matches_the_protocol_table() {
        assert_eq!(
            rpc_path(RUNNER_SERVICE, "FetchTask"),
            "/api/actions/runner.v1.RunnerService/FetchTask"
        );
        assert_eq!(
            rpc_path(PING_SERVICE, "Ping"),
            "/api/actions/ping.v1.PingService/Ping"
        );
    }
}

/// Field numbers at the top level of an encoded protobuf message that are not in `known`
/// (each reported once). A body that is not valid protobuf yields nothing here; decoding it
/// reports that.
pub fn unknown_fields(body: &[u8], known: &[u32]) -> Vec<u32> {
    fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *bytes.get(*at)?;
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    let mut unknown = Vec::new();
    let mut at = 0;
    while at < body.len() {
        let Some(key) = varint(body, &mut at) else {
            break;
        };
        let field = u32::try_from(key >> 3).unwrap_or(u32::MAX);
        let skip = match key & 7 {
            0 => varint(body, &mut at).map(|_| 0),
            1 => Some(8),
            2 => varint(body, &mut at).and_then(|n| usize::try_from(n).ok()),
            5 => Some(4),
            _ => None,
        };
        let Some(skip) = skip else {
            break;
        };
        at = at.saturating_add(skip);
        if !known.contains(&field) && !unknown.contains(&field) {
            unknown.push(field);
        }
    }
    unknown
}

#[cfg(test)]
mod unknown_field_tests {
    use super::unknown_fields;
    use crate::proto::runner::v1::{FetchTaskResponse, Task};
    use prost::Message;

    #[test]
    fn fields_outside_the_known_set_are_reported() {
        let reply = FetchTaskResponse {
            task: Some(Task {
                id: 7,
                ..Default::default()
            }),
            tasks_version: 3,
            additional_tasks: vec![Task {
                id: 8,
                ..Default::default()
            }],
        }
        .encode_to_vec();
        assert!(unknown_fields(&reply, &[1, 2, 3]).is_empty());
        assert_eq!(unknown_fields(&reply, &[1, 2]), vec![3]);
        // A varint field 9 and a fixed64 field 10 after the known ones.
        let mut extended = reply.clone();
        extended.extend_from_slice(&[9 << 3, 0x96, 0x01, (10 << 3) | 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(unknown_fields(&extended, &[1, 2, 3]), vec![9, 10]);
    }
}
