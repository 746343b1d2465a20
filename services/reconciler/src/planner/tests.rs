//! One test per planner rule, on hand-written histories.

use std::time::Duration;

use jr_protocol::{Envelope, Reason, WorkloadPhase};
use jr_store::testkit::Builder;
use jr_store::{REASON_BACKEND_UNREACHABLE, Snapshot};

use super::*;

const SEC: u64 = 1_000;

fn cfg() -> PlannerConfig {
    PlannerConfig::default()
}

fn plan_at(events: &[Envelope], now: u64) -> Vec<PlannedCommand> {
    plan(&Snapshot::from_events(events, now), now, &cfg())
}

fn ids(commands: &[PlannedCommand]) -> Vec<String> {
    commands.iter().map(PlannedCommand::id).collect()
}

fn delete_id(b: &Builder, attempt: u32) -> String {
    format!("delete:{}:{attempt}:{}", b.id, b.workload(attempt))
}

fn redispatch_id(b: &Builder, next: u32) -> String {
    format!("redispatch:{}:{next}", b.id)
}

fn fail_id(b: &Builder) -> String {
    format!("fail:{}", b.id)
}

/// Published, created and claimed at 1 s, 2 s, 3 s.
fn running(b: &Builder) -> Vec<Envelope> {
    vec![
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.claimed(1, 3 * SEC),
    ]
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

#[test]
fn published_assignment_without_workload_is_left_waiting() {
    let b = Builder::new(1, "pod");
    let events = [b.assignment(1, SEC), b.requested(1, 2 * SEC)];
    assert!(plan_at(&events, 86_400 * SEC).is_empty());
}

#[test]
fn terminal_with_closed_log_deletes_the_workload_at_once() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.terminal(1, 10 * SEC, true));
    let commands = plan_at(&events, 10 * SEC);
    assert_eq!(ids(&commands), [delete_id(&b, 1)]);
    assert_eq!(commands[0].reason(), Reason::TaskFinished.as_str());
}

#[test]
fn terminal_without_a_finish_signal_waits_for_the_grace_period() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.terminal(1, 10 * SEC, false));
    assert!(plan_at(&events, 10 * SEC + 29_999).is_empty());
    let commands = plan_at(&events, 40 * SEC);
    assert_eq!(ids(&commands), [delete_id(&b, 1)]);
    assert_eq!(commands[0].reason(), Reason::TerminalGraceExpired.as_str());

    events.push(b.executor_finished(1, 11 * SEC));
    assert_eq!(ids(&plan_at(&events, 11 * SEC)), [delete_id(&b, 1)]);
}

#[test]
fn terminal_and_exited_workload_deletes_at_once() {
    let b = Builder::new(1, "vm");
    let mut events = running(&b);
    events.push(b.terminal(1, 10 * SEC, false));
    events.push(b.observed(1, 11 * SEC, WorkloadPhase::Succeeded, None));
    assert_eq!(ids(&plan_at(&events, 11 * SEC)), [delete_id(&b, 1)]);
}

#[test]
fn released_workload_of_a_final_task_needs_nothing_more() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.terminal(1, 10 * SEC, true));
    events.push(b.released(1, 12 * SEC));
    let snapshot = Snapshot::from_events(&events, 13 * SEC);
    assert!(
        snapshot.assignments.is_empty(),
        "completed assignment still in the snapshot"
    );
    assert!(plan(&snapshot, 13 * SEC, &cfg()).is_empty());
}

#[test]
fn workload_failed_before_claim_is_deleted_and_redispatched() {
    let b = Builder::new(1, "pod");
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.observed(1, 3 * SEC, WorkloadPhase::Failed, Some("image-pull-failed")),
    ];
    let commands = plan_at(&events, 3 * SEC);
    assert_eq!(
        ids(&commands),
        sorted(vec![delete_id(&b, 1), redispatch_id(&b, 2)])
    );
    assert!(
        commands
            .iter()
            .all(|c| c.reason() == "workload-failed: image-pull-failed")
    );
}

#[test]
fn workload_gone_before_claim_is_redispatched() {
    let b = Builder::new(1, "pod");
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.observed(1, 3 * SEC, WorkloadPhase::Gone, None),
    ];
    // The gone workload is still deleted so that the worker releases its slot.
    assert_eq!(
        ids(&plan_at(&events, 3 * SEC)),
        sorted(vec![delete_id(&b, 1), redispatch_id(&b, 2)])
    );
}

