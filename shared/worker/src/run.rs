//! Wiring a [`Worker`]: start-up recovery, then the assignment and command consumers, the
//! backend's observer and the driver, all tied to one shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jr_bus::{ConsumerOptions, Delivery, Disposition};
use jr_protocol::{Assignment, BackendName, DeleteWorkload, Envelope, Message};
use jr_telemetry::{Shutdown, TaskSet};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, ObservedWorkload};
use crate::driver::{DeliveryIds, Driver, Io, Worker};
use crate::error::WorkerError;
use crate::facts::bus_facts;
use crate::gate::{Outstanding, TicketGate, ToDriver};
use crate::ledger::Ledger;
use crate::replicas::{Renewal, Replica, replica_name, taken_over};
use crate::state::{AttemptKey, BusFacts, Input};

/// Most assignments one pull of the assignment consumer asks for: as many as free slots allow
/// up to this, so a worker with many free slots fills them at the pace of the bus rather than
/// one pull round trip per assignment.
const PULL_BATCH: usize = 32;

/// Checks that a message on the assignment consumer is an assignment for this backend.
pub(crate) fn classify_assignment(
    envelope: &Envelope,
    backend: &BackendName,
) -> Result<Assignment, String> {
    match &envelope.message {
        Message::Assignment(a) if a.backend == *backend => Ok(a.clone()),
        Message::Assignment(a) => Err(format!(
            "assignment for backend {} reached {backend}",
            a.backend
        )),
        other => Err(format!("expected an assignment, got {}", other.kind())),
    }
}

/// Commands handled at once (and the most pulled at once).
const COMMAND_HANDLERS: usize = 8;

/// Checks that a command is a `delete-workload` for this backend; returns the workload.
pub(crate) fn classify_command(
    envelope: &Envelope,
    backend: &BackendName,
) -> Result<String, String> {
    match &envelope.message {
        Message::DeleteWorkload(DeleteWorkload {
            backend: target,
            workload,
            ..
        }) if target == backend => Ok(workload.clone()),
        Message::DeleteWorkload(d) => Err(format!(
            "delete for backend {} reached {backend}",
            d.backend
        )),
        other => Err(format!("unexpected command {}", other.kind())),
    }
}

/// Retries `op` with capped backoff until it succeeds or shutdown fires.
async fn until_ok<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    what: &str,
    shutdown: &CancellationToken,
    mut op: impl FnMut() -> F,
) -> Option<T> {
    let mut backoff = jr_bus::Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        match op().await {
            Ok(value) => return Some(value),
            Err(error) => tracing::warn!(%error, "{what} failed at start; retrying"),
        }
        if !backoff.pause(shutdown).await {
            return None;
        }
    }
}

