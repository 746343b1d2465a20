//! The Postgres projection: [`Store`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use jr_protocol::{AssignmentId, Envelope};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::StoreError;
use crate::cache::RecordCache;
use crate::memory::{Applied, ApplyStats};
use crate::model::{AssignmentRecord, AssignmentState, Snapshot, TimelineEntry};
use crate::rows::{Rows, decode};
use crate::sql::{Scope, load_rows, write_rows};

/// Transaction-level advisory lock taken by every projection write: the projector may apply
/// both streams concurrently, and both read-modify-write the same assignment records.
const PROJECTOR_LOCK: i64 = 0x6a72_7072_6f6a; // "jrproj"

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// SHA-384 (hex) of migration 1 before its first comment line was reworded.
const MIGRATION_1_OLD_CHECKSUM: &str = "51f938400f708d747c3a5f415127f2c5c38aae2401abba1295f76fee2a801dd6e13c00ce449864a4c7519eca7900b8fc";

/// Assignments per backend and state (status API).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StateCount {
    /// `None` for assignments known only from events that name no backend.
    pub backend: Option<String>,
    pub state: AssignmentState,
    pub count: u64,
}

/// Capacity slots in use per backend: attempts whose workload was created and not released.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlotUsage {
    pub backend: String,
    pub used: u64,
}

/// The projection in Postgres. Cheap to clone (a pool handle); clones share the projector's
/// copy of the records it wrote ([`crate::cache`]).
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
    /// Held for a whole write, so this process's writes are serialised here before they queue
    /// on the database's advisory lock.
    cache: Arc<tokio::sync::Mutex<RecordCache>>,
}

