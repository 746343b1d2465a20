//! Ordered publish lanes: the driver hands publishes and ledger writes to a fixed set of lanes
//! instead of waiting for each acknowledgement itself, so a replicated stream's quorum write
//! (milliseconds on a three-node cluster) no longer holds up every other delivery, observation
//! and backend answer.
//!
//! Order is kept where it means something: everything about one workload (its ledger entry,
//! `workload-created`, its observations, `released`, forgetting it) goes through the lane its
//! name hashes to, and a lane does one step at a time, each waiting for its acknowledgement. A
//! warm executor's bound job carries the warm workload's name, so its binding, its events and
//! its ledger entries share one lane too. A delivery is acknowledged only after its events are
//! stored: the lane reports a confirmation back to the driver, which settles the delivery then.
//! In flight at once: at most one step per lane; each lane queues a bounded number of steps, so
//! a stalled NATS slows the driver down instead of growing memory without bound.

use std::hash::{Hash as _, Hasher as _};

use jr_bus::async_nats::jetstream::kv;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::driver::Io;
use crate::state::{DeliveryId, Event};

/// Lanes per worker: the publishes that may wait for an acknowledgement at once.
pub(crate) const LANES: usize = 32;
/// Steps queued per lane before the driver waits for room.
const LANE_DEPTH: usize = 256;

/// One step of a lane.
pub(crate) enum Step {
    Publish(Event),
    /// Publish these in order, then report [`Confirmed`].
    Confirm {
        delivery: DeliveryId,
        events: Vec<Event>,
    },
    /// Write this ledger key.
    Remember(String),
    /// Purge these ledger keys.
    Forget(Vec<String>),
}

/// A confirmation's outcome, for the driver to settle its delivery.
#[derive(Debug)]
pub(crate) struct Confirmed {
    pub(crate) delivery: DeliveryId,
    /// Every event was stored; the first one's `Created` tells whether it bound a warm executor.
    pub(crate) published: bool,
    pub(crate) warm: Option<bool>,
}

pub(crate) struct Lanes {
    senders: Vec<mpsc::Sender<Step>>,
    tasks: JoinSet<()>,
    /// Stops retrying publishes (after the drain at a clean stop, or at once otherwise).
    stop: CancellationToken,
}

/// The lane of a workload.
fn lane_of(workload: &str) -> usize {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    workload.hash(&mut hasher);
    (hasher.finish() % LANES as u64) as usize
}

fn workload_of(event: &Event) -> &str {
    match event {
        Event::Created { workload, .. }
        | Event::Observed { workload, .. }
        | Event::Released { workload, .. } => workload,
    }
}

impl Lanes {
    /// Starts the lanes; confirmations are sent to `confirmed`.
    pub(crate) fn start<B: Backend>(
        io: &Io<B>,
        ledger: kv::Store,
        confirmed: mpsc::UnboundedSender<Confirmed>,
    ) -> Self {
        let stop = CancellationToken::new();
        let mut senders = Vec::with_capacity(LANES);
        let mut tasks = JoinSet::new();
        for lane in 0..LANES {
            let (tx, rx) = mpsc::channel(LANE_DEPTH);
            senders.push(tx);
            let (io, ledger, confirmed, stop) =
                (io.clone(), ledger.clone(), confirmed.clone(), stop.clone());
            let span = tracing::debug_span!("publish lane", lane);
            tasks.spawn(tracing::Instrument::instrument(
                run_lane(io, ledger, rx, confirmed, stop),
                span,
            ));
        }
        Self {
            senders,
            tasks,
            stop,
        }
    }

    /// Queues `step` on the lane of `workload` (waiting while that lane is full).
    pub(crate) async fn push(&self, workload: &str, step: Step) {
        let Some(lane) = self.senders.get(lane_of(workload)) else {
            tracing::warn!(%workload, "publish lanes drained; the step is left to recovery");
            return;
        };
        if lane.send(step).await.is_err() {
            tracing::error!(%workload, "a publish lane stopped; the step is dropped");
        }
    }

    /// Queues an event on its workload's lane.
    pub(crate) async fn publish(&self, event: Event) {
        let workload = workload_of(&event).to_owned();
        self.push(&workload, Step::Publish(event)).await;
    }

    /// Queues a delivery's events on their workload's lane; the delivery is settled when the
    /// lane reports them stored.
    pub(crate) async fn confirm(&self, delivery: DeliveryId, events: Vec<Event>) {
        let workload = events
            .first()
            .map(workload_of)
            .unwrap_or_default()
            .to_owned();
        self.push(&workload, Step::Confirm { delivery, events })
            .await;
    }

    /// Lets every queued step finish, for at most `within`; then stops whatever is left.
    pub(crate) async fn drain(&mut self, within: std::time::Duration) {
        self.senders.clear();
        let tasks = &mut self.tasks;
        let finished =
            tokio::time::timeout(within, async { while tasks.join_next().await.is_some() {} })
                .await;
        if finished.is_err() {
            tracing::warn!(
                "publish lanes did not drain in time; what they held is left to recovery"
            );
        }
        self.stop.cancel();
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn run_lane<B: Backend>(
    io: Io<B>,
    ledger: kv::Store,
    mut rx: mpsc::Receiver<Step>,
    confirmed: mpsc::UnboundedSender<Confirmed>,
    stop: CancellationToken,
) {
    while let Some(step) = rx.recv().await {
        match step {
            Step::Publish(event) => {
                io.publish(&event, &stop).await;
            }
            Step::Confirm { delivery, events } => {
                let mut published = true;
                for event in &events {
                    if !io.publish(event, &stop).await {
                        published = false;
                        break;
                    }
                }
                let warm = match events.first() {
                    Some(Event::Created { warm, .. }) => Some(warm.is_some()),
                    _ => None,
                };
                // The driver is gone only when the worker stops; the delivery is then
                // redelivered.
                let _ = confirmed.send(Confirmed {
                    delivery,
                    published,
                    warm,
                });
            }
            Step::Remember(name) => {
                if let Err(error) = ledger.put(&name, Default::default()).await {
                    tracing::warn!(%name, error = %jr_telemetry::error_chain(&error), "could not remember an announced workload");
                }
            }
            Step::Forget(names) => {
                for name in names {
                    if let Err(error) = ledger.purge(&name).await {
                        tracing::warn!(%name, error = %jr_telemetry::error_chain(&error), "could not forget a released workload");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_always_maps_to_the_same_lane_and_names_spread_over_all_of_them() {
        let names: Vec<String> = (0..2000).map(|i| format!("jr-{i:08x}-1")).collect();
        let mut used = [0usize; LANES];
        for name in &names {
            let lane = lane_of(name);
            assert_eq!(lane, lane_of(name));
            used[lane] += 1;
        }
        // Every lane gets work, none more than three times its fair part.
        let fair = names.len() / LANES;
        assert!(used.iter().all(|&n| n > 0 && n < 3 * fair), "{used:?}");
    }
}
