//! The assignment consumer's gate: a pull happens only with a ticket the state machine granted,
//! so the capacity decision is taken in one place. Tickets are counted, not matched: a handler
//! consumes any outstanding ticket, and a ticket whose guard is dropped while still outstanding
//! (the pull ended without a message) is given back. Each granted ticket is thus released
//! exactly once, by whichever comes first.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use jr_bus::{Gate, Permit};
use tokio::sync::{mpsc, oneshot};

use crate::state::{Input, TicketId};

/// Messages from the gate and the consumers to the driver.
pub(crate) enum ToDriver {
    /// A pull of up to `max` messages waits for tickets (at least one).
    PullWanted {
        max: usize,
        reply: oneshot::Sender<Vec<TicketId>>,
    },
    Input(Input),
    Assignment {
        input: Input,
        assignment: Box<jr_protocol::Assignment>,
        reply: oneshot::Sender<jr_bus::Disposition>,
    },
    Command {
        input: Input,
        reply: oneshot::Sender<jr_bus::Disposition>,
    },
}

#[derive(Clone, Default)]
pub(crate) struct Outstanding(Arc<Mutex<BTreeSet<TicketId>>>);

impl Outstanding {
    fn lock(&self) -> MutexGuard<'_, BTreeSet<TicketId>> {
        // Plain inserts and removes: a panic cannot leave the set half-updated.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks a granted ticket outstanding (before it is handed to the waiting pull).
    pub(crate) fn insert(&self, ticket: TicketId) {
        self.lock().insert(ticket);
    }

    /// True when `ticket` was still outstanding.
    pub(crate) fn remove(&self, ticket: TicketId) -> bool {
        self.lock().remove(&ticket)
    }

    /// Takes one outstanding ticket for a delivered message.
    pub(crate) fn consume(&self) -> Option<TicketId> {
        self.lock().pop_first()
    }
}

pub(crate) struct TicketGate {
    pub(crate) tx: mpsc::UnboundedSender<ToDriver>,
    pub(crate) outstanding: Outstanding,
}

struct TicketGuard {
    ticket: TicketId,
    outstanding: Outstanding,
    tx: mpsc::UnboundedSender<ToDriver>,
}

impl Drop for TicketGuard {
    fn drop(&mut self) {
        if self.outstanding.lock().remove(&self.ticket) {
            // The driver may already be gone at shutdown; nothing to give back then.
            let _ = self
                .tx
                .send(ToDriver::Input(Input::TicketDropped(self.ticket)));
        }
    }
}

impl Gate for TicketGate {
    fn acquire(&self) -> Pin<Box<dyn Future<Output = Permit> + Send + '_>> {
        Box::pin(async move {
            let mut permits = self.acquire_many(1).await;
            match permits.pop() {
                Some(permit) => permit,
                None => std::future::pending().await,
            }
        })
    }

    fn acquire_many(&self, max: usize) -> Pin<Box<dyn Future<Output = Vec<Permit>> + Send + '_>> {
        Box::pin(async move {
            let (reply, granted) = oneshot::channel();
            let max = max.max(1);
            if self.tx.send(ToDriver::PullWanted { max, reply }).is_err() {
                return std::future::pending().await;
            }
            match granted.await {
                // The driver marked them outstanding before sending them.
                Ok(tickets) if !tickets.is_empty() => tickets
                    .into_iter()
                    .map(|ticket| {
                        Permit::new(TicketGuard {
                            ticket,
                            outstanding: self.outstanding.clone(),
                            tx: self.tx.clone(),
                        })
                    })
                    .collect(),
                // The driver stopped: never pull again.
                _ => std::future::pending().await,
            }
        })
    }
}