#[test]
fn failure_on_the_last_attempt_fails_the_task_instead_of_redispatching() {
    let b = Builder::new(1, "pod");
    let mut events = Vec::new();
    for attempt in 1..=3 {
        let t = attempt as u64 * 10 * SEC;
        events.push(b.assignment(attempt, t));
        events.push(b.created(attempt, t + SEC));
        events.push(b.observed(attempt, t + 2 * SEC, WorkloadPhase::Failed, None));
        events.push(b.released(attempt, t + 3 * SEC));
        if attempt < 3 {
            events.push(b.redispatched(attempt, t + 3 * SEC, "workload-failed"));
        }
    }
    let commands = plan_at(&events, 60 * SEC);
    assert_eq!(ids(&commands), [fail_id(&b)]);
    match &commands[0] {
        PlannedCommand::FailTask {
            attempt,
            forge_task_id,
            ..
        } => assert_eq!((*attempt, *forge_task_id), (3, 1)),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn workload_lost_after_claim_fails_the_task_and_deletes_once_final() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.observed(1, 5 * SEC, WorkloadPhase::Failed, Some("oom-killed")));
    let commands = plan_at(&events, 5 * SEC);
    assert_eq!(ids(&commands), [fail_id(&b)]);
    assert_eq!(
        commands[0].reason(),
        "lost-after-claim: workload-failed: oom-killed"
    );

    events.push(b.task_failed(1, 6 * SEC, "lost"));
    assert_eq!(ids(&plan_at(&events, 6 * SEC)), [delete_id(&b, 1)]);
}

#[test]
fn claim_timeout_deletes_and_redispatches() {
    let b = Builder::new(1, "pod");
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.observed(1, 3 * SEC, WorkloadPhase::Running, None),
    ];
    assert!(plan_at(&events, 2 * SEC + 119_999).is_empty());
    let commands = plan_at(&events, 122 * SEC);
    assert_eq!(
        ids(&commands),
        sorted(vec![delete_id(&b, 1), redispatch_id(&b, 2)])
    );
    assert!(
        commands
            .iter()
            .all(|c| c.reason() == Reason::ClaimTimeout.as_str())
    );
}

#[test]
fn unreachable_backend_is_held_before_its_workload_counts_as_lost() {
    let b = Builder::new(1, "pod");
    let unreachable = Some(REASON_BACKEND_UNREACHABLE);
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.observed(1, 5 * SEC, WorkloadPhase::Unknown, unreachable),
        // Repeated reports do not restart the hold.
        b.observed(1, 200 * SEC, WorkloadPhase::Unknown, unreachable),
    ];
    // Long past the claim timeout, but held.
    assert!(plan_at(&events, 5 * SEC + 299_999).is_empty());
    let commands = plan_at(&events, 305 * SEC);
    assert_eq!(
        ids(&commands),
        sorted(vec![delete_id(&b, 1), redispatch_id(&b, 2)])
    );
    assert!(
        commands
            .iter()
            .all(|c| c.reason() == Reason::BackendUnreachable.as_str())
    );
}

#[test]
fn unreachable_backend_holds_claimed_work_then_fails_it() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.observed(
        1,
        10 * SEC,
        WorkloadPhase::Unknown,
        Some(REASON_BACKEND_UNREACHABLE),
    ));
    assert!(plan_at(&events, 309 * SEC).is_empty());
    assert_eq!(ids(&plan_at(&events, 310 * SEC)), [fail_id(&b)]);
}

#[test]
fn an_unreachable_provider_holds_only_its_own_workloads() {
    let reporting = Builder::new(1, "pod");
    let other_provider = Builder::new(2, "pod");
    let same_provider = Builder::new(3, "pod");
    let in_b = |b: &Builder| format!("b/{}", b.workload(1));
    let events = [
        other_provider.assignment(1, SEC),
        other_provider.created_ref(1, &format!("a/{}", other_provider.workload(1)), 2 * SEC),
        same_provider.assignment(1, SEC),
        same_provider.created_ref(1, &in_b(&same_provider), 2 * SEC),
        reporting.assignment(1, SEC),
        reporting.created_ref(1, &in_b(&reporting), 2 * SEC),
        reporting.claimed(1, 3 * SEC),
        reporting.observed_ref(
            1,
            &in_b(&reporting),
            10 * SEC,
            WorkloadPhase::Unknown,
            Some(REASON_BACKEND_UNREACHABLE),
        ),
    ];
    // At 200 s both unclaimed assignments are past their claim timeout: the one in provider
    // "b" is held with the rest of "b", the one in provider "a" is not.
    let commands = plan_at(&events, 200 * SEC);
    assert_eq!(
        ids(&commands),
        sorted(vec![
            format!(
                "delete:{}:1:a/{}",
                other_provider.id,
                other_provider.workload(1)
            ),
            redispatch_id(&other_provider, 2)
        ])
    );
}

#[test]
fn one_unreachable_report_holds_every_workload_of_that_backend() {
    let reporting = Builder::new(1, "pod");
    let quiet = Builder::new(2, "pod");
    let other_backend = Builder::new(3, "vm");
    let events = [
        quiet.assignment(1, SEC),
        quiet.created(1, 2 * SEC),
        other_backend.assignment(1, SEC),
        other_backend.created(1, 2 * SEC),
        reporting.assignment(1, SEC),
        reporting.created(1, 2 * SEC),
        reporting.claimed(1, 3 * SEC),
        reporting.observed(
            1,
            10 * SEC,
            WorkloadPhase::Unknown,
            Some(REASON_BACKEND_UNREACHABLE),
        ),
    ];
    // At 200 s the quiet pod assignment is past its claim timeout but held; the vm one is not.
    let commands = plan_at(&events, 200 * SEC);
    assert_eq!(
        ids(&commands),
        sorted(vec![
            delete_id(&other_backend, 1),
            redispatch_id(&other_backend, 2)
        ])
    );
    // A newer healthy observation from the backend ends the hold.
    let mut recovered = events.to_vec();
    recovered.push(reporting.observed(1, 20 * SEC, WorkloadPhase::Running, None));
    let ids_after = ids(&plan_at(&recovered, 200 * SEC));
    assert!(
        ids_after.contains(&redispatch_id(&quiet, 2)),
        "{ids_after:?}"
    );
}

