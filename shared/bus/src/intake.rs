//! What each intake (a forge registration of the scheduler) is doing, for operators: the
//! scheduler's fetching replica writes one record per registration into the KV bucket
//! `JR_INTAKES` (key: the registration's name) when it changes (at most once a second) and every
//! [`REFRESH_EVERY`]; the reconciler's status API and `jr status` read it. The record says
//! which labels the registration declares to the forge, whether it fetches, and for each
//! backend it serves why nothing is fetched for it, if nothing is.
//!
//! The bucket holds nothing secret (names, labels, counts). Fields a later version adds are
//! ignored by this one, so readers and writers of two releases side by side understand each
//! other.

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};

use crate::{Bus, BusError};

/// `JR_INTAKES`: written by the scheduler, read by the reconciler and operators.
pub const BUCKET: &str = "JR_INTAKES";

/// How often the fetching replica rewrites an unchanged record, so a reader can tell a live
/// record (`updated_at_ms` recent) from one a stopped scheduler left behind.
pub const REFRESH_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a registration takes no work for a backend now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Blocked {
    /// Its lookahead is used up: `lookahead` assignments already wait for a free slot.
    Full,
    /// No worker replica of the backend renews its capacity holding (stopped, crashed, not
    /// deployed), past a short grace.
    NoWorker,
    /// NATS did not answer the questions above (the backend's state is unknown).
    Unreachable,
}

impl Blocked {
    /// The metric label and the word in logs and on the status page.
    pub fn as_str(self) -> &'static str {
        match self {
            Blocked::Full => "full",
            Blocked::NoWorker => "no-worker",
            Blocked::Unreachable => "unreachable",
        }
    }

    /// Every reason, for metrics that export each one.
    pub const ALL: [Blocked; 3] = [Blocked::Full, Blocked::NoWorker, Blocked::Unreachable];

    /// What an operator reads.
    pub fn explain(self) -> &'static str {
        match self {
            Blocked::Full => {
                "full: its lookahead of assignments already waits for a free slot; jobs stay at the forge"
            }
            Blocked::NoWorker => {
                "no live worker: no replica renews the backend's capacity holding; jobs stay at the forge until one runs"
            }
            Blocked::Unreachable => {
                "unknown: NATS did not answer for the backend's consumer or capacity record"
            }
        }
    }
}

/// One backend as a registration sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendIntake {
    pub backend: String,
    /// `None`: work for it is taken. Otherwise why not.
    pub blocked: Option<Blocked>,
    /// Room for new tasks (lookahead minus assignments waiting), when known.
    pub room: Option<u64>,
    /// Assignments waiting for its worker (the worker consumer's pending count), when known.
    pub waiting: Option<u64>,
    /// Whether its labels are declared to the forge now (always true for a registration of
    /// its own).
    pub declared: bool,
    /// Since when (ms since the epoch) `blocked` has its current value.
    pub since_ms: u64,
}

/// One registration's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntakeStatus {
    /// `shared`, or the backend's name for a registration of its own; `github.<name>` for a
    /// GitHub scale set.
    pub registration: String,
    /// `gitea`, `forgejo` or `github`.
    pub forge: String,
    /// `shared` or `per-backend` (Gitea, Forgejo), `scale-set` (GitHub).
    pub layout: String,
    /// The labels the registration's runner declares to the forge now.
    pub declared_labels: Vec<String>,
    /// Whether the registration takes tasks now (some backend it serves has room).
    pub fetching: bool,
    pub backends: Vec<BackendIntake>,
    /// The scheduler replica that wrote it (the one holding the registration's lease).
    pub replica: String,
    pub updated_at_ms: u64,
    /// Why the intake does not work now (its forge unreachable, refusing the runner, a scale
    /// set that cannot be made), with the whole error chain; absent while it works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl IntakeStatus {
    pub fn encode(&self) -> Vec<u8> {
        // Strings, integers and enums always serialise.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Option<IntakeStatus> {
        serde_json::from_slice(bytes).ok()
    }
}

