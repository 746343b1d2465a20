//! Each service's NATS user against a real nats-server: its own operations work, and a
//! publish, subscription or JetStream call outside its permissions is refused by the server.

mod common;

use std::time::Duration;

use futures::StreamExt as _;
use jr_bus::async_nats::jetstream::{consumer, kv};
use jr_bus::permissions::{
    BackendName, PLACEMENT_BUCKET, Role, SCHEDULER_BUCKET, ordered_consumer_name, worker_bucket,
};
use jr_bus::testing::{NatsServer, ServiceUsers};
use jr_bus::{BusMetrics, ConsumerSpec, Credentials, Topology};
use jr_protocol::{
    AssignmentId, Kind, STREAM_ASSIGNMENTS, STREAM_COMMANDS, STREAM_EVENTS, subject,
};

use common::eventually;

const WAIT: Duration = Duration::from_secs(10);

fn backend(name: &str) -> BackendName {
    BackendName::new(name).expect("valid")
}

fn backends() -> Vec<BackendName> {
    vec![backend("pod"), backend("vm")]
}

async fn connect(server: &NatsServer, users: &ServiceUsers, role: &Role) -> jr_bus::Bus {
    let password = users.password(role).expect("role has a user").to_owned();
    jr_bus::Bus::connect_with_inbox(
        &server.url(),
        &role.user(),
        Some(Credentials::UserPassword {
            user: role.user(),
            password,
        }),
        &role.inbox_prefix(),
    )
    .await
    .expect("connects")
}

/// A JetStream publish that the server stores (a PubAck is the proof).
async fn stored(bus: &jr_bus::Bus, subject: &str) {
    let ack = bus
        .jetstream()
        .publish(subject.to_owned(), "x".into())
        .await
        .unwrap_or_else(|e| panic!("publish {subject}: {e}"));
    tokio::time::timeout(WAIT, ack)
        .await
        .unwrap_or_else(|_| panic!("no PubAck for {subject}"))
        .unwrap_or_else(|e| panic!("PubAck for {subject}: {e}"));
}

fn permission_errors(bus: &jr_bus::Bus) -> u64 {
    BusMetrics::value(&bus.metrics().server_errors, &[("kind", "permissions")])
}

/// Whether the server log has a `what` violation (`Publish`, `Subscription`) of `user` on
/// `subject`. nats-server 2.10 writes `User "u", Subject "s"`, later versions name the user in
/// the client tag (`"$G/user:u"`).
fn violation_logged(server: &NatsServer, what: &str, user: &str, subject: &str) -> bool {
    let violation = format!("{what} Violation");
    let subject = format!("Subject \"{subject}\"");
    let tags = [format!("user:{user}\""), format!("User \"{user}\"")];
    server.log().lines().any(|line| {
        line.contains(&violation)
            && line.contains(&subject)
            && tags.iter().any(|t| line.contains(t.as_str()))
    })
}

/// Publishes on `subject` as `bus` (user `user`) and waits until the server has refused it:
/// the server logs the violation and the client is told (its error counter grows).
async fn refused_publish(server: &NatsServer, bus: &jr_bus::Bus, user: &str, subject: &str) {
    let before = permission_errors(bus);
    bus.client()
        .publish(subject.to_owned(), "forged".into())
        .await
        .expect("sent");
    bus.client().flush().await.expect("flushed");
    eventually(
        &format!("server refuses {user} → {subject}"),
        WAIT,
        || {
            let found = violation_logged(server, "Publish", user, subject);
            async move { found }
        },
    )
    .await;
    eventually(&format!("{user} is told about {subject}"), WAIT, || {
        let n = permission_errors(bus);
        async move { n > before }
    })
    .await;
}

async fn refused_subscription(server: &NatsServer, bus: &jr_bus::Bus, user: &str, subject: &str) {
    let _subscription = bus
        .client()
        .subscribe(subject.to_owned())
        .await
        .expect("sent");
    bus.client().flush().await.expect("flushed");
    eventually(
        &format!("server refuses {user} subscribing {subject}"),
        WAIT,
        || {
            let found = violation_logged(server, "Subscription", user, subject);
            async move { found }
        },
    )
    .await;
}

/// Nothing was stored on `subject` (checked by the full-rights user).
async fn nothing_on(admin: &jr_bus::Bus, stream: &str, subject: &str) {
    let handle = admin
        .jetstream()
        .get_stream_no_info(stream)
        .await
        .expect("stream");
    assert!(
        handle
            .get_last_raw_message_by_subject(subject)
            .await
            .is_err(),
        "a message was stored on {subject}"
    );
}

