//! How many runners a scale set should have, as a pure function of GitHub's statistics, the
//! runners the listener holds, the backend's room and the entry's configuration, the rule the
//! Kubernetes runner controllers follow:
//!
//! - the runners that are not busy (starting, or online and idle) should number `min_idle`
//!   plus the jobs assigned to the scale set and not yet running;
//! - new runners are made up to that number, never past `max_runners` runners in all, nor
//!   past the room the backend has;
//! - a runner that is busy is never removed, and one that is free is removed only when the
//!   scale set is idle (no job available, assigned or running) and it is beyond `min_idle`:
//!   while any job waits, a free runner may be the one GitHub hands it to;
//! - warm capacity yields: while other assignments wait for a slot of the backend, no warm
//!   runner is kept or made, and free runners beyond the jobs waiting are removed (at most one
//!   for each assignment waiting), so the scale set's warm runners never starve other work;
//! - the decision is made again after every message, empty polls included, from the last
//!   statistics, so a runner lost before it took a job (its workload evicted, its sandbox gone)
//!   is made again.

use crate::wire::Statistics;

/// What the scale set's runners should become.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// New runners to make.
    pub make: usize,
    /// Free runners to remove (from those given, the newest first).
    pub remove: Vec<String>,
}

/// The demand GitHub reports: jobs assigned to the scale set and not yet running, and whether
/// the scale set is idle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    /// Jobs assigned and waiting for a runner.
    pub waiting: usize,
    /// No job available, assigned or running.
    pub idle: bool,
    /// Other assignments waiting for a slot of the backend (not this scale set's runners):
    /// warm runners beyond the jobs waiting yield their slots to them.
    pub others_waiting: usize,
}

impl Demand {
    /// From GitHub's statistics, less `refused` jobs the listener knows will get no runner
    /// (the trust guard refused them and their runs are being cancelled).
    pub fn from_statistics(statistics: &Statistics, refused: usize) -> Demand {
        let count = |n: i64| usize::try_from(n).unwrap_or(0);
        let assigned = count(statistics.total_assigned_jobs);
        let running = count(statistics.total_running_jobs);
        let available = count(statistics.total_available_jobs);
        Demand {
            waiting: assigned.saturating_sub(running).saturating_sub(refused),
            idle: assigned == 0 && running == 0 && available == 0,
            others_waiting: 0,
        }
    }
}

/// The entry's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub min_idle: usize,
    pub max_runners: usize,
}

