//! Which assignments this scheduler published: the history of an assignment subject, and
//! whether a message on it carries a task sealed with this scheduler's key for the forge task
//! its clear fields name. The command handlers and the facade's ledger act only on those.

use std::time::Duration;

use jr_bus::Bus;
use jr_bus::PublishOnce;
use jr_forge::proto::runner::v1::Task;
use jr_protocol::{
    AssignmentId, BackendName, Envelope, Kind, Message, STREAM_ASSIGNMENTS, Terminal, now_ms,
    subject,
};
use prost::Message as _;

use jr_seal::Sealer;

/// Whether `envelope` (an assignment) carries a task sealed by `sealer` for this assignment,
/// naming the forge task its clear fields name.
pub fn sealed_by(sealer: &Sealer, envelope: &Envelope) -> Result<(), String> {
    let Message::Assignment(assignment) = &envelope.message else {
        return Err(format!("{} is not an assignment", envelope.kind()));
    };
    let plaintext = sealer
        .open(
            jr_seal::SealScope::of(envelope.assignment_id, assignment),
            &assignment.sealed_task,
        )
        .map_err(|e| e.to_string())?;
    // A GitHub job's sealed task is its runner's config (the seal's scope binds it to the
    // assignment and its request id already).
    match assignment.forge_kind() {
        jr_protocol::ForgeKind::GitHub(_) => {
            return serde_json::from_slice::<jr_protocol::RunnerRegistration>(&plaintext)
                .map(|_| ())
                .map_err(|e| format!("the sealed task is not a GitHub runner config: {e}"));
        }
        jr_protocol::ForgeKind::Gitea(_) => {}
    }
    let task = Task::decode(plaintext.as_slice())
        .map_err(|e| format!("the sealed task is not a forge task: {e}"))?;
    if task.id != assignment.forge_task_id {
        return Err(format!(
            "the sealed task is forge task {}, the assignment names {}",
            task.id, assignment.forge_task_id
        ));
    }
    Ok(())
}

/// Most messages read from one assignment subject (one per attempt, plus anything planted).
const MAX_HISTORY: usize = 1000;

/// The decodable messages on `subject` of JR_ASSIGNMENTS in stream order (undecodable ones are
/// skipped), at most [`MAX_HISTORY`] of the latest.
pub async fn history(bus: &Bus, subject: &str) -> anyhow::Result<Vec<Envelope>> {
    use futures::StreamExt as _;
    use jr_bus::async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
    use jr_bus::async_nats::jetstream::stream::LastRawMessageErrorKind;

    let stream = bus
        .jetstream()
        .get_stream_no_info(STREAM_ASSIGNMENTS)
        .await?;
    let last = match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => message.sequence,
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let consumer = stream
        .create_consumer(OrderedConfig {
            // Named: the scheduler's NATS user may not use the nameless create endpoint.
            name: Some(jr_bus::permissions::ordered_consumer_name("scheduler")),
            filter_subject: subject.to_owned(),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out = std::collections::VecDeque::new();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), messages.next())
            .await
            .map_err(|_| anyhow::anyhow!("{subject}: history not delivered within 5 s"))?
            .ok_or_else(|| anyhow::anyhow!("ordered consumer ended"))??;
        let seq = message
            .info()
            .map_err(|e| anyhow::anyhow!("message info: {e}"))?
            .stream_sequence;
        if let Ok(envelope) = jr_protocol::decode(&message.payload) {
            out.push_back(envelope);
            if out.len() > MAX_HISTORY {
                out.pop_front();
            }
        }
        if seq >= last {
            return Ok(out.into());
        }
    }
}

/// The once-only `terminal` of attempt `attempt` of assignment `id`, written by `writer`
/// (`executor`, `fail-task`, `github`): every writer of a terminal builds it here, and its
/// message id names the writer, so one writer's repeat is recognised as its own.
pub fn terminal(id: AssignmentId, attempt: u32, writer: &str, terminal: Terminal) -> Envelope {
    Envelope::new(
        format!("terminal:{id}:{writer}"),
        now_ms(),
        id,
        attempt,
        Message::Terminal(terminal),
    )
}

/// Publishes the once-only `terminal` of attempt `attempt` of assignment `id` on `backend`'s
/// events, written by `writer` (see [`terminal`]): whichever writer is first decides the
/// assignment's end, every later one learns it lost.
pub async fn publish_terminal(
    bus: &Bus,
    backend: &BackendName,
    id: AssignmentId,
    attempt: u32,
    writer: &str,
    end: Terminal,
) -> Result<PublishOnce, jr_bus::BusError> {
    bus.publish_once(
        &subject::event(backend, id, Kind::Terminal),
        &terminal(id, attempt, writer, end),
    )
    .await
}
