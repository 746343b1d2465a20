//! The projection against a real Postgres (127.0.0.1:5432, user postgres, trust): every test
//! creates its own database and drops it at the end.

use anyhow::Context;
use jr_protocol::{Envelope, WorkloadPhase};
use jr_store::testkit::{ASSIGNMENTS_STREAM, Builder, EVENTS_STREAM, History, random_history};
use jr_store::{AssignmentState, MemoryProjection, Store};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::Connection;

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

struct TestDb {
    name: String,
    store: Store,
    dropped: bool,
}

/// A test that panics never reaches `TestDb::drop`: drop its database from a helper thread.
impl Drop for TestDb {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
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

impl TestDb {
    async fn new() -> anyhow::Result<Self> {
        let name = format!("jr_store_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(ADMIN_URL)
            .await
            .context("connect admin")?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await?;
        admin.close().await?;
        let store = Store::connect(&format!("postgres://postgres@127.0.0.1:5432/{name}")).await?;
        store.migrate().await?;
        Ok(Self {
            name,
            store,
            dropped: false,
        })
    }

    async fn drop(self) -> anyhow::Result<()> {
        self.store.pool().close().await;
        let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ))
        .execute(&mut admin)
        .await?;
        Ok(())
    }
}

async fn apply_all(store: &Store, history: &History) -> anyhow::Result<()> {
    for (stream, items) in history.streams() {
        store.apply_batch(stream, items).await?;
    }
    Ok(())
}

/// Stream, items of a chunk, end position of the chunk in the stream.
type Chunk<'a> = (&'static str, &'a [(u64, Envelope)], usize);

/// A random way to send both streams of `history`: chunks of up to `max_len` items from
/// either stream in a random interleaving, each starting up to `max_back` items before the first
/// item not sent yet (as a redelivering consumer re-sends what was applied).
fn random_chunks(history: &History, seed: u64, max_len: usize, max_back: usize) -> Vec<Chunk<'_>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let streams = history.streams();
    let mut positions = [0usize; 2];
    let mut chunks = Vec::new();
    while positions
        .iter()
        .zip(&streams)
        .any(|(p, (_, items))| *p < items.len())
    {
        let which = rng.random_range(0..2);
        let (stream, items) = streams[which];
        let start = positions[which];
        if start >= items.len() {
            continue;
        }
        let end = (start + rng.random_range(1..=max_len)).min(items.len());
        let from = start.saturating_sub(rng.random_range(0..=max_back));
        chunks.push((stream, &items[from..end], end));
        positions[which] = end;
    }
    chunks
}

/// Applies both streams in random chunks, interleaving the streams at random and sometimes
/// re-sending an already applied chunk (as a redelivering consumer would).
async fn apply_in_random_chunks(store: &Store, history: &History, seed: u64) -> anyhow::Result<()> {
    for (stream, chunk, _) in random_chunks(history, seed, 40, 4) {
        store.apply_batch(stream, chunk).await?;
    }
    Ok(())
}

#[tokio::test]
async fn replaying_the_same_batches_changes_nothing() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let history = random_history(7, 40);
    apply_all(&db.store, &history).await?;
    let first = db.store.dump_rows().await?;
    for (stream, items) in history.streams() {
        let stats = db.store.apply_batch(stream, items).await?;
        assert_eq!(stats.applied, 0, "{stream} re-applied items");
        assert_eq!(stats.skipped, items.len());
        assert_eq!(db.store.checkpoint(stream).await?, items.len() as u64);
    }
    assert_eq!(db.store.dump_rows().await?, first);
    assert!(
        first["assignments"]
            .as_array()
            .is_some_and(|a| a.len() == 40)
    );
    db.drop().await
}

