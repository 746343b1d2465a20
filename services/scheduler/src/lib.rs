//! The scheduler: jetrunner's only contact with the forge. It registers (one runner per backend
//! by default), fetches tasks paced by the backends' free capacity, routes each task to a
//! backend, seals it and publishes the assignment durably, keeps fetched tasks alive until an
//! executor claims them; it hosts the facade executors talk to; and it executes `fail-task`
//! commands.

pub mod commands;
pub mod declaration;
pub mod facade;
pub mod fetcher;
pub mod forge_report;
pub mod forges;
pub mod github;
pub mod github_forge;
pub mod intake;
pub mod intakes;
pub mod ledger;
pub mod metrics;
pub mod ours;
pub mod pacing;
pub mod presence;
pub mod registration;
pub mod request_key;
pub mod routing;
pub mod seal;
pub mod service;
pub mod unclaimed;
