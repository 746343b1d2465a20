//! act_runner's `tasks_version` rule for a Gitea/Forgejo fetch loop.

use std::time::{Duration, Instant};

/// act_runner's `tasks_version` rule for one fetch loop, compared against the version this
/// loop *sent* (a loop never shares its version with another caller), plus a periodic 0 as a
/// safety net: a version the forge reported while jobs still waited would otherwise hide them
/// until the next version bump.
#[derive(Clone, Debug)]
pub struct TasksVersion {
    stored: i64,
    reset_every: Duration,
    last_zero: Option<Instant>,
}

impl TasksVersion {
    pub fn new(reset_every: Duration) -> Self {
        Self {
            stored: 0,
            reset_every,
            last_zero: None,
        }
    }

    /// The version to send now.
    pub fn to_send(&mut self, now: Instant) -> i64 {
        let due = self
            .last_zero
            .is_none_or(|at| now.saturating_duration_since(at) >= self.reset_every);
        if self.stored == 0 || due {
            self.last_zero = Some(now);
            return 0;
        }
        self.stored
    }

    /// Records the reply to a fetch that sent `sent`.
    pub fn after_reply(&mut self, sent: i64, replied: i64, got_tasks: bool) {
        if replied > sent {
            self.stored = replied;
        }
        if got_tasks {
            // More jobs may be queued: the next fetch must try an assignment.
            self.stored = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_follows_the_reply_only_when_it_is_newer_than_what_was_sent() {
        let t0 = Instant::now();
        let mut v = TasksVersion::new(Duration::from_secs(30));
        assert_eq!(v.to_send(t0), 0);
        v.after_reply(0, 5, false);
        assert_eq!(v.to_send(t0 + Duration::from_secs(1)), 5);
        // An older reply (another registration's view, a restarted forge) does not move it.
        v.after_reply(5, 3, false);
        assert_eq!(v.to_send(t0 + Duration::from_secs(2)), 5);
        v.after_reply(5, 7, false);
        assert_eq!(v.to_send(t0 + Duration::from_secs(3)), 7);
    }

    #[test]
    fn a_received_task_forces_the_next_fetch_to_look_for_more() {
        let t0 = Instant::now();
        let mut v = TasksVersion::new(Duration::from_secs(30));
        let _ = v.to_send(t0);
        v.after_reply(0, 4, false);
        assert_eq!(v.to_send(t0 + Duration::from_secs(1)), 4);
        v.after_reply(4, 4, true);
        assert_eq!(v.to_send(t0 + Duration::from_secs(2)), 0);
    }

    #[test]
    fn version_zero_is_sent_periodically_even_when_the_forge_reports_no_change() {
        let t0 = Instant::now();
        let mut v = TasksVersion::new(Duration::from_secs(30));
        assert_eq!(v.to_send(t0), 0);
        v.after_reply(0, 9, false);
        for s in 1..30 {
            assert_eq!(v.to_send(t0 + Duration::from_secs(s)), 9, "second {s}");
        }
        assert_eq!(v.to_send(t0 + Duration::from_secs(30)), 0);
        v.after_reply(0, 9, false);
        assert_eq!(v.to_send(t0 + Duration::from_secs(31)), 9);
    }
}
