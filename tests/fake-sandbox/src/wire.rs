//! What the fake puts on and reads from the wire: error shapes, label rules, query strings and
//! sandbox JSON, each as the real 1.1.1 server does it.

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::{SandboxSnapshot, SandboxState};

/// `{"code","message"}`: every HTTPException of the server.
pub(crate) fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({ "code": code, "message": message.into() })),
    )
        .into_response()
}

/// FastAPI's request validation failure: 422 `{"detail":[{type, loc, msg, input, ctx?}]}`.
pub(crate) fn validation(
    kind: &str,
    loc: &[&str],
    msg: &str,
    input: Value,
    ctx: Option<Value>,
) -> Response {
    let mut item = json!({ "type": kind, "loc": loc, "msg": msg, "input": input });
    if let Some(ctx) = ctx {
        item["ctx"] = ctx;
    }
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        Json(json!({ "detail": [item] })),
    )
        .into_response()
}

pub(crate) fn with_retry_after(mut response: Response, secs: u64) -> Response {
    response
        .headers_mut()
        .insert("retry-after", HeaderValue::from(secs));
    response
}

fn is_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// `ensure_metadata_labels`: why a metadata entry is refused, if it is.
pub(crate) fn label_problem(key: &str, value: &str) -> Option<String> {
    if key.starts_with("opensandbox.io/") {
        return Some(format!(
            "metadata key {key:?} uses the reserved prefix opensandbox.io/"
        ));
    }
    let (prefix, name) = key
        .split_once('/')
        .map_or((None, key), |(p, n)| (Some(p), n));
    if prefix.is_some_and(|p| !is_dns_subdomain(p)) || !is_label_name(name) {
        return Some(format!("metadata key {key:?} is not a valid label key"));
    }
    if !value.is_empty() && !is_label_name(value) {
        return Some(format!(
            "metadata value {value:?} of {key:?} is not a valid label value"
        ));
    }
    None
}

fn hex_value(b: u8) -> Option<u8> {
    char::from(b)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

/// Form decoding of one component: `+` is a space, `%XX` a byte (malformed escapes stay).
pub(crate) fn form_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match (hex_value(bytes[i + 1]), hex_value(bytes[i + 2])) {
                    (Some(hi), Some(lo)) => {
                        out.push(hi * 16 + lo);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            other => out.push(other),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `parse_qsl(s, strict_parsing=True)`-like: every non-empty segment must hold `=`.
pub(crate) fn parse_query_strict(s: &str) -> Result<Vec<(String, String)>, String> {
    s.split('&')
        .filter(|segment| !segment.is_empty())
        .map(|segment| match segment.split_once('=') {
            Some((k, v)) => Ok((form_decode(k), form_decode(v))),
            None => Err(format!("bad query field: {segment:?}")),
        })
        .collect()
}

/// A lenient query parse for the outer query string (repeated keys kept).
pub(crate) fn parse_query(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|segment| !segment.is_empty())
        .map(|segment| {
            let (k, v) = segment.split_once('=').unwrap_or((segment, ""));
            (form_decode(k), form_decode(v))
        })
        .collect()
}

pub(crate) fn timestamp(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

/// Kubernetes `creationTimestamp` precision, as GET and list report it.
pub(crate) fn timestamp_seconds(t: OffsetDateTime) -> String {
    timestamp(t.replace_nanosecond(0).unwrap_or(t))
}

/// A `Sandbox` as GET and list show it (optional fields absent rather than null).
pub(crate) fn sandbox_json(s: &SandboxSnapshot) -> Value {
    let mut body = json!({
        "id": s.id,
        "status": {
            "state": s.state.as_str(),
            "reason": s.reason,
            "lastTransitionAt": timestamp_seconds(s.last_transition_at),
        },
        "createdAt": timestamp_seconds(s.created_at),
        "entrypoint": s.entrypoint.clone().unwrap_or_default(),
        "metadata": s.metadata,
    });
    if let Some(message) = &s.message {
        body["status"]["message"] = json!(message);
    }
    if let Some(expires_at) = s.expires_at {
        body["expiresAt"] = json!(timestamp_seconds(expires_at));
    }
    match &s.pool {
        Some(pool) => {
            body["image"] = json!({ "uri": "unknown" });
            if s.state == SandboxState::Running {
                body["allocation"] =
                    json!({ "mode": "pool", "poolRef": pool, "state": "allocated" });
            }
        }
        None => body["image"] = json!({ "uri": s.image.clone().unwrap_or_default() }),
    }
    body
}

/// A `CreateSandboxResponse`: fractional `createdAt`, no `entrypoint` unless one was given.
pub(crate) fn create_response_json(s: &SandboxSnapshot) -> Value {
    let mut body = json!({
        "id": s.id,
        "status": { "state": "Running", "reason": s.reason, "lastTransitionAt": timestamp(s.last_transition_at) },
        "createdAt": timestamp(s.created_at),
        "metadata": s.metadata,
    });
    if let Some(entrypoint) = &s.entrypoint {
        body["entrypoint"] = json!(entrypoint);
    }
    if let Some(expires_at) = s.expires_at {
        body["expiresAt"] = json!(timestamp(expires_at));
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_query_parsing_refuses_segments_without_equals() {
        assert_eq!(
            parse_query_strict("jetrunner.io%2Fworker=vm-1&a=b+c").expect("valid"),
            vec![
                ("jetrunner.io/worker".into(), "vm-1".into()),
                ("a".into(), "b c".into())
            ]
        );
        assert!(parse_query_strict("novalue").is_err());
        assert_eq!(form_decode("100%"), "100%");
        assert_eq!(form_decode("%zz%2F"), "%zz/");
    }

    #[test]
    fn labels_follow_kubernetes_rules() {
        assert_eq!(
            label_problem(
                "jetrunner.io/assignment",
                "0b7f9a0e-2f7e-4a55-9d8c-2d5e7f7e8a11"
            ),
            None
        );
        assert!(label_problem("opensandbox.io/id", "x").is_some());
        assert!(label_problem("k", "has space").is_some());
        assert!(label_problem("k", &"v".repeat(64)).is_some());
        assert_eq!(label_problem("k", ""), None);
    }
}
