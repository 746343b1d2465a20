//! The GitHub forge's answer to `fail-task`. A GitHub runner reports to GitHub, not to the
//! facade, so its workload may be gone before the listener has its job's end: the command waits
//! while GitHub holds the runner busy, or while the runner is gone after its job (that job's
//! `JobCompleted` ends the assignment); a runner that never took a job is removed from GitHub,
//! so it cannot take one, and its assignment ends as `withdrawn` (the job it was made for runs
//! on another runner, one the listener makes because the runner count no longer covers the
//! jobs waiting). A redispatch of a GitHub assignment is answered the same way: a runner's
//! registration works once, so the same runner cannot be started again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use jr_bus::{Bus, Disposition};
use jr_intake::{ForgeCommands, LostTask};
use jr_protocol::{
    AssignmentId, BackendName, ForgeKind, Kind, STREAM_EVENTS, TaskResult, Terminal,
    TerminalSource, subject,
};

/// How long a `fail-task` for a GitHub runner that took a job waits before looking again: the
/// job's end comes from GitHub through the listener.
const GITHUB_WAIT: Duration = Duration::from_secs(10);

/// `fail-task` for the assignments of the `[[github]]` entries this scheduler runs.
#[derive(Clone)]
pub struct GitHubCommands {
    pub bus: Bus,
    /// The scale set clients, by `[[github]]` name.
    pub clients: Arc<BTreeMap<String, jr_github::ScaleSetClient>>,
}

impl ForgeCommands for GitHubCommands {
    fn serves(&self, forge: &ForgeKind) -> bool {
        match forge {
            ForgeKind::GitHub(_) => true,
            ForgeKind::Gitea(_) => false,
        }
    }

    fn fail_task<'a>(&'a self, lost: LostTask<'a>) -> BoxFuture<'a, Disposition> {
        Box::pin(fail_task(self, lost))
    }

    fn ends_lost_attempts(&self) -> bool {
        true
    }
}

async fn fail_task(commands: &GitHubCommands, lost: LostTask<'_>) -> Disposition {
    let ForgeKind::GitHub(name) = lost.forge else {
        return Disposition::Term("not a GitHub assignment".to_owned());
    };
    let (bus, backend, id) = (&commands.bus, lost.backend, lost.id);
    if let Some(wait) = runner_busy(bus, &commands.clients, name, backend, id).await {
        return wait;
    }
    let withdrawn = Terminal {
        forge_task_id: lost.forge_task_id,
        result: TaskResult::Cancelled,
        source: TerminalSource::Withdrawn,
        log_closed: true,
        reason: Some(format!("runner lost before it took a job: {}", lost.reason)),
    };
    match jr_intake::ours::publish_terminal(bus, backend, id, lost.attempt, "fail-task", withdrawn)
        .await
    {
        Ok(_) => Disposition::Ack,
        Err(e) => {
            tracing::warn!(assignment = %id, error = %e, "cannot publish terminal; retrying");
            Disposition::Nak(Some(Duration::from_secs(2)))
        }
    }
}

/// `None` when the failure may be recorded now (the runner never took a job, and is removed
/// from GitHub so it cannot take one), else what to do with the command: done when the
/// assignment is final, or wait while GitHub still holds the runner busy or the runner is gone
/// after its job (its `JobCompleted` ends the assignment).
async fn runner_busy(
    bus: &Bus,
    clients: &BTreeMap<String, jr_github::ScaleSetClient>,
    name: &str,
    backend: &BackendName,
    id: AssignmentId,
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
                tracing::warn!(assignment = %id, error = %jr_telemetry::error_chain(&e), "cannot remove the runner; retrying fail-task");
                Some(Disposition::Nak(Some(Duration::from_secs(5))))
            }
        },
        Err(e) => {
            tracing::warn!(assignment = %id, error = %jr_telemetry::error_chain(&e), "cannot look the runner up; retrying fail-task");
            Some(Disposition::Nak(Some(Duration::from_secs(5))))
        }
    }
}
