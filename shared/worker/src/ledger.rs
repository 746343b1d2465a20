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

/// One remembered workload: the replica that remembered it (`None` for an entry written
/// before replicas named theirs), its attempt and its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) owner: Option<String>,
    pub(crate) key: AttemptKey,
    pub(crate) workload: String,
}

#[derive(Clone)]
pub(crate) struct Ledger {
    bucket: String,
    store: kv::Store,
    /// This process's replica name: what it remembers goes under it.
    me: String,
    /// Who remembered each workload this process manages but did not remember itself
    /// (adopted from an earlier process or another replica): forgetting uses that key.
    owners: std::collections::HashMap<String, Option<String>>,
}

/// `JR_WORKLOADS_<backend>`: the one name the worker's NATS permissions grant.
pub(crate) fn bucket_name(backend: &BackendName) -> String {
    jr_bus::permissions::worker_bucket(backend)
}

/// The key of the replicas' shared capacity record in the same bucket.
pub(crate) const SLOTS_KEY: &str = jr_bus::permissions::WORKER_SLOTS_KEY;

/// `<owner>.<assignment>.<attempt>.<workload>` (`<assignment>.<attempt>.<workload>` without an
/// owner); `None` for a workload name a key cannot carry.
pub(crate) fn ledger_key(owner: Option<&str>, key: AttemptKey, workload: &str) -> Option<String> {
    let valid = !workload.is_empty()
        && workload.len() <= 253
        && workload
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/'));
    let base = format!("{}.{}.{workload}", key.assignment, key.attempt);
    valid.then(|| match owner {
        Some(owner) => format!("{owner}.{base}"),
        None => base,
    })
}

pub(crate) fn parse_ledger_key(text: &str) -> Option<Entry> {
    let parts: Vec<&str> = text.split('.').collect();
    let (owner, rest) = match parts.len() {
        3 => (None, &parts[..]),
        4 => (Some(parts[0].to_owned()), &parts[1..]),
        _ => return None,
    };
    Some(Entry {
        owner,
        key: AttemptKey::new(rest[0].parse().ok()?, rest[1].parse().ok()?),
        workload: rest[2].to_owned(),
    })
}

impl Ledger {
    pub(crate) async fn open(
        bus: &Bus,
        backend: &BackendName,
        me: &str,
    ) -> Result<Self, WorkerError> {
        let bucket = bucket_name(backend);
        let error = |message: String| WorkerError::Ledger {
            bucket: bucket.clone(),
            message,
        };
        let store = bus
            .jetstream()
            .create_or_update_key_value(kv::Config {
                bucket: bucket.clone(),
                description: "workloads the worker replicas announced and have not released, and their shared capacity".into(),
                history: 1,
                num_replicas: bus.replicas(),
                ..Default::default()
            })
            .await
            .map_err(|e| error(e.to_string()))?;
        Ok(Self {
            bucket,
            store,
            me: me.to_owned(),
            owners: Default::default(),
        })
    }

    pub(crate) fn store(&self) -> &kv::Store {
        &self.store
    }

    /// Every remembered workload of every replica.
    pub(crate) async fn all(&self) -> Result<Vec<Entry>, WorkerError> {
        let error = |message: String| WorkerError::Ledger {
            bucket: self.bucket.clone(),
            message,
        };
        let mut keys = self.store.keys().await.map_err(|e| error(e.to_string()))?;
        let mut out = Vec::new();
        while let Some(key) = keys.next().await {
            let key = key.map_err(|e| error(e.to_string()))?;
            if key == SLOTS_KEY {
                continue;
            }
            match parse_ledger_key(&key) {
                Some(entry) => out.push(entry),
                None => tracing::warn!(%key, "ignoring a ledger key that is not a workload"),
            }
        }
        Ok(out)
    }

    /// Takes over entries another process remembered: forgetting them uses their keys.
    pub(crate) fn adopt(&mut self, entries: &[Entry]) {
        for e in entries {
            if e.owner.as_deref() != Some(self.me.as_str()) {
                self.owners.insert(e.workload.clone(), e.owner.clone());
            }
        }
    }

    /// The key that remembers `workload` (written by a publish lane); `None` when its name
    /// cannot be a key.
    pub(crate) fn remember_key(&self, key: AttemptKey, workload: &str) -> Option<String> {
        let name = ledger_key(Some(&self.me), key, workload);
        if name.is_none() {
            tracing::warn!(%workload, "workload name cannot be a ledger key; not remembered");
        }
        name
    }

    /// The keys that may remember `workload` (this process's, and the one it was adopted
    /// under), to be purged by a publish lane.
    pub(crate) fn forget_keys(&mut self, key: AttemptKey, workload: &str) -> Vec<String> {
        let mut owners = vec![Some(self.me.clone())];
        if let Some(other) = self.owners.remove(workload) {
            owners.push(other);
        }
        owners
            .iter()
            .filter_map(|owner| ledger_key(owner.as_deref(), key, workload))
            .collect()
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
            num_replicas: bus.replicas(),
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
        let entry = |owner: Option<&str>, workload: &str| Entry {
            owner: owner.map(str::to_owned),
            key,
            workload: workload.to_owned(),
        };
        let text = ledger_key(Some("pod-worker_0a1b2c3d"), key, "jr-abc-2").expect("valid");
        assert_eq!(
            parse_ledger_key(&text),
            Some(entry(Some("pod-worker_0a1b2c3d"), "jr-abc-2"))
        );
        // A provider's workload reference (`<provider>/<name>`), and an entry of a worker from
        // before replicas named theirs.
        let text = ledger_key(None, key, "east/jr-abc-2").expect("valid");
        assert_eq!(parse_ledger_key(&text), Some(entry(None, "east/jr-abc-2")));
        for bad in ["", "a.b", "a>", "a*", "a b"] {
            assert_eq!(ledger_key(None, key, bad), None, "{bad:?}");
        }
        assert_eq!(parse_ledger_key(SLOTS_KEY), None);
    }
}
