mod common;

use std::time::Duration;

use async_nats::jetstream::stream::RetentionPolicy;
use common::*;
use jr_bus::{BusMetrics, ConsumerSpec, PublishOnce, Topology};
use jr_protocol::{Claimed, Envelope, Kind, Message, STREAM_EVENTS, subject};

#[tokio::test]
async fn ensure_topology_twice_is_idempotent() {
    let (_server, bus) = server_and_bus().await;
    let topology = Topology::new()
        .consumer(ConsumerSpec::worker_assignments(&pod()))
        .consumer(ConsumerSpec::worker_commands(&pod()))
        .consumer(ConsumerSpec::scheduler_commands())
        .consumer(ConsumerSpec::reconciler_assignments())
        .consumer(ConsumerSpec::reconciler_events());
    bus.ensure_topology(&topology)
        .await
        .expect("first declaration");
    bus.ensure_topology(&topology)
        .await
        .expect("second declaration is a no-op");

    let mut commands = bus
        .jetstream()
        .get_stream("JR_COMMANDS")
        .await
        .expect("stream");
    let info = commands.info().await.expect("info");
    assert_eq!(info.config.retention, RetentionPolicy::WorkQueue);
    let mut events = bus
        .jetstream()
        .get_stream("JR_EVENTS")
        .await
        .expect("stream");
    let info = events.info().await.expect("info");
    assert_eq!(info.config.duplicate_window, Duration::from_secs(600));
    assert_eq!(info.config.max_age, Duration::from_secs(30 * 24 * 3600));

    let counts = bus
        .consumer_info("JR_ASSIGNMENTS", "pod-worker")
        .await
        .expect("consumer");
    assert_eq!(counts.num_pending, 0);
    let consumer = commands
        .consumer_info("pod-worker")
        .await
        .expect("consumer info");
    assert_eq!(consumer.config.filter_subject, "jr.command.pod.>");
    assert_eq!(consumer.config.max_deliver, -1);
}

#[tokio::test]
async fn publish_sets_readable_headers_and_reports_duplicates() {
    let (_server, bus) = server_and_bus().await;
    let id = new_assignment();
    let envelope = released(id, "released-1");
    let subject = released_subject(id);

    let first = bus
        .publish(&subject, &envelope)
        .await
        .expect("first publish");
    let second = bus
        .publish(&subject, &envelope)
        .await
        .expect("second publish");
    assert!(!first.duplicate);
    assert!(
        second.duplicate,
        "same Nats-Msg-Id inside the window is a duplicate"
    );
    assert_eq!(first.stream_seq, second.stream_seq);
    assert_eq!(messages_in(&bus, STREAM_EVENTS).await, 1);

    let stream = bus
        .jetstream()
        .get_stream(STREAM_EVENTS)
        .await
        .expect("stream");
    let raw = stream
        .get_last_raw_message_by_subject(&subject)
        .await
        .expect("stored");
    let header = |name: &str| raw.headers.get(name).map(|v| v.as_str().to_owned());
    assert_eq!(header("Nats-Msg-Id").as_deref(), Some("released-1"));
    assert_eq!(header("Jr-Kind").as_deref(), Some("released"));
    assert_eq!(header("Jr-Assignment"), Some(id.to_string()));
    assert_eq!(header("Jr-Attempt").as_deref(), Some("1"));
    assert_eq!(header("Jr-Backend").as_deref(), Some("pod"));
    assert_eq!(header("Content-Type").as_deref(), Some("application/cbor"));
    assert_eq!(
        jr_protocol::decode(&raw.payload).expect("decodes"),
        envelope
    );

    let published = BusMetrics::value(
        &bus.metrics().published,
        &[("kind", "released"), ("outcome", "duplicate")],
    );
    assert_eq!(published, 1);
}

fn claimed(id: jr_protocol::AssignmentId, message_id: &str, executor: &str) -> Envelope {
    Envelope::new(
        message_id,
        1_700_000_000_000,
        id,
        1,
        Message::Claimed(Claimed {
            forge_task_id: 7,
            executor: executor.to_owned(),
        }),
    )
}

