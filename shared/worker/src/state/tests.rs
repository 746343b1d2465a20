use std::time::{Duration, Instant};

use jr_bus::Disposition;
use jr_protocol::{AssignmentId, WorkloadPhase};

use super::*;
use crate::backend::ObservedWorkload;

fn key(task: i64, attempt: u32) -> AttemptKey {
    AttemptKey::new(AssignmentId::for_task("https://forge", task), attempt)
}

fn seen(key: AttemptKey, workload: &str, phase: WorkloadPhase) -> ObservedWorkload {
    ObservedWorkload {
        workload: workload.to_owned(),
        assignment_id: key.assignment,
        attempt: key.attempt,
        phase,
        reason: None,
    }
}

fn ready(capacity: usize, now: Instant) -> WorkerState {
    let mut s = WorkerState::new(StateConfig::new(capacity));
    s.on(
        Input::Recovered {
            listed: vec![],
            remembered: vec![],
        },
        now,
    );
    s
}

fn deliver(
    s: &mut WorkerState,
    d: u64,
    key: AttemptKey,
    facts: BusFacts,
    now: Instant,
) -> Vec<Effect> {
    s.on(
        Input::Delivered {
            delivery: DeliveryId(d),
            key,
            ticket: None,
            facts,
        },
        now,
    )
}

fn settled(fx: &[Effect]) -> Option<Disposition> {
    fx.iter().find_map(|e| match e {
        Effect::Settle { disposition, .. } => Some(disposition.clone()),
        Effect::Confirm { .. } => Some(Disposition::Ack),
        _ => None,
    })
}

fn publishes_failure_or_release(fx: &[Effect]) -> bool {
    fx.iter().any(|e| {
        let events: Vec<&Event> = match e {
            Effect::Publish(ev) => vec![ev],
            Effect::Confirm { events, .. } => events.iter().collect(),
            _ => vec![],
        };
        events.iter().any(|ev| {
            matches!(ev, Event::Released { .. })
                || matches!(ev, Event::Observed { phase, .. } if phase.is_terminal())
        })
    })
}

#[test]
fn a_delivery_with_a_free_slot_creates_its_workload() {
    let now = Instant::now();
    let mut s = ready(1, now);
    let fx = deliver(&mut s, 1, key(1, 1), BusFacts::default(), now);
    assert_eq!(
        fx,
        vec![Effect::Create {
            delivery: DeliveryId(1),
            key: key(1, 1)
        }]
    );
    assert_eq!(s.used(), 1);
}

#[test]
fn superseded_and_terminal_deliveries_are_acked_without_a_backend_call() {
    let now = Instant::now();
    let mut s = ready(4, now);
    let superseded = BusFacts {
        latest_attempt: Some(2),
        ..BusFacts::default()
    };
    assert_eq!(
        deliver(&mut s, 1, key(1, 1), superseded, now),
        vec![Effect::Settle {
            delivery: DeliveryId(1),
            disposition: Disposition::Ack
        }]
    );
    let terminal = BusFacts {
        terminal: true,
        latest_attempt: Some(1),
        ..BusFacts::default()
    };
    assert_eq!(
        settled(&deliver(&mut s, 2, key(2, 1), terminal, now)),
        Some(Disposition::Ack)
    );
    // Remembered: a later redelivery with stale facts still creates nothing.
    let fx = deliver(&mut s, 3, key(2, 1), BusFacts::default(), now);
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Create { .. })),
        "{fx:?}"
    );
    assert_eq!(s.used(), 0);
}

#[test]
fn a_job_that_must_wait_is_naked_without_pausing_the_others() {
    let now = Instant::now();
    let mut s = ready(2, now);
    deliver(&mut s, 1, key(1, 1), BusFacts::default(), now);
    let fx = s.on(
        Input::CreateAnswered {
            delivery: DeliveryId(1),
            key: key(1, 1),
            answer: CreateAnswer::Wait {
                retry_after: Duration::from_secs(2),
            },
        },
        now,
    );
    assert_eq!(
        settled(&fx),
        Some(Disposition::Nak(Some(Duration::from_secs(2))))
    );
    assert!(!publishes_failure_or_release(&fx));
    assert!(!s.is_paused(now), "a job-specific wait paused pulling");
    assert_eq!(s.used(), 0, "the waiting job keeps no slot");
    // The next delivery is created at once.
    let fx = deliver(&mut s, 2, key(2, 1), BusFacts::default(), now);
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Create { .. })),
        "{fx:?}"
    );
}

