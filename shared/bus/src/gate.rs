//! Capacity gating for consumers: a consumer asks its [`Gate`] for a [`Permit`] before it pulls
//! the next message, so a full worker does not pull and the work waits in JetStream.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::Semaphore;

/// A held capacity slot. Dropping it frees the slot; a handler may keep it (move it into its
/// own state) for as long as the work occupies capacity.
pub struct Permit {
    guard: Option<Box<dyn Any + Send + Sync>>,
}

impl Permit {
    /// A permit that frees its slot when `guard` is dropped.
    pub fn new(guard: impl Send + Sync + 'static) -> Self {
        Self {
            guard: Some(Box::new(guard)),
        }
    }

    /// A permit that holds nothing.
    pub fn unlimited() -> Self {
        Self { guard: None }
    }

    /// The guard this permit was made with, when it is a `T` (so the gate that made it can
    /// tell which of its slots a delivery holds).
    pub fn guard<T: 'static>(&self) -> Option<&T> {
        self.guard.as_ref()?.downcast_ref::<T>()
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Permit")
    }
}

/// Decides when a consumer may pull. `acquire` waits until a slot is free.
pub trait Gate: Send + Sync + 'static {
    fn acquire(&self) -> Pin<Box<dyn Future<Output = Permit> + Send + '_>>;

    /// Waits until at least one slot is free and takes up to `max` of the free ones, so one pull
    /// can bring several messages. The default takes exactly one.
    fn acquire_many(&self, max: usize) -> Pin<Box<dyn Future<Output = Vec<Permit>> + Send + '_>> {
        let _ = max;
        Box::pin(async move { vec![self.acquire().await] })
    }
}

/// A gate over a counting semaphore: `capacity` slots, more can be added or removed at runtime.
#[derive(Clone, Debug)]
pub struct SemaphoreGate {
    semaphore: Arc<Semaphore>,
}

impl SemaphoreGate {
    pub fn new(capacity: usize) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(capacity)),
        }
    }

    /// Free slots right now.
    pub fn available(&self) -> usize {
        self.semaphore.available_permits()
    }

    pub fn add_permits(&self, n: usize) {
        self.semaphore.add_permits(n);
    }

    /// Takes one slot without waiting (e.g. for adopted workloads found at start).
    pub fn try_acquire(&self) -> Option<Permit> {
        self.semaphore
            .clone()
            .try_acquire_owned()
            .ok()
            .map(Permit::new)
    }
}

impl Gate for SemaphoreGate {
    fn acquire(&self) -> Pin<Box<dyn Future<Output = Permit> + Send + '_>> {
        Box::pin(async move {
            match self.semaphore.clone().acquire_owned().await {
                Ok(permit) => Permit::new(permit),
                // The semaphore is never closed by this type; if it were, never hand out slots.
                Err(_closed) => std::future::pending().await,
            }
        })
    }

    fn acquire_many(&self, max: usize) -> Pin<Box<dyn Future<Output = Vec<Permit>> + Send + '_>> {
        Box::pin(async move {
            let mut permits = vec![self.acquire().await];
            while permits.len() < max {
                match self.try_acquire() {
                    Some(permit) => permits.push(permit),
                    None => break,
                }
            }
            permits
        })
    }
}
