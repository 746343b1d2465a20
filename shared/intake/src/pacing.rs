//! Pure pacing decisions every intake shares: whether a backend takes work (a live worker,
//! and room left in its lookahead), and how many jobs an intake may take for its backends now.

use std::time::Duration;

use jr_bus::intake::Blocked;

/// What pacing reads about one backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Condition {
    /// Takes work: `room` more jobs may be taken for it (`room` ≤ `lookahead`).
    Room {
        room: usize,
        lookahead: usize,
    },
    Blocked(Blocked),
}

impl Condition {
    pub fn room(self) -> usize {
        match self {
            Condition::Room { room, .. } => room,
            Condition::Blocked(_) => 0,
        }
    }

    pub fn blocked(self) -> Option<Blocked> {
        match self {
            Condition::Room { room: 0, .. } => Some(Blocked::Full),
            Condition::Room { .. } => None,
            Condition::Blocked(b) => Some(b),
        }
    }
}

/// What the bus says about one backend a registration fetches for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendRoom {
    /// How many assignments may wait for this backend's worker (`backend.<name>.lookahead`).
    pub lookahead: usize,
    /// Assignments stored for the backend's worker but not yet delivered to it (the worker
    /// pulls only while it has a free slot, so these wait for capacity). `None`: the worker's
    /// consumer does not exist or cannot be read — no worker to take work.
    pub waiting: Option<u64>,
}

/// Whether a worker replica of a backend lives, read from its capacity record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Worker {
    /// A replica renewed its holding recently.
    Live,
    /// No replica renewed a holding within the grace (or none ever wrote one).
    Gone,
    /// The record could not be read.
    Unknown,
}

/// How long after a worker's holding expires it still counts as live: a worker restarting
/// (a rollout, a crash looping back) keeps its backend's labels declared meanwhile.
pub const WORKER_GRACE: Duration = Duration::from_secs(4);

/// Whether a replica in the capacity record `slots` may still be live at `now_ms` (the
/// scheduler's clock): its last renewal plus its holding's lifetime plus [`WORKER_GRACE`],
/// which also covers the clock skew between the worker and the scheduler.
pub fn worker_lives(slots: &jr_lease::Slots, now_ms: u64) -> bool {
    let grace = u64::try_from(WORKER_GRACE.as_millis()).unwrap_or(u64::MAX);
    slots
        .held
        .values()
        .any(|h| now_ms < h.renewed_at.saturating_add(h.ttl_ms).saturating_add(grace))
}

impl BackendRoom {
    /// The backend as a registration's pacing sees it.
    pub fn condition(&self, worker: Worker) -> Condition {
        match (worker, self.waiting) {
            (Worker::Gone, _) => Condition::Blocked(Blocked::NoWorker),
            (Worker::Unknown, _) | (Worker::Live, None) => Condition::Blocked(Blocked::Unreachable),
            (Worker::Live, Some(_)) => Condition::Room {
                room: room(std::slice::from_ref(self)),
                lookahead: self.lookahead,
            },
        }
    }
}

