//! Postgres projection store: migrations, tables, idempotent apply per stream sequence.
//!
//! The projection is a set of [`AssignmentRecord`] aggregates, one per assignment id, folded from
//! the `JR_ASSIGNMENTS` and `JR_EVENTS` streams by [`AssignmentRecord::apply`]. [`Store`] keeps
//! them in Postgres (one transaction per batch, checkpoint per stream in the same transaction);
//! [`MemoryProjection`] keeps them in memory with the same fold, for tests and simulations.
//! The planner reads a [`Snapshot`] of the records that are not finished.

mod apply;
mod memory;
mod model;
mod rows;
mod sql;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use memory::{ApplyStats, MemoryProjection};
pub use model::{
    AssignmentInfo, AssignmentRecord, AssignmentState, AttemptRecord, ClaimRecord, FailureRecord,
    Observation, Outcome, REASON_BACKEND_UNREACHABLE, RedispatchRecord, Snapshot, TerminalRecord,
    TimelineEntry, WorkloadRecord,
};
pub use store::{SlotUsage, StateCount, Store};

/// Everything the projection store can fail at.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("connect to postgres: {0}")]
    Connect(#[source] sqlx::Error),
    #[error("run migrations: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("{op}: {source}")]
    Query {
        op: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("invalid row in {table}: {reason}")]
    Decode { table: &'static str, reason: String },
}

impl StoreError {
    pub(crate) fn decode(table: &'static str, reason: impl Into<String>) -> Self {
        StoreError::Decode {
            table,
            reason: reason.into(),
        }
    }

    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Connect(_) => "connect",
            StoreError::Migrate(_) => "migrate",
            StoreError::Query { .. } => "query",
            StoreError::Decode { .. } => "decode",
        }
    }
}
