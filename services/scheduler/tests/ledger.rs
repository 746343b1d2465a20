//! The facade's JetStream ledger against a real nats-server: once the current attempt's
//! executor has claimed, that attempt's view is settled (only `terminal` can still change), in
//! the replica that published the claim and in one that only read it.

mod support;

use std::sync::Arc;
use std::time::Duration;

use jr_facade::Ledger as _;
use jr_gitea_intake::unclaimed::Unclaimed;
use jr_protocol::{
    AssignmentId, BackendName, Envelope, Kind, Message, TaskResult, Terminal, TerminalSource,
    TokenHash, WorkloadCreated, subject,
};
use jr_scheduler::ledger::JetStreamLedger;
use support::{World, sealed_assignment};

fn pod() -> BackendName {
    BackendName::new("pod").expect("name")
}

/// A ledger of the one backend `pod` on `world`'s bus.
fn pod_ledger(world: &World, sealer: &Arc<jr_seal::Sealer>) -> JetStreamLedger {
    JetStreamLedger::new(
        world.bus.clone(),
        vec![pod()],
        Arc::new(Unclaimed::new(Duration::from_secs(180))),
        sealer.clone(),
    )
}

fn created(id: AssignmentId, attempt: u32, token: &str) -> Envelope {
    Envelope::new(
        format!("workload-created:{id}:{attempt}"),
        1_100,
        id,
        attempt,
        Message::WorkloadCreated(WorkloadCreated {
            backend: pod(),
            workload: format!("w-{attempt}"),
            token_hash: TokenHash::of_token(token),
            worker_id: "pod-1".into(),
            warm: None,
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_attempts_view_is_settled_and_only_terminal_is_read_again() {
    let world = World::start().await;
    let sealer = Arc::new(jr_scheduler::service::sealer_from_config(&world.config).expect("key"));
    // Reading `terminal` at every call, so a terminal published elsewhere shows at once.
    let ledger = || pod_ledger(&world, &sealer).terminal_recheck(Duration::ZERO);
    let (publisher, reader) = (ledger(), ledger());
    let id = AssignmentId::for_task("https://forge.test", 41);
    let publish = |subject: String, envelope: Envelope| {
        let bus = world.bus.clone();
        async move { bus.publish(&subject, &envelope).await.expect("publish") }
    };
    publish(
        subject::assignment(&pod(), id),
        sealed_assignment(id, 1, 41, &sealer),
    )
    .await;
    publish(
        subject::event(&pod(), id, Kind::WorkloadCreated),
        created(id, 1, "token-1"),
    )
    .await;

    let view = publisher.lookup(id).await.expect("lookup").expect("known");
    assert_eq!(
        (view.attempt, view.claimed, view.terminal),
        (1, false, false)
    );
    assert_eq!(view.token_hash, Some(TokenHash::of_token("token-1")));
    assert!(
        publisher
            .publish_claimed(&view, "exec-1")
            .await
            .expect("claim")
    );
    let read = reader.lookup(id).await.expect("lookup").expect("known");
    assert_eq!((read.attempt, read.claimed), (1, true));

    // A second attempt appears on the subject after the claim (a redispatch racing the claim):
    // the claiming attempt's executor keeps its view in both replicas.
    publish(
        subject::assignment(&pod(), id),
        sealed_assignment(id, 2, 41, &sealer),
    )
    .await;
    publish(
        subject::event(&pod(), id, Kind::WorkloadCreated),
        created(id, 2, "token-2"),
    )
    .await;
    for l in [&publisher, &reader] {
        let v = l.lookup(id).await.expect("lookup").expect("known");
        assert_eq!(
            (v.attempt, v.claimed, v.terminal, v.token_hash),
            (1, true, false, Some(TokenHash::of_token("token-1")))
        );
    }
    // A replica that never saw the claiming attempt as current reads the subjects as they are.
    let fresh = ledger().lookup(id).await.expect("lookup").expect("known");
    assert_eq!((fresh.attempt, fresh.claimed), (2, true));

    // `terminal` is still read: a terminal published by anyone shows in every replica.
    publish(
        subject::event(&pod(), id, Kind::Terminal),
        Envelope::new(
            format!("terminal:{id}:fail-task"),
            2_000,
            id,
            1,
            Message::Terminal(Terminal {
                forge_task_id: 41,
                result: TaskResult::Failure,
                source: TerminalSource::FailTask,
                log_closed: false,
                reason: None,
            }),
        ),
    )
    .await;
    for l in [&publisher, &reader] {
        let v = l.lookup(id).await.expect("lookup").expect("known");
        assert_eq!((v.attempt, v.claimed, v.terminal), (1, true, true));
    }
    // Once final, the settled view is dropped (the cache holds running jobs only): later
    // lookups read the subjects as they are.
    let after = publisher.lookup(id).await.expect("lookup").expect("known");
    assert_eq!(
        (after.attempt, after.claimed, after.terminal),
        (2, true, true)
    );
}

/// Within the recheck window a claimed assignment's "not terminal" is believed without reading
/// the stream (a terminal published elsewhere is not seen yet), while a terminal this ledger
/// published is known at once; identifying an executor reads no progress at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_assignment_is_not_read_again_within_the_recheck_window() {
    let world = World::start().await;
    let sealer = Arc::new(jr_scheduler::service::sealer_from_config(&world.config).expect("key"));
    let ledger = pod_ledger(&world, &sealer).terminal_recheck(Duration::from_secs(3600));
    let publish = |subject: String, envelope: Envelope| {
        let bus = world.bus.clone();
        async move { bus.publish(&subject, &envelope).await.expect("publish") }
    };
    let terminal = |id: AssignmentId, task: i64, source: TerminalSource| {
        Envelope::new(
            format!("terminal:{id}:{source:?}"),
            2_000,
            id,
            1,
            Message::Terminal(Terminal {
                forge_task_id: task,
                result: TaskResult::Failure,
                source,
                log_closed: false,
                reason: None,
            }),
        )
    };
    let (elsewhere, here) = (
        AssignmentId::for_task("https://forge.test", 51),
        AssignmentId::for_task("https://forge.test", 52),
    );
    for (id, task) in [(elsewhere, 51), (here, 52)] {
        publish(
            subject::assignment(&pod(), id),
            sealed_assignment(id, 1, task, &sealer),
        )
        .await;
        publish(
            subject::event(&pod(), id, Kind::WorkloadCreated),
            created(id, 1, "token-1"),
        )
        .await;
        let view = ledger.lookup(id).await.expect("lookup").expect("known");
        assert!(
            ledger
                .publish_claimed(&view, "exec-1")
                .await
                .expect("claim")
        );
    }

    publish(
        subject::event(&pod(), elsewhere, Kind::Terminal),
        terminal(elsewhere, 51, TerminalSource::FailTask),
    )
    .await;
    let v = ledger
        .lookup(elsewhere)
        .await
        .expect("lookup")
        .expect("known");
    assert_eq!(
        (v.claimed, v.terminal),
        (true, false),
        "the terminal subject was read inside the window"
    );

    // Identifying the executor (Declare) reads neither `claimed` nor `terminal`; a lookup
    // does. A fresh ledger knows nothing of either.
    let fresh = pod_ledger(&world, &sealer);
    let who = fresh
        .identify(elsewhere)
        .await
        .expect("identify")
        .expect("known");
    assert_eq!(
        (
            who.attempt,
            who.token_hash.clone(),
            who.claimed,
            who.terminal
        ),
        (1, Some(TokenHash::of_token("token-1")), false, false),
        "identify read the progress subjects"
    );
    let all = fresh
        .lookup(elsewhere)
        .await
        .expect("lookup")
        .expect("known");
    assert_eq!((all.claimed, all.terminal), (true, true));

    let view = ledger.lookup(here).await.expect("lookup").expect("known");
    let Message::Terminal(t) = terminal(here, 52, TerminalSource::Executor).message else {
        unreachable!("a terminal envelope")
    };
    assert!(ledger.publish_terminal(&view, t).await.expect("terminal"));
    let v = ledger.lookup(here).await.expect("lookup").expect("known");
    assert_eq!((v.claimed, v.terminal), (true, true));
}

/// After a genuine assignment was read, a message that reuses its id with one byte changed is
/// checked again: the forgery never replaces the genuine attempt, and a later genuine attempt
/// is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgery_reusing_a_genuine_assignments_id_never_replaces_it() {
    let world = World::start().await;
    let sealer = Arc::new(jr_scheduler::service::sealer_from_config(&world.config).expect("key"));
    let ledger = pod_ledger(&world, &sealer);
    let id = AssignmentId::for_task("https://forge.test", 61);
    let subject = subject::assignment(&pod(), id);
    let genuine = sealed_assignment(id, 1, 61, &sealer);
    world
        .bus
        .publish(&subject, &genuine)
        .await
        .expect("publish");
    for _ in 0..2 {
        let view = ledger.identify(id).await.expect("identify").expect("known");
        assert_eq!(view.attempt, 1);
    }

    // The same assignment again as attempt 2, one ciphertext byte flipped: the seal does not
    // open, so the lookup goes on to the genuine attempt 1.
    let mut forged = genuine.clone();
    forged.id = format!("assignment:{id}:2:forged");
    forged.attempt = 2;
    let Message::Assignment(a) = &mut forged.message else {
        unreachable!("an assignment")
    };
    a.sealed_task.ciphertext[0] ^= 1;
    world.bus.publish(&subject, &forged).await.expect("publish");
    let view = ledger.lookup(id).await.expect("lookup").expect("known");
    assert_eq!(view.attempt, 1, "the forgery was taken for the scheduler's");

    // A genuine attempt 2 (the seal opens) is taken.
    let mut second = genuine.clone();
    second.id = format!("assignment:{id}:2:genuine");
    second.attempt = 2;
    world.bus.publish(&subject, &second).await.expect("publish");
    let view = ledger.lookup(id).await.expect("lookup").expect("known");
    assert_eq!(view.attempt, 2);
}
