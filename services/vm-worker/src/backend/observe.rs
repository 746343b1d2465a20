//! Observation by polling (the API has no watch): one paged list of all our sandboxes per cycle,
//! a GET only for tracked sandboxes missing from it (normally the ones just deleted, which end in
//! 404), renewal of expiries for long jobs, and back-off while the server fails.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use jr_protocol::{Reason, WorkloadPhase};
use jr_worker::ObservedWorkload;
use time::OffsetDateTime;
use tokio::sync::mpsc;

use super::{PollConfig, Tracked, VmBackend, deadline, ownership, phase_of};
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
        let started = tokio::time::Instant::now();
        let interval = tokio::select! {
            () = &mut shutdown => return,
            result = poller.poll_once(&tx) => match result {
                Ok(interval) => interval,
                Err(Closed) => return,
            },
        };
        let woken = tokio::select! {
            () = &mut shutdown => return,
            () = backend.inner.wake.notified() => true,
            () = tokio::time::sleep(interval) => false,
        };
        // Wakes that arrive within the gap are served by one poll at its end.
        let earliest = started + backend.inner.config.poll.woken_gap;
        if woken && tokio::time::Instant::now() < earliest {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep_until(earliest) => {}
            }
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

        let (now, monotonic_now) = (OffsetDateTime::now_utc(), Instant::now());
        let mut observations = Vec::new();
        let mut renewals = Vec::new();
        let listed: HashSet<String> = sandboxes.iter().map(|s| s.id.clone()).collect();
        let missing: Vec<String> = {
            let mut tracked = self.backend.tracked();
            for sandbox in &sandboxes {
                if let Some(observed) = record(&mut tracked, sandbox) {
                    observations.push(observed);
                }
                if let Some(target) = renewal_due(&tracked, sandbox, now, monotonic_now, poll) {
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
    let (assignment_id, attempt, worker) = ownership(sandbox)?;
    let (phase, reason) = phase_of(&sandbox.status);
    let entry = tracked
        .entry(sandbox.id.clone())
        .or_insert_with(|| Tracked::new(assignment_id, attempt, worker));
    entry
        .update(phase)
        .then(|| entry.observed(&sandbox.id, phase, reason))
}

/// The expiry to ask for when the sandbox would expire before its deadline soon. Expiries are
/// compared with the wall clock `now`; renewals of one sandbox are spaced by the monotonic clock.
fn renewal_due(
    tracked: &HashMap<String, Tracked>,
    sandbox: &Sandbox,
    now: OffsetDateTime,
    monotonic_now: Instant,
    poll: &PollConfig,
) -> Option<OffsetDateTime> {
    let expires_at = sandbox.expires_at?;
    let deadline = OffsetDateTime::from_unix_timestamp(deadline(sandbox)?).ok()?;
    let live =
        !sandbox.status.state.is_terminal() && sandbox.status.state != SandboxState::Stopping;
    let entry = tracked.get(&sandbox.id)?;
    let recently = entry
        .last_renew
        .is_some_and(|at| monotonic_now.saturating_duration_since(at) < poll.renew_every);
    let short = expires_at + time::Duration::seconds(5) < deadline;
    (live && short && !recently && expires_at - now < poll.renew_ahead).then_some(deadline)
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

#[cfg(test)]
mod tests {
    use super::*;
    use jr_protocol::{AssignmentId, labels};

    fn sandbox(
        state: &str,
        expires_at: OffsetDateTime,
        deadline_key: &str,
        deadline: i64,
    ) -> Sandbox {
        serde_json::from_value(serde_json::json!({
            "id": "sb-1",
            "status": {"state": state},
            "expiresAt": expires_at.format(&time::format_description::well_known::Rfc3339).expect("format"),
            "metadata": {deadline_key: deadline.to_string()},
        }))
        .expect("sandbox")
    }

    #[test]
    fn renewal_is_due_close_to_an_expiry_before_the_deadline_and_spaced_out() {
        let poll = PollConfig::default();
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).expect("time");
        let t0 = Instant::now();
        let deadline = now.unix_timestamp() + 3 * 3600;
        let mut tracked = HashMap::from([(
            "sb-1".to_owned(),
            Tracked::new(AssignmentId(uuid::Uuid::nil()), 1, String::new()),
        )]);
        let soon = now + time::Duration::minutes(5);
        let target = OffsetDateTime::from_unix_timestamp(deadline).ok();

        let running = sandbox("Running", soon, labels::DEADLINE, deadline);
        assert_eq!(renewal_due(&tracked, &running, now, t0, &poll), target);
        // Sandboxes of older workers carry their deadline under the legacy key.
        let legacy = sandbox("Running", soon, labels::legacy_sandbox::DEADLINE, deadline);
        assert_eq!(renewal_due(&tracked, &legacy, now, t0, &poll), target);
        // Far from expiring, or on its way out: nothing to do.
        let later = sandbox(
            "Running",
            now + time::Duration::hours(1),
            labels::DEADLINE,
            deadline,
        );
        assert_eq!(renewal_due(&tracked, &later, now, t0, &poll), None);
        let stopping = sandbox("Stopping", soon, labels::DEADLINE, deadline);
        assert_eq!(renewal_due(&tracked, &stopping, now, t0, &poll), None);

        // Renewed just now: not again until `renew_every` has passed.
        if let Some(entry) = tracked.get_mut("sb-1") {
            entry.last_renew = Some(t0);
        }
        let before = t0 + poll.renew_every - Duration::from_secs(1);
        assert_eq!(renewal_due(&tracked, &running, now, before, &poll), None);
        let after = t0 + poll.renew_every;
        assert_eq!(renewal_due(&tracked, &running, now, after, &poll), target);
    }
}
