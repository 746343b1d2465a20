//! The one retry helper of jetrunner: capped exponential backoff with jitter, so replicas and
//! loops that failed together do not retry in step. Every retry loop of the services uses it.

use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

/// Capped exponential backoff with jitter: each delay is drawn from `[d/2, d]` where `d`
/// doubles from `initial` up to `max`.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            current: initial,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.current;
        self.current = (self.current * 2).min(self.max);
        let half = ceiling / 2;
        let jitter_ns = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let extra = if jitter_ns == 0 {
            0
        } else {
            rand::rng().random_range(0..=jitter_ns)
        };
        half + Duration::from_nanos(extra)
    }

    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

impl Default for Backoff {
    /// 100 ms doubling up to 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// Sleeps the next delay. `false` when `stop` fired first (the caller gives up).
    pub async fn pause(&mut self, stop: &CancellationToken) -> bool {
        let delay = self.next_delay();
        tokio::select! {
            () = stop.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_and_stays_within_jitter_bounds() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        let ceilings = [100, 200, 400, 800, 800, 800];
        for ceiling in ceilings {
            let delay = backoff.next_delay();
            let ceiling = Duration::from_millis(ceiling);
            assert!(
                delay >= ceiling / 2 && delay <= ceiling,
                "{delay:?} outside [{:?}, {ceiling:?}]",
                ceiling / 2
            );
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