#[test]
fn a_full_backend_naks_pauses_and_publishes_nothing() {
    let now = Instant::now();
    let mut s = ready(2, now);
    deliver(&mut s, 1, key(1, 1), BusFacts::default(), now);
    // The server lists its half-made sandbox while the call waits, then refuses with 429.
    assert!(
        s.on(
            Input::Observed(seen(key(1, 1), "sb-1", WorkloadPhase::Pending)),
            now
        )
        .is_empty()
    );
    let fx = s.on(
        Input::CreateAnswered {
            delivery: DeliveryId(1),
            key: key(1, 1),
            answer: CreateAnswer::Full {
                retry_after: Duration::from_secs(30),
            },
        },
        now,
    );
    assert_eq!(
        settled(&fx),
        Some(Disposition::Nak(Some(Duration::from_secs(30))))
    );
    assert!(!publishes_failure_or_release(&fx));
    assert!(s.is_paused(now + Duration::from_secs(29)));
    // It stops and vanishes: not a failure, nothing published.
    let later = now + Duration::from_secs(3);
    let mut all = s.on(
        Input::Observed(seen(key(1, 1), "sb-1", WorkloadPhase::Terminating)),
        later,
    );
    all.extend(s.on(
        Input::Observed(seen(key(1, 1), "sb-1", WorkloadPhase::Gone)),
        later,
    ));
    all.extend(s.on(Input::Tick, later + Duration::from_secs(120)));
    assert!(!publishes_failure_or_release(&all), "{all:?}");
    assert_eq!(s.used(), 0);
    // The same attempt is created once the pause is over.
    let fx = deliver(
        &mut s,
        2,
        key(1, 1),
        BusFacts::default(),
        now + Duration::from_secs(31),
    );
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Create { .. })),
        "{fx:?}"
    );
}

#[test]
fn adoption_beyond_capacity_is_debt_and_blocks_pulls_until_paid() {
    let now = Instant::now();
    let mut s = WorkerState::new(StateConfig::new(1));
    let listed = vec![
        seen(key(1, 1), "w1", WorkloadPhase::Running),
        seen(key(2, 1), "w2", WorkloadPhase::Running),
    ];
    let remembered = vec![(key(1, 1), "w1".to_owned()), (key(2, 1), "w2".to_owned())];
    s.on(Input::Recovered { listed, remembered }, now);
    assert_eq!(s.debt(), 1);
    assert!(
        !s.on(Input::PullWanted { max: 1 }, now)
            .iter()
            .any(|e| matches!(e, Effect::GrantPull(_)))
    );
    let fx = s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Gone)),
        now,
    );
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::GrantPull(_))),
        "still full: {fx:?}"
    );
    let fx = s.on(
        Input::Observed(seen(key(2, 1), "w2", WorkloadPhase::Gone)),
        now,
    );
    assert!(
        fx.iter().any(|e| matches!(e, Effect::GrantPull(_))),
        "{fx:?}"
    );
}

#[test]
fn a_remembered_workload_missing_after_restart_is_released() {
    let now = Instant::now();
    let mut s = WorkerState::new(StateConfig::new(1));
    let fx = s.on(
        Input::Recovered {
            listed: vec![],
            remembered: vec![(key(1, 1), "w1".to_owned())],
        },
        now,
    );
    assert!(fx.contains(&Effect::Publish(Event::Released {
        key: key(1, 1),
        workload: "w1".into()
    })));
    assert!(fx.contains(&Effect::Forget {
        key: key(1, 1),
        workload: "w1".into()
    }));
}

#[test]
fn a_delete_racing_the_create_waits_for_its_answer() {
    let now = Instant::now();
    let mut s = ready(1, now);
    deliver(&mut s, 1, key(1, 1), BusFacts::default(), now);
    let fx = s.on(
        Input::DeleteRequested {
            delivery: DeliveryId(2),
            key: key(1, 1),
            workload: "jr-1".into(),
        },
        now,
    );
    assert_eq!(
        settled(&fx),
        Some(Disposition::Nak(Some(Duration::from_secs(1))))
    );
    assert!(!fx.iter().any(|e| matches!(e, Effect::Delete { .. })));
}

#[test]
fn a_deleted_workload_is_released_once_when_gone() {
    let now = Instant::now();
    let mut s = live(now);
    let del = |d| Input::DeleteRequested {
        delivery: DeliveryId(d),
        key: key(1, 1),
        workload: "w1".into(),
    };
    let mut all = s.on(del(2), now);
    all.extend(s.on(del(3), now));
    all.extend(s.on(
        Input::DeleteAnswered {
            delivery: DeliveryId(2),
            key: key(1, 1),
            workload: "w1".into(),
            answer: DeleteAnswer::Deleted,
        },
        now,
    ));
    all.extend(s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Terminating)),
        now,
    ));
    all.extend(s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Gone)),
        now,
    ));
    all.extend(s.on(
        Input::Listed {
            started: now,
            listed: vec![seen(key(1, 1), "w1", WorkloadPhase::Terminating)],
        },
        now,
    ));
    let released = all
        .iter()
        .filter(|e| matches!(e, Effect::Publish(Event::Released { .. })))
        .count();
    assert_eq!(released, 1, "{all:?}");
    // Nothing repeats what the delete command and `released` already say.
    assert!(
        !all.iter().any(|e| matches!(
            e,
            Effect::Publish(Event::Observed {
                phase: WorkloadPhase::Terminating | WorkloadPhase::Gone,
                ..
            })
        )),
        "{all:?}"
    );
    assert_eq!(s.used(), 0);
    // The attempt had its workload: a redelivery creates nothing.
    let fx = deliver(&mut s, 4, key(1, 1), BusFacts::default(), now);
    assert_eq!(settled(&fx), Some(Disposition::Ack));
    assert!(!fx.iter().any(|e| matches!(e, Effect::Create { .. })));
}