#[tokio::test]
async fn one_batch_one_by_one_and_random_chunks_give_identical_rows() -> anyhow::Result<()> {
    let history = random_history(11, 30);

    let whole = TestDb::new().await?;
    apply_all(&whole.store, &history).await?;
    let expected = whole.store.dump_rows().await?;

    let single = TestDb::new().await?;
    // Events stream first this time: the order of the two streams must not matter.
    for (stream, items) in history.streams().into_iter().rev() {
        for item in items {
            single
                .store
                .apply_batch(stream, std::slice::from_ref(item))
                .await?;
        }
    }
    assert_eq!(
        single.store.dump_rows().await?,
        expected,
        "one-by-one differs from one batch"
    );

    let chunked = TestDb::new().await?;
    for seed in 0..3 {
        chunked.store.reset().await?;
        apply_in_random_chunks(&chunked.store, &history, seed).await?;
        assert_eq!(
            chunked.store.dump_rows().await?,
            expected,
            "random chunks (seed {seed}) differ"
        );
    }

    whole.drop().await?;
    single.drop().await?;
    chunked.drop().await
}

#[tokio::test]
async fn reset_and_replay_rebuilds_identical_rows() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let history = random_history(23, 30);
    apply_in_random_chunks(&db.store, &history, 5).await?;
    let before = db.store.dump_rows().await?;
    db.store.reset().await?;
    assert_eq!(db.store.checkpoint(EVENTS_STREAM).await?, 0);
    assert!(db.store.records().await?.is_empty());
    apply_all(&db.store, &history).await?;
    assert_eq!(db.store.dump_rows().await?, before);
    db.drop().await
}

#[tokio::test]
async fn stale_observations_are_ignored() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let b = Builder::new(1, "pod");
    let events: Vec<Envelope> = vec![
        b.created(1, 1_000),
        b.observed(1, 2_000, WorkloadPhase::Running, None),
        b.redispatched(1, 2_500, "test"),
        b.created(2, 3_000),
        b.observed(2, 3_500, WorkloadPhase::Running, None),
        // Published late: older than what is already known about attempt 1's workload.
        b.observed(1, 1_500, WorkloadPhase::Pending, None),
        // A newer observation of attempt 1 arriving after attempt 2 exists.
        b.observed(1, 4_000, WorkloadPhase::Failed, Some("evicted")),
    ];
    let items: Vec<(u64, Envelope)> = events
        .into_iter()
        .enumerate()
        .map(|(i, e)| (i as u64 + 1, e))
        .collect();
    db.store.apply_batch(EVENTS_STREAM, &items[..5]).await?;
    db.store.apply_batch(EVENTS_STREAM, &items[5..6]).await?;
    let record = db.store.assignment(b.id).await?.context("record")?;
    let first = record.attempt_workload(1).context("attempt 1 workload")?;
    assert_eq!(
        first.phase(),
        Some(WorkloadPhase::Running),
        "stale pending replaced running"
    );

    db.store.apply_batch(EVENTS_STREAM, &items[6..]).await?;
    let record = db.store.assignment(b.id).await?.context("record")?;
    assert_eq!(
        record.attempt_workload(1).and_then(|w| w.phase()),
        Some(WorkloadPhase::Failed)
    );
    assert_eq!(
        record.attempt_workload(2).and_then(|w| w.phase()),
        Some(WorkloadPhase::Running)
    );
    assert_eq!(record.current_attempt(), 2);
    db.drop().await
}

#[tokio::test]
async fn sql_projection_agrees_with_the_in_memory_fold() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    for seed in [3, 4] {
        db.store.reset().await?;
        let history = random_history(seed, 40);
        apply_in_random_chunks(&db.store, &history, seed).await?;
        let mut memory = MemoryProjection::new();
        for (stream, items) in history.streams() {
            memory.apply_batch(stream, items);
        }
        let records = db.store.records().await?;
        let expected: Vec<_> = memory.records().cloned().collect();
        assert_eq!(records.len(), expected.len());
        for (got, want) in records.iter().zip(&expected) {
            assert_eq!(got, want, "record {} differs", want.id);
        }
        assert_eq!(db.store.snapshot(42).await?, memory.snapshot(42));
        assert_eq!(
            db.store.checkpoint(ASSIGNMENTS_STREAM).await?,
            memory.checkpoint(ASSIGNMENTS_STREAM)
        );
    }
    db.drop().await
}

