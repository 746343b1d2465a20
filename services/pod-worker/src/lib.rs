//! jetrunner pod-worker: the Kubernetes backend of the worker core.
//!
//! - [`template`]: the layered runner block and the executor Pod/Secret builder (pure).
//! - [`backend`]: [`PodBackend`], the [`jr_worker::Backend`] over a `kube::Client`.
//! - [`executor_pod`]: what the executor Pod looks like and why (documentation only).

pub mod backend;
mod error;
pub mod executor_pod;
pub mod service;
pub mod template;

pub use backend::PodBackend;
pub use error::PodWorkerError;
pub use template::{PodTemplate, RunnerBlock};
