//! A faithful fake Gitea/Forgejo RunnerService for tests, demo and benchmark.
//!
//! [`FakeForge::start`] binds an axum server (default `127.0.0.1:0`) that serves the Connect
//! routes of Gitea's RunnerService under `/api/actions/…` (binary protobuf only)
//! and a JSON admin API under `/_fake/…`. The state machine follows Gitea's: reusable global
//! registration tokens, the auth interceptor, `tasks_version` with its fast path, `runs-on` ⊆
//! labels picking (oldest first, one task per job, fresh task ids and tokens), sticky final
//! results, first-write-wins outputs, UpdateLog ack/archive rules, cancellation and reapers
//! driven by an injectable [`Clock`]. Errors come in Gitea (`unknown` + `rpc error: …`) or
//! Forgejo (proper Connect codes) style, switchable at runtime, as are the [`FaultConfig`]
//! switches (injected 500s, latency, processed-but-dropped replies).
//!
//! Everything the fake saw is kept for invariant checks: see [`Snapshot`].

mod admin;
mod clock;
mod config;
mod error;
mod faults;
mod model;
mod payload;
mod rpc;
mod server;
mod state;

pub use admin::{ChangedReply, EnqueueReply, EnqueueRequest, TokenReply};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{Behaviour, Config};
pub use error::{Code, ConnectErrorBody, ErrorStyle, FakeForgeError};
pub use faults::{DropMode, FaultConfig, Rpc};
pub use model::{
    FaultCounters, JobId, JobSpec, JobView, LabelStats, Outcome, ReapReport, RunnerView, Snapshot,
    Stats, Status, StepView, StopCause, TaskView,
};
pub use server::FakeForge;
