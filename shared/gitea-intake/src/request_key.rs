//! Forgejo's fetch request key (`x-runner-request-key`): the forge records the key with the
//! tasks it assigns, and a fetch repeated with the same key returns those tasks again (with new
//! task tokens). The key is kept in a JetStream KV bucket before the fetch and replaced only once
//! every task of the reply is durable as an assignment, so a reply lost in transit, or a
//! scheduler killed between the reply and the PubAck, is recovered by the next fetch.

use jr_bus::async_nats::jetstream::kv;

use jr_bus::Bus;

/// KV bucket holding the scheduler's small durable records.
pub const BUCKET: &str = "JR_SCHEDULER";

#[derive(Debug, thiserror::Error)]
#[error("request key store: {0}")]
pub struct KeyStoreError(String);

fn err(e: impl std::fmt::Display) -> KeyStoreError {
    KeyStoreError(e.to_string())
}

/// The current request key of one registration.
pub struct RequestKeys {
    store: kv::Store,
    key: String,
    current: Option<String>,
    /// The current key was found in the store (an earlier process's or replica's).
    reused: bool,
}

/// The scheduler's KV bucket, created when missing (request keys and fetch leases).
pub async fn open_bucket(bus: &Bus) -> Result<kv::Store, KeyStoreError> {
    bus.key_value(
        BUCKET,
        "the scheduler's leases, shared runner credentials, request keys and GitHub cursors",
        1,
    )
    .await
    .map_err(err)
}

impl RequestKeys {
    pub async fn open(bus: &Bus, registration: &str) -> Result<RequestKeys, KeyStoreError> {
        let store = open_bucket(bus).await?;
        Ok(RequestKeys {
            store,
            key: format!("request-key.{registration}"),
            current: None,
            reused: false,
        })
    }

    /// The key for the next fetch: the stored one (an earlier fetch's tasks may not be durable
    /// yet), else a new one stored before it is used.
    pub async fn current(&mut self) -> Result<String, KeyStoreError> {
        if let Some(k) = &self.current {
            return Ok(k.clone());
        }
        let stored = self.store.get(&self.key).await.map_err(err)?;
        let key = match stored.and_then(|b| String::from_utf8(b.to_vec()).ok()) {
            Some(k) if !k.is_empty() => {
                tracing::info!(key = %k, "reusing the stored fetch request key");
                self.reused = true;
                k
            }
            _ => self.fresh().await?,
        };
        self.current = Some(key.clone());
        Ok(key)
    }

    /// Every task fetched under the current key is durable: the next fetch uses a new key.
    pub async fn rotate(&mut self) -> Result<(), KeyStoreError> {
        let key = self.fresh().await?;
        self.current = Some(key);
        self.reused = false;
        Ok(())
    }

    /// Whether the current key came from the store rather than from this process. An empty
    /// reply to such a key means the forge has nothing left under it (its tasks ended while
    /// no scheduler fetched, or it never brought any): the key must then be replaced, or every
    /// later fetch would repeat it and get nothing.
    pub fn reused(&self) -> bool {
        self.reused
    }

    async fn fresh(&mut self) -> Result<String, KeyStoreError> {
        let key = uuid::Uuid::new_v4().to_string();
        self.store
            .put(&self.key, key.clone().into())
            .await
            .map_err(err)?;
        Ok(key)
    }
}
