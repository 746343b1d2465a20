//! Worker core shared by pod-worker and vm-worker. The backend-specific part is the [`Backend`]
//! trait; everything else (slots, assignment handling, commands, observation publishing,
//! start-up recovery) is the same for both.

pub mod backend;
mod core;
pub mod metrics;
pub mod slots;
pub mod token;

pub use backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec, workload_name};
pub use core::{
    Worker, WorkerError, WorkerSettings, projected_live, run_service, settings_from_config,
};
pub use metrics::WorkerMetrics;
pub use token::{TokenKey, token_hash};
