//! The `redispatch` command: the reconciler decided that an assignment's workload failed before
//! any executor claimed the task, and asks for attempt n+1. The scheduler is the only writer of
//! `jr.assignment.>`, so it publishes the new attempt itself, re-using its own latest assignment
//! message on the subject: one whose sealed task opens with the scheduler's key and names the
//! same forge task. A forged assignment planted on the subject is never republished, and
//! garbage or a forgery published after the genuine messages does not block the redispatch
//! (the subject's history is read and the latest genuine message used).
//!
//! Order: the new attempt first, then the `redispatched` event. A crash in between leaves the
//! event missing; the reconciler then asks again (same ids), and the attempt is found already
//! published, so no attempt is ever published twice. Message ids are deterministic
//! (`assignment:<id>:<attempt>`, `redispatch:<id>:<attempt>`), so a repeat within the
//! duplicate window is dropped by the server as well.

use std::time::Duration;

use jr_bus::{Delivery, Disposition};
use jr_protocol::{
    AssignmentId, Envelope, Kind, Message, Redispatch, Redispatched, STREAM_ASSIGNMENTS, now_ms,
    subject,
};

/// What one `redispatch` command leads to.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Publish `assignment` (attempt n+1), then `event`.
    Publish {
        assignment: Box<Envelope>,
        event: Envelope,
    },
    /// The attempt is already published (an earlier delivery got that far): only the event.
    EventOnly { event: Envelope },
    /// Never act on this command; the reason is logged.
    Refuse(String),
}

/// The message id of attempt `attempt` of `id` when it is a redispatch.
pub fn assignment_message_id(id: AssignmentId, attempt: u32) -> String {
    format!("assignment:{id}:{attempt}")
}

/// The message id of the `redispatched` event announcing `next_attempt` (the same as the
/// reconciler's command id, so a command planned again maps to the same event).
pub fn event_message_id(id: AssignmentId, next_attempt: u32) -> String {
    format!("redispatch:{id}:{next_attempt}")
}

/// Decides what to publish for `command` about `id`, given the decodable messages on the
/// assignment's subject in stream order (`history`) and `genuine`, which tells whether a
/// message's sealed task is the scheduler's own (opens with its key and names the message's
/// forge task). Only the latest genuine assignment of this id and backend counts.
pub fn decide(
    id: AssignmentId,
    command: &Redispatch,
    history: &[Envelope],
    genuine: impl Fn(&Envelope) -> Result<(), String>,
    now: u64,
) -> Plan {
    let next = command.next_attempt;
    if next < 2 {
        return Plan::Refuse(format!("redispatch to attempt {next}: attempts start at 1"));
    }
    let mut refused = Vec::new();
    let last = history.iter().rev().find(|e| {
        let ours = match &e.message {
            Message::Assignment(a) if e.assignment_id == id && a.backend == command.backend => {
                genuine(e)
            }
            Message::Assignment(a) => Err(format!(
                "names assignment {} on backend {}",
                e.assignment_id, a.backend
            )),
            other => Err(format!("is a {}", other.kind())),
        };
        ours.map_err(|reason| refused.push(format!("{}: {reason}", e.id)))
            .is_ok()
    });
    let Some(last) = last else {
        return Plan::Refuse(format!(
            "no assignment {id} published by this scheduler on {} (refused: {})",
            subject::assignment(&command.backend, id),
            if refused.is_empty() {
                "none".to_owned()
            } else {
                refused.join("; ")
            }
        ));
    };
    let event = Envelope::new(
        event_message_id(id, next),
        now,
        id,
        next - 1,
        Message::Redispatched(Redispatched {
            next_attempt: next,
            reason: command.reason.clone(),
        }),
    );
    if last.attempt >= next {
        return Plan::EventOnly { event };
    }
    let mut republished = last.clone();
    republished.id = assignment_message_id(id, next);
    republished.attempt = next;
    republished.occurred_at = now;
    republished.trace = None;
    Plan::Publish {
        assignment: Box::new(republished),
        event,
    }
}

const RETRY: Duration = Duration::from_secs(2);

