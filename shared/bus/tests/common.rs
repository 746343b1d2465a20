//! Helpers shared by the bus integration tests.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::future::Future;
use std::time::Duration;

use jr_bus::Bus;
use jr_bus::testing::NatsServer;
use jr_protocol::{AssignmentId, BackendName, Envelope, Message, Released, subject};

pub async fn server_and_bus() -> (NatsServer, Bus) {
    let server = NatsServer::start().await.expect("nats-server starts");
    let bus = Bus::connect(&server.url(), "jr-bus-test", None)
        .await
        .expect("connects");
    bus.ensure_topology(&jr_bus::Topology::new())
        .await
        .expect("topology");
    (server, bus)
}

pub fn pod() -> BackendName {
    BackendName::new("pod").expect("valid backend")
}

pub fn new_assignment() -> AssignmentId {
    AssignmentId(uuid::Uuid::new_v4())
}

pub fn released(id: AssignmentId, message_id: &str) -> Envelope {
    Envelope::new(
        message_id,
        1_700_000_000_000,
        id,
        1,
        Message::Released(Released {
            backend: pod(),
            workload: format!("jr-{id}"),
        }),
    )
}

pub fn released_subject(id: AssignmentId) -> String {
    subject::event(&pod(), id, jr_protocol::Kind::Released)
}

/// Polls `condition` every 20 ms until it holds or `timeout` passes.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn messages_in(bus: &Bus, stream: &str) -> u64 {
    let mut handle = bus
        .jetstream()
        .get_stream(stream)
        .await
        .expect("stream exists");
    handle.info().await.expect("stream info").state.messages
}
