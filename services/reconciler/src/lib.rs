//! jetrunner reconciler service: the projector (single writer of the Postgres projection, see
//! `jr-store`) and the planner, which turns the unfinished records into cleanup and retry
//! commands: [`plan`] over a whole snapshot is the reference, [`IncrementalPlanner`] the same
//! rules applied to what changed, over a copy of the records kept in memory.

pub mod executor;
pub mod jobs_api;
pub mod metrics;
pub mod planner;
pub mod projector;
pub mod service;
pub mod status;

pub use planner::{IncrementalPlanner, PlannedCommand, PlannerConfig, plan};
