//! A leader lease kept in a JetStream KV key, on the pure rules of `jr-lease`: the keeper reads
//! the key, asks [`jr_lease::next_lease_step`] what to write and writes with compare-and-set on
//! the revision it read, so of two replicas writing at once one fails and reads again.
//!
//! A replica acts only while [`Leadership::acting`] says so: until the acting deadline of its
//! last successful write (its own clock), which ends before any other replica may take over. The
//! deadline is checked against the clock at every call, so a keeper that stalls (a paused
//! process, a bus that stopped answering) makes its replica stop acting by itself.
//!
//! The value is JSON (`{"holder":…,"renewed_at":…,"ttl_ms":…,"term":…}`), readable with
//! `nats kv get <bucket> <key>`. A replica that stops cleanly writes its lease as expired, so a
//! standby takes over at its next look instead of after the TTL.

use std::time::Duration;

use async_nats::jetstream::kv;
use jr_lease::{Lease, LeaseStep, Policy, next_lease_step};
use jr_protocol::now_ms;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What a replica holds: the lease's term and until when (its own clock, unix ms) it may act.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub term: u64,
    pub acting_until: u64,
}

/// A replica's view of one lease, updated by [`keep_lease`].
#[derive(Clone, Debug)]
pub struct Leadership {
    rx: watch::Receiver<Option<Held>>,
}

impl Leadership {
    /// A leadership that always acts (a single replica configured without a lease, and tests).
    pub fn always() -> Self {
        let (_tx, rx) = watch::channel(Some(Held {
            term: 0,
            acting_until: u64::MAX,
        }));
        Self { rx }
    }

    /// The term this replica acts under now, or `None` when it must not act.
    pub fn acting(&self) -> Option<u64> {
        let held = (*self.rx.borrow())?;
        (now_ms() < held.acting_until).then_some(held.term)
    }

    /// How long this replica may still act (zero when it may not).
    pub fn remaining(&self) -> Duration {
        match *self.rx.borrow() {
            Some(held) => Duration::from_millis(held.acting_until.saturating_sub(now_ms())),
            None => Duration::ZERO,
        }
    }

    /// Waits until this replica acts; `None` when `shutdown` comes first or the keeper ended.
    pub async fn until_acting(&mut self, shutdown: &CancellationToken) -> Option<u64> {
        loop {
            if let Some(term) = self.acting() {
                return Some(term);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                changed = self.rx.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
            }
        }
    }