fn observations(fx: &[Effect]) -> Vec<(WorkloadPhase, Option<String>)> {
    fx.iter()
        .flat_map(|e| match e {
            Effect::Publish(ev) => vec![ev],
            Effect::Confirm { events, .. } => events.iter().collect(),
            _ => vec![],
        })
        .filter_map(|ev| match ev {
            Event::Observed { phase, reason, .. } => Some((*phase, reason.clone())),
            _ => None,
        })
        .collect()
}

/// A live workload `w1` of key(1, 1), created at `now`.
fn live(now: Instant) -> WorkerState {
    let mut s = ready(2, now);
    deliver(&mut s, 1, key(1, 1), BusFacts::default(), now);
    s.on(
        Input::CreateAnswered {
            delivery: DeliveryId(1),
            key: key(1, 1),
            answer: CreateAnswer::Created("w1".into()),
        },
        now,
    );
    s
}

#[test]
fn only_news_to_the_reconciler_is_published() {
    let now = Instant::now();
    let mut s = live(now);
    let observe = |s: &mut WorkerState, phase, reason: Option<&str>| {
        let mut o = seen(key(1, 1), "w1", phase);
        o.reason = reason.map(str::to_owned);
        observations(&s.on(Input::Observed(o), now))
    };
    // Pending → running: `workload-created` already said it is healthy.
    assert_eq!(observe(&mut s, WorkloadPhase::Running, None), vec![]);
    // A problem reason is news, and so is its end.
    assert_eq!(
        observe(&mut s, WorkloadPhase::Pending, Some("image-pull-failed")),
        vec![(WorkloadPhase::Pending, Some("image-pull-failed".into()))]
    );
    assert_eq!(
        observe(&mut s, WorkloadPhase::Running, None),
        vec![(WorkloadPhase::Running, None)]
    );
    // Unknown and failed are published at once.
    assert_eq!(
        observe(&mut s, WorkloadPhase::Unknown, None),
        vec![(WorkloadPhase::Unknown, None)]
    );
    assert_eq!(
        observe(&mut s, WorkloadPhase::Running, None),
        vec![(WorkloadPhase::Running, None)]
    );
    assert_eq!(
        observe(&mut s, WorkloadPhase::Failed, Some("oom-killed")),
        vec![(WorkloadPhase::Failed, Some("oom-killed".into()))]
    );
}

#[test]
fn an_exit_is_held_and_dropped_when_a_delete_overtakes_it() {
    let now = Instant::now();
    let delay = StateConfig::new(1).exit_report_delay;
    // Exit, then the reconciler's delete within the delay: only `released` is said.
    let mut s = live(now);
    let mut all = s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Succeeded)),
        now,
    );
    all.extend(s.on(Input::Tick, now + delay / 2));
    all.extend(s.on(
        Input::DeleteRequested {
            delivery: DeliveryId(2),
            key: key(1, 1),
            workload: "w1".into(),
        },
        now + delay / 2,
    ));
    all.extend(s.on(Input::Tick, now + delay * 3));
    all.extend(s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Gone)),
        now + delay * 3,
    ));
    assert_eq!(observations(&all), vec![], "{all:?}");
    assert!(
        all.iter()
            .any(|e| matches!(e, Effect::Publish(Event::Released { .. }))),
        "{all:?}"
    );

    // Exit and no delete: published once the delay has passed, and only once.
    let mut s = live(now);
    let fx = s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Succeeded)),
        now,
    );
    assert_eq!(observations(&fx), vec![]);
    assert_eq!(observations(&s.on(Input::Tick, now + delay / 2)), vec![]);
    assert_eq!(
        observations(&s.on(Input::Tick, now + delay)),
        vec![(WorkloadPhase::Succeeded, None)]
    );
    assert_eq!(observations(&s.on(Input::Tick, now + delay * 2)), vec![]);

    // An exit that turns into a failure is published at once.
    let mut s = live(now);
    s.on(
        Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Succeeded)),
        now,
    );
    assert_eq!(
        observations(&s.on(
            Input::Observed(seen(key(1, 1), "w1", WorkloadPhase::Failed)),
            now
        )),
        vec![(WorkloadPhase::Failed, None)]
    );
    assert_eq!(observations(&s.on(Input::Tick, now + delay * 2)), vec![]);
}
