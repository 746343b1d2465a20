//! The `redispatch` command against a real nats-server: the scheduler republishes its own
//! assignment as the next attempt (once, however often it is asked), never republishes an
//! assignment whose sealed task it did not seal, and is not stopped by a forgery or garbage
//! published after its own assignment.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use jr_bus::{ConsumerOptions, ConsumerSpec};
use jr_protocol::{
    Assignment, AssignmentId, BackendName, Envelope, Kind, Message, Redispatch, STREAM_COMMANDS,
    STREAM_EVENTS, subject,
};
use jr_seal::Sealer;
use support::{World, eventually, sealed_assignment};
use tokio_util::sync::CancellationToken;

fn pod() -> BackendName {
    BackendName::new("pod").expect("name")
}

fn assignment(id: AssignmentId, task_id: i64, sealer: &Sealer) -> Envelope {
    sealed_assignment(id, 1, task_id, sealer)
}

fn command(id: AssignmentId, nonce: &str) -> Envelope {
    Envelope::new(
        format!("redispatch:{id}:2@{nonce}"),
        2_000,
        id,
        1,
        Message::Redispatch(Redispatch {
            backend: pod(),
            next_attempt: 2,
            reason: "workload-failed".into(),
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_schedulers_own_assignments_are_redispatched_and_only_once() {
    let world = World::start().await;
    let sealer = jr_scheduler::service::sealer_from_config(&world.config).expect("seal key");
    let stranger = Sealer::new(
        "k1",
        &BTreeMap::from([("k1".to_owned(), Sealer::generate_key())]),
    )
    .expect("stranger key");

    let genuine = AssignmentId::for_task("https://forge.test", 7);
    let forged = AssignmentId::for_task("https://forge.test", 8);
    let overwritten = AssignmentId::for_task("https://forge.test", 9);
    let garbled = AssignmentId::for_task("https://forge.test", 10);
    let publish = |id: AssignmentId, envelope: Envelope| {
        let bus = world.bus.clone();
        async move {
            bus.publish(&subject::assignment(&pod(), id), &envelope)
                .await
                .expect("publish assignment");
        }
    };
    publish(genuine, assignment(genuine, 7, &sealer)).await;
    publish(forged, assignment(forged, 8, &stranger)).await;
    publish(overwritten, assignment(overwritten, 9, &sealer)).await;
    // A forged message planted after the genuine one: the last message is not the scheduler's.
    let mut planted = assignment(overwritten, 9, &stranger);
    planted.id = format!("assignment:{overwritten}:1:planted");
    publish(overwritten, planted).await;
    // Garbage after the genuine one.
    publish(garbled, assignment(garbled, 10, &sealer)).await;
    world
        .bus
        .jetstream()
        .publish(subject::assignment(&pod(), garbled), "not cbor".into())
        .await
        .expect("publish garbage")
        .await
        .expect("garbage stored");

    let command_subject = subject::command(subject::SCHEDULER_TARGET, Kind::Redispatch);
    for envelope in [
        command(genuine, "1"),
        command(genuine, "2"), // asked again in a later period
        command(forged, "1"),
        command(overwritten, "1"),
        command(garbled, "1"),
    ] {
        world
            .bus
            .publish(&command_subject, &envelope)
            .await
            .expect("publish command");
    }

    let stop = CancellationToken::new();
    let consumer = {
        let (bus, stop) = (world.bus.clone(), stop.clone());
        let sealer = std::sync::Arc::new(sealer);
        tokio::spawn(async move {
            let handler_bus = bus.clone();
            bus.run_consumer(
                &ConsumerSpec::scheduler_commands(),
                move |d| {
                    let ctx = jr_scheduler::commands::Context {
                        bus: handler_bus.clone(),
                        forges: Vec::new(),
                        sealer: sealer.clone(),
                    };
                    async move { jr_scheduler::commands::redispatch::handle(&ctx, d).await }
                },
                ConsumerOptions::default(),
                stop,
            )
            .await
        })
    };
    eventually("every command handled", Duration::from_secs(20), || async {
        world
            .bus
            .consumer_info(STREAM_COMMANDS, "scheduler")
            .await
            .is_ok_and(|c| c.num_pending == 0 && c.num_ack_pending == 0)
    })
    .await;
    stop.cancel();
    let _ = consumer.await;

    let stored = read_assignments(&world).await;
    let attempts = |id: AssignmentId| -> Vec<(u32, String)> {
        stored
            .iter()
            .filter(|s| s.envelope.assignment_id == id)
            .map(|s| (s.envelope.attempt, s.msg_id.clone().unwrap_or_default()))
            .collect()
    };
    assert_eq!(
        attempts(genuine),
        [
            (1, format!("assignment:{genuine}:1:test")),
            (2, format!("assignment:{genuine}:2")),
        ],
        "attempt 2 published exactly once"
    );
    let republished = stored
        .iter()
        .find(|s| s.envelope.assignment_id == genuine && s.envelope.attempt == 2)
        .expect("attempt 2");
    assert_eq!(
        republished.assignment, stored[0].assignment,
        "the sealed assignment is republished unchanged"
    );
    assert!(
        attempts(forged).iter().all(|(a, _)| *a == 1),
        "forged assignment republished"
    );
    for id in [overwritten, garbled] {
        let attempts = attempts(id);
        assert_eq!(
            attempts.last(),
            Some(&(2, format!("assignment:{id}:2"))),
            "a forgery or garbage after the genuine assignment blocked the redispatch"
        );
        let republished = stored
            .iter()
            .find(|s| s.envelope.assignment_id == id && s.envelope.attempt == 2)
            .expect("attempt 2");
        let original = stored
            .iter()
            .find(|s| {
                s.envelope.assignment_id == id
                    && s.msg_id.as_deref().is_some_and(|m| m.ends_with(":1:test"))
            })
            .expect("attempt 1");
        assert_eq!(
            republished.assignment, original.assignment,
            "built from the genuine one"
        );
    }

    let world = &world;
    let event = |id| async move {
        world
            .bus
            .last_on_subject(
                STREAM_EVENTS,
                &subject::event(&pod(), id, Kind::Redispatched),
            )
            .await
            .expect("read events")
    };
    let (_, announced) = event(genuine).await.expect("redispatched published");
    assert_eq!(announced.id, format!("redispatch:{genuine}:2"));
    assert!(event(forged).await.is_none());
    assert!(event(overwritten).await.is_some());
    assert!(event(garbled).await.is_some());
}

/// Every decodable message of JR_ASSIGNMENTS (the garbage is skipped).
async fn read_assignments(world: &World) -> Vec<Stored> {
    use futures::StreamExt as _;
    use jr_bus::async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
    let stream = world
        .bus
        .jetstream()
        .get_stream(jr_protocol::STREAM_ASSIGNMENTS)
        .await
        .expect("stream");
    let total = stream.cached_info().state.messages;
    let mut messages = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("reader")
        .messages()
        .await
        .expect("messages");
    let mut out = Vec::new();
    for _ in 0..total {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("every stored message")
            .expect("open")
            .expect("message");
        let Ok(envelope) = jr_protocol::decode(&message.payload) else {
            continue;
        };
        let Message::Assignment(assignment) = envelope.message.clone() else {
            panic!("{} in JR_ASSIGNMENTS", envelope.kind());
        };
        let msg_id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_owned());
        out.push(Stored {
            envelope,
            assignment,
            msg_id,
        });
    }
    out
}

struct Stored {
    envelope: Envelope,
    assignment: Assignment,
    msg_id: Option<String>,
}

/// A forge that ends lost attempts (a runner-bound one), recording what it was asked to end.
struct RunnerBound(std::sync::Arc<std::sync::Mutex<Vec<(AssignmentId, u32, String)>>>);

impl jr_intake::ForgeCommands for RunnerBound {
    fn serves(&self, forge: &jr_protocol::ForgeKind) -> bool {
        matches!(forge, jr_protocol::ForgeKind::GitHub(_))
    }

    fn fail_task<'a>(
        &'a self,
        lost: jr_intake::LostTask<'a>,
    ) -> futures::future::BoxFuture<'a, jr_bus::Disposition> {
        self.0
            .lock()
            .expect("lock")
            .push((lost.id, lost.attempt, lost.reason.to_owned()));
        Box::pin(async { jr_bus::Disposition::Ack })
    }

    fn ends_lost_attempts(&self) -> bool {
        true
    }
}

/// A GitHub runner's config works once: a redispatch of a GitHub assignment is not republished
/// as attempt 2 but handed to its forge to end (the listener makes a fresh runner). Seen
/// failing with the forge's `ends_lost_attempts` answering false: attempt 2 was published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redispatch_of_a_runner_bound_assignment_ends_it_instead_of_republishing_it() {
    let world = World::start().await;
    let sealer = std::sync::Arc::new(
        jr_scheduler::service::sealer_from_config(&world.config).expect("seal key"),
    );
    let id = AssignmentId(uuid::Uuid::new_v4());
    let runner = serde_json::to_vec(&jr_protocol::RunnerRegistration {
        runner_name: format!("jr-{}-1", id.0.simple()),
        jit_config: "eyJqaXQiOiJ4In0=".into(),
    })
    .expect("encode");
    let mut envelope = sealed_assignment(id, 1, 0, &sealer);
    if let Message::Assignment(a) = &mut envelope.message {
        a.forge_instance = "github:gh".into();
        a.sealed_task = sealer
            .seal(jr_seal::SealScope::new(id, &pod(), 0), &runner)
            .expect("seal");
    }
    world
        .bus
        .publish(&subject::assignment(&pod(), id), &envelope)
        .await
        .expect("publish assignment");
    world
        .bus
        .publish(
            &subject::command(subject::SCHEDULER_TARGET, Kind::Redispatch),
            &command(id, "1"),
        )
        .await
        .expect("publish command");
    let ended = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = CancellationToken::new();
    let consumer = {
        let (bus, stop) = (world.bus.clone(), stop.clone());
        let ctx = jr_scheduler::commands::Context {
            bus: world.bus.clone(),
            forges: vec![std::sync::Arc::new(RunnerBound(ended.clone()))],
            sealer,
        };
        tokio::spawn(async move {
            bus.run_consumer(
                &ConsumerSpec::scheduler_commands(),
                move |d| {
                    let ctx = ctx.clone();
                    async move { jr_scheduler::commands::redispatch::handle(&ctx, d).await }
                },
                ConsumerOptions::default(),
                stop,
            )
            .await
        })
    };
    eventually("the command handled", Duration::from_secs(20), || async {
        world
            .bus
            .consumer_info(STREAM_COMMANDS, "scheduler")
            .await
            .is_ok_and(|c| c.num_pending == 0 && c.num_ack_pending == 0)
    })
    .await;
    stop.cancel();
    let _ = consumer.await;
    assert_eq!(
        *ended.lock().expect("lock"),
        vec![(id, 1, "workload-failed".to_owned())],
        "the lost attempt was not handed to its forge to end"
    );
    let attempts: Vec<u32> = read_assignments(&world)
        .await
        .iter()
        .filter(|s| s.envelope.assignment_id == id)
        .map(|s| s.envelope.attempt)
        .collect();
    assert_eq!(
        attempts,
        vec![1],
        "a GitHub runner's attempt was republished"
    );
}
