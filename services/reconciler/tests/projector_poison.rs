//! The projector against a real nats-server and Postgres (127.0.0.1:5432, trust): poison
//! messages published into JR_EVENTS (garbage bytes, an unknown kind, a NUL in a string, a time
//! Postgres cannot store, an envelope the database refuses) are quarantined and skipped, and
//! the good messages behind them are still projected, and handed to the planner's copy as
//! committed.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use jr_bus::testing::NatsServer;
use jr_bus::{Bus, Topology};
use jr_protocol::{Envelope, Message, STREAM_EVENTS};
use jr_store::Store;
use jr_store::testkit::Builder;
use reconciler::projector::{self, Feed, ProjectorState};
use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

struct TestDb {
    name: String,
    store: Store,
}

impl TestDb {
    async fn new() -> anyhow::Result<Self> {
        let name = format!("jr_projector_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await?;
        admin.close().await?;
        let store = Store::connect(&format!("postgres://postgres@127.0.0.1:5432/{name}")).await?;
        store.migrate().await?;
        Ok(Self { name, store })
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
                sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut admin)
                    .await?;
                anyhow::Ok(())
            })
        });
        let _ = cleanup.join();
    }
}

/// Publishes raw bytes (no envelope checks) and returns the stream sequence.
async fn publish_raw(bus: &Bus, subject: &str, payload: Vec<u8>) -> anyhow::Result<u64> {
    let ack = bus
        .jetstream()
        .publish(subject.to_owned(), bytes::Bytes::from(payload))
        .await?
        .await?;
    Ok(ack.sequence)
}

async fn publish(bus: &Bus, b: &Builder, envelope: &Envelope) -> anyhow::Result<u64> {
    let subject = jr_protocol::subject::event(&b.backend, b.id, envelope.kind());
    publish_raw(bus, &subject, jr_protocol::encode(envelope)).await
}

/// CBOR of an envelope whose `kind` this build does not know.
fn unknown_kind(b: &Builder) -> Vec<u8> {
    let mut bytes = jr_protocol::encode(&b.claimed(1, 1_000));
    // "claimed" → "claimer": same length, so the CBOR stays well-formed.
    let at = bytes
        .windows(7)
        .position(|w| w == b"claimed")
        .unwrap_or_else(|| panic!("kind text not found"));
    bytes[at + 6] = b'r';
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_quarantined_and_the_projection_keeps_advancing() -> anyhow::Result<()>
{
    let nats = NatsServer::start().await?;
    let bus = Bus::connect(&nats.url(), "projector-test", None).await?;
    bus.ensure_topology(&Topology::new()).await?;
    let db = TestDb::new().await?;

    let state = Arc::new(ProjectorState::default());
    let shutdown = CancellationToken::new();
    let feed = Arc::new(Feed::new());
    let projector = tokio::spawn(projector::run(
        bus.clone(),
        db.store.clone(),
        STREAM_EVENTS,
        64,
        std::time::Duration::from_millis(10),
        state.clone(),
        feed.clone(),
        shutdown.clone(),
    ));

    let good = Builder::new(1, "pod");
    let poisoned = Builder::new(2, "pod");
    let mut nul = poisoned.created(1, 1_000);
    if let Message::WorkloadCreated(c) = &mut nul.message {
        c.workload = "pod\0x".into();
    }
    let far_future = poisoned.claimed(1, u64::MAX);
    let mut poison = 0;
    publish(&bus, &good, &good.created(1, 1_000)).await?;
    for payload in [
        b"\xff\x00 not cbor".to_vec(),
        unknown_kind(&poisoned),
        jr_protocol::encode(&nul),
        jr_protocol::encode(&far_future),
    ] {
        let subject =
            jr_protocol::subject::event(&poisoned.backend, poisoned.id, jr_protocol::Kind::Claimed);
        publish_raw(&bus, &subject, payload).await?;
        poison += 1;
    }
    publish(&bus, &good, &good.claimed(1, 2_000)).await?;
    publish(&bus, &poisoned, &poisoned.created(1, 3_000)).await?;
    let last = publish(&bus, &good, &good.released(1, 4_000)).await?;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while db.store.checkpoint(STREAM_EVENTS).await? < last {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "projection stuck at {} of {last} (store errors: {})",
            db.store.checkpoint(STREAM_EVENTS).await?,
            state.store_errors.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let quarantined = db.store.quarantine_count().await?;
    println!("quarantined {quarantined} poison messages; checkpoint {last}");
    assert_eq!(quarantined, poison);
    assert_eq!(state.quarantined.load(Ordering::Relaxed), poison);
    let entries = db.store.quarantined(10).await?;
    assert!(
        entries.iter().all(|e| e.stream == STREAM_EVENTS
            && e.subject.ends_with(".claimed")
            && e.raw_size > 0),
        "{entries:?}"
    );

    let record = db.store.assignment(good.id).await?.context("good record")?;
    assert!(
        record.claim.is_some(),
        "the claim after the poison is projected"
    );
    assert!(
        record
            .attempt_workload(1)
            .and_then(|w| w.released_at)
            .is_some(),
        "the release at the end is projected"
    );
    let record = db
        .store
        .assignment(poisoned.id)
        .await?
        .context("record of the poisoned assignment")?;
    assert!(record.claim.is_none(), "no poison was applied");
    assert_eq!(
        record.attempts.get(&1).and_then(|a| a.workload.clone()),
        Some(poisoned.workload(1)),
        "the good message behind the poison is projected"
    );

    // What the feed handed over is what Postgres holds: the planner's copy follows the
    // projection, poison excluded.
    let mut handed = std::collections::BTreeMap::new();
    for record in feed.take() {
        handed.insert(record.id, record);
    }
    assert_eq!(handed.len(), 2, "{:?}", handed.keys());
    for (id, record) in &handed {
        assert_eq!(
            Some(record),
            db.store.assignment(*id).await?.as_ref(),
            "record {id} handed over differs from the stored one"
        );
    }

    shutdown.cancel();
    projector.await?;
    Ok(())
}
