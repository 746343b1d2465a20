//! What one executor (or anyone who can reach the facade from a job) may cost the scheduler:
//! request body size and arrival time, open connections, and calls per second per assignment.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use jr_protocol::AssignmentId;

/// The facade's resource bounds (`[facade]` keys of the same names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FacadeLimits {
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
    pub max_connections: usize,
    pub max_calls_per_second: u32,
}

impl Default for FacadeLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_calls_per_second: 50,
        }
    }
}

impl From<&jr_config::FacadeConfig> for FacadeLimits {
    fn from(f: &jr_config::FacadeConfig) -> Self {
        Self {
            max_body_bytes: f.max_body_bytes,
            body_timeout: f.body_timeout,
            max_connections: f.max_connections.max(1),
            max_calls_per_second: f.max_calls_per_second.max(1),
        }
    }
}

/// Calls per assignment in the current one-second window. The map holds only the assignments
/// seen in the current window, so it stays as small as the set of active executors.
#[derive(Debug)]
pub struct CallRate {
    per_second: u32,
    window: Mutex<(Instant, HashMap<AssignmentId, u32>)>,
}

impl CallRate {
    pub fn new(per_second: u32) -> Self {
        Self {
            per_second,
            window: Mutex::new((Instant::now(), HashMap::new())),
        }
    }

    /// Counts a call of `id` at `now`; `false` when it is over the limit.
    pub fn admit(&self, id: AssignmentId, now: Instant) -> bool {
        let mut guard = self
            .window
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (start, counts) = &mut *guard;
        if now.saturating_duration_since(*start) >= Duration::from_secs(1) {
            *start = now;
            counts.clear();
        }
        let n = counts.entry(id).or_default();
        *n = n.saturating_add(1);
        *n <= self.per_second
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_over_the_per_second_limit_are_refused_until_the_next_window() {
        let rate = CallRate::new(3);
        let t0 = Instant::now();
        let (a, b) = (
            AssignmentId::for_task("f", 1),
            AssignmentId::for_task("f", 2),
        );
        assert!((0..3).all(|_| rate.admit(a, t0)));
        assert!(!rate.admit(a, t0 + Duration::from_millis(500)));
        // Another assignment has its own budget.
        assert!(rate.admit(b, t0 + Duration::from_millis(500)));
        assert!(rate.admit(a, t0 + Duration::from_secs(1)));
    }
}
