//! A Gitea/Forgejo registration as an independent intake: its runner is established on its own
//! (retried with back-off while the forge is down or refuses it, the reason reported on the
//! intake board), then its fetch loop runs; a runner the forge no longer knows is reported and
//! established again. Nothing here stops the scheduler or another intake.
//!
//! Also what a fetch loop decides before each fetch: the backends' conditions read from the
//! bus, the labels a shared registration declares, and the room.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use jr_config::Config;
use jr_protocol::BackendName;
use tokio_util::sync::CancellationToken;

use crate::declaration::{Condition, Declarer};
use crate::fetcher::{Dispatcher, FetchError, Pacing, fetch_loop};
use crate::forges::{Planned, Registration};
use crate::registration::{RegistrationError, SharedCredentials};
use jr_intake::board::Observation;
use jr_intake::pacing::BackendRoom;

/// The longest wait between two tries to establish a registration: one Ping (or Declare) per
/// registration this often is nothing for a forge, and a forge that is back is used soon.
const MAX_RETRY: Duration = Duration::from_secs(10);

/// Runs `planned` until shutdown: establish, fetch, and again after any failure.
pub async fn run_registration(
    d: Arc<Dispatcher>,
    config: Arc<Config>,
    planned: Planned,
    shared: Option<SharedCredentials>,
    pacing: Pacing,
    shutdown: CancellationToken,
) {
    let name = planned.name.clone();
    let mut backoff = jr_bus::Backoff::new(Duration::from_millis(500), MAX_RETRY);
    let speaks = |shared: &Option<SharedCredentials>| {
        shared
            .as_ref()
            .is_none_or(|s| s.leadership.acting().is_some())
    };
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        let labels = labels_in_effect(&d, &planned).await;
        let planned = Planned {
            labels,
            ..planned.clone()
        };
        let error = match planned.establish(&config, shared.as_ref(), &shutdown).await {
            Ok(registration) => {
                d.intakes.report(&name, None, None, speaks(&shared));
                d.forges.insert(registration.clone());
                backoff.reset();
                match fetch_loop(registration, &d, pacing, &shutdown).await {
                    Ok(()) => return,
                    Err(FetchError::Unregistered(e)) => {
                        let why = jr_telemetry::error_chain(&e);
                        tracing::error!(
                            registration = %name,
                            error = %why,
                            "the forge no longer knows this registration's runner: fetching stops; \
                             it is established again (configure fresh credentials, or remove the \
                             stored ones and give a registration token)"
                        );
                        format!("the forge no longer knows the runner: {why}")
                    }
                }
            }
            Err(RegistrationError::Shutdown) => return,
            Err(e) => {
                let why = jr_telemetry::error_chain(&e);
                tracing::warn!(registration = %name, error = %why, "the forge registration is not established; retrying");
                why
            }
        };
        d.intakes.report(&name, None, Some(error), speaks(&shared));
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// The labels a registration's runner declares when it is established. One serving several
/// backends declares what the replica fetching for it declares now (its record in
/// `JR_INTAKES`, if fresh), so a replica starting or coming back does not hand the forge the
/// labels of a backend that was withdrawn; the fetching replica applies its own declaration
/// again in any case (at takeover and every few seconds).
async fn labels_in_effect(d: &Dispatcher, planned: &Planned) -> Vec<String> {
    if planned.backends.len() < 2 {
        return planned.labels.clone();
    }
    let fresh = jr_bus::intake::REFRESH_EVERY * 3;
    match jr_bus::intake::read(&d.bus, std::slice::from_ref(&planned.name)).await {
        Ok(records) => records
            .into_iter()
            .find(|r| {
                r.error.is_none()
                    && !r.declared_labels.is_empty()
                    && jr_protocol::now_ms().saturating_sub(r.updated_at_ms)
                        < u64::try_from(fresh.as_millis()).unwrap_or(u64::MAX)
            })
            .map_or_else(|| planned.labels.clone(), |r| r.declared_labels),
        Err(e) => {
            tracing::debug!(registration = %planned.name, error = %e, "the intake record is not readable; declaring every label");
            planned.labels.clone()
        }
    }
}

impl Dispatcher {
    /// Each backend `registration` fetches for, as the bus shows it now.
    pub async fn readings(
        &self,
        registration: &Registration,
    ) -> Vec<(BackendName, jr_intake::presence::Reading)> {
        let mut out = Vec::with_capacity(registration.backends.len());
        for backend in &registration.backends {
            let waiting = jr_intake::presence::waiting(&self.bus, backend).await;
            let worker = self.presence.worker(&self.bus, backend).await;
            let room = BackendRoom {
                lookahead: self.lookahead.get(backend).copied().unwrap_or(2),
                waiting,
            };
            out.push((
                backend.clone(),
                jr_intake::presence::Reading { room, worker },
            ));
        }
        out
    }

    /// How many tasks `registration` may take now. A shared registration first declares the
    /// labels of the backends taking work when they changed (see [`crate::declaration`]);
    /// `declared` is then true and the caller decides again before fetching. Reports the
    /// decision to the intake board.
    pub(crate) async fn decide(
        &self,
        registration: &Registration,
        declarer: Option<&mut Declarer>,
        taking: &mut Vec<BackendName>,
    ) -> (usize, bool) {
        let readings = self.readings(registration).await;
        let conditions: BTreeMap<BackendName, Condition> = readings
            .iter()
            .map(|(b, r)| (b.clone(), r.room.condition(r.worker)))
            .collect();
        taking.clear();
        taking.extend(
            conditions
                .iter()
                .filter(|(_, c)| c.room() > 0)
                .map(|(b, _)| b.clone()),
        );
        let mut declared_now = false;
        let (room, labels, reaches): (usize, Vec<String>, Vec<bool>) = match declarer {
            None => {
                let room = conditions.values().map(|c| c.room()).min().unwrap_or(0);
                let labels = registration
                    .own_backend
                    .as_ref()
                    .map(|b| self.router.labels_of(b).to_vec())
                    .unwrap_or_else(|| self.router.declared_labels().to_vec());
                (room, labels, vec![true; readings.len()])
            }
            Some(declarer) => {
                let now = Instant::now();
                let step = declarer.step(&self.router, &conditions, now);
                let mut room = step.room;
                if let Some(declare) = step.declare {
                    room = 0;
                    declared_now = true;
                    let request = jr_forge::proto::runner::v1::DeclareRequest {
                        version: crate::registration::RUNNER_VERSION.to_owned(),
                        labels: declare.labels.clone(),
                        ..Default::default()
                    };
                    let before = declarer.declared_labels().to_vec();
                    match registration.client.declare(&request).await {
                        Ok(_) => {
                            if before != declare.labels {
                                self.stats.declares.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(
                                    registration = %registration.name,
                                    labels = ?declare.labels,
                                    before = ?before,
                                    "declared the labels of the backends taking work"
                                );
                            }
                            declarer.declared(&self.router, declare.labels, Instant::now());
                        }
                        Err(e) => {
                            // Nothing is fetched until the forge has the labels wanted.
                            declared_now = false;
                            declarer.failed(Instant::now());
                            tracing::warn!(
                                registration = %registration.name,
                                labels = ?declare.labels,
                                error = %e,
                                "declaring labels failed; fetching waits and the Declare is retried"
                            );
                        }
                    }
                }
                let reaches = readings.iter().map(|(b, _)| declarer.reaches(b)).collect();
                (room, declarer.declared_labels().to_vec(), reaches)
            }
        };
        self.intakes.observe(&Observation {
            registration: &registration.name,
            backends: readings
                .iter()
                .zip(reaches)
                .map(|((b, r), declared)| (b.clone(), conditions[b], r.room.waiting, declared))
                .collect(),
            declared_labels: &labels,
            room,
        });
        (room, declared_now)
    }
}
