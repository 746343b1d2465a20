//! The assignment consumer's gate: a pull happens only with tickets the state machine granted,
//! so the capacity decision is taken in one place. One pull may hold several tickets (one per
//! message it may bring); each delivered message carries the permit of one ticket, and its
//! handler takes exactly that ticket. A ticket whose permit is dropped while still outstanding
//! (the pull ended with fewer messages) is given back. Each granted ticket is thus released
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

    /// Takes the ticket of a delivered message's permit, if it is still outstanding.
    pub(crate) fn consume(&self, permit: Option<&Permit>) -> Option<TicketId> {
        let ticket = permit?.guard::<TicketGuard>()?.ticket;
        self.remove(ticket).then_some(ticket)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn permit(
        ticket: u64,
        outstanding: &Outstanding,
        tx: &mpsc::UnboundedSender<ToDriver>,
    ) -> Permit {
        let ticket = TicketId(ticket);
        outstanding.insert(ticket);
        Permit::new(TicketGuard {
            ticket,
            outstanding: outstanding.clone(),
            tx: tx.clone(),
        })
    }

    /// Two messages of one pull: the first finishes (its permit dropped) before the second's
    /// handler runs. Each handler must get its own ticket and nothing may be given back, or
    /// the second message would find no ticket and the state machine would count a slot short.
    #[test]
    fn each_delivery_takes_the_ticket_of_its_own_permit() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let outstanding = Outstanding::default();
        let first = permit(2, &outstanding, &tx);
        let second = permit(1, &outstanding, &tx);
        assert_eq!(outstanding.consume(Some(&first)), Some(TicketId(2)));
        drop(first);
        assert_eq!(outstanding.consume(Some(&second)), Some(TicketId(1)));
        drop(second);
        assert!(rx.try_recv().is_err(), "no ticket was given back");
        assert_eq!(outstanding.consume(None), None);
    }

    #[test]
    fn an_unused_permit_gives_its_ticket_back_once() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let outstanding = Outstanding::default();
        drop(permit(7, &outstanding, &tx));
        match rx.try_recv() {
            Ok(ToDriver::Input(Input::TicketDropped(TicketId(7)))) => {}
            _ => panic!("ticket 7 given back"),
        }
        assert!(rx.try_recv().is_err());
        assert_eq!(outstanding.lock().len(), 0);
    }
}