    /// Resolves when this replica stops acting: the keeper lost or gave up the lease, or the
    /// acting deadline passed without a renewal.
    pub async fn lost(&mut self) {
        loop {
            let Some(held) = *self.rx.borrow_and_update() else {
                return;
            };
            let left = held.acting_until.saturating_sub(now_ms());
            if left == 0 {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(left)) => {}
                changed = self.rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// Where a lease lives and who this replica is.
#[derive(Clone, Debug)]
pub struct LeaseSpec {
    pub store: kv::Store,
    pub key: String,
    /// Unique per running replica (e.g. the host name and a random suffix).
    pub me: String,
    pub policy: Policy,
}

/// A replica identity: `<host name>-<random>` (the host name is the Pod's name in Kubernetes).
pub fn replica_id(service: &str) -> String {
    use rand::Rng as _;
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| service.to_owned());
    let suffix: u32 = rand::rng().random();
    format!("{host}-{suffix:08x}")
}

/// Starts keeping `spec`'s lease in a task until `shutdown`; the returned view follows it.
pub fn spawn_lease(spec: LeaseSpec, shutdown: CancellationToken) -> Leadership {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(keep_lease(spec, tx, shutdown));
    Leadership { rx }
}

/// How often a replica that waits for the lease looks at it (a clean hand-over is seen this
/// quickly; a dead holder's lease is taken over when it becomes free).
fn look_interval(policy: &Policy) -> Duration {
    Duration::from_millis((policy.ttl_ms / 6).clamp(50, 1000))
}

/// The key's lease and revision; a deleted, purged or unreadable value counts as a free lease
/// at that revision.
async fn read(spec: &LeaseSpec) -> Result<Option<(Lease, u64)>, String> {
    let entry = spec
        .store
        .entry(spec.key.clone())
        .await
        .map_err(|e| e.to_string())?;
    let Some(entry) = entry else {
        return Ok(None);
    };
    let free = Lease {
        holder: String::new(),
        renewed_at: 0,
        ttl_ms: 0,
        term: 0,
    };
    if entry.operation != kv::Operation::Put {
        return Ok(Some((free, entry.revision)));
    }
    match serde_json::from_slice::<Lease>(&entry.value) {
        Ok(lease) => Ok(Some((lease, entry.revision))),
        Err(e) => {
            tracing::warn!(key = %spec.key, error = %e, "lease value unreadable; treating it as free");
            Ok(Some((free, entry.revision)))
        }
    }
}

async fn write(spec: &LeaseSpec, lease: &Lease, revision: Option<u64>) -> Result<u64, String> {
    let value = serde_json::to_vec(lease).map_err(|e| e.to_string())?;
    match revision {
        None => spec
            .store
            .create(spec.key.clone(), value.into())
            .await
            .map_err(|e| e.to_string()),
        Some(r) => spec
            .store
            .update(spec.key.clone(), value.into(), r)
            .await
            .map_err(|e| e.to_string()),
    }
}

/// Keeps the lease until `shutdown`, publishing what this replica holds on `tx`.
pub async fn keep_lease(
    spec: LeaseSpec,
    tx: watch::Sender<Option<Held>>,
    shutdown: CancellationToken,
) {
    let policy = spec.policy;
    let look = look_interval(&policy);
    // The revision of this replica's last successful write, to give the lease up cleanly.
    let mut mine: Option<(Lease, u64)> = None;
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        let now = now_ms();
        let wait = match read(&spec).await {
            Err(e) => {
                tracing::warn!(key = %spec.key, error = %e, "cannot read the lease");
                look
            }
            Ok(current) => match next_lease_step(
                &spec.me,
                now,
                current.as_ref().map(|(l, r)| (l, *r)),
                &policy,
            ) {
                LeaseStep::Write { lease, revision } => {
                    match write(&spec, &lease, revision).await {
                        Ok(written) => {
                            let held = Held {
                                term: lease.term,
                                acting_until: lease.acting_until(&policy),
                            };
                            let was = *tx.borrow();
                            if was.map(|h| h.term) != Some(held.term) {
                                tracing::info!(key = %spec.key, me = %spec.me, term = held.term, "holding the lease");
                            }
                            tx.send_replace(Some(held));
                            let renew = policy.renew_at(lease.renewed_at);
                            mine = Some((lease, written));
                            Duration::from_millis(renew.saturating_sub(now_ms()))
                        }
                        Err(e) => {
                            // Someone else wrote first, or the bus failed: read again soon. What
                            // this replica held stays valid until its own deadline.
                            tracing::debug!(key = %spec.key, error = %e, "lease write refused");
                            Duration::from_millis(50)
                        }
                    }
                }
                LeaseStep::Hold { renew_at } => Duration::from_millis(renew_at.saturating_sub(now)),
                LeaseStep::Wait { holder, retry_at } => {
                    if tx.borrow().is_some() {
                        tracing::warn!(key = %spec.key, me = %spec.me, %holder, "lost the lease");
                    }
                    tx.send_replace(None);
                    mine = None;
                    look.min(Duration::from_millis(retry_at.saturating_sub(now)))
                }
            },
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait.max(Duration::from_millis(1))) => {}
        }
    }
    tx.send_replace(None);
    // Give the lease up: an expired value at the revision this replica wrote (a write by anyone
    // since then makes this fail, which is right: the lease is no longer ours).
    if let Some((lease, revision)) = mine {
        let expired = Lease {
            renewed_at: 0,
            ttl_ms: 0,
            ..lease
        };
        match write(&spec, &expired, Some(revision)).await {
            Ok(_) => tracing::info!(key = %spec.key, me = %spec.me, "gave the lease up"),
            Err(e) => tracing::debug!(key = %spec.key, error = %e, "lease not given up"),
        }
    }
}
