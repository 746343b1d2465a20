//! Postgres projection store: migrations, tables, idempotent apply per stream sequence
