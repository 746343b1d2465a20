//! Warm executor bindings: where a worker records which assignment attempt it bound a warm
//! executor to, and how the facade learns of it at once.
//!
//! - The KV bucket `JR_WARM_<backend>` (written only by that backend's worker) holds one key
//!   per bound warm executor: its warm id → [`WarmBinding`]. The bucket a binding is read from
//!   says which backend made it, so the facade checks the executor's token with that
//!   backend's key and hands it only that backend's assignments.
//! - After writing a binding the worker publishes an empty core NATS message on
//!   `jr.warm.<backend>.<warm id>`; a facade holding that executor's FetchTask wakes and reads
//!   the bucket. The wake-up carries no authority (the facade only reads again) and may be
//!   lost; the facade also looks again on its own.

use jr_protocol::{AssignmentId, BackendName};
use serde::{Deserialize, Serialize};

/// Bound warm executors older than this are dropped from the bucket by the server (longer
/// than any job may run).
pub const BINDING_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// `JR_WARM_<backend>`.
pub fn bucket(backend: &BackendName) -> String {
    format!("JR_WARM_{backend}")
}

/// `jr.warm.<backend>.<warm id>`: the wake-up after a binding was written.
pub fn wake_subject(backend: &BackendName, warm: AssignmentId) -> String {
    format!("jr.warm.{backend}.{warm}")
}

/// Every wake-up subject (what the facade subscribes to).
pub const WAKE_ALL: &str = "jr.warm.>";

/// The warm id named by a wake-up subject of `backend`.
pub fn parse_wake_subject(subject: &str) -> Option<(String, AssignmentId)> {
    let rest = subject.strip_prefix("jr.warm.")?;
    let (backend, warm) = rest.split_once('.')?;
    Some((backend.to_owned(), warm.parse().ok()?))
}

/// The attempt a warm executor was bound to. Fields a later version adds are ignored, so a
/// facade of this version reads a newer worker's binding during a rolling upgrade.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmBinding {
    pub assignment: AssignmentId,
    pub attempt: u32,
}

impl WarmBinding {
    pub fn encode(&self) -> Vec<u8> {
        // A struct of a UUID and an integer always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// `None` for anything that is not a binding (the facade then treats the executor as
    /// unbound and logs).
    pub fn decode(bytes: &[u8]) -> Option<WarmBinding> {
        serde_json::from_slice::<WarmBinding>(bytes)
            .ok()
            .filter(|b| b.attempt >= 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_and_wake_subjects_round_trip_and_refuse_the_rest() {
        let backend = BackendName::new("pod").expect("name");
        let warm = AssignmentId::for_task("https://forge", 7);
        let subject = wake_subject(&backend, warm);
        assert_eq!(parse_wake_subject(&subject), Some(("pod".to_owned(), warm)));
        assert_eq!(parse_wake_subject("jr.warm.pod.not-a-uuid"), None);
        assert_eq!(parse_wake_subject("jr.event.pod.x"), None);
        let binding = WarmBinding {
            assignment: AssignmentId::for_task("https://forge", 8),
            attempt: 2,
        };
        assert_eq!(WarmBinding::decode(&binding.encode()), Some(binding));
        assert_eq!(WarmBinding::decode(b"garbage"), None);
        let zero = WarmBinding {
            attempt: 0,
            ..binding
        };
        assert_eq!(WarmBinding::decode(&zero.encode()), None);
        assert_eq!(bucket(&backend), "JR_WARM_pod");
    }

    #[test]
    fn the_corpus_binding_keeps_reading_and_added_fields_are_ignored() {
        let binding = WarmBinding {
            assignment: AssignmentId::for_task("https://forge.example", 1234),
            attempt: 2,
        };
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/wire-corpus/v1/kv/warm-binding.json");
        if std::env::var_os("JR_WRITE_CORPUS").is_some() {
            std::fs::write(&path, binding.encode()).expect("write corpus file");
        }
        let stored = std::fs::read(&path).expect("corpus file");
        assert_eq!(WarmBinding::decode(&stored), Some(binding));
        let mut later: serde_json::Value = serde_json::from_slice(&stored).expect("json");
        later["added_later"] = 1.into();
        let later = serde_json::to_vec(&later).expect("json");
        assert_eq!(WarmBinding::decode(&later), Some(binding));
    }
}
