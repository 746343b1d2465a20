//! jetrunner reconciler service: the projector (single writer of the Postgres projection, see
//! `jr-store`) and the planner, a pure function from a projection snapshot to cleanup and retry
//! commands.

pub mod executor;
pub mod metrics;
pub mod planner;
pub mod projector;
pub mod service;
pub mod status;

pub use planner::{PlannedCommand, PlannerConfig, plan};
