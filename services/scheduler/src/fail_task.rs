//! The `fail-task` command: the reconciler decided a task's workload is lost. Unless the task is
//! already terminal, mark it terminal (once-only, so an executor's late result and this command
//! cannot both win), report the failure to the forge and publish `task-failed`.

use jr_bus::{Bus, Delivery, Disposition, PublishOnce};
use jr_protocol::now_ms;
use jr_protocol::{
    Envelope, FailTask, Kind, Message, STREAM_EVENTS, TaskFailed, TaskResult, Terminal,
    TerminalSource, subject,
};
use std::time::Duration;

use crate::forge_report::report_failure;
use crate::forges::Forges;
use crate::seal::Sealer;

pub async fn handle(
    bus: &Bus,
    forges: &Forges,
    sealer: &Sealer,
    delivery: Delivery,
) -> Disposition {
    let envelope = delivery.envelope;
    let Message::FailTask(FailTask {
        forge_task_id,
        backend,
        reason,
    }) = envelope.message
    else {
        return Disposition::Term(format!("{} is not a fail-task command", envelope.kind()));
    };
    let id = envelope.assignment_id;
    // Act only on an assignment this scheduler published, for this very forge task: anyone
    // else's command (or one naming another task) must not fail a forge task or write its log.
    let github = match crate::redispatch::history(bus, &subject::assignment(&backend, id)).await {
        Ok(history) => {
            let ours = history.iter().rev().find_map(|e| match &e.message {
                Message::Assignment(a)
                    if a.forge_task_id == forge_task_id
                        && crate::redispatch::sealed_by(sealer, e).is_ok() =>
                {
                    Some(crate::github::is_github(&a.forge_instance))
                }
                _ => None,
            });
            let Some(github) = ours else {
                tracing::warn!(assignment = %id, task = forge_task_id, "fail-task names no assignment of ours for that task; refused");
                return Disposition::Term(format!(
                    "fail-task for forge task {forge_task_id}: no assignment {id} sealed by this scheduler for it"
                ));
            };
            github
        }
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot read the assignment; retrying fail-task");
            return Disposition::Nak(Some(Duration::from_secs(2)));
        }
    };
    // A GitHub runner's job is ended by GitHub itself when the runner is gone; jetrunner's
    // ledger records the failure, and there is no Gitea task to report it to.
    let forge = match (github, forges.client(&backend)) {
        (true, _) => None,
        (false, Some(forge)) => Some(forge),
        (false, None) => {
            return Disposition::Term(format!(
                "fail-task for backend {backend}, which has no forge registration here"
            ));
        }
    };
    let terminal = Envelope::new(
        format!("terminal:{id}:fail-task"),
        now_ms(),
        id,
        envelope.attempt,
        Message::Terminal(Terminal {
            forge_task_id,
            result: TaskResult::Failure,
            source: TerminalSource::FailTask,
            log_closed: true,
            reason: Some(reason.clone()),
        }),
    );
    match bus
        .publish_once(&subject::event(&backend, id, Kind::Terminal), &terminal)
        .await
    {
        Ok(PublishOnce::Published { .. }) => {}
        // Our own earlier attempt: finished already if task-failed exists, else resume it.
        Ok(PublishOnce::Duplicate { .. }) => {
            match bus
                .last_on_subject(
                    STREAM_EVENTS,
                    &subject::event(&backend, id, Kind::TaskFailed),
                )
                .await
            {
                Ok(Some(_)) => return Disposition::Ack,
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(assignment = %id, error = %e, "cannot read task-failed; retrying");
                    return Disposition::Nak(Some(Duration::from_secs(2)));
                }
            }
        }
        Ok(PublishOnce::AlreadyExists { .. }) => {
            tracing::info!(assignment = %id, "task already terminal; fail-task not needed");
            return Disposition::Ack;
        }
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot publish terminal; retrying");
            return Disposition::Nak(Some(Duration::from_secs(2)));
        }
    }
    if let Some(forge) = forge {
        match report_failure(forge, forge_task_id, std::slice::from_ref(&reason)).await {
            Ok(result) => {
                tracing::info!(assignment = %id, task = forge_task_id, ?result, %reason, "failure reported to the forge")
            }
            Err(e) if e.is_retryable() => {
                tracing::warn!(assignment = %id, error = %e, "forge unavailable; retrying fail-task");
                return Disposition::Nak(Some(Duration::from_secs(5)));
            }
            Err(e) => {
                tracing::warn!(assignment = %id, error = %e, "forge refused the failure report; the task stays failed here")
            }
        }
    }
    let failed = Envelope::new(
        format!("task-failed:{id}"),
        now_ms(),
        id,
        envelope.attempt,
        Message::TaskFailed(TaskFailed {
            forge_task_id,
            reason,
        }),
    );
    match bus
        .publish(&subject::event(&backend, id, Kind::TaskFailed), &failed)
        .await
    {
        Ok(_) => Disposition::Ack,
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot publish task-failed; retrying");
            Disposition::Nak(Some(Duration::from_secs(2)))
        }
    }
}
