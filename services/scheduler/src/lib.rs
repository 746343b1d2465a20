//! The scheduler: jetrunner's only contact with the forge. It registers, fetches tasks with N
//! concurrent fetchers, routes each task to a backend, seals it and publishes the assignment
//! durably; it hosts the facade executors talk to; and it executes `fail-task` commands.

pub mod facade;
pub mod fail_task;
pub mod fetcher;
pub mod forge_report;
pub mod ledger;
pub mod metrics;
pub mod redispatch;
pub mod registration;
pub mod routing;
pub mod seal;
pub mod service;
