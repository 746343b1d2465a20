//! Stream limits: a full stream refuses new messages and keeps every stored one; a service that
//! declares the topology without limits never resets the ones configured.

mod common;

use common::{new_assignment, released, server_and_bus};
use jr_bus::{StreamLimit, StreamLimits, Topology};
use jr_protocol::{STREAM_EVENTS, subject};

#[tokio::test]
async fn a_full_stream_refuses_new_messages_and_keeps_the_old_ones() {
    let (_server, bus) = server_and_bus().await;
    let small = StreamLimits {
        events: StreamLimit {
            max_messages: 3,
            max_bytes: 1 << 20,
        },
        ..StreamLimits::default()
    };
    bus.ensure_topology(&Topology::new().stream_limits(small))
        .await
        .expect("limits applied");

    let ids: Vec<_> = (0..4).map(|_| new_assignment()).collect();
    let subject_of = |id| subject::event(&common::pod(), id, jr_protocol::Kind::Released);
    for (i, id) in ids.iter().take(3).enumerate() {
        bus.publish(&subject_of(*id), &released(*id, &format!("m-{i}")))
            .await
            .expect("room for three");
    }
    let refused = bus
        .publish(&subject_of(ids[3]), &released(ids[3], "m-3"))
        .await;
    let refused = refused.expect_err("a fourth message was stored");
    // Backpressure, not failure: callers retry the same message until space frees.
    assert_eq!(
        refused.publish_failure(),
        Some(jr_bus::PublishFailure::StreamFull),
        "{refused}"
    );
    assert!(refused.is_transient(), "{refused}");
    // Nothing was discarded to make room: the first message is still there.
    let first = bus
        .last_on_subject(STREAM_EVENTS, &subject_of(ids[0]))
        .await
        .expect("read");
    assert!(first.is_some(), "the oldest message was dropped");

    // A service without limits (a worker) declares the topology: the limits stay.
    bus.ensure_topology(&Topology::new())
        .await
        .expect("declare");
    let info = bus
        .jetstream()
        .get_stream(STREAM_EVENTS)
        .await
        .expect("stream")
        .cached_info()
        .config
        .clone();
    assert_eq!(info.max_messages, 3);
    assert_eq!(
        info.discard,
        jr_bus::async_nats::jetstream::stream::DiscardPolicy::New
    );
}

#[tokio::test]
async fn a_refused_message_lands_once_the_limit_is_raised() {
    let (_server, bus) = server_and_bus().await;
    let one = StreamLimits {
        events: StreamLimit {
            max_messages: 1,
            max_bytes: 1 << 20,
        },
        ..StreamLimits::default()
    };
    bus.ensure_topology(&Topology::new().stream_limits(one))
        .await
        .expect("limits applied");
    let (a, b) = (new_assignment(), new_assignment());
    let subject_of = |id| subject::event(&common::pod(), id, jr_protocol::Kind::Released);
    bus.publish(&subject_of(a), &released(a, "a"))
        .await
        .expect("room for one");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let retrying = tokio::spawn({
        let bus = bus.clone();
        let shutdown = shutdown.clone();
        async move {
            bus.publish_retrying(&subject_of(b), &released(b, "b"), &shutdown)
                .await
        }
    });
    // The retry loop keeps trying while the stream is full ...
    common::eventually(
        "the full stream refused a publish",
        std::time::Duration::from_secs(10),
        || {
            let refused = jr_bus::BusMetrics::value(
                &bus.metrics().publish_errors,
                &[("failure", "stream-full")],
            );
            async move { refused > 0 }
        },
    )
    .await;
    assert!(
        !retrying.is_finished(),
        "the publish gave up on a full stream"
    );
    // ... and lands once an operator raises the limit.
    let raised = StreamLimits {
        events: StreamLimit {
            max_messages: 10,
            max_bytes: 1 << 20,
        },
        ..StreamLimits::default()
    };
    bus.ensure_topology(&Topology::new().stream_limits(raised))
        .await
        .expect("limits raised");
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(30), retrying)
        .await
        .expect("the publish lands after the limit is raised")
        .expect("task")
        .expect("published");
    assert!(!outcome.duplicate);
}

#[test]
fn every_stream_discards_new_messages_with_bounded_defaults() {
    for config in Topology::new().streams() {
        assert_eq!(
            config.discard,
            jr_bus::async_nats::jetstream::stream::DiscardPolicy::New,
            "{}",
            config.name
        );
        assert!(
            config.max_messages > 0 && config.max_bytes > 0,
            "{}",
            config.name
        );
    }
}
