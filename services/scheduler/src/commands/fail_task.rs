//! The `fail-task` command: the reconciler decided a task's workload is lost. The command is
//! checked to name an assignment this scheduler published, for this very forge task, and then
//! handed to the forge of that assignment ([`jr_intake::ForgeCommands`]), which ends it: a
//! job-bound forge's task is marked terminal and reported failed, a runner-bound forge's
//! runner is withdrawn unless it took a job.

use std::time::Duration;

use jr_bus::{Delivery, Disposition};
use jr_intake::LostTask;
use jr_protocol::{FailTask, Message, subject};

use super::Context;

pub async fn handle(ctx: &Context, delivery: Delivery) -> Disposition {
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
    let history = match jr_intake::ours::history(&ctx.bus, &subject::assignment(&backend, id)).await
    {
        Ok(history) => history,
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot read the assignment; retrying fail-task");
            return Disposition::Nak(Some(Duration::from_secs(2)));
        }
    };
    let forge = history.iter().rev().find_map(|e| match &e.message {
        Message::Assignment(a)
            if a.forge_task_id == forge_task_id
                && jr_intake::ours::sealed_by(&ctx.sealer, e).is_ok() =>
        {
            Some(a.forge_kind())
        }
        _ => None,
    });
    let Some(forge) = forge else {
        tracing::warn!(assignment = %id, task = forge_task_id, "fail-task names no assignment of ours for that task; refused");
        return Disposition::Term(format!(
            "fail-task for forge task {forge_task_id}: no assignment {id} sealed by this scheduler for it"
        ));
    };
    let Some(commands) = ctx.forges.iter().find(|f| f.serves(&forge)) else {
        // Ours, but its forge is no longer configured: nothing here can end it at the forge.
        tracing::warn!(assignment = %id, forge = %forge.instance(), "fail-task for a forge this scheduler does not run; refused");
        return Disposition::Term(format!(
            "fail-task for {}: no forge of that kind is configured here",
            forge.instance()
        ));
    };
    commands
        .fail_task(LostTask {
            id,
            attempt: envelope.attempt,
            backend: &backend,
            forge_task_id,
            forge: &forge,
            reason: &reason,
        })
        .await
}