/// The records a batch hands back are what the store committed and what the in-memory fold
/// returns for the same batch, chunk after chunk (re-sent chunks included), and every record
/// the batch changed is among them.
#[tokio::test]
async fn returned_records_follow_the_projection_chunk_by_chunk() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let history = random_history(21, 30);
    let mut memory = MemoryProjection::new();
    for (stream, chunk, end) in random_chunks(&history, 21, 25, 3) {
        let before = db.store.records().await?;
        let stored = db.store.apply_batch_returning(stream, chunk).await?;
        let expected = memory.apply_batch_returning(stream, chunk);
        // (`touched` differs by definition: rows written vs records the batch named.)
        let counts = |a: &jr_store::Applied| {
            let s = a.stats;
            (s.applied, s.skipped, s.quarantined, s.checkpoint)
        };
        assert_eq!(
            counts(&stored),
            counts(&expected),
            "{stream} chunk ending at {end}"
        );
        let ids = |a: &jr_store::Applied| a.records.iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(
            ids(&stored),
            ids(&expected),
            "{stream} chunk ending at {end}"
        );
        for (got, want) in stored.records.iter().zip(&expected.records) {
            assert_eq!(got, want, "{stream} chunk ending at {end}");
        }
        let after = db.store.records().await?;
        for record in &after {
            let unchanged = before.iter().any(|b| b == record);
            let returned = stored.records.iter().find(|r| r.id == record.id);
            assert!(
                unchanged || returned == Some(record),
                "record {} changed but was not returned as stored",
                record.id
            );
        }
    }
    db.drop().await
}

#[tokio::test]
async fn status_queries_report_states_slots_and_timeline() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let running = Builder::new(1, "pod");
    let waiting = Builder::new(2, "pod");
    let done = Builder::new(3, "vm");
    db.store
        .apply_batch(
            ASSIGNMENTS_STREAM,
            &[
                (1, running.assignment(1, 1_000)),
                (2, waiting.assignment(1, 1_000)),
                (3, done.assignment(1, 1_000)),
            ],
        )
        .await?;
    let events = [
        running.created(1, 2_000),
        running.claimed(1, 3_000),
        done.created(1, 2_000),
        done.claimed(1, 2_500),
        done.terminal(1, 4_000, true),
        done.released(1, 5_000),
    ];
    let items: Vec<(u64, Envelope)> = events
        .into_iter()
        .enumerate()
        .map(|(i, e)| (i as u64 + 1, e))
        .collect();
    db.store.apply_batch(EVENTS_STREAM, &items).await?;

    let counts = db.store.state_counts().await?;
    let count = |backend: &str, state| {
        counts
            .iter()
            .find(|c| c.backend.as_deref() == Some(backend) && c.state == state)
            .map(|c| c.count)
    };
    assert_eq!(count("pod", AssignmentState::Running), Some(1));
    assert_eq!(count("pod", AssignmentState::Pending), Some(1));
    assert_eq!(count("vm", AssignmentState::Completed), Some(1));

    let slots = db.store.slots_used().await?;
    assert_eq!(slots.len(), 1);
    assert_eq!((slots[0].backend.as_str(), slots[0].used), ("pod", 1));

    let snapshot = db.store.snapshot(10_000).await?;
    let ids: Vec<_> = snapshot.assignments.iter().map(|r| r.id).collect();
    assert!(ids.contains(&running.id) && ids.contains(&waiting.id) && !ids.contains(&done.id));

    let timeline = db.store.timeline(done.id).await?.context("timeline")?;
    let steps: Vec<_> = timeline.iter().map(|e| e.step).collect();
    assert_eq!(
        steps,
        [
            "fetched",
            "published",
            "workload-created",
            "claimed",
            "terminal",
            "released"
        ]
    );
    assert!(
        db.store
            .timeline(jr_protocol::AssignmentId::for_task("x", 9))
            .await?
            .is_none()
    );
    db.drop().await
}

fn message(seq: u64, content: Result<Envelope, String>) -> jr_store::StreamMessage {
    jr_store::StreamMessage {
        seq,
        subject: format!("jr.event.pod.x.{seq}"),
        size: 100 + seq as usize,
        content,
    }
}

