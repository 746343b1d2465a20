//! The Postgres projection: [`Store`].

use std::collections::{BTreeMap, BTreeSet};

use jr_protocol::{AssignmentId, Envelope};
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::StoreError;
use crate::memory::ApplyStats;
use crate::model::{AssignmentRecord, AssignmentState, Snapshot, TimelineEntry};
use crate::rows::{Rows, decode};
use crate::sql::{Scope, load_rows, write_rows};

/// Transaction-level advisory lock taken by every projection write: the projector may apply
/// both streams concurrently, and both read-modify-write the same assignment records.
const PROJECTOR_LOCK: i64 = 0x6a72_7072_6f6a; // "jrproj"

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

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

/// The projection in Postgres. Cheap to clone (a pool handle).
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
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
        Ok(Self { pool })
    }

    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded migrations (`shared/store/migrations`).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        MIGRATOR.run(&self.pool).await.map_err(StoreError::Migrate)
    }

    /// Applies `items` (stream sequence, message) of `stream` in one transaction: items at or
    /// below the stream's checkpoint (or not above an earlier item of the batch) are skipped, the
    /// rest folded into their assignment records in order, the changed rows written and the
    /// checkpoint advanced. Idempotent: replaying any prefix changes nothing.
    pub async fn apply_batch(
        &self,
        stream: &str,
        items: &[(u64, Envelope)],
    ) -> Result<ApplyStats, StoreError> {
        let mut tx = self.pool.begin().await.map_err(q("begin"))?;
        let stored: i64 = sqlx::query_scalar(
            "INSERT INTO projector_checkpoint (stream, last_seq) \
             SELECT $1, 0 FROM (SELECT pg_advisory_xact_lock($2)) AS locked \
             ON CONFLICT (stream) DO UPDATE SET last_seq = projector_checkpoint.last_seq \
             RETURNING last_seq",
        )
        .bind(stream)
        .bind(PROJECTOR_LOCK)
        .fetch_one(&mut *tx)
        .await
        .map_err(q("read checkpoint"))?;
        let stored = u64::try_from(stored).unwrap_or(0);

        let mut checkpoint = stored;
        let mut stats = ApplyStats::default();
        let mut fresh = Vec::with_capacity(items.len());
        for (seq, envelope) in items {
            if *seq <= checkpoint {
                stats.skipped += 1;
            } else {
                checkpoint = *seq;
                fresh.push((*seq, envelope));
            }
        }
        stats.applied = fresh.len();
        stats.checkpoint = checkpoint;
        if fresh.is_empty() {
            tx.commit().await.map_err(q("commit"))?;
            return Ok(stats);
        }

        let ids: BTreeSet<Uuid> = fresh.iter().map(|(_, e)| e.assignment_id.0).collect();
        let ids: Vec<Uuid> = ids.into_iter().collect();
        let before: BTreeMap<AssignmentId, AssignmentRecord> =
            decode(load_rows(&mut tx, Scope::Ids(&ids)).await?)?
                .into_iter()
                .map(|r| (r.id, r))
                .collect();
        let mut after = before.clone();
        for (seq, envelope) in &fresh {
            after
                .entry(envelope.assignment_id)
                .or_insert_with(|| AssignmentRecord::new(envelope.assignment_id))
                .apply(*seq, envelope);
        }
        let mut changed = Rows::default();
        for (id, record) in &after {
            changed.push_changed(before.get(id), record);
        }
        stats.touched = changed.assignments.len();
        write_rows(&mut tx, &changed).await?;

        sqlx::query("UPDATE projector_checkpoint SET last_seq = $2 WHERE stream = $1")
            .bind(stream)
            .bind(crate::rows::db_ms(checkpoint))
            .execute(&mut *tx)
            .await
            .map_err(q("write checkpoint"))?;
        tx.commit().await.map_err(q("commit"))?;
        tracing::debug!(
            stream,
            applied = stats.applied,
            skipped = stats.skipped,
            checkpoint,
            "applied batch"
        );
        Ok(stats)
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

    /// Drops all projection data including checkpoints, so replaying the streams rebuilds it.
    pub async fn reset(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(q("begin"))?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(PROJECTOR_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(q("reset"))?;
        sqlx::query(
            "TRUNCATE assignments, attempts, claims, terminal_markers, task_failures, redispatches, \
             workloads, projector_checkpoint",
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