#[tokio::test]
async fn each_service_does_its_own_work_and_is_refused_outside_its_permissions() {
    let backends = backends();
    let (server, users) = NatsServer::start_with_users(&backends)
        .await
        .expect("nats-server with users starts");
    // Connections without credentials are the full-rights harness user.
    let admin = jr_bus::Bus::connect(&server.url(), "admin", None)
        .await
        .expect("admin connects");
    let pod = Role::Worker(backend("pod"));
    let vm = Role::Worker(backend("vm"));
    let scheduler = connect(&server, &users, &Role::Scheduler).await;
    let pod_worker = connect(&server, &users, &pod).await;
    let vm_worker = connect(&server, &users, &vm).await;
    let reconciler = connect(&server, &users, &Role::Reconciler).await;
    let id = AssignmentId(uuid::Uuid::new_v4());

    // --- own work ---------------------------------------------------------------------------
    // Owners of the stream limits create and update the streams; workers declare (create if
    // missing) and their durables with the exact filter.
    let limits = jr_bus::StreamLimits::default();
    reconciler
        .ensure_topology(&Topology::new().stream_limits(limits))
        .await
        .expect("reconciler declares the streams");
    pod_worker
        .ensure_topology(
            &Topology::new()
                .consumer(ConsumerSpec::worker_assignments(&backend("pod")))
                .consumer(ConsumerSpec::worker_commands(&backend("pod"))),
        )
        .await
        .expect("pod-worker declares its durables");
    scheduler
        .ensure_topology(
            &Topology::new()
                .stream_limits(limits)
                .consumer(ConsumerSpec::scheduler_commands()),
        )
        .await
        .expect("scheduler declares its durable");

    let assignment = subject::assignment(&backend("pod"), id);
    stored(&scheduler, &assignment).await;
    for kind in jr_bus::permissions::SCHEDULER_EVENT_KINDS {
        stored(&scheduler, &subject::event(&backend("pod"), id, kind)).await;
    }
    for kind in jr_bus::permissions::WORKER_EVENT_KINDS {
        stored(&pod_worker, &subject::event(&backend("pod"), id, kind)).await;
        stored(&vm_worker, &subject::event(&backend("vm"), id, kind)).await;
    }
    // Last-message reads are direct gets naming the subject: the scheduler reads any
    // assignment's, a worker its backend's (what was stored is not an envelope, so a permitted
    // read ends in a decode error). Reading another backend's is refused below.
    let pod_event = subject::event(&backend("pod"), id, Kind::WorkloadCreated);
    for (bus, user) in [(&scheduler, "scheduler"), (&pod_worker, "pod-worker")] {
        let read = bus.last_on_subject(STREAM_EVENTS, &pod_event).await;
        assert!(
            matches!(read, Err(jr_bus::BusError::DecodeLast { .. })),
            "{user} reads the pod event: {read:?}"
        );
    }
    stored(&reconciler, &subject::command("pod", Kind::DeleteWorkload)).await;
    stored(
        &reconciler,
        &subject::command(subject::SCHEDULER_TARGET, Kind::FailTask),
    )
    .await;

    // The scheduler reads the worker's queue depth; the worker pulls and double-acks.
    let counts = scheduler
        .consumer_info(STREAM_ASSIGNMENTS, "pod-worker")
        .await
        .expect("scheduler reads pod-worker's counts");
    assert_eq!(counts.num_pending, 1);
    reconciler
        .consumer_info(STREAM_ASSIGNMENTS, "pod-worker")
        .await
        .expect("reconciler reads pod-worker's counts");
    let durable = pod_worker
        .ensure_consumer(&ConsumerSpec::worker_assignments(&backend("pod")))
        .await
        .expect("pod-worker binds");
    let mut batch = durable
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("pull");
    let message = batch.next().await.expect("one message").expect("delivered");
    assert_eq!(message.subject.as_str(), assignment);
    message.double_ack().await.expect("ack confirmed");
    // The delete-workload command reaches the pod worker's commands durable.
    let commands = pod_worker
        .ensure_consumer(&ConsumerSpec::worker_commands(&backend("pod")))
        .await
        .expect("bind commands");
    let mut batch = commands
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("pull commands");
    batch
        .next()
        .await
        .expect("one command")
        .expect("delivered")
        .double_ack()
        .await
        .expect("command acked");

    // Ordered consumers (replays) of the scheduler and the reconciler.
    for (bus, user) in [(&scheduler, "scheduler"), (&reconciler, "reconciler")] {
        let stream = bus
            .jetstream()
            .get_stream(STREAM_EVENTS)
            .await
            .expect("stream info");
        let ordered = stream
            .create_consumer(consumer::pull::OrderedConfig {
                name: Some(ordered_consumer_name(user)),
                filter_subject: format!("jr.event.pod.{id}.>"),
                ..Default::default()
            })
            .await
            .expect("ordered consumer");
        let mut messages = ordered.messages().await.expect("messages");
        let first = tokio::time::timeout(WAIT, messages.next())
            .await
            .expect("replayed in time")
            .expect("a message")
            .expect("delivered");
        assert!(first.subject.as_str().starts_with("jr.event.pod."));
    }
    // Single reads by subject (the last message, from the stream leader).
    for bus in [&scheduler, &pod_worker] {
        let handle = bus
            .jetstream()
            .get_stream_no_info(STREAM_ASSIGNMENTS)
            .await
            .expect("handle");
        handle
            .get_last_raw_message_by_subject(&assignment)
            .await
            .expect("last message read");
    }
    // The KV buckets each owns.
    let requests = scheduler
        .jetstream()
        .create_key_value(kv::Config {
            bucket: SCHEDULER_BUCKET.into(),
            history: 1,
            ..Default::default()
        })
        .await
        .expect("scheduler bucket");
    requests.put("pod", "key-1".into()).await.expect("put");
    assert_eq!(
        requests.get("pod").await.expect("get").as_deref(),
        Some(&b"key-1"[..])
    );
    let ledger = pod_worker
        .jetstream()
        .create_or_update_key_value(kv::Config {
            bucket: worker_bucket(&backend("pod")),
            history: 1,
            ..Default::default()
        })
        .await
        .expect("worker ledger");
    ledger.put("a.1.jr-a-1", "".into()).await.expect("put");
    let keys: Vec<String> = ledger
        .keys()
        .await
        .expect("keys")
        .map(|k| k.expect("key"))
        .collect()
        .await;
    assert_eq!(keys, vec!["a.1.jr-a-1".to_owned()]);
    ledger.purge("a.1.jr-a-1").await.expect("purge");
    // The reconciler creates the placement bucket, an operator sets the switch, workers read it.
    reconciler
        .jetstream()
        .create_key_value(kv::Config {
            bucket: PLACEMENT_BUCKET.into(),
            history: 10,
            ..Default::default()
        })
        .await
        .expect("placement bucket");
    admin
        .jetstream()
        .get_key_value(PLACEMENT_BUCKET)
        .await
        .expect("admin opens the placement bucket")
        .put("burst", "on:30".into())
        .await
        .expect("admin sets the switch");
    let switches = pod_worker
        .jetstream()
        .get_key_value(PLACEMENT_BUCKET)
        .await
        .expect("worker opens the placement bucket");
    assert_eq!(
        switches
            .get("burst")
            .await
            .expect("worker reads")
            .as_deref(),
        Some(&b"on:30"[..])
    );

    for bus in [&scheduler, &pod_worker, &vm_worker, &reconciler] {
        assert_eq!(permission_errors(bus), 0, "own work refused");
    }
    assert!(
        !server.log().contains("Violation"),
        "own work refused: {}",
        server.log()
    );

    // --- refused ----------------------------------------------------------------------------
    let other = AssignmentId(uuid::Uuid::new_v4());
    let pod_event = |kind| subject::event(&backend("pod"), other, kind);
    let forged_assignment = subject::assignment(&backend("pod"), other);
    let pod_user = pod.user();
    for subject in [
        forged_assignment.clone(),
        subject::event(&backend("vm"), other, Kind::WorkloadCreated),
        subject::event(&backend("vm"), other, Kind::Claimed),
        pod_event(Kind::Claimed),
        pod_event(Kind::Terminal),
        pod_event(Kind::TaskFailed),
        subject::command("pod", Kind::DeleteWorkload),
        subject::command(subject::SCHEDULER_TARGET, Kind::FailTask),
        "$JS.API.STREAM.DELETE.JR_EVENTS".to_owned(),
        "$JS.API.STREAM.PURGE.JR_ASSIGNMENTS".to_owned(),
        "$JS.API.STREAM.UPDATE.JR_EVENTS".to_owned(),
        "$JS.API.CONSUMER.MSG.NEXT.JR_ASSIGNMENTS.vm-worker".to_owned(),
        "$JS.API.CONSUMER.CREATE.JR_ASSIGNMENTS.pod-worker.jr.assignment.>".to_owned(),
        "$JS.API.CONSUMER.DELETE.JR_ASSIGNMENTS.pod-worker".to_owned(),
        "$KV.JR_SCHEDULER.pod".to_owned(),
        // A worker reads the burst switch but cannot set it.
        "$KV.JR_PLACEMENT.burst".to_owned(),
        "_INBOX.scheduler.reply".to_owned(),
        // Direct reads of another backend's assignment and events.
        format!(
            "$JS.API.DIRECT.GET.JR_ASSIGNMENTS.{}",
            subject::assignment(&backend("vm"), other)
        ),
        format!(
            "$JS.API.DIRECT.GET.JR_EVENTS.{}",
            subject::event(&backend("vm"), other, Kind::Terminal)
        ),
    ] {
        refused_publish(&server, &pod_worker, &pod_user, &subject).await;
    }
    refused_publish(&server, &vm_worker, &vm.user(), &pod_event(Kind::Released)).await;
    for subject in [
        subject::command("pod", Kind::DeleteWorkload),
        pod_event(Kind::WorkloadCreated),
        pod_event(Kind::Released),
        "$JS.API.CONSUMER.MSG.NEXT.JR_ASSIGNMENTS.pod-worker".to_owned(),
        "$JS.API.CONSUMER.DELETE.JR_ASSIGNMENTS.vm-worker".to_owned(),
        "$JS.API.STREAM.PURGE.JR_ASSIGNMENTS".to_owned(),
        "$KV.JR_WORKLOADS_pod.a.1.jr-a-1".to_owned(),
    ] {
        refused_publish(&server, &scheduler, "scheduler", &subject).await;
    }
    for subject in [
        forged_assignment.clone(),
        pod_event(Kind::Terminal),
        pod_event(Kind::WorkloadObserved),
        "$JS.API.CONSUMER.MSG.NEXT.JR_ASSIGNMENTS.pod-worker".to_owned(),
        "$JS.API.CONSUMER.CREATE.JR_ASSIGNMENTS.pod-worker.jr.assignment.>".to_owned(),
        "$JS.API.CONSUMER.DELETE.JR_COMMANDS.scheduler".to_owned(),
        "$JS.ACK.JR_COMMANDS.scheduler.1.1.1.1.0".to_owned(),
        "$KV.JR_SCHEDULER.pod".to_owned(),
    ] {
        refused_publish(&server, &reconciler, "reconciler", &subject).await;
    }
    refused_subscription(&server, &pod_worker, &pod_user, "jr.>").await;
    refused_subscription(&server, &pod_worker, &pod_user, "_INBOX.scheduler.>").await;
    refused_subscription(&server, &reconciler, "reconciler", "_INBOX.>").await;

    // The nameless create endpoint would let a config naming a worker's durable replace it
    // (the server takes the name from the body there): nobody may use it on these streams.
    for (bus, user) in [(&scheduler, "scheduler"), (&reconciler, "reconciler")] {
        for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS] {
            refused_publish(
                &server,
                bus,
                user,
                &format!("$JS.API.CONSUMER.CREATE.{stream}"),
            )
            .await;
        }
    }
    let durable = admin
        .jetstream()
        .get_stream(STREAM_ASSIGNMENTS)
        .await
        .expect("stream")
        .consumer_info("pod-worker")
        .await
        .expect("pod-worker exists");
    assert_eq!(durable.config.filter_subject, "jr.assignment.pod.>");
    assert!(durable.config.durable_name.is_some());

    // None of the refused messages reached a stream, and the streams and durables are intact.
    nothing_on(&admin, STREAM_ASSIGNMENTS, &forged_assignment).await;
    for kind in [
        Kind::Claimed,
        Kind::Terminal,
        Kind::WorkloadCreated,
        Kind::Released,
    ] {
        nothing_on(&admin, STREAM_EVENTS, &pod_event(kind)).await;
    }
    for stream in [STREAM_ASSIGNMENTS, STREAM_EVENTS, STREAM_COMMANDS] {
        admin
            .jetstream()
            .get_stream(stream)
            .await
            .unwrap_or_else(|e| panic!("{stream} still exists: {e}"));
    }
    let info = admin
        .consumer_info(STREAM_ASSIGNMENTS, "pod-worker")
        .await
        .expect("pod-worker durable still exists");
    assert_eq!(info.num_pending, 0);
}

/// A service that presents no or wrong credentials on a server with users (and no anonymous
/// fallback) is not let in at all.
#[tokio::test]
async fn wrong_credentials_are_refused() {
    let backends = backends();
    let (server, users) = NatsServer::start_with_users(&backends)
        .await
        .expect("nats-server with users starts");
    let good = users.password(&Role::Scheduler).expect("password");
    let client = jr_bus::async_nats::ConnectOptions::new()
        .user_and_password("scheduler".into(), format!("{good}-wrong"))
        .connect(server.url())
        .await;
    assert!(client.is_err(), "a wrong password was accepted");
}
