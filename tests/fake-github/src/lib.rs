//! A strict fake of GitHub's runner scale set service and the REST endpoints a scale set
//! client needs, for tests, demo and benchmark.
//!
//! [`FakeGitHub::start`] binds an axum server on `127.0.0.1:0` serving:
//! - the REST side (`/orgs/{org}/actions/runners/registration-token`,
//!   `/repos/{owner}/{repo}/…`, `/enterprises/{enterprise}/…`, `/actions/runner-registration`,
//!   workflow runs) under a PAT, both at the root (as api.github.com) and under `/api/v3` (as
//!   a GitHub Enterprise Server);
//! - the Actions service under `/actions-service/_apis/…` (runner groups, scale sets, message
//!   sessions, the long-polled message queue, acquire, JIT configs, runners) under the admin
//!   token the registration hands out, or the session's queue token where the real service
//!   wants it;
//! - `/_fake/runner/…`, what an `actions/runner` started with a JIT config does (start, poll,
//!   finish), so tests and the bench can play the runner.
//!
//! Strictness: one session per scale set (409 `RunnerScaleSetSessionConflictException`),
//! messages come back until deleted, acquire grants only jobs offered to the caller and at
//! most [`FakeGitHub::set_acquire_limit`], tokens expire or are revoked on request (401), a
//! JIT config starts one runner once, `api-version=6.0-preview` is required, a registration
//! token registers only the scope it was made for (the runner registration's `url` must name
//! it), removing a runner that is busy is refused (400 `JobStillRunningException`) and
//! removing one the service no longer holds answers 204 as the real service does. Job
//! messages can carry `runnerRequestId` 0, as github.com's do
//! ([`FakeGitHub::set_zero_request_ids`]). Every fault is
//! switchable per test ([`Fault`], [`Route`]), and every request is logged for checks.

mod server;
mod state;

pub use server::{FakeGitHub, Fault, RequestRecord, Route};
pub use state::{Job, JobSpec, JobState, MAX_ASSIGNMENTS, MAX_BATCH, Runner};
