//! The worker's own ledger: a JetStream key-value bucket holding one key per workload the
//! worker announced (`workload-created`, or adopted and reported) and has not released yet.
//! After a restart, a workload in the ledger that the backend no longer lists vanished while
//! the worker was down and is reported released, so nothing waits for it forever.

use futures::StreamExt as _;
use jr_bus::Bus;
use jr_bus::async_nats::jetstream::kv;
use jr_protocol::BackendName;

use crate::error::WorkerError;
use crate::state::AttemptKey;

#[derive(Clone)]
pub(crate) struct Ledger {
    bucket: String,
    store: kv::Store,
}

/// `JR_WORKLOADS_<backend>`: the one name the worker's NATS permissions grant.
pub(crate) fn bucket_name(backend: &BackendName) -> String {
    jr_bus::permissions::worker_bucket(backend)
}

/// `<assignment>.<attempt>.<workload>`; `None` for a workload name a key cannot carry.
pub(crate) fn ledger_key(key: AttemptKey, workload: &str) -> Option<String> {
    let valid = !workload.is_empty()
        && workload.len() <= 253
        && workload
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/'));
    valid.then(|| format!("{}.{}.{workload}", key.assignment, key.attempt))
}

pub(crate) fn parse_ledger_key(text: &str) -> Option<(AttemptKey, String)> {
    let mut parts = text.splitn(3, '.');
    let assignment = parts.next()?.parse().ok()?;
    let attempt = parts.next()?.parse().ok()?;
    let workload = parts.next()?.to_owned();
    Some((AttemptKey::new(assignment, attempt), workload))
}

impl Ledger {
    pub(crate) async fn open(bus: &Bus, backend: &BackendName) -> Result<Self, WorkerError> {
        let bucket = bucket_name(backend);
        let error = |message: String| WorkerError::Ledger {
            bucket: bucket.clone(),
            message,
        };
        let store = bus
            .jetstream()
            .create_or_update_key_value(kv::Config {
                bucket: bucket.clone(),
                description: "workloads this worker announced and has not released".into(),
                history: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| error(e.to_string()))?;
        Ok(Self { bucket, store })
    }

    /// Every remembered workload.
    pub(crate) async fn all(&self) -> Result<Vec<(AttemptKey, String)>, WorkerError> {
        let error = |message: String| WorkerError::Ledger {
            bucket: self.bucket.clone(),
            message,
        };
        let mut keys = self.store.keys().await.map_err(|e| error(e.to_string()))?;
        let mut out = Vec::new();
        while let Some(key) = keys.next().await {
            let key = key.map_err(|e| error(e.to_string()))?;
            match parse_ledger_key(&key) {
                Some(entry) => out.push(entry),
                None => tracing::warn!(%key, "ignoring a ledger key that is not a workload"),
            }
        }
        Ok(out)
    }

    pub(crate) async fn remember(&self, key: AttemptKey, workload: &str) {
        let Some(name) = ledger_key(key, workload) else {
            tracing::warn!(%workload, "workload name cannot be a ledger key; not remembered");
            return;
        };
        if let Err(error) = self.store.put(&name, Default::default()).await {
            tracing::warn!(%name, %error, "could not remember an announced workload");
        }
    }

    pub(crate) async fn forget(&self, key: AttemptKey, workload: &str) {
        let Some(name) = ledger_key(key, workload) else {
            return;
        };
        if let Err(error) = self.store.purge(&name).await {
            tracing::warn!(%name, %error, "could not forget a released workload");
        }
    }
}

/// Opens (creating if missing) `JR_WARM_<backend>`, where bindings of warm executors are
/// recorded for the facade.
pub(crate) async fn open_warm_bindings(
    bus: &Bus,
    backend: &BackendName,
) -> Result<kv::Store, WorkerError> {
    let bucket = jr_bus::warm::bucket(backend);
    bus.jetstream()
        .create_or_update_key_value(kv::Config {
            bucket: bucket.clone(),
            description: "warm executors' bindings to assignment attempts (read by the facade)"
                .into(),
            history: 1,
            max_age: jr_bus::warm::BINDING_MAX_AGE,
            ..Default::default()
        })
        .await
        .map_err(|e| WorkerError::Ledger {
            bucket,
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use jr_protocol::AssignmentId;

    #[test]
    fn ledger_keys_round_trip_and_refuse_unsafe_names() {
        let key = AttemptKey::new(AssignmentId::for_task("https://f", 1), 2);
        let text = ledger_key(key, "jr-abc-2").expect("valid");
        assert_eq!(parse_ledger_key(&text), Some((key, "jr-abc-2".to_owned())));
        // A provider's workload reference (`<provider>/<name>`).
        let text = ledger_key(key, "east/jr-abc-2").expect("valid");
        assert_eq!(
            parse_ledger_key(&text),
            Some((key, "east/jr-abc-2".to_owned()))
        );
        for bad in ["", "a.b", "a>", "a*", "a b"] {
            assert_eq!(ledger_key(key, bad), None, "{bad:?}");
        }
    }
}
