//! jetrunner's wire vocabulary: the assignment, every event and command, the versioned envelope that
//! carries them, the subjects they travel on and the CBOR codec. No async and no IO live here, so
//! every service, the fakes and the `jr decode` tool share one definition of what is on the wire.

mod codec;
mod forge;
mod ids;
pub mod labels;
mod message;
mod reason;
pub mod subject;
mod token_hash;
mod validate;
mod worker_ids;

pub use codec::{DecodeError, decode, encode, to_json};
pub use forge::{ForgeKind, RunnerRegistration};
pub use ids::{AssignmentId, BackendName, InvalidName};
pub use message::*;
pub use reason::Reason;
pub use token_hash::TokenHash;
pub use validate::{
    MAX_ATTEMPT, MAX_DURATION_SECS, MAX_LABELS, MAX_NAME_BYTES, MAX_TEXT_BYTES, MAX_TIME_MS,
};
pub use worker_ids::msg_id;

/// The envelope version this build writes. Decoding accepts every version listed in
/// [`SUPPORTED_SCHEMA_VERSIONS`].
pub const SCHEMA_VERSION: u32 = 1;
pub const SUPPORTED_SCHEMA_VERSIONS: &[u32] = &[1];

/// The current time as envelopes carry it (`occurred_at`, `fetched_at`): unix milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Stream names (docs/architecture.md, "Subjects and streams").
pub const STREAM_ASSIGNMENTS: &str = "JR_ASSIGNMENTS";
pub const STREAM_EVENTS: &str = "JR_EVENTS";
pub const STREAM_COMMANDS: &str = "JR_COMMANDS";

/// Readable headers repeated on every message so the NATS CLI shows what a message is.
pub mod header {
    pub const KIND: &str = "Jr-Kind";
    pub const ASSIGNMENT: &str = "Jr-Assignment";
    pub const BACKEND: &str = "Jr-Backend";
    pub const ATTEMPT: &str = "Jr-Attempt";
    pub const CONTENT_TYPE: &str = "Content-Type";
    pub const CBOR: &str = "application/cbor";
    pub const TRACEPARENT: &str = "traceparent";
    pub const TRACESTATE: &str = "tracestate";
}