pub async fn handle(ctx: &super::Context, delivery: Delivery) -> Disposition {
    let (bus, sealer) = (&ctx.bus, &*ctx.sealer);
    let envelope = delivery.envelope;
    let id = envelope.assignment_id;
    let Message::Redispatch(command) = &envelope.message else {
        return Disposition::Term(format!("{} is not a redispatch command", envelope.kind()));
    };
    let assignment_subject = subject::assignment(&command.backend, id);
    let genuine = |e: &Envelope| jr_intake::ours::sealed_by(sealer, e);
    // Usually the last message is the scheduler's own; only otherwise is the history read.
    let plan = match bus
        .last_on_subject(STREAM_ASSIGNMENTS, &assignment_subject)
        .await
    {
        Ok(None) => decide(id, command, &[], genuine, now_ms()),
        Err(e) if e.is_transient() => {
            tracing::warn!(assignment = %id, error = %e, "cannot read the assignment; retrying");
            return Disposition::Nak(Some(RETRY));
        }
        last => {
            let plan = match last {
                Ok(Some((_, last))) => decide(id, command, &[last], genuine, now_ms()),
                _ => Plan::Refuse(String::new()),
            };
            if let Plan::Refuse(_) = plan {
                match jr_intake::ours::history(bus, &assignment_subject).await {
                    Ok(history) => decide(id, command, &history, genuine, now_ms()),
                    Err(e) => {
                        tracing::warn!(assignment = %id, error = %e, "cannot read the assignment's history; retrying");
                        return Disposition::Nak(Some(RETRY));
                    }
                }
            } else {
                plan
            }
        }
    };
    let event = match plan {
        Plan::Refuse(reason) => {
            tracing::warn!(assignment = %id, %reason, "redispatch refused");
            return Disposition::Term(reason);
        }
        Plan::EventOnly { event } => event,
        Plan::Publish { assignment, event } => {
            if let Some(ended) = end_instead(ctx, &assignment, command).await {
                return ended;
            }
            if let Err(e) = bus.publish(&assignment_subject, &assignment).await {
                tracing::warn!(assignment = %id, error = %e, "cannot publish the new attempt; retrying");
                return Disposition::Nak(Some(RETRY));
            }
            tracing::info!(assignment = %id, attempt = assignment.attempt, reason = %command.reason, "assignment redispatched");
            event
        }
    };
    match bus
        .publish(
            &subject::event(&command.backend, id, Kind::Redispatched),
            &event,
        )
        .await
    {
        Ok(_) => Disposition::Ack,
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot publish redispatched; retrying");
            Disposition::Nak(Some(RETRY))
        }
    }
}

