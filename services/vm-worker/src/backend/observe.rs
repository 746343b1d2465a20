//! Observation by polling (the API has no watch): one paged list of all our sandboxes per cycle,
//! a GET only for tracked sandboxes missing from it (normally the ones just deleted, which end in
//! 404), renewal of expiries for long jobs, and back-off while the server fails.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use jr_protocol::{Reason, WorkloadPhase};
use jr_worker::ObservedWorkload;
use time::OffsetDateTime;
use tokio::sync::mpsc;

use super::{Tracked, VmBackend, deadline, ownership, phase_of};
use crate::opensandbox::{Sandbox, SandboxError, SandboxState};

/// The receiver is gone: nobody needs observations any more.
struct Closed;

pub(super) async fn run(
    backend: &VmBackend,
    tx: mpsc::Sender<ObservedWorkload>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let mut poller = Poller {
        backend,
        failures: 0,
    };
    tokio::pin!(shutdown);
    loop {
        let interval = tokio::select! {
            () = &mut shutdown => return,
            result = poller.poll_once(&tx) => match result {
                Ok(interval) => interval,
                Err(Closed) => return,
            },
        };
        tokio::select! {
            () = &mut shutdown => return,
            () = backend.inner.wake.notified() => {}
            () = tokio::time::sleep(interval) => {}
        }
    }
}

struct Poller<'a> {
    backend: &'a VmBackend,
    failures: u32,
}

impl Poller<'_> {
    /// One cycle; returns how long to wait before the next.
    async fn poll_once(&mut self, tx: &mpsc::Sender<ObservedWorkload>) -> Result<Duration, Closed> {
        let inner = &self.backend.inner;
        let poll = &inner.config.poll;
        let sandboxes = match self.backend.list_owned().await {
            Ok(sandboxes) => sandboxes,
            Err(error) => {
                self.failures = self.failures.saturating_add(1);
                tracing::warn!(%error, failures = self.failures, "polling sandboxes failed");
                if self.failures >= poll.unreachable_after {
                    send_all(tx, self.report_unreachable()).await?;
                }
                let factor = 2u32.saturating_pow(self.failures.min(16));
                return Ok(poll.active.saturating_mul(factor).min(poll.max_backoff));
            }
        };
        self.failures = 0;

        let now = OffsetDateTime::now_utc();
        let mut observations = Vec::new();
        let mut renewals = Vec::new();
        let listed: HashSet<String> = sandboxes.iter().map(|s| s.id.clone()).collect();
        let missing: Vec<String> = {
            let mut tracked = self.backend.tracked();
            for sandbox in &sandboxes {
                if let Some(observed) = record(&mut tracked, sandbox) {
                    observations.push(observed);
                }
                if let Some(target) =
                    renewal_due(&tracked, sandbox, now, poll.renew_ahead, poll.renew_every)
                {
                    renewals.push((sandbox.id.clone(), target));
                }
            }
            tracked
                .keys()
                .filter(|id| !listed.contains(*id))
                .cloned()
                .collect()
        };

        // Not in the list: gone (404), or the list lags behind a fresh create.
        for id in missing {
            match inner.client.get(&id).await {
                Ok(sandbox) => {
                    if let Some(observed) = record(&mut self.backend.tracked(), &sandbox) {
                        observations.push(observed);
                    }
                }
                Err(SandboxError::NotFound { .. }) => {
                    if let Some(gone) = self.backend.tracked().remove(&id) {
                        observations.push(gone.observed(&id, WorkloadPhase::Gone, None));
                    }
                }
                Err(error) => tracing::warn!(sandbox = %id, %error, "getting a sandbox failed"),
            }
        }

        for (id, target) in renewals {
            match inner.client.renew_expiration(&id, target).await {
                Ok(expires_at) => {
                    tracing::info!(sandbox = %id, %expires_at, "sandbox expiry renewed")
                }
                Err(error) => {
                    tracing::warn!(sandbox = %id, %error, "renewing a sandbox expiry failed")
                }
            }
            if let Some(entry) = self.backend.tracked().get_mut(&id) {
                entry.last_renew = Some(Instant::now());
            }
        }

        send_all(tx, observations).await?;
        let settling = self.backend.tracked().values().any(|t| {
            !matches!(
                t.last,
                Some(WorkloadPhase::Running | WorkloadPhase::Failed | WorkloadPhase::Succeeded)
            )
        });
        Ok(if settling { poll.active } else { poll.steady })
    }

    /// Reports every tracked sandbox once as `Unknown`/`backend-unreachable`; the next successful
    /// poll reports its real phase again.
    fn report_unreachable(&self) -> Vec<ObservedWorkload> {
        let mut tracked = self.backend.tracked();
        tracked
            .iter_mut()
            .filter(|(_, t)| !t.unreachable_reported)
            .map(|(id, t)| {
                t.unreachable_reported = true;
                t.last = Some(WorkloadPhase::Unknown);
                t.observed(
                    id,
                    WorkloadPhase::Unknown,
                    Some(Reason::BackendUnreachable.to_string()),
                )
            })
            .collect()
    }
}

/// Updates the tracked entry of `sandbox` (tracking it if new); returns an observation on change.
fn record(tracked: &mut HashMap<String, Tracked>, sandbox: &Sandbox) -> Option<ObservedWorkload> {
    let (assignment_id, attempt) = ownership(sandbox)?;
    let (phase, reason) = phase_of(&sandbox.status);
    let entry = tracked
        .entry(sandbox.id.clone())
        .or_insert_with(|| Tracked::new(assignment_id, attempt));
    entry
        .update(phase)
        .then(|| entry.observed(&sandbox.id, phase, reason))
}

/// The expiry to ask for when the sandbox would expire before its deadline soon.
fn renewal_due(
    tracked: &HashMap<String, Tracked>,
    sandbox: &Sandbox,
    now: OffsetDateTime,
    renew_ahead: Duration,
    renew_every: Duration,
) -> Option<OffsetDateTime> {
    let expires_at = sandbox.expires_at?;
    let deadline = OffsetDateTime::from_unix_timestamp(deadline(sandbox)?).ok()?;
    let live =
        !sandbox.status.state.is_terminal() && sandbox.status.state != SandboxState::Stopping;
    let entry = tracked.get(&sandbox.id)?;
    let recently = entry
        .last_renew
        .is_some_and(|at| at.elapsed() < renew_every);
    let short = expires_at + time::Duration::seconds(5) < deadline;
    (live && short && !recently && expires_at - now < renew_ahead).then_some(deadline)
}

async fn send_all(
    tx: &mpsc::Sender<ObservedWorkload>,
    observations: Vec<ObservedWorkload>,
) -> Result<(), Closed> {
    for observed in observations {
        tracing::debug!(sandbox = %observed.workload, phase = ?observed.phase, "sandbox phase changed");
        tx.send(observed).await.map_err(|_| Closed)?;
    }
    Ok(())
}
