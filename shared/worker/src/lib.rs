//! Worker core shared by pod-worker and vm-worker. The backend-specific part is the [`Backend`]
//! trait; the decisions live in the pure [`state::WorkerState`]; [`Worker`] is the thin driver
//! that performs its effects against NATS and the backend.

pub mod backend;
pub mod burst;
mod driver;
mod error;
mod facts;
pub mod fair;
mod gate;
mod lanes;
mod ledger;
pub mod metrics;
pub mod providers;
pub mod replicas;
mod run;
mod service;
pub mod state;

pub use backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec, workload_name};
pub use driver::{WarmSettings, Worker, WorkerSettings};
pub use error::WorkerError;
pub use fair::{Fair, FairShare};
pub use jr_seal::{TokenKey, token_hash};
pub use metrics::WorkerMetrics;
pub use providers::{Burst, PlacementMetrics, Provider, ProviderStats, Providers, Tier};
pub use service::{fair_share_from_config, run_with_providers};
pub use service::{run_service, settings_from_config};