fn error(e: impl std::error::Error + Send + Sync + 'static) -> BusError {
    BusError::KeyValue {
        bucket: BUCKET.to_owned(),
        source: Box::new(e),
    }
}

/// The bucket, created when missing (by the scheduler; readers only open it).
pub async fn open_or_create(bus: &Bus) -> Result<kv::Store, BusError> {
    bus.key_value(
        BUCKET,
        "what each intake of the scheduler fetches, and why not",
        1,
    )
    .await
}

/// The records of `registrations` that exist and can be read; a missing bucket (no scheduler
/// ran yet) reads as none.
pub async fn read(bus: &Bus, registrations: &[String]) -> Result<Vec<IntakeStatus>, BusError> {
    // Only a bucket that does not exist reads as "no records"; NATS not answering is an error.
    use async_nats::jetstream::context::GetStreamErrorKind;
    match bus.jetstream().get_stream(format!("KV_{BUCKET}")).await {
        Ok(_) => {}
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j)
                if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                return Ok(Vec::new());
            }
            _ => return Err(error(e)),
        },
    }
    let store = bus.jetstream().get_key_value(BUCKET).await.map_err(error)?;
    let mut records = Vec::new();
    for name in registrations {
        if let Some(bytes) = store.get(name).await.map_err(error)? {
            match IntakeStatus::decode(&bytes) {
                Some(record) => records.push(record),
                None => tracing::warn!(
                    registration = %name,
                    "the intake record is not readable (written by an incompatible scheduler?)"
                ),
            }
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_added_fields_are_ignored() {
        let record = IntakeStatus {
            registration: "shared".to_owned(),
            forge: "gitea".to_owned(),
            layout: "shared".to_owned(),
            declared_labels: vec!["vm".to_owned()],
            fetching: true,
            backends: vec![BackendIntake {
                backend: "pod".to_owned(),
                blocked: Some(Blocked::NoWorker),
                room: Some(0),
                waiting: Some(2),
                declared: false,
                since_ms: 5,
            }],
            replica: "scheduler_1".to_owned(),
            updated_at_ms: 9,
            error: None,
        };
        assert_eq!(IntakeStatus::decode(&record.encode()), Some(record.clone()));
        let mut later: serde_json::Value = serde_json::from_slice(&record.encode()).expect("json");
        later["added_later"] = 1.into();
        assert_eq!(
            IntakeStatus::decode(&serde_json::to_vec(&later).expect("json")),
            Some(record)
        );
        assert!(later.to_string().contains("\"no-worker\""));
        assert_eq!(IntakeStatus::decode(b"nonsense"), None);
    }

    #[test]
    fn the_corpus_record_keeps_reading() {
        let record = IntakeStatus {
            registration: "shared".to_owned(),
            forge: "forgejo".to_owned(),
            layout: "shared".to_owned(),
            declared_labels: vec!["self-hosted".to_owned(), "vm".to_owned()],
            fetching: false,
            backends: vec![
                BackendIntake {
                    backend: "pod".to_owned(),
                    blocked: Some(Blocked::NoWorker),
                    room: None,
                    waiting: Some(3),
                    declared: false,
                    since_ms: 1_700_000_000_000,
                },
                BackendIntake {
                    backend: "vm".to_owned(),
                    blocked: Some(Blocked::Full),
                    room: Some(0),
                    waiting: Some(2),
                    declared: true,
                    since_ms: 1_700_000_001_000,
                },
            ],
            replica: "scheduler-7f9c_1a2b".to_owned(),
            updated_at_ms: 1_700_000_002_000,
            error: None,
        };
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/wire-corpus/v1/kv/intake-status.json");
        if std::env::var_os("JR_WRITE_CORPUS").is_some() {
            std::fs::write(&path, record.encode()).expect("write corpus file");
        }
        let stored = std::fs::read(&path).expect("corpus file");
        assert_eq!(IntakeStatus::decode(&stored), Some(record));
    }
}