#[tokio::test]
async fn publish_once_lets_only_the_first_writer_win() {
    let (_server, bus) = server_and_bus().await;
    let id = new_assignment();
    let subject = subject::event(&pod(), id, Kind::Claimed);
    let ours = claimed(id, "claimed-a", "token");
    let theirs = claimed(id, "claimed-b", "spiffe://x/y");

    assert!(
        bus.last_on_subject(STREAM_EVENTS, &subject)
            .await
            .expect("read")
            .is_none()
    );

    let first = bus
        .publish_once(&subject, &ours)
        .await
        .expect("first writer");
    let PublishOnce::Published { seq } = first else {
        panic!("expected Published, got {first:?}")
    };
    assert_eq!(
        bus.publish_once(&subject, &ours).await.expect("repeat"),
        PublishOnce::Duplicate { seq }
    );
    assert_eq!(
        bus.publish_once(&subject, &theirs)
            .await
            .expect("second writer"),
        PublishOnce::AlreadyExists { seq }
    );

    let (last_seq, stored) = bus
        .last_on_subject(STREAM_EVENTS, &subject)
        .await
        .expect("read")
        .expect("present");
    assert_eq!(last_seq, seq);
    assert_eq!(stored, ours);
    assert_eq!(messages_in(&bus, STREAM_EVENTS).await, 1);
}

#[tokio::test]
async fn last_on_subject_reports_a_foreign_message_as_undecodable() {
    let (_server, bus) = server_and_bus().await;
    let id = new_assignment();
    let subject = released_subject(id);
    bus.jetstream()
        .publish(subject.clone(), "not cbor".into())
        .await
        .expect("sent")
        .await
        .expect("stored");
    let error = bus
        .last_on_subject(STREAM_EVENTS, &subject)
        .await
        .expect_err("garbage");
    assert_eq!(error.kind(), "decode-last");
    assert!(!error.is_transient());
}

#[tokio::test]
async fn publish_retrying_survives_a_nats_restart() {
    let (mut server, bus) = server_and_bus().await;
    let id = new_assignment();
    let subject = released_subject(id);
    let envelope = released(id, "released-during-outage");

    server.kill();
    let shutdown = jr_bus::CancellationToken::new();
    let publisher = {
        let (bus, subject, envelope, shutdown) = (
            bus.clone(),
            subject.clone(),
            envelope.clone(),
            shutdown.clone(),
        );
        tokio::spawn(async move { bus.publish_retrying(&subject, &envelope, &shutdown).await })
    };
    eventually(
        "a publish attempt failed during the outage",
        Duration::from_secs(30),
        || async {
            [
                "timeout",
                "no-responders",
                "disconnected",
                "backpressure",
                "other",
            ]
            .into_iter()
            .map(|failure| {
                BusMetrics::value(&bus.metrics().publish_errors, &[("failure", failure)])
            })
            .sum::<u64>()
                > 0
        },
    )
    .await;
    server.restart().await.expect("restarts");

    let outcome = tokio::time::timeout(Duration::from_secs(60), publisher)
        .await
        .expect("publish finishes after the restart")
        .expect("task did not panic")
        .expect("published");
    assert!(outcome.stream_seq >= 1);
    assert_eq!(
        messages_in(&bus, STREAM_EVENTS).await,
        1,
        "landed exactly once"
    );
    let (_, stored) = bus
        .last_on_subject(STREAM_EVENTS, &subject)
        .await
        .expect("read")
        .expect("present");
    assert_eq!(stored.id, "released-during-outage");
}

#[tokio::test]
async fn publish_retrying_gives_up_when_shutdown_fires() {
    let (mut server, bus) = server_and_bus().await;
    server.kill();
    let id = new_assignment();
    let shutdown = jr_bus::CancellationToken::new();
    shutdown.cancel();
    let error = bus
        .publish_retrying(&released_subject(id), &released(id, "x"), &shutdown)
        .await
        .expect_err("shut down");
    assert_eq!(error.kind(), "shut-down");
}
