//! A client of GitHub's runner scale set service, the API actions-runner-controller's listener
//! uses: the token chain (PAT → registration token → Actions service URL and admin token,
//! renewed before it expires), runner groups and scale sets, one message session per scale
//! set with its long-polled queue, acquiring offered jobs, just-in-time runner configs and
//! removing runners, plus the REST workflow-run lookup that tells a fork's run from the base
//! repository's.
//!
//! Every call goes through one retry layer ([`retry`]): connection errors, 429 and 5xx (but
//! 501) are retried with capped backoff, and `Retry-After` is honoured on 429, 503 and on a
//! 403 that carries it (GitHub's secondary rate limits). What is still refused after the last
//! try comes back as a [`GitHubError`] that says whether it was backpressure.

mod app;
mod client;
mod driver;
mod error;
pub mod guard;
pub mod listener;
mod retry;
pub mod scale;
mod scope;
mod session;
pub mod wire;

pub use client::{Credentials, ScaleSetClient, Settings};
pub use driver::{ListenError, Listener, ListenerStats, RunnerRecord, Sink, SinkError};
pub use error::GitHubError;
pub use retry::RetryPolicy;
pub use scope::{ConfigUrl, Scope};
pub use session::MessageSession;
