//! Turns planned commands into messages. Every message id derives from the command id, so a
//! command planned again from an unchanged state is a JetStream duplicate, not a second action.
//!
//! Commands (`delete-workload`, `redispatch`, `fail-task`) carry the reissue period in their
//! message id (`<command id>@<period>`): copies within one period are duplicates, but a command
//! the planner still asks for a period later is delivered again. Its first delivery may have had
//! no lasting effect (a worker killed between deleting a workload and reporting it released),
//! and the streams' duplicate window (minutes) would otherwise swallow every reissue. Which
//! commands to publish when (new ones at once, wanted ones again each period) is the
//! incremental planner's decision; the executor publishes what it is given.

use jr_protocol::now_ms;
use std::time::Duration;

use jr_bus::{Bus, BusError};
use jr_protocol::{DeleteWorkload, Envelope, FailTask, Kind, Message, Redispatch, subject};

use crate::planner::PlannedCommand;

/// Publishes commands.
pub struct Executor {
    bus: Bus,
    metrics: std::sync::Arc<crate::metrics::ReconcilerMetrics>,
    reissue_after: Duration,
    traces: jr_bus::TraceBook,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    #[error("publish: {0}")]
    Bus(#[from] BusError),
}

impl Executor {
    pub fn new(
        bus: Bus,
        metrics: std::sync::Arc<crate::metrics::ReconcilerMetrics>,
        reissue_after: Duration,
    ) -> Self {
        Self {
            bus,
            metrics,
            reissue_after,
            traces: jr_bus::TraceBook::default(),
        }
    }

    /// Commands continue the traces of their jobs found in `traces`.
    pub fn with_traces(mut self, traces: jr_bus::TraceBook) -> Self {
        self.traces = traces;
        self
    }

    /// Publishes `commands` planned at `planned_at` (unix ms; it picks the reissue period of
    /// their message ids, so a command planned again a period later is never a duplicate);
    /// returns the ones that could not be published.
    pub async fn execute(
        &mut self,
        commands: &[PlannedCommand],
        planned_at: u64,
    ) -> Vec<PlannedCommand> {
        let mut failed = Vec::new();
        for command in commands {
            let id = command.id();
            let message_id = self.message_id(&id, planned_at);
            let span = tracing::info_span!(
                parent: None,
                "reconciler command",
                kind = command.kind(),
                assignment = %command.assignment_id(),
                reason = command.reason(),
            );
            jr_bus::follow(&span, self.traces.get(command.assignment_id()).as_ref());
            let published =
                tracing::Instrument::instrument(self.publish(command, message_id), span).await;
            match published {
                Ok(()) => {
                    tracing::debug!(command = %id, reason = command.reason(), "command issued");
                    self.metrics
                        .commands
                        .get_or_create(&crate::metrics::KindLabel {
                            kind: command.kind().to_owned(),
                        })
                        .inc();
                }
                Err(e) => {
                    tracing::warn!(command = %id, error = %e, "command not issued; will retry");
                    failed.push(command.clone());
                }
            }
        }
        failed
    }

    /// `<command id>@<reissue period number>`: the same within a period (whichever reconciler
    /// instance publishes), new in the next one.
    fn message_id(&self, id: &str, at: u64) -> String {
        let period = u64::try_from(self.reissue_after.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        format!("{id}@{}", at / period)
    }

    async fn publish(
        &self,
        command: &PlannedCommand,
        message_id: String,
    ) -> Result<(), ExecuteError> {
        match command {
            PlannedCommand::DeleteWorkload {
                backend,
                workload,
                assignment_id,
                attempt,
                reason,
            } => {
                let envelope = Envelope::new(
                    message_id,
                    now_ms(),
                    *assignment_id,
                    *attempt,
                    Message::DeleteWorkload(DeleteWorkload {
                        backend: backend.clone(),
                        workload: workload.clone(),
                        reason: reason.clone(),
                    }),
                );
                self.bus
                    .publish(
                        &subject::command(backend.as_str(), Kind::DeleteWorkload),
                        &envelope,
                    )
                    .await?;
            }
            PlannedCommand::FailTask {
                assignment_id,
                attempt,
                backend,
                forge_task_id,
                reason,
            } => {
                let envelope = Envelope::new(
                    message_id,
                    now_ms(),
                    *assignment_id,
                    *attempt,
                    Message::FailTask(FailTask {
                        forge_task_id: *forge_task_id,
                        backend: backend.clone(),
                        reason: reason.clone(),
                    }),
                );
                self.bus
                    .publish(
                        &subject::command(subject::SCHEDULER_TARGET, Kind::FailTask),
                        &envelope,
                    )
                    .await?;
            }
            PlannedCommand::Redispatch {
                assignment_id,
                backend,
                next_attempt,
                reason,
            } => {
                // The scheduler, the only writer of `jr.assignment.>`, publishes the new attempt
                // (from its own sealed assignment) and the `redispatched` event.
                let envelope = Envelope::new(
                    message_id,
                    now_ms(),
                    *assignment_id,
                    next_attempt.saturating_sub(1),
                    Message::Redispatch(Redispatch {
                        backend: backend.clone(),
                        next_attempt: *next_attempt,
                        reason: reason.clone(),
                    }),
                );
                self.bus
                    .publish(
                        &subject::command(subject::SCHEDULER_TARGET, Kind::Redispatch),
                        &envelope,
                    )
                    .await?;
            }
        }
        Ok(())
    }
}
