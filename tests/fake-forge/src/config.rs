//! Server configuration and the runtime-changeable behaviour switches.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::clock::{Clock, SystemClock};
use crate::error::ErrorStyle;
use crate::faults::FaultConfig;

/// How the fake behaves; changeable at runtime with `FakeForge::set_behaviour`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Behaviour {
    pub error_style: ErrorStyle,
    /// `false` (default) mimics Gitea ≤ 1.27: an UpdateLog with no rows and `no_more` does not
    /// archive the log. `true` mimics the fix (PR #37631).
    pub archive_on_empty_final: bool,
    /// Running task without UpdateTask for longer than this → failure (Gitea default 10 min).
    pub zombie_timeout: Duration,
    /// Running task started longer ago than this → failure (Gitea default 3 h).
    pub endless_timeout: Duration,
    /// Waiting job older than this → cancelled (Gitea default 24 h).
    pub abandoned_timeout: Duration,
    /// Value for the `X-Gitea-Actions-Capabilities` header on Declare replies.
    pub capabilities: Option<String>,
    /// Gitea's unsafe concurrent pick: a FetchTask that overlaps an earlier, still running
    /// FetchTask of the same runner loses the job guard and answers "no task" with the latest
    /// version, although jobs wait.
    pub fetch_race: bool,
    /// Forgejo extensions: `task_capacity` / `additional_tasks` and `x-runner-request-key`
    /// replay (a repeated key returns the tasks assigned under it again, with new tokens, and
    /// `tasks_version = 0`; a key in use by another call is "locked").
    pub forgejo: bool,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            error_style: ErrorStyle::Gitea,
            archive_on_empty_final: false,
            zombie_timeout: Duration::from_secs(10 * 60),
            endless_timeout: Duration::from_secs(3 * 60 * 60),
            abandoned_timeout: Duration::from_secs(24 * 60 * 60),
            capabilities: None,
            fetch_race: false,
            forgejo: false,
        }
    }
}

/// Start-up configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Address to bind; port 0 picks a free one.
    pub listen: SocketAddr,
    /// Initial global registration token; a random 40-char token when `None`.
    pub registration_token: Option<String>,
    pub behaviour: Behaviour,
    pub faults: FaultConfig,
    pub clock: Arc<dyn Clock>,
    /// Run the reapers in the background at this interval (with `clock`); tests call `reap`.
    pub reap_interval: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            registration_token: None,
            behaviour: Behaviour::default(),
            faults: FaultConfig::default(),
            clock: Arc::new(SystemClock),
            reap_interval: None,
        }
    }
}