#[test]
fn backend_silence_counts_as_unreachable_only_when_configured() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.observed(1, 4 * SEC, WorkloadPhase::Running, None));
    let now = 4 * SEC + 3_600 * SEC;
    assert!(
        plan_at(&events, now).is_empty(),
        "silence must not matter by default"
    );
    let silent = PlannerConfig {
        backend_silence: Some(Duration::from_secs(600)),
        ..cfg()
    };
    let snapshot = Snapshot::from_events(&events, now);
    assert_eq!(ids(&plan(&snapshot, now, &silent)), [fail_id(&b)]);
    // Within silence + hold nothing happens.
    assert!(plan(&snapshot, 4 * SEC + 899_999, &silent).is_empty());
}

#[test]
fn workload_of_a_superseded_attempt_is_deleted() {
    let b = Builder::new(1, "pod");
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.redispatched(1, 130 * SEC, "claim-timeout"),
        b.assignment(2, 130 * SEC),
        b.created(2, 131 * SEC),
    ];
    let commands = plan_at(&events, 132 * SEC);
    assert_eq!(ids(&commands), [delete_id(&b, 1)]);
    assert_eq!(commands[0].reason(), Reason::SupersededAttempt.as_str());
}

#[test]
fn duplicate_workload_of_the_current_attempt_is_deleted() {
    let b = Builder::new(1, "vm");
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.observed_ref(
            1,
            "sandbox-duplicate",
            3 * SEC,
            WorkloadPhase::Running,
            None,
        ),
    ];
    let commands = plan_at(&events, 4 * SEC);
    assert_eq!(
        ids(&commands),
        [format!("delete:{}:1:sandbox-duplicate", b.id)]
    );
}

#[test]
fn workload_of_an_unknown_assignment_is_deleted_after_the_orphan_grace() {
    let b = Builder::new(1, "pod");
    let events = [
        b.created(1, SEC),
        b.observed(1, 2 * SEC, WorkloadPhase::Running, None),
    ];
    assert!(plan_at(&events, SEC + 119_999).is_empty());
    let commands = plan_at(&events, 121 * SEC);
    assert_eq!(ids(&commands), [delete_id(&b, 1)]);
    assert_eq!(
        commands[0].reason(),
        Reason::OrphanUnknownAssignment.as_str()
    );
}

#[test]
fn claimed_healthy_workload_is_never_deleted() {
    let b = Builder::new(1, "pod");
    let mut events = running(&b);
    events.push(b.observed(1, 4 * SEC, WorkloadPhase::Running, None));
    assert!(plan_at(&events, 100_000 * SEC).is_empty());
    // Not even when the assignment message is unknown (the assignments stream lags).
    let events_only: Vec<_> = events.iter().skip(1).cloned().collect();
    assert!(plan_at(&events_only, 100_000 * SEC).is_empty());
}

#[test]
fn announced_redispatch_is_asked_again_until_its_assignment_is_projected() {
    let b = Builder::new(1, "pod");
    let mut events = vec![
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        b.observed(1, 3 * SEC, WorkloadPhase::Failed, None),
        b.released(1, 4 * SEC),
        b.redispatched(1, 4 * SEC, "workload-failed"),
    ];
    assert_eq!(ids(&plan_at(&events, 5 * SEC)), [redispatch_id(&b, 2)]);
    events.push(b.assignment(2, 4 * SEC));
    assert!(
        plan_at(&events, 5 * SEC).is_empty(),
        "attempt 2 waits for capacity"
    );
}

#[test]
fn replanning_an_unchanged_snapshot_gives_the_same_ids() {
    let b = Builder::new(1, "pod");
    let c = Builder::new(2, "vm");
    let events = [
        b.assignment(1, SEC),
        b.created(1, 2 * SEC),
        c.assignment(1, SEC),
        c.created(1, 2 * SEC),
        c.claimed(1, 3 * SEC),
        c.terminal(1, 4 * SEC, false),
    ];
    let snapshot = Snapshot::from_events(&events, 200 * SEC);
    let first = ids(&plan(&snapshot, 200 * SEC, &cfg()));
    assert_eq!(first.len(), 3, "{first:?}");
    assert_eq!(ids(&plan(&snapshot.clone(), 200 * SEC, &cfg())), first);
    assert_eq!(
        ids(&plan(&snapshot, 300 * SEC, &cfg())),
        first,
        "later plan, same decisions, same ids"
    );
}