/// Envelopes decoding would refuse still reach the store through `apply_batch`; the database
/// refuses them (NUL in text, a time beyond `timestamptz`), and only they are quarantined.
#[tokio::test]
async fn messages_the_database_refuses_are_quarantined_and_skipped() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let good = Builder::new(1, "pod");
    let nul = Builder::new(2, "pod");
    let late = Builder::new(3, "pod");
    let mut with_nul = nul.created(1, 2_000);
    if let jr_protocol::Message::WorkloadCreated(c) = &mut with_nul.message {
        c.workload = "pod\0evil".into();
    }
    let far_future = late.claimed(1, u64::MAX);
    let items = vec![
        (1, good.created(1, 1_000)),
        (2, with_nul),
        (3, far_future),
        (4, good.claimed(1, 3_000)),
        (5, nul.claimed(1, 3_000)),
    ];
    let applied = db
        .store
        .apply_batch_returning(EVENTS_STREAM, &items)
        .await?;
    let stats = applied.stats;
    assert_eq!((stats.applied, stats.quarantined), (3, 2), "{stats:?}");
    // The records handed back are the committed ones: without the poison.
    let returned: Vec<_> = applied.records.iter().map(|r| r.id).collect();
    let mut expected = vec![good.id, nul.id];
    expected.sort();
    assert_eq!(returned, expected);
    for record in &applied.records {
        assert_eq!(
            Some(record),
            db.store.assignment(record.id).await?.as_ref(),
            "returned record differs from the stored one"
        );
    }
    assert_eq!(stats.checkpoint, 5);
    assert_eq!(db.store.checkpoint(EVENTS_STREAM).await?, 5);
    assert_eq!(db.store.quarantine_count().await?, 2);
    let entries = db.store.quarantined(10).await?;
    let mut seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, [2, 3]);
    assert!(
        entries
            .iter()
            .all(|e| e.reason.contains("refused by the database")),
        "{entries:?}"
    );

    // The good messages around the poison were applied, the poison left no trace.
    let record = db.store.assignment(good.id).await?.context("good record")?;
    assert!(record.claim.is_some());
    let record = db.store.assignment(nul.id).await?.context("nul record")?;
    assert!(
        record.claim.is_some(),
        "the message after the poison counts"
    );
    assert!(record.attempt_workload(1).is_none(), "poison was applied");
    assert!(db.store.assignment(late.id).await?.is_none());

    // Replaying the batch is idempotent: nothing applied or quarantined twice.
    let again = db.store.apply_batch(EVENTS_STREAM, &items).await?;
    assert_eq!((again.applied, again.quarantined, again.skipped), (0, 0, 5));
    assert_eq!(db.store.quarantine_count().await?, 2);
    db.drop().await
}

#[tokio::test]
async fn undecodable_messages_are_quarantined_with_subject_and_size() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let b = Builder::new(1, "pod");
    let messages = vec![
        message(1, Ok(b.created(1, 1_000))),
        message(2, Err("not a CBOR envelope: \0 garbage".into())),
        message(3, Ok(b.claimed(1, 2_000))),
    ];
    let stats = db.store.apply_messages(EVENTS_STREAM, &messages).await?;
    assert_eq!(
        (stats.applied, stats.quarantined, stats.checkpoint),
        (2, 1, 3)
    );
    let entries = db.store.quarantined(10).await?;
    assert_eq!(entries.len(), 1);
    let e = &entries[0];
    assert_eq!(
        (e.stream.as_str(), e.seq, e.subject.as_str(), e.raw_size),
        (EVENTS_STREAM, 2, "jr.event.pod.x.2", 102)
    );
    assert!(e.reason.starts_with("not a CBOR envelope"), "{}", e.reason);
    assert!(!e.reason.contains('\0'));
    assert!(
        db.store
            .assignment(b.id)
            .await?
            .context("record")?
            .claim
            .is_some()
    );
    db.drop().await
}