/// How many tasks a registration may take now. For one backend: its lookahead not yet used by
/// assignments waiting for a slot. A backend whose worker takes everything at once has nothing
/// waiting, so it gets its full lookahead every time: fetching then runs at the pace the worker
/// frees slots, and never more than `lookahead` jobs wait for it.
///
/// A registration that serves several backends does not know which of them the next task the
/// forge hands out will need, so it may take only what *every* one of them has room for: the
/// smallest room, never the sum (a sum lets an idle backend's room fetch jobs for a full one,
/// which then wait unclaimed until the forge's zombie reaper fails them). A backend without a
/// readable worker consumer has no room, so it pauses the whole registration. No backends: no
/// room.
pub fn room(backends: &[BackendRoom]) -> usize {
    backends
        .iter()
        .map(|b| match b.waiting {
            Some(waiting) => b
                .lookahead
                .saturating_sub(usize::try_from(waiting).unwrap_or(usize::MAX)),
            None => 0,
        })
        .min()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_lives_while_a_holding_is_renewed_within_its_lifetime_and_the_grace() {
        use jr_lease::{Holding, Slots};
        let holding = |renewed_at| Holding {
            slots: 0,
            renewed_at,
            ttl_ms: 6_000,
            owns: Default::default(),
        };
        let grace = WORKER_GRACE.as_millis() as u64;
        let mut slots = Slots::default();
        assert!(!worker_lives(&slots, 1_000), "no holding: no worker");
        slots
            .held
            .insert("pod-worker_0000000a".into(), holding(10_000));
        assert!(worker_lives(&slots, 10_000));
        assert!(worker_lives(&slots, 16_000 + grace - 1));
        assert!(!worker_lives(&slots, 16_000 + grace));
        // A second replica still renewing keeps the backend live.
        slots
            .held
            .insert("pod-worker_0000000b".into(), holding(30_000));
        assert!(worker_lives(&slots, 33_000));
    }

    #[test]
    fn a_backend_takes_work_only_with_a_live_worker_and_room() {
        let b = |waiting| BackendRoom {
            lookahead: 2,
            waiting,
        };
        assert_eq!(
            b(Some(0)).condition(Worker::Live),
            Condition::Room {
                room: 2,
                lookahead: 2
            }
        );
        assert_eq!(
            b(Some(5)).condition(Worker::Live).blocked(),
            Some(Blocked::Full)
        );
        // Queued room for a stopped worker is not room.
        assert_eq!(
            b(Some(0)).condition(Worker::Gone),
            Condition::Blocked(Blocked::NoWorker)
        );
        assert_eq!(
            b(None).condition(Worker::Live),
            Condition::Blocked(Blocked::Unreachable)
        );
        assert_eq!(
            b(Some(0)).condition(Worker::Unknown),
            Condition::Blocked(Blocked::Unreachable)
        );
    }

    #[test]
    fn room_of_one_backend_is_its_unused_lookahead() {
        let b = |lookahead, waiting| BackendRoom { lookahead, waiting };
        assert_eq!(room(&[b(2, Some(0))]), 2);
        assert_eq!(room(&[b(2, Some(1))]), 1);
        assert_eq!(room(&[b(2, Some(2))]), 0);
        assert_eq!(room(&[b(2, Some(40))]), 0);
        // No worker consumer: nothing is taken for that backend.
        assert_eq!(room(&[b(2, None)]), 0);
        assert_eq!(room(&[]), 0);
    }

    #[test]
    fn a_shared_registration_takes_only_what_every_backend_has_room_for() {
        let b = |lookahead, waiting| BackendRoom { lookahead, waiting };
        // Both idle: the smaller lookahead.
        assert_eq!(room(&[b(2, Some(0)), b(3, Some(0))]), 2);
        assert_eq!(room(&[b(3, Some(1)), b(3, Some(0))]), 2);
        // A full Pod backend with an idle VM backend: the forge may hand out a Pod job next, so
        // nothing is fetched (summing gave 2 here, and again after every Pod job fetched).
        assert_eq!(room(&[b(2, Some(2)), b(2, Some(0))]), 0);
        assert_eq!(room(&[b(2, Some(124)), b(2, Some(0))]), 0);
        // A backend without a worker pauses the whole registration.
        assert_eq!(room(&[b(2, None), b(3, Some(0))]), 0);
        assert_eq!(room(&[b(2, Some(0)), b(3, None)]), 0);
    }

    #[test]
    fn waiting_jobs_of_a_shared_registration_stay_within_the_lookahead_whatever_the_forge_hands_out()
     {
        // The measured case: Pod and VM backends, lookahead 2 each, no slot ever freed, and a
        // forge that hands out only Pod jobs. Fetch as long as the rule gives room.
        let mut waiting = [0_u64, 0];
        let mut fetched = 0;
        loop {
            let now = [
                BackendRoom {
                    lookahead: 2,
                    waiting: Some(waiting[0]),
                },
                BackendRoom {
                    lookahead: 2,
                    waiting: Some(waiting[1]),
                },
            ];
            let take = room(&now);
            if take == 0 || fetched >= 150 {
                break;
            }
            waiting[0] += take as u64;
            fetched += take;
        }
        assert_eq!(
            waiting,
            [2, 0],
            "only the lookahead waits for the full backend"
        );
        // A registration per backend asks only for its own backend's room.
        let own = room(&[BackendRoom {
            lookahead: 2,
            waiting: Some(0),
        }]);
        assert_eq!(own, 2);
    }
}
