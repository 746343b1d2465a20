//! What JetStream says about an assignment when one of its messages is delivered: the current
//! attempt (last message on its assignment subject) and whether it is terminal, claimed or
//! already had a workload (last events on its event subjects). This is what lets a worker
//! recover from the bus alone, without the reconciler's projection.

use jr_bus::{Bus, BusError};
use jr_protocol::{AssignmentId, BackendName, Kind, STREAM_ASSIGNMENTS, STREAM_EVENTS, subject};

use crate::state::BusFacts;

/// How an undecodable last message is read.
#[derive(Clone, Copy)]
enum Garbage {
    /// As absent (the fact carries data we need, e.g. an attempt number).
    Absent,
    /// As present: for once-only facts, a message of any content holds the subject, so the
    /// real fact can never be published after it.
    Present,
}

async fn last_attempt(
    bus: &Bus,
    stream: &str,
    subject: &str,
    garbage: Garbage,
) -> Result<Option<u32>, BusError> {
    match bus.last_on_subject(stream, subject).await {
        Ok(found) => Ok(found.map(|(_, envelope)| envelope.attempt)),
        Err(BusError::DecodeLast { .. }) => {
            tracing::warn!(%subject, "undecodable last message");
            Ok(match garbage {
                Garbage::Absent => None,
                Garbage::Present => Some(0),
            })
        }
        Err(error) => Err(error),
    }
}

pub(crate) async fn bus_facts(
    bus: &Bus,
    backend: &BackendName,
    id: AssignmentId,
) -> Result<BusFacts, BusError> {
    let assignment = subject::assignment(backend, id);
    let terminal = subject::event(backend, id, Kind::Terminal);
    let claimed = subject::event(backend, id, Kind::Claimed);
    let created = subject::event(backend, id, Kind::WorkloadCreated);
    let (latest, terminal, claimed, created) = tokio::join!(
        last_attempt(bus, STREAM_ASSIGNMENTS, &assignment, Garbage::Absent),
        last_attempt(bus, STREAM_EVENTS, &terminal, Garbage::Present),
        last_attempt(bus, STREAM_EVENTS, &claimed, Garbage::Present),
        last_attempt(bus, STREAM_EVENTS, &created, Garbage::Absent),
    );
    Ok(BusFacts {
        latest_attempt: latest?,
        terminal: terminal?.is_some(),
        claimed_attempt: claimed?,
        created_attempt: created?,
        no_warm: false,
    })
}
