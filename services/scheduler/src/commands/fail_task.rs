//! The `fail-task` command: the reconciler decided a task's workload is lost. Unless the task is
//! already terminal, mark it terminal (once-only, so an executor's late result and this command
//! cannot both win), report the failure to the forge and publish `task-failed`.
//!
//! A GitHub runner reports to GitHub, so its workload may be gone before the listener has its
//! job's end. The command then waits while GitHub holds the runner busy or the runner is gone
//! after its job (that job's `JobCompleted` ends the assignment); a runner that never took a
//! job is removed from GitHub and its assignment ends as `withdrawn`.

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

/// The scale set clients of the `[[github]]` entries, by name.
pub type GitHubClients = std::collections::BTreeMap<String, jr_github::ScaleSetClient>;

/// How long a `fail-task` for a GitHub runner that took a job waits before looking again: the
/// job's end comes from GitHub through the listener.
const GITHUB_WAIT: Duration = Duration::from_secs(10);

pub async fn handle(
    bus: &Bus,
    forges: &Forges,
    github_clients: &GitHubClients,
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
    let github = match crate::ours::history(bus, &subject::assignment(&backend, id)).await {
        Ok(history) => {
            let ours = history.iter().rev().find_map(|e| match &e.message {
                Message::Assignment(a)
                    if a.forge_task_id == forge_task_id
                        && crate::ours::sealed_by(sealer, e).is_ok() =>
                {
                    Some(match a.forge_kind() {
                        jr_protocol::ForgeKind::GitHub(name) => Some(name),
                        jr_protocol::ForgeKind::Gitea(_) => None,
                    })
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
    // A GitHub runner reports to GitHub, not to the facade: a workload that exited after its
    // job may have its terminal still on the way from the listener. Only a runner that never
    // took a job is failed here; the end of one that did comes from GitHub.
    if let Some(name) = &github {
        if let Some(wait) = github_runner_busy(bus, github_clients, name, &backend, id).await {
            return wait;
        }
        // The runner never took a job and is removed: its assignment ends as withdrawn (the
        // job it was made for still runs on another runner), and there is no task to fail.
        let withdrawn = crate::ours::terminal(
            id,
            envelope.attempt,
            "fail-task",
            Terminal {
                forge_task_id,
                result: TaskResult::Cancelled,
                source: TerminalSource::Withdrawn,
                log_closed: true,
                reason: Some(format!("runner lost before it took a job: {reason}")),
            },
        );
        return match bus
            .publish_once(&subject::event(&backend, id, Kind::Terminal), &withdrawn)
            .await
        {
            Ok(_) => Disposition::Ack,
            Err(e) => {
                tracing::warn!(assignment = %id, error = %e, "cannot publish terminal; retrying");
                Disposition::Nak(Some(Duration::from_secs(2)))
            }
        };
    }
    let Some(forge) = forges.client(&backend) else {
        if forges.serves(&backend) {
            // Its registration is still coming up here (the forge down or refusing it).
            tracing::info!(assignment = %id, %backend, "fail-task waits for the backend's forge registration");
            return Disposition::Nak(Some(Duration::from_secs(5)));
        }
        return Disposition::Term(format!(
            "fail-task for backend {backend}, which has no forge registration here"
        ));
    };
    let terminal = crate::ours::terminal(
        id,
        envelope.attempt,
        "fail-task",
        Terminal {
            forge_task_id,
            result: TaskResult::Failure,
            source: TerminalSource::FailTask,
            log_closed: true,
            reason: Some(reason.clone()),
        },
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
    match report_failure(&forge, forge_task_id, std::slice::from_ref(&reason)).await {
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

/// For the `fail-task` of GitHub runner assignment `id` of forge `name`: `None` when the
/// failure may be recorded now (the runner never took a job, and is removed from GitHub so it
/// cannot take one), else what to do with the command: done when the assignment is final, or
/// wait while GitHub still holds the runner busy or the runner is gone after its job (its
/// `JobCompleted` ends the assignment).
async fn github_runner_busy(
    bus: &Bus,
    clients: &GitHubClients,
    name: &str,
    backend: &jr_protocol::BackendName,
    id: jr_protocol::AssignmentId,
) -> Option<Disposition> {
    match bus
        .last_on_subject(STREAM_EVENTS, &subject::event(backend, id, Kind::Terminal))
        .await
    {
        Ok(Some(_)) => return Some(Disposition::Ack),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot read the terminal; retrying fail-task");
            return Some(Disposition::Nak(Some(Duration::from_secs(2))));
        }
    }
    let Some(client) = clients.get(name) else {
        tracing::warn!(assignment = %id, forge = name, "fail-task for a GitHub forge this scheduler does not run; waiting");
        return Some(Disposition::Nak(Some(GITHUB_WAIT)));
    };
    let runner = jr_github::listener::runner_name(&id.0.simple().to_string(), 1);
    let wait = |why: &str| {
        tracing::info!(assignment = %id, %runner, why, "fail-task waits for GitHub's end of the runner's job");
        Some(Disposition::Nak(Some(GITHUB_WAIT)))
    };
    match client.runner_by_name(&runner).await {
        // An ephemeral runner is gone after its job: the job's end is on its way.
        Ok(None) => wait("the runner is gone after its job"),
        Ok(Some(found)) => match client.remove_runner(found.id).await {
            Ok(_) => {
                tracing::info!(assignment = %id, %runner, "removed the lost workload's idle runner");
                None
            }
            Err(e) if e.is_exception("JobStillRunningException") => wait("the runner has a job"),
            Err(e) => {
                tracing::warn!(assignment = %id, error = %e, "cannot remove the runner; retrying fail-task");
                Some(Disposition::Nak(Some(Duration::from_secs(5))))
            }
        },
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot look the runner up; retrying fail-task");
            Some(Disposition::Nak(Some(Duration::from_secs(5))))
        }
    }
}
