//! Capacity slots of one worker. The consumer asks the gate before each pull, so a full backend
//! stops pulling and its work waits in JetStream. The gate can also be paused (the backend said
//! "full, retry after …") and can account for adopted workloads beyond capacity (debt).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use jr_bus::{Gate, Permit};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

#[derive(Debug)]
pub struct Slots {
    capacity: usize,
    semaphore: Arc<Semaphore>,
    paused_until: Mutex<Option<Instant>>,
}

impl Slots {
    pub fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            capacity,
            semaphore: Arc::new(Semaphore::new(capacity)),
            paused_until: Mutex::new(None),
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn used(&self) -> usize {
        self.capacity
            .saturating_sub(self.semaphore.available_permits())
    }

    /// Takes a slot for a workload found at start, without waiting. `None` means the backend
    /// already holds more workloads than capacity (the caller keeps pulling blocked until some go).
    pub fn adopt(&self) -> Option<OwnedSemaphorePermit> {
        self.semaphore.clone().try_acquire_owned().ok()
    }

    /// Stop handing out slots for `delay` (backend reported it is full).
    pub fn pause_for(&self, delay: Duration) {
        let until = Instant::now() + delay;
        if let Ok(mut p) = self.paused_until.lock() {
            *p = Some(p.map_or(until, |cur| cur.max(until)));
        }
    }

    fn pause_remaining(&self) -> Option<Duration> {
        let until = self.paused_until.lock().ok().and_then(|p| *p)?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }
}

impl Gate for Slots {
    fn acquire(&self) -> Pin<Box<dyn Future<Output = Permit> + Send + '_>> {
        Box::pin(async move {
            loop {
                while let Some(wait) = self.pause_remaining() {
                    tokio::time::sleep(wait).await;
                }
                let Ok(permit) = self.semaphore.clone().acquire_owned().await else {
                    return std::future::pending().await;
                };
                // A pause may have started while we waited for the slot.
                if self.pause_remaining().is_none() {
                    return Permit::new(permit);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn paused_gate_hands_out_no_slot_until_the_pause_ends() {
        let slots = Slots::new(1);
        slots.pause_for(Duration::from_secs(5));
        let started = Instant::now();
        let _p = slots.acquire().await;
        assert!(started.elapsed() >= Duration::from_secs(5));
        assert_eq!(slots.used(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn adopted_workloads_take_slots() {
        let slots = Slots::new(2);
        let a = slots.adopt();
        let b = slots.adopt();
        assert!(a.is_some() && b.is_some());
        assert!(slots.adopt().is_none());
        assert_eq!(slots.used(), 2);
        drop(a);
        assert_eq!(slots.used(), 1);
    }
}
