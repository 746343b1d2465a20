//! CBOR encoding of [`Envelope`]s. Decoding is two-phase: the envelope is read with the body kept
//! as a generic CBOR value, then the body is read as the type its `kind` names. Garbage of any
//! shape yields a [`DecodeError`], never a panic.

use serde::{Deserialize, Serialize};

use crate::ids::AssignmentId;
use crate::message::*;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a CBOR envelope: {0}")]
    Envelope(String),
    #[error("unsupported schema version {0}")]
    UnsupportedVersion(u32),
    #[error("unknown message kind {0:?}")]
    UnknownKind(String),
    #[error("malformed {kind} body: {reason}")]
    Body { kind: Kind, reason: String },
    /// Well-formed, but a value is outside what jetrunner accepts (a NUL in a string, a string
    /// too long, a time Postgres cannot store; see the `validate` module).
    #[error("invalid {kind}: {reason}")]
    Invalid { kind: Kind, reason: String },
}

impl DecodeError {
    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::Envelope(_) => "envelope",
            DecodeError::UnsupportedVersion(_) => "version",
            DecodeError::UnknownKind(_) => "unknown-kind",
            DecodeError::Body { .. } => "body",
            DecodeError::Invalid { .. } => "invalid",
        }
    }
}

#[derive(Serialize, Deserialize)]
struct WireEnvelope {
    schema_version: u32,
    kind: String,
    id: String,
    occurred_at: u64,
    assignment_id: AssignmentId,
    attempt: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trace: Option<TraceContext>,
    body: ciborium::Value,
}

fn to_value<T: Serialize>(body: &T) -> ciborium::Value {
    // Serializing our own plain structs into a Value cannot fail: no maps with non-string keys,
    // no custom serializers that error.
    ciborium::Value::serialized(body).unwrap_or(ciborium::Value::Null)
}

fn body_value(message: &Message) -> ciborium::Value {
    match message {
        Message::Assignment(b) => to_value(b),
        Message::WorkloadRequested(b) => to_value(b),
        Message::WorkloadCreated(b) => to_value(b),
        Message::WorkloadObserved(b) => to_value(b),
        Message::Claimed(b) => to_value(b),
        Message::Terminal(b) => to_value(b),
        Message::ExecutorFinished(b) => to_value(b),
        Message::Released(b) => to_value(b),
        Message::Redispatched(b) => to_value(b),
        Message::TaskFailed(b) => to_value(b),
        Message::DeleteWorkload(b) => to_value(b),
        Message::FailTask(b) => to_value(b),
        Message::Redispatch(b) => to_value(b),
    }
}

pub fn encode(envelope: &Envelope) -> Vec<u8> {
    let wire = WireEnvelope {
        schema_version: envelope.schema_version,
        kind: envelope.kind().as_str().to_owned(),
        id: envelope.id.clone(),
        occurred_at: envelope.occurred_at,
        assignment_id: envelope.assignment_id,
        attempt: envelope.attempt,
        trace: envelope.trace.clone(),
        body: body_value(&envelope.message),
    };
    let mut out = Vec::with_capacity(256);
    // Writing into a Vec cannot fail.
    let _ = ciborium::into_writer(&wire, &mut out);
    out
}

fn body<T: for<'de> Deserialize<'de>>(
    kind: Kind,
    value: ciborium::Value,
) -> Result<T, DecodeError> {
    value.deserialized().map_err(|e| DecodeError::Body {
        kind,
        reason: e.to_string(),
    })
}

pub fn decode(bytes: &[u8]) -> Result<Envelope, DecodeError> {
    let wire: WireEnvelope =
        ciborium::from_reader(bytes).map_err(|e| DecodeError::Envelope(e.to_string()))?;
    if !crate::SUPPORTED_SCHEMA_VERSIONS.contains(&wire.schema_version) {
        return Err(DecodeError::UnsupportedVersion(wire.schema_version));
    }
    let kind =
        Kind::parse(&wire.kind).ok_or_else(|| DecodeError::UnknownKind(wire.kind.clone()))?;
    let v = wire.body;
    let message = match kind {
        Kind::Assignment => Message::Assignment(body(kind, v)?),
        Kind::WorkloadRequested => Message::WorkloadRequested(body(kind, v)?),
        Kind::WorkloadCreated => Message::WorkloadCreated(body(kind, v)?),
        Kind::WorkloadObserved => Message::WorkloadObserved(body(kind, v)?),
        Kind::Claimed => Message::Claimed(body(kind, v)?),
        Kind::Terminal => Message::Terminal(body(kind, v)?),
        Kind::ExecutorFinished => Message::ExecutorFinished(body(kind, v)?),
        Kind::Released => Message::Released(body(kind, v)?),
        Kind::Redispatched => Message::Redispatched(body(kind, v)?),
        Kind::TaskFailed => Message::TaskFailed(body(kind, v)?),
        Kind::DeleteWorkload => Message::DeleteWorkload(body(kind, v)?),
        Kind::FailTask => Message::FailTask(body(kind, v)?),
        Kind::Redispatch => Message::Redispatch(body(kind, v)?),
    };
    let envelope = Envelope {
        schema_version: wire.schema_version,
        id: wire.id,
        occurred_at: wire.occurred_at,
        assignment_id: wire.assignment_id,
        attempt: wire.attempt,
        trace: wire.trace,
        message,
    };
    crate::validate::check(&envelope).map_err(|reason| DecodeError::Invalid { kind, reason })?;
    Ok(envelope)
}

/// A JSON rendering for people (`jr decode`). Sealed bytes are summarised, never printed.
pub fn to_json(envelope: &Envelope) -> serde_json::Value {
    let body = match &envelope.message {
        Message::Assignment(a) => {
            let mut v = serde_json::to_value(a).unwrap_or_default();
            v["sealed_task"] = serde_json::json!({
                "key_id": a.sealed_task.key_id,
                "sealed_bytes": a.sealed_task.ciphertext.len(),
            });
            v
        }
        other => {
            let value = body_value(other);
            value
                .deserialized::<serde_json::Value>()
                .unwrap_or_default()
        }
    };
    serde_json::json!({
        "schema_version": envelope.schema_version,
        "kind": envelope.kind().as_str(),
        "id": envelope.id,
        "occurred_at": envelope.occurred_at,
        "assignment_id": envelope.assignment_id.to_string(),
        "attempt": envelope.attempt,
        "trace": envelope.trace,
        "body": body,
    })
}