/// Decides for `demand`, with `free` the runners not known to be busy (oldest first), `busy`
/// the number that are, and `room` how many more workloads the backend can take soon.
pub fn plan(demand: Demand, free: &[String], busy: usize, room: usize, limits: Limits) -> Plan {
    let min_idle = if demand.others_waiting > 0 {
        0
    } else {
        limits.min_idle
    };
    let wanted = min_idle.saturating_add(demand.waiting);
    let total = free.len().saturating_add(busy);
    if free.len() < wanted {
        let make = (wanted - free.len())
            .min(limits.max_runners.saturating_sub(total))
            .min(room);
        return Plan {
            make,
            remove: Vec::new(),
        };
    }
    // On an idle scale set, free runners beyond `min_idle` go; while other work waits for
    // slots, warm ones go too (one for each assignment waiting), never below the jobs waiting.
    let mut extra = 0;
    if demand.idle {
        extra = free.len().saturating_sub(limits.min_idle);
    }
    if demand.others_waiting > 0 {
        let warm = free
            .len()
            .saturating_sub(extra)
            .saturating_sub(demand.waiting);
        extra += warm.min(demand.others_waiting);
    }
    Plan {
        make: 0,
        remove: free.iter().rev().take(extra).cloned().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r{i}")).collect()
    }

    #[test]
    fn waiting_jobs_get_runners_within_the_room_and_the_maximum() {
        let limits = Limits {
            min_idle: 1,
            max_runners: 10,
        };
        let demand = Demand {
            waiting: 4,
            idle: false,
            others_waiting: 0,
        };
        assert_eq!(plan(demand, &names(2), 0, 100, limits).make, 3);
        assert_eq!(plan(demand, &names(2), 0, 2, limits).make, 2);
        assert_eq!(plan(demand, &names(2), 7, 100, limits).make, 1);
        // Enough free runners: nothing to do, and nothing removed while jobs wait.
        assert_eq!(plan(demand, &names(9), 0, 100, limits), Plan::default());
    }

    #[test]
    fn extra_runners_go_only_when_the_scale_set_is_idle() {
        let limits = Limits {
            min_idle: 1,
            max_runners: 10,
        };
        let idle = Demand {
            waiting: 0,
            idle: true,
            others_waiting: 0,
        };
        assert_eq!(
            plan(idle, &names(3), 0, 0, limits).remove,
            vec!["r2".to_owned(), "r1".to_owned()]
        );
        // A job is running: the scale set is not idle, the free runners stay.
        let running = Demand {
            waiting: 0,
            idle: false,
            others_waiting: 0,
        };
        assert_eq!(plan(running, &names(3), 1, 0, limits), Plan::default());
    }

    #[test]
    fn warm_runners_yield_to_other_work_waiting_for_slots() {
        let limits = Limits {
            min_idle: 3,
            max_runners: 10,
        };
        let others = Demand {
            waiting: 1,
            idle: false,
            others_waiting: 1,
        };
        // Four free runners, one job waiting: one warm runner goes per assignment waiting.
        assert_eq!(
            plan(others, &names(4), 0, 5, limits).remove,
            vec!["r3".to_owned()]
        );
        // None is made past the jobs waiting while others wait.
        assert_eq!(plan(others, &names(0), 0, 5, limits).make, 1);
        // The job waiting keeps its runner.
        assert_eq!(plan(others, &names(1), 0, 5, limits), Plan::default());
    }

    #[test]
    fn statistics_count_assigned_jobs_less_those_running_and_those_refused() {
        let statistics = Statistics {
            total_assigned_jobs: 7,
            total_running_jobs: 2,
            ..Statistics::default()
        };
        assert_eq!(
            Demand::from_statistics(&statistics, 1),
            Demand {
                waiting: 4,
                idle: false,
                others_waiting: 0,
            }
        );
        assert!(Demand::from_statistics(&Statistics::default(), 0).idle);
        let offered = Statistics {
            total_available_jobs: 1,
            ..Statistics::default()
        };
        assert!(!Demand::from_statistics(&offered, 0).idle);
    }

    /// One step of the world the plan is applied to: runners made start free; a free runner
    /// may take a waiting job (busy), a busy one may finish, a free one may be lost.
    #[derive(Clone, Debug)]
    enum Event {
        Take,
        Finish,
        Lose,
        NewJob,
        RoomChanges(usize),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            Just(Event::Take),
            Just(Event::Finish),
            Just(Event::Lose),
            Just(Event::NewJob),
            (0usize..6).prop_map(Event::RoomChanges),
        ]
    }

    proptest! {
        /// Whatever happens, the plan never removes a busy runner, never has more than
        /// `max_runners`, removes nothing while a job waits, and never makes more than the
        /// room allows.
        #[test]
        fn the_plan_keeps_its_promises(
            min_idle in 0usize..4,
            max_runners in 1usize..12,
            waiting in 0usize..15,
            running in 0usize..5,
            free in 0usize..12,
            busy in 0usize..12,
            room in 0usize..20,
            others_waiting in 0usize..4,
        ) {
            let limits = Limits { min_idle, max_runners };
            let demand = Demand { waiting, idle: waiting == 0 && running == 0, others_waiting };
            let free = names(free);
            let plan = plan(demand, &free, busy, room, limits);
            prop_assert!(plan.make <= room);
            prop_assert!(plan.remove.iter().all(|r| free.contains(r)));
            prop_assert!(plan.remove.len() <= free.len());
            if plan.make > 0 {
                prop_assert!(free.len() + busy + plan.make <= max_runners);
                prop_assert!(plan.remove.is_empty());
            }
            // Never fewer free runners than jobs waiting; while jobs run or wait, only what
            // other work waiting for slots asks for, and never more.
            prop_assert!(free.len() - plan.remove.len() >= waiting.min(free.len()));
            if (waiting > 0 || running > 0) && others_waiting == 0 {
                prop_assert!(plan.remove.is_empty(), "removed while jobs wait or run");
            }
            prop_assert!(plan.remove.len() <= others_waiting + free.len().saturating_sub(min_idle));
            if !plan.remove.is_empty() && others_waiting == 0 {
                prop_assert_eq!(free.len() - plan.remove.len(), min_idle);
            }
            if others_waiting > 0 && plan.make > 0 {
                prop_assert!(free.len() + plan.make <= waiting, "a warm runner made while others wait");
            }
        }

        /// Applied after every event, the plan gives every waiting job a runner whenever the
        /// room and the maximum allow it: runners lost before they took a job are made again.
        #[test]
        fn every_waiting_job_gets_a_runner_while_room_allows(
            min_idle in 0usize..3,
            events in proptest::collection::vec(event(), 1..60),
        ) {
            let limits = Limits { min_idle, max_runners: 50 };
            let (mut free, mut busy, mut waiting, mut room, mut next) = (Vec::<String>::new(), 0usize, 0usize, 5usize, 0usize);
            for event in events {
                match event {
                    Event::Take if waiting > 0 && !free.is_empty() => {
                        free.remove(0);
                        busy += 1;
                        waiting -= 1;
                    }
                    Event::Finish if busy > 0 => busy -= 1,
                    Event::Lose if !free.is_empty() => { free.pop(); }
                    Event::NewJob => waiting += 1,
                    Event::RoomChanges(r) => room = r,
                    _ => {}
                }
                let demand = Demand { waiting, idle: waiting == 0 && busy == 0, others_waiting: 0 };
                let plan = plan(demand, &free, busy, room, limits);
                for _ in 0..plan.make {
                    next += 1;
                    free.push(format!("r{next}"));
                }
                free.retain(|r| !plan.remove.contains(r));
                let wanted = min_idle + waiting;
                let short = wanted.saturating_sub(free.len());
                // Short only by what the room (or the maximum) kept back.
                prop_assert!(short == 0 || plan.make == room || free.len() + busy >= limits.max_runners,
                    "wanted {wanted}, have {} free, room {room}, made {}", free.len(), plan.make);
                prop_assert!(free.len() + busy <= limits.max_runners.max(busy));
            }
        }
    }
}
