//! Postgres projection store: migrations, tables, idempotent apply per stream sequence.
//!
//! The projection is a set of [`AssignmentRecord`] aggregates, one per assignment id, folded from
//! the `JR_ASSIGNMENTS` and `JR_EVENTS` streams by [`AssignmentRecord::apply`]. [`Store`] keeps
//! them in Postgres (one transaction per batch, checkpoint per stream in the same transaction);
//! [`MemoryProjection`] keeps them in memory with the same fold, for tests and simulations.
//! The planner reads a [`Snapshot`] of the records that are not finished.

mod apply;
mod cache;
mod jobs;
mod memory;
mod model;
mod rows;
mod sql;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use jobs::{Cursor, JobFilter, JobPage, JobRow, MAX_PAGE, Minute};
pub use memory::{Applied, ApplyStats, MemoryProjection};
pub use model::{
    AssignmentInfo, AssignmentRecord, AssignmentState, AttemptRecord, ClaimRecord, FailureRecord,
    Observation, Outcome, REASON_BACKEND_UNREACHABLE, RedispatchRecord, Snapshot, TerminalRecord,
    TimelineEntry, WorkloadRecord,
};
pub use store::{QuarantineEntry, SlotUsage, StateCount, Store, StreamMessage};

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
    /// The database refused the data of this statement (SQLSTATE class 22 data exception, 23
    /// integrity constraint, 54 program limit such as an index row too large), or a value could
    /// not be encoded: applying the same message again fails again, so the projector
    /// quarantines it. Every other error (connection lost, pool closed or timed out,
    /// serialization failure, server shutting down, ...) may pass on retry.
    pub fn is_data_error(&self) -> bool {
        let StoreError::Query { source, .. } = self else {
            return false;
        };
        match source {
            sqlx::Error::Database(db) => db.code().is_some_and(|code| is_data_sqlstate(&code)),
            sqlx::Error::Encode(_) => true,
            _ => false,
        }
    }

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

/// SQLSTATE classes that depend on the data written, not on the server's state.
fn is_data_sqlstate(code: &str) -> bool {
    matches!(code.get(..2), Some("22" | "23" | "54"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn data_sqlstates_are_told_from_transient_ones() {
        // NUL in text, timestamp out of range, check violation, index row too large.
        for code in ["22021", "22008", "23514", "54000"] {
            assert!(super::is_data_sqlstate(code), "{code}");
        }
        // Connection failure, serialization failure, deadlock, admin shutdown, out of memory,
        // disk full, undefined table.
        for code in [
            "08006", "40001", "40P01", "57P01", "53200", "53100", "42P01", "",
        ] {
            assert!(!super::is_data_sqlstate(code), "{code}");
        }
    }
}