/// Errors that may pass on retry are returned, never quarantined: the checkpoint stays and the
/// same batch applies once the cause is gone. Here: Postgres unreachable, and a lock wait that
/// times out in the middle of writing the rows (a server-side error that is not about the data).
#[tokio::test]
async fn transient_errors_are_returned_not_quarantined() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let b = Builder::new(1, "pod");
    let unreachable = Store::from_pool(
        sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(std::time::Duration::from_millis(500))
            .connect_lazy("postgres://postgres@127.0.0.1:1/none")?,
    );
    let err = unreachable
        .apply_batch(EVENTS_STREAM, &[(1, b.created(1, 1_000))])
        .await
        .err()
        .context("apply without a database succeeded")?;
    assert!(!err.is_data_error(), "{err}");

    db.store
        .apply_batch(EVENTS_STREAM, &[(1, b.created(1, 1_000))])
        .await?;
    let impatient = Store::from_pool(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(
                format!("postgres://postgres@127.0.0.1:5432/{}", db.name)
                    .parse::<sqlx::postgres::PgConnectOptions>()?
                    .options([("lock_timeout", "300ms")]),
            )
            .await?,
    );
    let mut holder = db.store.pool().begin().await?;
    sqlx::query("SELECT id FROM assignments WHERE id = $1 FOR UPDATE")
        .bind(b.id.0)
        .fetch_one(&mut *holder)
        .await?;
    let err = impatient
        .apply_batch(EVENTS_STREAM, &[(2, b.claimed(1, 2_000))])
        .await
        .err()
        .context("apply through a held row lock succeeded")?;
    assert!(!err.is_data_error(), "{err}");
    assert_eq!(db.store.quarantine_count().await?, 0);
    assert_eq!(db.store.checkpoint(EVENTS_STREAM).await?, 1);

    holder.rollback().await?;
    let stats = impatient
        .apply_batch(EVENTS_STREAM, &[(2, b.claimed(1, 2_000))])
        .await?;
    assert_eq!((stats.applied, stats.quarantined), (1, 0));
    impatient.pool().close().await;
    db.drop().await
}

/// A database migrated before migration 1's first comment line was reworded records the old
/// text's checksum; it still migrates (sqlx alone would refuse it as modified), and an unknown
/// checksum is still refused.
#[tokio::test]
async fn a_database_migrated_before_the_reworded_comment_still_migrates() -> anyhow::Result<()> {
    let db = TestDb::new().await?;
    let old = "51f938400f708d747c3a5f415127f2c5c38aae2401abba1295f76fee2a801dd6e13c00ce449864a4c7519eca7900b8fc";
    let set = |checksum: Vec<u8>| {
        sqlx::query("UPDATE _sqlx_migrations SET checksum = $1 WHERE version = 1")
            .bind(checksum)
            .execute(db.store.pool())
    };
    set(hex::decode(old)?).await?;
    db.store.migrate().await?;
    set(vec![0u8; 48]).await?;
    assert!(
        db.store.migrate().await.is_err(),
        "a migration modified otherwise is refused"
    );
    db.drop().await
}

/// The projector keeps the records it wrote and reads back only what it never wrote; a second
/// writer on the same database (a reconciler that took over) moves the checkpoints, and the
/// first then reads everything again instead of folding over its stale copy.
#[tokio::test]
async fn writers_taking_turns_give_the_rows_of_one_and_never_fold_a_stale_copy()
-> anyhow::Result<()> {
    let history = random_history(31, 30);
    let whole = TestDb::new().await?;
    apply_all(&whole.store, &history).await?;
    let expected = whole.store.dump_rows().await?;

    let db = TestDb::new().await?;
    // Applied one message at a time, every later message of an assignment finds its record in
    // the copy: nothing is read back.
    for (stream, items) in history.streams() {
        for item in &items[..items.len() / 2] {
            db.store
                .apply_batch(stream, std::slice::from_ref(item))
                .await?;
        }
    }
    assert_eq!(db.store.records_read().await, 0, "records were read back");

    // A second writer (its own copy) takes the other half in turns with the first.
    let other = Store::connect(&format!("postgres://postgres@127.0.0.1:5432/{}", db.name)).await?;
    let mut turn = 0;
    for (stream, items) in history.streams() {
        for chunk in items[items.len() / 2..].chunks(3) {
            let writer = if turn % 2 == 0 { &other } else { &db.store };
            writer.apply_batch(stream, chunk).await?;
            turn += 1;
        }
    }
    assert!(
        db.store.records_read().await > 0 && other.records_read().await > 0,
        "each writer must read what the other wrote"
    );
    assert_eq!(
        db.store.dump_rows().await?,
        expected,
        "writers taking turns differ from one writer"
    );
    other.pool().close().await;
    whole.drop().await?;
    db.drop().await
}
