//! Cross-service scenarios: the harness that runs all of jetrunner on one machine (real NATS,
//! PostgreSQL and service binaries; fake forge, Kubernetes API and OpenSandbox), the invariants
//! checked after every scenario, and the demo and benchmark built on the same harness.

pub mod chaos;
pub mod consistency;
pub mod executor;
pub mod measure;
pub mod pg;
pub mod process;
pub mod proxy;
pub mod system;

pub use system::{GITHUB_PAT, OutcomeReport, System, SystemSpec, Touched};
