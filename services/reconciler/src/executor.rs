//! Turns planned commands into messages. Every message id derives from the command id, so a
//! command planned again from an unchanged state is a JetStream duplicate, not a second action.
//!
//! Commands (`delete-workload`, `redispatch`, `fail-task`) carry the reissue period in their
//! message id (`<command id>@<period>`): copies within one period are duplicates, but a command
//! the planner still asks for a period later is delivered again. Its first delivery may have had
//! no lasting effect (a worker killed between deleting a workload and reporting it released),
//! and the streams' duplicate window (minutes) would otherwise swallow every reissue.

use jr_protocol::now_ms;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use jr_bus::{Bus, BusError};
use jr_protocol::{DeleteWorkload, Envelope, FailTask, Kind, Message, Redispatch, subject};

use crate::planner::PlannedCommand;

/// Publishes commands, skipping ones issued within `reissue_after` (they are in flight; the
/// server would drop them as duplicates anyway, this saves the round trip).
pub struct Executor {
    bus: Bus,
    metrics: std::sync::Arc<crate::metrics::ReconcilerMetrics>,
    reissue_after: Duration,
    issued: HashMap<String, Instant>,
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
            issued: HashMap::new(),
        }
    }

    /// Executes `commands`; returns how many were published now.
    pub async fn execute(&mut self, commands: &[PlannedCommand]) -> usize {
        let now = Instant::now();
        self.issued
            .retain(|_, at| now.duration_since(*at) < self.reissue_after);
        let mut published = 0;
        for command in commands {
            let id = command.id();
            if self.issued.contains_key(&id) {
                continue;
            }
            match self.publish(command, &id).await {
                Ok(()) => {
                    tracing::info!(command = %id, reason = command.reason(), "command issued");
                    self.metrics
                        .commands
                        .get_or_create(&crate::metrics::KindLabel {
                            kind: command.kind().to_owned(),
                        })
                        .inc();
                    self.issued.insert(id, now);
                    published += 1;
                }
                Err(e) => {
                    tracing::warn!(command = %id, error = %e, "command not issued; will retry")
                }
            }
        }
        published
    }

    /// `<command id>@<reissue period number>`: the same within a period (whichever reconciler
    /// instance publishes), new in the next one.
    fn message_id(&self, id: &str) -> String {
        let period = u64::try_from(self.reissue_after.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        format!("{id}@{}", now_ms() / period)
    }

    async fn publish(&self, command: &PlannedCommand, id: &str) -> Result<(), ExecuteError> {
        match command {
            PlannedCommand::DeleteWorkload {
                backend,
                workload,
                assignment_id,
                attempt,
                reason,
            } => {
                let envelope = Envelope::new(
                    self.message_id(id),
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
                    self.message_id(id),
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
                    self.message_id(id),
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