/// A forge that cannot start an attempt again (a runner-bound forge: its runner's
/// registration works once) ends the lost attempt instead, and its intake makes a fresh runner:
/// what to do with the command then. `None`: publish the new attempt.
async fn end_instead(
    ctx: &super::Context,
    assignment: &Envelope,
    command: &Redispatch,
) -> Option<Disposition> {
    let Message::Assignment(a) = &assignment.message else {
        return None;
    };
    let kind = a.forge_kind();
    let forge = ctx
        .forges
        .iter()
        .find(|f| f.serves(&kind) && f.ends_lost_attempts())?;
    tracing::info!(assignment = %assignment.assignment_id, reason = %command.reason, "lost attempt of a runner-bound forge ended instead of redispatched; its intake makes a fresh runner");
    Some(
        forge
            .fail_task(jr_intake::LostTask {
                id: assignment.assignment_id,
                attempt: assignment.attempt.saturating_sub(1).max(1),
                backend: &command.backend,
                forge_task_id: a.forge_task_id,
                forge: &kind,
                reason: &command.reason,
            })
            .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use jr_forge::proto::runner::v1::Task;
    use jr_protocol::{Assignment, BackendName, SealedTask};
    use jr_seal::Sealer;
    use prost::Message as _;

    fn backend(name: &str) -> BackendName {
        BackendName::new(name).unwrap_or_else(|e| panic!("{e}"))
    }

    fn id() -> AssignmentId {
        AssignmentId::for_task("https://forge.test", 7)
    }

    fn assignment(attempt: u32) -> Envelope {
        Envelope::new(
            format!("assignment:{}:{attempt}:x", id()),
            1_000,
            id(),
            attempt,
            Message::Assignment(Assignment {
                forge_instance: "https://forge.test".into(),
                forge_task_id: 7,
                backend: backend("pod"),
                provider: None,
                placement: None,
                labels: vec!["pod".into()],
                repository: "org/repo".into(),
                workflow: None,
                job_name: "build".into(),
                max_duration_secs: 3600,
                fetched_at: 900,
                sealed_task: SealedTask {
                    key_id: "k1".into(),
                    nonce: vec![0; 24],
                    ciphertext: vec![1, 2, 3],
                },
            }),
        )
    }

    fn command(next_attempt: u32) -> Redispatch {
        Redispatch {
            backend: backend("pod"),
            next_attempt,
            reason: "workload-failed".into(),
        }
    }

    fn ok(_: &Envelope) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn publishes_the_next_attempt_of_the_same_assignment_then_the_event() {
        let last = assignment(1);
        let Plan::Publish { assignment, event } =
            decide(id(), &command(2), std::slice::from_ref(&last), ok, 5_000)
        else {
            panic!("expected a publish");
        };
        assert_eq!(assignment.attempt, 2);
        assert_eq!(assignment.id, format!("assignment:{}:2", id()));
        assert_eq!(assignment.occurred_at, 5_000);
        assert_eq!(
            assignment.message, last.message,
            "the sealed task is re-used as is"
        );
        assert_eq!(event.id, format!("redispatch:{}:2", id()));
        assert_eq!(event.attempt, 1);
        assert!(matches!(
            &event.message,
            Message::Redispatched(Redispatched {
                next_attempt: 2,
                ..
            })
        ));
    }

    #[test]
    fn an_attempt_already_published_is_not_published_again() {
        let plan = decide(id(), &command(2), &[assignment(2)], ok, 5_000);
        assert!(matches!(plan, Plan::EventOnly { .. }), "{plan:?}");
        let plan = decide(id(), &command(2), &[assignment(3)], ok, 5_000);
        assert!(matches!(plan, Plan::EventOnly { .. }), "{plan:?}");
    }

    #[test]
    fn forged_or_foreign_assignments_are_never_republished() {
        let forged = |_: &Envelope| Err("does not open".to_owned());
        assert!(matches!(
            decide(id(), &command(2), &[assignment(1)], forged, 1),
            Plan::Refuse(_)
        ));
        // Another assignment's message on this subject.
        let mut other = assignment(1);
        other.assignment_id = AssignmentId::for_task("https://forge.test", 8);
        assert!(matches!(
            decide(id(), &command(2), std::slice::from_ref(&other), ok, 1),
            Plan::Refuse(_)
        ));
        // Another backend named in the command.
        let mut on_vm = command(2);
        on_vm.backend = backend("vm");
        assert!(matches!(
            decide(id(), &on_vm, &[assignment(1)], ok, 1),
            Plan::Refuse(_)
        ));
        // Not an assignment at all, nothing there, or a nonsensical attempt.
        let mut event = assignment(1);
        event.message = Message::Redispatch(command(2));
        assert!(matches!(
            decide(id(), &command(2), std::slice::from_ref(&event), ok, 1),
            Plan::Refuse(_)
        ));
        assert!(matches!(
            decide(id(), &command(2), &[], ok, 1),
            Plan::Refuse(_)
        ));
        assert!(matches!(
            decide(id(), &command(1), &[assignment(1)], ok, 1),
            Plan::Refuse(_)
        ));
    }

    #[test]
    fn the_latest_genuine_assignment_counts_whatever_was_published_after_it() {
        let mut planted = assignment(1);
        planted.id = "planted".into();
        if let Message::Assignment(a) = &mut planted.message {
            a.sealed_task.key_id = "forged".into();
        }
        let mut other_kind = assignment(1);
        other_kind.message = Message::Redispatch(command(9));
        let genuine = |e: &Envelope| match &e.message {
            Message::Assignment(a) if a.sealed_task.key_id == "k1" => Ok(()),
            _ => Err("not sealed by us".to_owned()),
        };
        let history = [assignment(1), assignment(2), planted.clone(), other_kind];
        let Plan::Publish {
            assignment: next, ..
        } = decide(id(), &command(3), &history, genuine, 7)
        else {
            panic!("expected a publish");
        };
        assert_eq!(next.attempt, 3);
        assert_eq!(
            next.message,
            assignment(2).message,
            "built from the genuine attempt 2"
        );
        // Only forgeries: refused, naming them.
        let Plan::Refuse(reason) = decide(id(), &command(2), &[planted], genuine, 7) else {
            panic!("a forgery was accepted");
        };
        assert!(reason.contains("planted"), "{reason}");
    }

    #[test]
    fn the_seal_check_needs_the_schedulers_key_and_the_same_task() {
        let keys = [("k1".to_owned(), Sealer::generate_key())].into();
        let sealer = Sealer::new("k1", &keys).unwrap_or_else(|e| panic!("{e}"));
        let other_keys = [("k1".to_owned(), Sealer::generate_key())].into();
        let stranger = Sealer::new("k1", &other_keys).unwrap_or_else(|e| panic!("{e}"));
        let pod = backend("pod");
        let task = |task_id: i64| {
            Task {
                id: task_id,
                ..Task::default()
            }
            .encode_to_vec()
        };
        let with_seal = |sealed: SealedTask| {
            let mut e = assignment(1);
            if let Message::Assignment(a) = &mut e.message {
                a.sealed_task = sealed;
            }
            e
        };
        let genuine = with_seal(
            sealer
                .seal(jr_seal::SealScope::new(id(), &pod, 7), &task(7))
                .unwrap_or_else(|e| panic!("{e}")),
        );
        assert_eq!(jr_intake::ours::sealed_by(&sealer, &genuine), Ok(()));
        let forged = with_seal(
            stranger
                .seal(jr_seal::SealScope::new(id(), &pod, 7), &task(7))
                .unwrap_or_else(|e| panic!("{e}")),
        );
        assert!(jr_intake::ours::sealed_by(&sealer, &forged).is_err());
        let other_task = with_seal(
            sealer
                .seal(jr_seal::SealScope::new(id(), &pod, 7), &task(8))
                .unwrap_or_else(|e| panic!("{e}")),
        );
        assert!(jr_intake::ours::sealed_by(&sealer, &other_task).is_err());
        let other_assignment = with_seal(
            sealer
                .seal(
                    jr_seal::SealScope::new(
                        AssignmentId::for_task("https://forge.test", 9),
                        &pod,
                        7,
                    ),
                    &task(7),
                )
                .unwrap_or_else(|e| panic!("{e}")),
        );
        assert!(jr_intake::ours::sealed_by(&sealer, &other_assignment).is_err());
    }
}
