//! The one place an assignment is built, sealed and published, for every forge: an intake
//! hands over a [`Draft`] (what it learned about the job, and the plaintext its executor needs)
//! and gets back the assignment's envelope, sealed with the scheduler's key for exactly that
//! assignment, backend and forge task.

use std::sync::Arc;
use std::time::Duration;

use jr_bus::Bus;
use jr_protocol::{
    Assignment, AssignmentId, BackendName, Envelope, ForgeKind, Message, now_ms, subject,
};
use jr_seal::{SealError, SealScope, Sealer};

/// What an intake learned about one job, ready to become attempt 1 of an assignment.
#[derive(Clone, Debug)]
pub struct Draft {
    pub id: AssignmentId,
    pub forge: ForgeKind,
    pub forge_task_id: i64,
    pub backend: BackendName,
    /// Why the job went to `backend` (shown by the status page).
    pub placement: String,
    pub labels: Vec<String>,
    pub repository: String,
    pub workflow: Option<String>,
    pub job_name: String,
    pub max_duration: Duration,
    /// What the executor needs to run the job, sealed into the assignment.
    pub plaintext: Vec<u8>,
    /// The tail of the message id: the same tail publishes as a duplicate (deduplicated),
    /// a new one replaces the copy on the subject.
    pub dedup: String,
}

/// Builds, seals and publishes assignments.
#[derive(Clone)]
pub struct AssignmentSink {
    bus: Bus,
    sealer: Arc<Sealer>,
}

impl std::fmt::Debug for AssignmentSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AssignmentSink")
    }
}

impl AssignmentSink {
    pub fn new(bus: Bus, sealer: Arc<Sealer>) -> Self {
        Self { bus, sealer }
    }

    pub fn sealer(&self) -> &Arc<Sealer> {
        &self.sealer
    }

    /// The envelope of attempt 1 of `draft`'s assignment, its task sealed.
    pub fn build(&self, draft: Draft) -> Result<Envelope, SealError> {
        let sealed_task = self.sealer.seal(
            SealScope::new(draft.id, &draft.backend, draft.forge_task_id),
            &draft.plaintext,
        )?;
        let fetched_at = now_ms();
        Ok(Envelope::new(
            format!("assignment:{}:1:{}", draft.id, draft.dedup),
            fetched_at,
            draft.id,
            1,
            Message::Assignment(Assignment {
                forge_instance: draft.forge.instance(),
                forge_task_id: draft.forge_task_id,
                backend: draft.backend,
                provider: None,
                placement: Some(draft.placement),
                labels: draft.labels,
                repository: draft.repository,
                workflow: draft.workflow,
                job_name: draft.job_name,
                max_duration_secs: draft.max_duration.as_secs(),
                fetched_at,
                sealed_task,
            }),
        ))
    }

    /// Publishes the assignment envelope `envelope` (built by [`AssignmentSink::build`] for
    /// `backend`) on its subject and waits until it is durable; a repeat of the same message
    /// id is deduplicated.
    pub async fn publish(
        &self,
        backend: &BackendName,
        envelope: &Envelope,
    ) -> Result<jr_bus::PublishOutcome, jr_bus::BusError> {
        self.bus
            .publish(
                &subject::assignment(backend, envelope.assignment_id),
                envelope,
            )
            .await
    }

    /// How many more jobs `backend` may take now: its lookahead less the assignments waiting
    /// for its worker; 0 when the worker's consumer cannot be read.
    pub async fn room(&self, backend: &BackendName, lookahead: usize) -> usize {
        let waiting = crate::presence::waiting(&self.bus, backend).await;
        crate::pacing::room(&[crate::pacing::BackendRoom { lookahead, waiting }])
    }
}