fn q(op: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { op, source }
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

impl Store {
    /// Connects a pool (no migration; call [`Store::migrate`]).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(url)
            .await
            .map_err(StoreError::Connect)?;
        Ok(Self::from_pool(pool))
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            cache: Arc::default(),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded migrations (`shared/store/migrations`).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.adopt_edited_comment().await?;
        MIGRATOR.run(&self.pool).await.map_err(StoreError::Migrate)
    }

    /// Migration 1's first comment line was reworded after release; nothing else in it changed.
    /// A database migrated before records the checksum of the old text, which sqlx would refuse
    /// as a modified migration: that one known checksum is replaced by the current one.
    async fn adopt_edited_comment(&self) -> Result<(), StoreError> {
        let Some(current) = MIGRATOR.iter().find(|m| m.version == 1) else {
            return Ok(());
        };
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&self.pool)
            .await
            .map_err(|source| StoreError::Query {
                op: "look for the migrations table",
                source,
            })?;
        if exists {
            sqlx::query(
                "UPDATE _sqlx_migrations SET checksum = $1 WHERE version = 1 AND checksum = $2",
            )
            .bind(current.checksum.as_ref())
            .bind(hex::decode(MIGRATION_1_OLD_CHECKSUM).unwrap_or_default())
            .execute(&self.pool)
            .await
            .map_err(|source| StoreError::Query {
                op: "adopt migration 1's reworded comment",
                source,
            })?;
        }
        Ok(())
    }

    /// Applies `items` (stream sequence, message) of `stream`; see [`Store::apply_messages`],
    /// which this is for messages that were decoded already (subject and size unknown).
    pub async fn apply_batch(
        &self,
        stream: &str,
        items: &[(u64, Envelope)],
    ) -> Result<ApplyStats, StoreError> {
        Ok(self.apply_batch_returning(stream, items).await?.stats)
    }

    /// [`Store::apply_batch`], also returning the records the batch changed.
    pub async fn apply_batch_returning(
        &self,
        stream: &str,
        items: &[(u64, Envelope)],
    ) -> Result<Applied, StoreError> {
        let items: Vec<Item<'_>> = items
            .iter()
            .map(|(seq, envelope)| Item {
                seq: *seq,
                subject: "",
                size: 0,
                content: Ok(envelope),
            })
            .collect();
        self.apply_items(stream, &items).await
    }

    /// Applies the messages of `stream` in one transaction: items at or below the stream's
    /// checkpoint (or not above an earlier item of the batch) are skipped, the rest folded into
    /// their assignment records in order, the changed rows written and the checkpoint advanced.
    /// Idempotent: replaying any prefix changes nothing.
    ///
    /// Poison-safe: a message that could not be decoded, or that the database refuses (a data
    /// error such as an invalid string or an out-of-range time, a constraint, a size limit), is
    /// recorded in `quarantine` and skipped; the checkpoint moves past it. When the batch as a
    /// whole hits a data error it is applied again message by message, each in a savepoint, so
    /// only the message that causes it is quarantined. Any other error (connection lost,
    /// serialization failure, ...) is returned without quarantining anything: the caller
    /// retries the same batch.
    pub async fn apply_messages(
        &self,
        stream: &str,
        messages: &[StreamMessage],
    ) -> Result<ApplyStats, StoreError> {
        Ok(self.apply_messages_returning(stream, messages).await?.stats)
    }

    /// [`Store::apply_messages`], also returning every record the batch changed as it was
    /// committed (the fold of [`AssignmentRecord::apply`] over the stored record), so that a
    /// copy of the projection kept elsewhere can follow it without reading it back.
    pub async fn apply_messages_returning(
        &self,
        stream: &str,
        messages: &[StreamMessage],
    ) -> Result<Applied, StoreError> {
        let items: Vec<Item<'_>> = messages
            .iter()
            .map(|m| Item {
                seq: m.seq,
                subject: &m.subject,
                size: m.size,
                content: m.content.as_ref().map_err(String::as_str),
            })
            .collect();
        self.apply_items(stream, &items).await
    }

    async fn apply_items(&self, stream: &str, items: &[Item<'_>]) -> Result<Applied, StoreError> {
        let mut cache = self.cache.lock().await;
        let result = match self.apply_together(stream, items, &mut cache).await {
            Err(e) if e.is_data_error() => {
                tracing::warn!(stream, error = %e, "batch refused by the database; applying it message by message");
                cache.clear();
                self.apply_one_by_one(stream, items).await
            }
            other => other,
        };
        if result.is_err() {
            // Committed or not, the database's state is not known for sure: read it again.
            cache.clear();
        }
        result
    }

    /// Every stream's checkpoint, read under the projector's lock.
    async fn checkpoints(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<BTreeMap<String, u64>, StoreError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT stream, last_seq FROM projector_checkpoint")
                .fetch_all(&mut **tx)
                .await
                .map_err(q("read checkpoints"))?;
        Ok(rows
            .into_iter()
            .map(|(stream, seq)| (stream, u64::try_from(seq).unwrap_or(0)))
            .collect())
    }

    /// Locks the projection for this transaction and returns the stream's checkpoint.
    async fn lock_checkpoint(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        stream: &str,
    ) -> Result<u64, StoreError> {
        let stored: i64 = sqlx::query_scalar(
            "INSERT INTO projector_checkpoint (stream, last_seq) \
             SELECT $1, 0 FROM (SELECT pg_advisory_xact_lock($2)) AS locked \
             ON CONFLICT (stream) DO UPDATE SET last_seq = projector_checkpoint.last_seq \
             RETURNING last_seq",
        )
        .bind(stream)
        .bind(PROJECTOR_LOCK)
        .fetch_one(&mut **tx)
        .await
        .map_err(q("read checkpoint"))?;
        Ok(u64::try_from(stored).unwrap_or(0))
    }

    async fn write_checkpoint(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        stream: &str,
        checkpoint: u64,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE projector_checkpoint SET last_seq = $2 WHERE stream = $1")
            .bind(stream)
            .bind(crate::rows::db_ms(checkpoint))
            .execute(&mut **tx)
            .await
            .map_err(q("write checkpoint"))?;
        Ok(())
    }

    /// The items above the checkpoint, in order; counts the rest as skipped.
    fn fresh<'i, 'a>(
        items: &'i [Item<'a>],
        stored: u64,
        stats: &mut ApplyStats,
    ) -> Vec<&'i Item<'a>> {
        let mut checkpoint = stored;
        let mut fresh = Vec::with_capacity(items.len());
        for item in items {
            if item.seq <= checkpoint {
                stats.skipped += 1;
            } else {
                checkpoint = item.seq;
                fresh.push(item);
            }
        }
        stats.checkpoint = checkpoint;
        fresh
    }

    /// The fast path: every fresh message folded and written with one statement per table,
    /// over the records of `cache` where it holds them.
    async fn apply_together(
        &self,
        stream: &str,
        items: &[Item<'_>],
        cache: &mut RecordCache,
    ) -> Result<Applied, StoreError> {
        let mut tx = self.pool.begin().await.map_err(q("begin"))?;
        let stored = Self::lock_checkpoint(&mut tx, stream).await?;
        cache.validate(&Self::checkpoints(&mut tx).await?);
        let mut stats = ApplyStats::default();
        let fresh = Self::fresh(items, stored, &mut stats);
        if fresh.is_empty() {
            tx.commit().await.map_err(q("commit"))?;
            cache.committed(stream, stored, []);
            return Ok(Applied {
                stats,
                records: Vec::new(),
            });
        }
        let mut good: Vec<(u64, &Envelope)> = Vec::with_capacity(fresh.len());
        for item in &fresh {
            match item.content {
                Ok(envelope) => good.push((item.seq, envelope)),
                Err(reason) => {
                    quarantine(&mut tx, stream, item, reason).await?;
                    stats.quarantined += 1;
                }
            }
        }
        stats.applied = good.len();
        let folded = fold_and_write(&mut tx, &good, Some(cache)).await?;
        cache.loaded += folded.loaded as u64;
        stats.touched = folded.touched;
        Self::write_checkpoint(&mut tx, stream, stats.checkpoint).await?;
        tx.commit().await.map_err(q("commit"))?;
        cache.committed(stream, stats.checkpoint, folded.after.values());
        tracing::debug!(
            stream,
            applied = stats.applied,
            skipped = stats.skipped,
            quarantined = stats.quarantined,
            checkpoint = stats.checkpoint,
            "applied batch"
        );
        Ok(Applied {
            stats,
            records: folded.into_changed(),
        })
    }

    /// The slow path after a data error: each message in its own savepoint; the ones the
    /// database refuses are rolled back to their savepoint and quarantined.
    async fn apply_one_by_one(
        &self,
        stream: &str,
        items: &[Item<'_>],
    ) -> Result<Applied, StoreError> {
        let mut tx = self.pool.begin().await.map_err(q("begin"))?;
        let stored = Self::lock_checkpoint(&mut tx, stream).await?;
        let mut stats = ApplyStats::default();
        let fresh = Self::fresh(items, stored, &mut stats);
        let mut touched = BTreeSet::new();
        // The latest version of each record changed by a message that was kept.
        let mut changed: BTreeMap<AssignmentId, AssignmentRecord> = BTreeMap::new();
        for item in fresh {
            let envelope = match item.content {
                Ok(envelope) => envelope,
                Err(reason) => {
                    quarantine(&mut tx, stream, item, reason).await?;
                    stats.quarantined += 1;
                    continue;
                }
            };
            let mut savepoint = sqlx::Acquire::begin(&mut *tx)
                .await
                .map_err(q("savepoint"))?;
            match fold_and_write(&mut savepoint, &[(item.seq, envelope)], None).await {
                Ok(folded) => {
                    savepoint.commit().await.map_err(q("release savepoint"))?;
                    touched.insert(envelope.assignment_id);
                    changed.extend(folded.into_changed().into_iter().map(|r| (r.id, r)));
                    stats.applied += 1;
                }
                Err(e) if e.is_data_error() => {
                    savepoint
                        .rollback()
                        .await
                        .map_err(q("rollback to savepoint"))?;
                    let reason = format!("refused by the database: {e}");
                    tracing::warn!(stream, seq = item.seq, subject = item.subject, %reason, "message quarantined");
                    quarantine(&mut tx, stream, item, &reason).await?;
                    stats.quarantined += 1;
                }
                Err(e) => return Err(e),
            }
        }
        stats.touched = touched.len();
        Self::write_checkpoint(&mut tx, stream, stats.checkpoint).await?;
        tx.commit().await.map_err(q("commit"))?;
        Ok(Applied {
            stats,
            records: changed.into_values().collect(),
        })
    }

    /// How many messages are quarantined (all streams).
    pub async fn quarantine_count(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM quarantine")
            .fetch_one(&self.pool)
            .await
            .map_err(q("quarantine count"))?;
        Ok(count(n))
    }

    /// The most recently quarantined messages, newest first, at most `limit`.
    pub async fn quarantined(&self, limit: u32) -> Result<Vec<QuarantineEntry>, StoreError> {
        let rows: Vec<(String, i64, String, String, i64, i64)> = sqlx::query_as(
            "SELECT stream, seq, subject, reason, raw_size, jr_ms(quarantined_at) FROM quarantine \
             ORDER BY quarantined_at DESC, stream, seq DESC LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(q("quarantined"))?;
        Ok(rows
            .into_iter()
            .map(|(stream, seq, subject, reason, size, at)| QuarantineEntry {
                stream,
                seq: count(seq),
                subject,
                reason,
                raw_size: count(size),
                quarantined_at: count(at),
            })
            .collect())
    }

    /// The last sequence of `stream` applied (0 = nothing yet).
    pub async fn checkpoint(&self, stream: &str) -> Result<u64, StoreError> {
        let seq: Option<i64> =
            sqlx::query_scalar("SELECT last_seq FROM projector_checkpoint WHERE stream = $1")
                .bind(stream)
                .fetch_optional(&self.pool)
                .await
                .map_err(q("read checkpoint"))?;
        Ok(seq.map_or(0, |s| u64::try_from(s).unwrap_or(0)))
    }

    /// Records the writes of this handle (and its clones) read back from the database because
    /// its copy of the records it wrote did not hold them; a projector that keeps up reads
    /// only records it never wrote.
    pub async fn records_read(&self) -> u64 {
        self.cache.lock().await.loaded
    }

    /// Drops all projection data including checkpoints, so replaying the streams rebuilds it.
    pub async fn reset(&self) -> Result<(), StoreError> {
        let mut cache = self.cache.lock().await;
        cache.clear();
        let mut tx = self.pool.begin().await.map_err(q("begin"))?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(PROJECTOR_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(q("reset"))?;
        sqlx::query(
            "TRUNCATE assignments, attempts, claims, terminal_markers, task_failures, redispatches, \
             workloads, projector_checkpoint, quarantine",
        )
        .execute(&mut *tx)
        .await
        .map_err(q("reset"))?;
        tx.commit().await.map_err(q("commit"))
    }

    /// Every assignment that is not finished, with all its rows (what the planner needs).
    pub async fn snapshot(&self, now_ms: u64) -> Result<Snapshot, StoreError> {
        let mut tx = self.read_tx().await?;
        let assignments = decode(load_rows(&mut tx, Scope::Open).await?)?;
        tx.commit().await.map_err(q("commit"))?;
        Ok(Snapshot {
            taken_at: now_ms,
            assignments,
        })
    }

    /// Every assignment record, finished or not, sorted by id.
    pub async fn records(&self) -> Result<Vec<AssignmentRecord>, StoreError> {
        let mut tx = self.read_tx().await?;
        let records = decode(load_rows(&mut tx, Scope::All).await?)?;
        tx.commit().await.map_err(q("commit"))?;
        Ok(records)
    }

    /// One assignment's record.
    pub async fn assignment(
        &self,
        id: AssignmentId,
    ) -> Result<Option<AssignmentRecord>, StoreError> {
        let mut tx = self.read_tx().await?;
        let ids = [id.0];
        let record = decode(load_rows(&mut tx, Scope::Ids(&ids)).await?)?
            .into_iter()
            .next();
        tx.commit().await.map_err(q("commit"))?;
        Ok(record)
    }

    /// The lifecycle steps of one assignment in time order (`None` if unknown).
    pub async fn timeline(
        &self,
        id: AssignmentId,
    ) -> Result<Option<Vec<TimelineEntry>>, StoreError> {
        Ok(self.assignment(id).await?.map(|r| r.timeline()))
    }

    /// Assignment counts per backend and state.
    pub async fn state_counts(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows: Vec<(Option<String>, String, i64)> = sqlx::query_as(
            "SELECT backend, state, count(*) FROM assignments GROUP BY backend, state ORDER BY backend, state",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(q("state counts"))?;
        rows.into_iter()
            .map(|(backend, state, n)| {
                let state = AssignmentState::parse(&state).ok_or_else(|| {
                    StoreError::decode("assignments", format!("unknown state {state:?}"))
                })?;
                Ok(StateCount {
                    backend,
                    state,
                    count: count(n),
                })
            })
            .collect()
    }

    /// Workloads of `backend` that hold a slot according to the projection (created and not
    /// released): `(assignment, attempt, workload)`. A restarted worker compares them with what
    /// its backend still lists, to report the ones that vanished while it was down.
    pub async fn slot_holders(
        &self,
        backend: &str,
    ) -> Result<Vec<(AssignmentId, u32, String)>, StoreError> {
        let rows: Vec<(Uuid, i32, String)> = sqlx::query_as(
            "SELECT assignment_id, attempt, workload FROM attempts \
             WHERE holds_slot AND backend = $1 AND workload IS NOT NULL ORDER BY assignment_id, attempt",
        )
        .bind(backend)
        .fetch_all(&self.pool)
        .await
        .map_err(|source| StoreError::Query { op: "slot holders", source })?;
        Ok(rows
            .into_iter()
            .map(|(id, attempt, workload)| {
                (
                    AssignmentId(id),
                    u32::try_from(attempt).unwrap_or(0),
                    workload,
                )
            })
            .collect())
    }

    /// Slots in use per backend.
    pub async fn slots_used(&self) -> Result<Vec<SlotUsage>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT backend, count(*) FROM attempts WHERE holds_slot AND backend IS NOT NULL \
             GROUP BY backend ORDER BY backend",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(q("slots used"))?;
        Ok(rows
            .into_iter()
            .map(|(backend, n)| SlotUsage {
                backend,
                used: count(n),
            })
            .collect())
    }

    /// Per backend, the forge fetch time (unix ms) of the longest-waiting pending assignment (no
    /// workload yet): `(backend, fetched_at)`.
    pub async fn oldest_waiting(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT backend, jr_ms(min(fetched_at)) FROM assignments \
             WHERE state = 'pending' AND backend IS NOT NULL AND fetched_at IS NOT NULL GROUP BY backend ORDER BY backend",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(q("oldest waiting"))?;
        Ok(rows
            .into_iter()
            .map(|(backend, ms)| (backend, u64::try_from(ms).unwrap_or(0)))
            .collect())
    }

    /// Slots held per provider: `(backend, provider, used)` over the workloads whose reference
    /// is `<provider>/<name>` (backends with providers).
    pub async fn slots_by_provider(&self) -> Result<Vec<(String, String, u64)>, StoreError> {
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT backend, split_part(workload, '/', 1), count(*) FROM attempts \
             WHERE holds_slot AND backend IS NOT NULL AND strpos(workload, '/') > 0 \
             GROUP BY 1, 2 ORDER BY 1, 2",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(q("slots by provider"))?;
        Ok(rows
            .into_iter()
            .map(|(backend, provider, n)| (backend, provider, count(n)))
            .collect())
    }

    /// Every row of every projection table as JSON, each table ordered by its primary key, so
    /// two projections can be compared row by row.
    pub async fn dump_rows(&self) -> Result<serde_json::Value, StoreError> {
        sqlx::query_scalar(
            "SELECT jsonb_build_object( \
               'assignments', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.id), '[]') FROM assignments t), \
               'attempts', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.assignment_id, t.attempt), '[]') \
                 FROM attempts t), \
               'claims', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.assignment_id), '[]') FROM claims t), \
               'terminal_markers', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.assignment_id), '[]') \
                 FROM terminal_markers t), \
               'task_failures', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.assignment_id), '[]') \
                 FROM task_failures t), \
               'redispatches', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.assignment_id, t.next_attempt), \
                 '[]') FROM redispatches t), \
               'workloads', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.backend, t.workload), '[]') \
                 FROM workloads t), \
               'projector_checkpoint', (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.stream), '[]') \
                 FROM projector_checkpoint t))",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(q("dump"))
    }

    /// A read-only, repeatable-read transaction so multi-table loads see one consistent state.
    async fn read_tx(&self) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, StoreError> {
        let mut tx = self.pool.begin().await.map_err(q("begin"))?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await
            .map_err(q("begin"))?;
        Ok(tx)
    }
}

/// One message read from a stream, as the projector hands it over.
#[derive(Clone, Debug)]
pub struct StreamMessage {
    pub seq: u64,
    pub subject: String,
    /// Size of the raw payload in bytes.
    pub size: usize,
    /// The decoded envelope, or why it could not be decoded.
    pub content: Result<Envelope, String>,
}

/// A quarantined message (status API).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QuarantineEntry {
    pub stream: String,
    pub seq: u64,
    pub subject: String,
    pub reason: String,
    pub raw_size: u64,
    /// Unix ms.
    pub quarantined_at: u64,
}

/// A borrowed [`StreamMessage`].
struct Item<'a> {
    seq: u64,
    subject: &'a str,
    size: usize,
    content: Result<&'a Envelope, &'a str>,
}

/// Longest subject and reason kept in the quarantine table.
const QUARANTINE_TEXT_BYTES: usize = 1024;

/// `text` made storable: NUL replaced, cut to at most `max` bytes on a character boundary.
/// (Subjects and decode errors can quote the poison itself.)
pub(crate) fn storable(text: &str, max: usize) -> String {
    let mut out = text.replace('\0', "\u{fffd}");
    if out.len() > max {
        let mut cut = max;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

async fn quarantine(
    conn: &mut sqlx::PgConnection,
    stream: &str,
    item: &Item<'_>,
    reason: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO quarantine (stream, seq, subject, reason, raw_size) VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (stream, seq) DO NOTHING",
    )
    .bind(stream)
    .bind(crate::rows::db_ms(item.seq))
    .bind(storable(item.subject, QUARANTINE_TEXT_BYTES))
    .bind(storable(reason, QUARANTINE_TEXT_BYTES))
    .bind(i64::try_from(item.size).unwrap_or(i64::MAX))
    .execute(conn)
    .await
    .map_err(q("quarantine"))?;
    Ok(())
}

/// What [`fold_and_write`] did.
struct Folded {
    /// Records with a changed row.
    touched: usize,
    /// The ids of the changed records, sorted.
    changed: Vec<AssignmentId>,
    /// Every record of the batch as it is now.
    after: BTreeMap<AssignmentId, AssignmentRecord>,
    /// Records read from the database.
    loaded: usize,
}

impl Folded {
    /// The changed records, sorted by id (moved out of `after`).
    fn into_changed(mut self) -> Vec<AssignmentRecord> {
        self.changed
            .iter()
            .filter_map(|id| self.after.remove(id))
            .collect()
    }
}

/// Folds `items` into their records (from `cache` where it holds them, else loaded from the
/// database) and writes the changed rows.
async fn fold_and_write(
    conn: &mut sqlx::PgConnection,
    items: &[(u64, &Envelope)],
    cache: Option<&RecordCache>,
) -> Result<Folded, StoreError> {
    if items.is_empty() {
        return Ok(Folded {
            touched: 0,
            changed: Vec::new(),
            after: BTreeMap::new(),
            loaded: 0,
        });
    }
    let ids: BTreeSet<AssignmentId> = items.iter().map(|(_, e)| e.assignment_id).collect();
    let mut before: BTreeMap<AssignmentId, AssignmentRecord> = BTreeMap::new();
    let mut missing: Vec<Uuid> = Vec::new();
    let mut loaded = 0;
    for id in ids {
        match cache.and_then(|c| c.get(&id)) {
            Some(record) => {
                before.insert(id, record);
            }
            None => missing.push(id.0),
        }
    }
    if !missing.is_empty() {
        // Every record has its `assignments` row, so the other tables are read only for the
        // ids found there (a new assignment's first messages need one query, not seven).
        let present: Vec<Uuid> =
            sqlx::query_scalar("SELECT id FROM assignments WHERE id = ANY($1)")
                .bind(&missing)
                .fetch_all(&mut *conn)
                .await
                .map_err(q("load"))?;
        if !present.is_empty() {
            loaded = present.len();
            before.extend(
                decode(load_rows(&mut *conn, Scope::Ids(&present)).await?)?
                    .into_iter()
                    .map(|r| (r.id, r)),
            );
        }
    }
    let mut after = before.clone();
    for (seq, envelope) in items {
        after
            .entry(envelope.assignment_id)
            .or_insert_with(|| AssignmentRecord::new(envelope.assignment_id))
            .apply(*seq, envelope);
    }
    let mut changed = Rows::default();
    for (id, record) in &after {
        changed.push_changed(before.get(id), record);
    }
    write_rows(&mut *conn, &changed).await?;
    let ids = after
        .iter()
        .filter(|(id, record)| before.get(id) != Some(*record))
        .map(|(id, _)| *id)
        .collect();
    Ok(Folded {
        touched: changed.assignments.len(),
        changed: ids,
        after,
        loaded,
    })
}

#[cfg(test)]
mod tests {
    use super::storable;

    #[test]
    fn storable_text_has_no_nul_and_respects_the_bound() {
        assert_eq!(storable("a\0b", 10), "a\u{fffd}b");
        assert_eq!(storable("abcdef", 3), "abc");
        // Never cuts inside a character.
        assert_eq!(storable("aé", 2), "a");
        assert!(storable(&"\0".repeat(5000), 1024).len() <= 1024);
    }
}
