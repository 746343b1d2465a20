//! Where a job runs, decided without IO. Every function here is pure: it takes what the caller
//! observed (provider counts, the runtime burst value, the forge context, running jobs) and, where
//! time matters, `now` as an argument, and returns a decision the caller then acts on.
//!
//! - [`provider`]: inside one backend, which provider (a Kubernetes cluster or namespace, an
//!   OpenSandbox server or pool) takes the next workload. Providers are chosen by weight among
//!   those with room; one that answers "full" or is unreachable is excluded and the next is tried
//!   without spending an attempt; an unreachable provider's workloads are held, then written off.
//! - [`tier`]: whether a job goes to the burst tier. One runtime value switches the tier on or
//!   off and sets a percentage; a stable hash of repository, workflow and job picks the same jobs
//!   on every re-run; protected jobs never leave the default tier; an invalid value means "off"
//!   with a warning, never an error.
//! - [`trust`]: the most trusted backend a job may use, from the forge context (repository,
//!   owner, event, fork, actor). `runs-on` may only ask for a less trusted backend, so a fork's
//!   pull request cannot choose a Pod.
//! - [`quota`]: fair shares inside a backend. Work over a per-repository or per-owner quota waits
//!   (never fails), and the next job to start comes from the repository with the smallest
//!   weighted share of running work, so one repository's burst cannot starve another's job.

mod glob;
pub mod provider;
pub mod quota;
pub mod tier;
pub mod trust;

pub use provider::{
    DEFAULT_UNREACHABLE_HOLD, ProviderView, Unreachable, WeightedPicker, unreachable_verdict,
};
pub use quota::{Admission, Quotas, Usage, WaitReason, WaitingJob, admit, next_fair};
pub use tier::{
    BurstProblem, BurstSetting, BurstWarning, DefaultReason, JobKey, ProtectedMatcher, TierChoice,
    burst_bucket, choose_tier, drain_key, interpret_drain, parse_burst,
};
pub use trust::{
    AllowedTrust, ContextMatcher, ForgeContext, TrustDecision, TrustLevel, TrustPolicy, TrustRule,
    decide,
};

/// The one error of this crate: a decision that cannot be made from the given inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The trust policy allows no backend that is configured: neither a backend serving the job's
    /// `runs-on` nor any other backend is at or below the most trusted level the job may use.
    #[error(
        "no backend may run this job: {reason}; runs-on asked for {requested:?} and no configured backend is at or below {max_trust}"
    )]
    NoTrustedBackend {
        /// The most trusted level the job may use.
        max_trust: trust::TrustLevel,
        /// Why the policy allows no more than `max_trust`.
        reason: String,
        /// The backends serving the job's `runs-on`, in router preference order.
        requested: Vec<String>,
    },
    /// Trust routing was asked to choose among no candidates: no backend serves the job's
    /// `runs-on`, so there is nothing to route (the router should not have offered the job).
    #[error("no backend serves this job's runs-on, so there is no backend to route it to")]
    NoCandidateBackend,
}

impl PlacementError {
    /// A low-cardinality name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NoTrustedBackend { .. } => "no_trusted_backend",
            Self::NoCandidateBackend => "no_candidate_backend",
        }
    }
}