impl<B: Backend> Worker<B> {
    /// Runs until `shutdown`: recovery from the bus and the backend, then assignments,
    /// commands and observation. `report(ready)` is called after every input (readiness).
    pub async fn run(
        self,
        report: impl Fn(bool) + Send + 'static,
        shutdown: CancellationToken,
    ) -> Result<(), WorkerError> {
        self.metrics.slots_total.set(self.settings.capacity as i64);
        self.ensure_topology(&shutdown).await?;
        let backend_name = self.settings.backend.clone();
        // This process's name: workloads it creates carry it, and replicas share capacity
        // under it.
        let name = replica_name(&self.settings.worker_id);
        let mut settings = self.settings.clone();
        settings.worker_id = name.clone();
        let Some(mut ledger) = until_ok("opening the ledger", &shutdown, || {
            Ledger::open(&self.bus, &backend_name, &name)
        })
        .await
        else {
            return Ok(());
        };
        let mut replica = Replica::new(name.clone(), ledger.store().clone(), settings.capacity);
        // The first holding: takes over an earlier process of this replica (and any replica
        // that stopped), whose workloads are recovered below.
        let mut first = None;
        while first.is_none() {
            match replica.renew(0, &Default::default()).await {
                Renewal::Held { slots, adopted } => first = Some((slots, adopted)),
                Renewal::Failed(error) => {
                    tracing::warn!(%error, "writing this replica's first holding failed; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
                Renewal::Lost { by } => {
                    return Err(WorkerError::Lost {
                        replica: name,
                        by: by.unwrap_or_default(),
                    });
                }
            }
        }
        let (slots, adopted) = first.unwrap_or_default();
        let Some(listed) = until_ok("listing workloads", &shutdown, || self.backend.list()).await
        else {
            return Ok(());
        };
        let Some(entries) = until_ok("reading the ledger", &shutdown, || ledger.all()).await else {
            return Ok(());
        };
        let (listed, entries) = taken_over(listed, entries, replica.bare(), |c| replica.manages(c));
        ledger.adopt(&entries);
        let remembered: Vec<(AttemptKey, String)> =
            entries.into_iter().map(|e| (e.key, e.workload)).collect();
        tracing::info!(
            replica = %name,
            listed = listed.len(),
            remembered = remembered.len(),
            capacity = settings.capacity,
            slots,
            took_over = ?adopted,
            "recovering"
        );
        self.metrics.adopted.inc_by(listed.len() as u64);
        self.metrics.takeovers.inc_by(adopted.len() as u64);
        self.metrics.slots_held.set(slots as i64);
        self.metrics.replicas.set(replica.replicas() as i64);

        // Each job's trace, so the events published later continue it.
        let traces = jr_bus::TraceBook::default();
        let warm_bindings = match &self.settings.warm {
            Some(_) => {
                let Some(store) = until_ok("opening the warm binding bucket", &shutdown, || {
                    crate::ledger::open_warm_bindings(&self.bus, &backend_name)
                })
                .await
                else {
                    return Ok(());
                };
                Some(store)
            }
            None => None,
        };
        let io = Io {
            warm_bindings,
            bus: self.bus.clone(),
            backend: self.backend.clone(),
            settings,
            metrics: self.metrics.clone(),
            shutdown: shutdown.clone(),
            traces: traces.clone(),
        };
        let outstanding = Outstanding::default();
        let mut driver = Driver::new(io, ledger, outstanding.clone(), replica);
        // Replicas first: each keeps its part of the warm executors from the start.
        let replicas = driver.replica.replicas();
        driver.feed(Input::Replicas(replicas)).await;
        driver.replicas = replicas;
        // Capacity before recovery: recovered with none, every adopted workload would be
        // slot debt and the adopted idle warm executors would be retired at once.
        driver.feed(Input::Capacity(slots)).await;
        driver.feed(Input::Recovered { listed, remembered }).await;

        let (tx, rx) = mpsc::unbounded_channel::<ToDriver>();
        let (obs_tx, obs_rx) = mpsc::channel::<ObservedWorkload>(1024);
        let mut tasks = TaskSet::new(Shutdown::from(shutdown.clone()));
        {
            let (backend, stop) = (self.backend.clone(), shutdown.clone());
            tasks.spawn("observer", async move {
                backend
                    .observe(obs_tx, async move { stop.cancelled().await })
                    .await
            });
        }
        let ids = DeliveryIds::default();
        let (assignments, commands) = Self::topology(&self.settings.backend);
        {
            let (bus, stop, tx, ids) =
                (self.bus.clone(), shutdown.clone(), tx.clone(), ids.clone());
            let backend = self.settings.backend.clone();
            let metrics = self.metrics.clone();
            let traces = traces.clone();
            tasks.spawn("command consumer", async move {
                let handler = move |delivery: Delivery| {
                    let (tx, ids, backend, metrics, traces) = (
                        tx.clone(),
                        ids.clone(),
                        backend.clone(),
                        metrics.clone(),
                        traces.clone(),
                    );
                    async move {
                        let workload = match classify_command(&delivery.envelope, &backend) {
                            Ok(workload) => workload,
                            Err(reason) => {
                                metrics.terminated_messages.inc();
                                return Disposition::Term(reason);
                            }
                        };
                        let key = AttemptKey::new(
                            delivery.envelope.assignment_id,
                            delivery.envelope.attempt,
                        );
                        // A job this worker has not seen since its start continues the
                        // command's trace.
                        traces.remember(key.assignment, jr_bus::current_trace_context());
                        let (reply, answer) = oneshot::channel();
                        let input = Input::DeleteRequested {
                            delivery: ids.next(),
                            key,
                            workload,
                        };
                        if tx.send(ToDriver::Command { input, reply }).is_err() {
                            return Disposition::Nak(Some(Duration::from_secs(2)));
                        }
                        answer
                            .await
                            .unwrap_or(Disposition::Nak(Some(Duration::from_secs(2))))
                    }
                };
                // Pulled only for a free handler, a few at a time, with a short-lived pull
                // request: nothing waits in this process's buffer for a handler, so a worker
                // that dies holds no command longer than the consumer's short ack_wait.
                bus.run_consumer(
                    &commands,
                    handler,
                    ConsumerOptions::default()
                        .concurrency(COMMAND_HANDLERS)
                        .gate(Arc::new(jr_bus::SemaphoreGate::new(COMMAND_HANDLERS)))
                        .pull_batch(COMMAND_HANDLERS),
                    stop,
                )
                .await
            });
        }
        {
            let (bus, stop, tx, ids) =
                (self.bus.clone(), shutdown.clone(), tx.clone(), ids.clone());
            let backend = self.settings.backend.clone();
            let metrics = self.metrics.clone();
            let gate = Arc::new(TicketGate {
                tx: tx.clone(),
                outstanding: outstanding.clone(),
            });
            let capacity = self.settings.capacity;
            let traces = traces.clone();
            tasks.spawn("assignment consumer", async move {
                let handler_bus = bus.clone();
                let handler = move |delivery: Delivery| {
                    let (bus, tx, ids, backend, metrics, outstanding) = (
                        handler_bus.clone(),
                        tx.clone(),
                        ids.clone(),
                        backend.clone(),
                        metrics.clone(),
                        outstanding.clone(),
                    );
                    // The consume span is a child of the job's trace: what follows joins it.
                    traces.remember(
                        delivery.envelope.assignment_id,
                        jr_bus::current_trace_context().or_else(|| delivery.envelope.trace.clone()),
                    );
                    async move {
                        handle_assignment(
                            delivery,
                            &bus,
                            &tx,
                            &ids,
                            &backend,
                            &metrics,
                            &outstanding,
                        )
                        .await
                    }
                };
                bus.run_consumer(
                    &assignments,
                    handler,
                    ConsumerOptions::default()
                        // Handlers for the slots, and for the deliveries parked for their
                        // fair share (they hold no slot).
                        .concurrency(capacity.saturating_mul(1 + crate::state::PARK_PER_SLOT))
                        .gate(gate)
                        .pull_batch(PULL_BATCH),
                    stop,
                )
                .await
            });
        }
        drop(tx);
        let started = Instant::now();
        tracing::debug!(?started, "worker running");
        let lost = driver.run(rx, obs_rx, report).await;
        shutdown.cancel();
        let joined = tasks.join_all(Duration::from_secs(15)).await;
        if !joined.is_clean() {
            tracing::warn!(failed = ?joined.failed, unfinished = ?joined.unfinished, "worker tasks did not end cleanly");
        }
        match lost {
            Some(by) => Err(WorkerError::Lost { replica: name, by }),
            None => Ok(()),
        }
    }
}

async fn handle_assignment(
    delivery: Delivery,
    bus: &jr_bus::Bus,
    tx: &mpsc::UnboundedSender<ToDriver>,
    ids: &DeliveryIds,
    backend: &BackendName,
    metrics: &crate::metrics::WorkerMetrics,
    outstanding: &Outstanding,
) -> Disposition {
    // The pull that brought this message used the ticket of its permit; take it now (see
    // `gate`), and give it back if the message cannot reach the state machine.
    let ticket = outstanding.consume(delivery.permit.as_ref());
    let give_back = || {
        if let Some(ticket) = ticket {
            let _ = tx.send(ToDriver::Input(Input::TicketDropped(ticket)));
        }
    };
    let assignment = match classify_assignment(&delivery.envelope, backend) {
        Ok(assignment) => assignment,
        Err(reason) => {
            give_back();
            metrics.terminated_messages.inc();
            return Disposition::Term(reason);
        }
    };
    let key = AttemptKey::new(delivery.envelope.assignment_id, delivery.envelope.attempt);
    let facts = match bus_facts(bus, backend, key.assignment).await {
        // Whether a warm executor may run it is the forge's to say (a GitHub job runs only on
        // the just-in-time runner made for it).
        Ok(facts) => BusFacts {
            no_warm: !assignment.forge_kind().may_bind_warm(),
            ..facts
        },
        Err(error) => {
            give_back();
            tracing::warn!(%key, %error, "cannot read what the bus knows about the assignment; will retry");
            return Disposition::Nak(Some(Duration::from_secs(2)));
        }
    };
    let (reply, answer) = oneshot::channel();
    let input = Input::Delivered {
        delivery: ids.next(),
        key,
        ticket,
        facts,
    };
    let message = ToDriver::Assignment {
        input,
        assignment: Box::new(assignment),
        reply,
    };
    if tx.send(message).is_err() {
        return Disposition::Nak(Some(Duration::from_secs(2)));
    }
    answer
        .await
        .unwrap_or(Disposition::Nak(Some(Duration::from_secs(2))))
}
