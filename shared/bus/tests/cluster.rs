//! The bus on a three-node JetStream cluster with R3 streams: a publish survives the loss of the
//! stream leader (retried until a new leader takes it, stored once), the last message of a
//! subject read after the fault is the newest one, and a once-only fact stays once-only.

mod common;

use std::time::Duration;

use common::{new_assignment, pod, released, released_subject};
use jr_bus::testing::NatsCluster;
use jr_bus::{Bus, PublishOnce, Topology};
use jr_protocol::STREAM_EVENTS;

/// One three-node cluster at a time: three tests of this binary each starting nine processes at
/// once on a small machine made a node miss its start-up deadline.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn cluster_and_bus() -> (tokio::sync::MutexGuard<'static, ()>, NatsCluster, Bus) {
    let serial = ONE_CLUSTER.lock().await;
    let (cluster, _users) = NatsCluster::start_with_users(&[pod()])
        .await
        .expect("three nats-servers start");
    let bus = Bus::connect(&cluster.urls(), "jr-bus-cluster-test", None)
        .await
        .expect("connects")
        .with_leader_reads(true);
    let topology = Topology::new().replicas(3);
    jr_bus::retry_transient("topology", &jr_bus::CancellationToken::new(), || {
        bus.ensure_topology(&topology)
    })
    .await
    .expect("R3 topology");
    (serial, cluster, bus)
}

#[tokio::test]
async fn r3_streams_survive_the_loss_of_their_leader() {
    let (_serial, mut cluster, bus) = cluster_and_bus().await;
    let info = bus
        .jetstream()
        .get_stream(STREAM_EVENTS)
        .await
        .expect("stream")
        .cached_info()
        .clone();
    assert_eq!(info.config.num_replicas, 3, "the events stream is not R3");

    // A stream just made R3 may not have a leader (or its interest may not have reached the
    // connected node) yet: the first publish waits for the leader and retries a `no
    // responders` as a service does.
    let leader = cluster
        .wait_for_stream_leader(STREAM_EVENTS, None, Duration::from_secs(20))
        .await
        .expect("the events stream has a leader");
    let first = new_assignment();
    tokio::time::timeout(
        Duration::from_secs(30),
        bus.publish_retrying(
            &released_subject(first),
            &released(first, "first"),
            &jr_bus::CancellationToken::new(),
        ),
    )
    .await
    .expect("the first publish lands")
    .expect("publish before the fault");
    assert!(leader < cluster.len());

    cluster.kill(leader);
    let second = new_assignment();
    let shutdown = jr_bus::CancellationToken::new();
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        bus.publish_retrying(
            &released_subject(second),
            &released(second, "second"),
            &shutdown,
        ),
    )
    .await
    .expect("the publish lands within a minute of the leader's loss")
    .expect("published");
    assert!(!outcome.duplicate);
    let new_leader = cluster
        .wait_for_stream_leader(STREAM_EVENTS, Some(leader), Duration::from_secs(20))
        .await
        .expect("a new leader");
    assert_ne!(new_leader, leader);

    // The same message again is recognised by the new leader: the dedupe window is replicated.
    let again = bus
        .publish(&released_subject(second), &released(second, "second"))
        .await
        .expect("repeat");
    assert!(again.duplicate, "the new leader stored a repeat");

    // A once-only fact: the first writer wins, the second is told, across the new leader.
    let once = new_assignment();
    let won = bus
        .publish_once(&released_subject(once), &released(once, "once-a"))
        .await
        .expect("first");
    assert!(matches!(won, PublishOnce::Published { .. }), "{won:?}");
    let lost = bus
        .publish_once(&released_subject(once), &released(once, "once-b"))
        .await
        .expect("second");
    assert!(
        matches!(lost, PublishOnce::AlreadyExists { .. }),
        "{lost:?}"
    );

    // The killed node comes back and catches up; reads see the newest message.
    cluster.restart(leader).await.expect("restart");
    let (_, last) = bus
        .last_on_subject(STREAM_EVENTS, &released_subject(second))
        .await
        .expect("read")
        .expect("the message is there");
    assert_eq!(last.id, "second");
}

#[tokio::test]
async fn consumer_and_meta_leaders_are_found_and_move_when_killed() {
    let (_serial, mut cluster, bus) = cluster_and_bus().await;
    let meta = cluster
        .wait_for_meta_leader(Duration::from_secs(20))
        .await
        .expect("meta leader");
    bus.jetstream()
        .get_stream(STREAM_EVENTS)
        .await
        .expect("stream")
        .create_consumer(jr_bus::async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("probe".into()),
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let consumer_leader = loop {
        if let Some(l) = cluster.consumer_leader(STREAM_EVENTS, "probe") {
            break l;
        }
        assert!(tokio::time::Instant::now() < deadline, "no consumer leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(consumer_leader < cluster.len());
    cluster.kill(meta);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match cluster.meta_leader() {
            Some(m) if m != meta => break,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no new meta leader after killing {meta}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_lease_on_an_r3_bucket_is_held_again_soon_after_the_bucket_leader_dies() {
    use jr_bus::async_nats::jetstream::kv;
    use jr_bus::lease::{LeaseSpec, spawn_lease};
    let (_serial, mut cluster, bus) = cluster_and_bus().await;
    let store = bus
        .jetstream()
        .create_key_value(kv::Config {
            bucket: "JR_LEASE_R3".to_owned(),
            history: 1,
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .expect("R3 bucket");
    let shutdown = jr_bus::CancellationToken::new();
    let leadership = spawn_lease(
        LeaseSpec {
            store,
            key: "lease.test".to_owned(),
            me: "me".to_owned(),
            policy: jr_lease::Policy::new(3000, 250).expect("policy"),
        },
        shutdown.clone(),
    );
    let until = |what: &'static str, leadership: jr_bus::lease::Leadership| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while leadership.acting().is_none() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    until("the lease is taken", leadership.clone()).await;
    let leader = cluster
        .wait_for_stream_leader("KV_JR_LEASE_R3", None, Duration::from_secs(20))
        .await
        .expect("bucket leader");
    cluster.kill(leader);
    let killed = tokio::time::Instant::now();
    // Held through the election or taken again after it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    until(
        "the lease is held again after the leader's loss",
        leadership.clone(),
    )
    .await;
    println!("lease acting again {:?} after the kill", killed.elapsed());
    shutdown.cancel();
}
