//! The Gitea/Forgejo forge's answer to `fail-task`: the task's workload is lost, so the task
//! is marked terminal (once-only, so an executor's late result and this command cannot both
//! win), its failure is reported to the forge with the reason in its log, and `task-failed`
//! is published.

use std::time::Duration;

use futures::future::BoxFuture;
use jr_bus::{Bus, Disposition, PublishOnce};
use jr_intake::{ForgeCommands, LostTask};
use jr_protocol::{
    Envelope, ForgeKind, Kind, Message, STREAM_EVENTS, TaskFailed, TaskResult, Terminal,
    TerminalSource, now_ms, subject,
};

use crate::forges::Forges;

/// `fail-task` for the assignments of one Gitea/Forgejo forge.
#[derive(Clone)]
pub struct GiteaCommands {
    pub bus: Bus,
    pub forges: Forges,
}

impl ForgeCommands for GiteaCommands {
    /// A scheduler runs one Gitea/Forgejo forge: every job-bound assignment is its own (the
    /// assignment was checked to be sealed by this scheduler before).
    fn serves(&self, forge: &ForgeKind) -> bool {
        match forge {
            ForgeKind::Gitea(_) => true,
            ForgeKind::GitHub(_) => false,
        }
    }

    fn fail_task<'a>(&'a self, lost: LostTask<'a>) -> BoxFuture<'a, Disposition> {
        Box::pin(fail_task(self, lost))
    }
}

async fn fail_task(commands: &GiteaCommands, lost: LostTask<'_>) -> Disposition {
    let LostTask {
        id,
        attempt,
        backend,
        forge_task_id,
        reason,
        ..
    } = lost;
    let bus = &commands.bus;
    let Some(forge) = commands.forges.client(backend) else {
        if commands.forges.serves(backend) {
            // Its registration is still coming up here (the forge down or refusing it).
            tracing::info!(assignment = %id, %backend, "fail-task waits for the backend's forge registration");
            return Disposition::Nak(Some(Duration::from_secs(5)));
        }
        return Disposition::Term(format!(
            "fail-task for backend {backend}, which has no forge registration here"
        ));
    };
    let terminal = Terminal {
        forge_task_id,
        result: TaskResult::Failure,
        source: TerminalSource::FailTask,
        log_closed: true,
        reason: Some(reason.to_owned()),
    };
    match jr_intake::ours::publish_terminal(bus, backend, id, attempt, "fail-task", terminal).await
    {
        Ok(PublishOnce::Published { .. }) => {}
        // Our own earlier attempt: finished already if task-failed exists, else resume it.
        Ok(PublishOnce::Duplicate { .. }) => {
            match bus
                .last_on_subject(
                    STREAM_EVENTS,
                    &subject::event(backend, id, Kind::TaskFailed),
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
    let lines = [reason.to_owned()];
    match jr_forge::report::report_failure(&forge, forge_task_id, &lines).await {
        Ok(result) => {
            tracing::info!(assignment = %id, task = forge_task_id, ?result, %reason, "failure reported to the forge")
        }
        Err(e) if e.is_retryable() => {
            tracing::warn!(assignment = %id, error = %jr_telemetry::error_chain(&e), "forge unavailable; retrying fail-task");
            return Disposition::Nak(Some(Duration::from_secs(5)));
        }
        Err(e) => {
            tracing::warn!(assignment = %id, error = %jr_telemetry::error_chain(&e), "forge refused the failure report; the task stays failed here")
        }
    }
    let failed = Envelope::new(
        format!("task-failed:{id}"),
        now_ms(),
        id,
        attempt,
        Message::TaskFailed(TaskFailed {
            forge_task_id,
            reason: reason.to_owned(),
        }),
    );
    match bus
        .publish(&subject::event(backend, id, Kind::TaskFailed), &failed)
        .await
    {
        Ok(_) => Disposition::Ack,
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot publish task-failed; retrying");
            Disposition::Nak(Some(Duration::from_secs(2)))
        }
    }
}
