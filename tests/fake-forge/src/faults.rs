//! Runtime-changeable fault injection for the RunnerService routes.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The RPCs the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Rpc {
    Ping,
    Register,
    Declare,
    FetchTask,
    UpdateTask,
    UpdateLog,
}

impl Rpc {
    /// URL path below the instance root.
    pub fn path(self) -> &'static str {
        match self {
            Self::Ping => "/api/actions/ping.v1.PingService/Ping",
            Self::Register => "/api/actions/runner.v1.RunnerService/Register",
            Self::Declare => "/api/actions/runner.v1.RunnerService/Declare",
            Self::FetchTask => "/api/actions/runner.v1.RunnerService/FetchTask",
            Self::UpdateTask => "/api/actions/runner.v1.RunnerService/UpdateTask",
            Self::UpdateLog => "/api/actions/runner.v1.RunnerService/UpdateLog",
        }
    }
}

/// How a dropped reply looks to the client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropMode {
    /// Never answer (until the client gives up, the hang limit passes or the server stops).
    #[default]
    Hang,
    /// Send the status line, then break the connection before the body.
    Abort,
}

/// Fault switches. Counted faults (`*_next`) fire before the probabilistic ones.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FaultConfig {
    /// Probability (0..=1) of an injected 500 reply; the request is **not** processed.
    pub error_rate: f64,
    /// The next N matching calls get an injected 500.
    pub error_next: u32,
    /// Probability (0..=1) that the request **is** processed but the reply is withheld.
    pub drop_rate: f64,
    /// The next N matching calls are processed and their replies withheld.
    pub drop_next: u32,
    pub drop_mode: DropMode,
    /// Added before every matching call is handled.
    pub latency_ms: u64,
    /// Apply only to these RPCs; empty = all.
    pub only: Vec<Rpc>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultAction {
    Pass,
    Error,
    Drop(DropMode),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FaultPlan {
    pub latency: Duration,
    pub action: FaultAction,
}

impl FaultPlan {
    pub const NONE: Self = Self {
        latency: Duration::ZERO,
        action: FaultAction::Pass,
    };
}

impl FaultConfig {
    /// Decides what happens to one call, consuming counted faults. `roll` yields values in [0, 1).
    pub(crate) fn decide(&mut self, rpc: Rpc, mut roll: impl FnMut() -> f64) -> FaultPlan {
        if !self.only.is_empty() && !self.only.contains(&rpc) {
            return FaultPlan::NONE;
        }
        let latency = Duration::from_millis(self.latency_ms);
        let action = if self.error_next > 0 {
            self.error_next -= 1;
            FaultAction::Error
        } else if self.drop_next > 0 {
            self.drop_next -= 1;
            FaultAction::Drop(self.drop_mode)
        } else if self.error_rate > 0.0 && roll() < self.error_rate {
            FaultAction::Error
        } else if self.drop_rate > 0.0 && roll() < self.drop_rate {
            FaultAction::Drop(self.drop_mode)
        } else {
            FaultAction::Pass
        };
        FaultPlan { latency, action }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_faults_fire_once_each_and_respect_the_filter() {
        let mut f = FaultConfig {
            error_next: 1,
            drop_next: 1,
            only: vec![Rpc::FetchTask],
            ..FaultConfig::default()
        };
        assert_eq!(f.decide(Rpc::UpdateLog, || 0.0).action, FaultAction::Pass);
        assert_eq!(f.decide(Rpc::FetchTask, || 0.0).action, FaultAction::Error);
        assert_eq!(
            f.decide(Rpc::FetchTask, || 0.0).action,
            FaultAction::Drop(DropMode::Hang)
        );
        assert_eq!(f.decide(Rpc::FetchTask, || 0.0).action, FaultAction::Pass);
    }

    #[test]
    fn rates_use_the_roll() {
        let mut f = FaultConfig {
            error_rate: 0.5,
            latency_ms: 7,
            ..FaultConfig::default()
        };
        assert_eq!(f.decide(Rpc::Ping, || 0.4).action, FaultAction::Error);
        let plan = f.decide(Rpc::Ping, || 0.6);
        assert_eq!(
            plan,
            FaultPlan {
                latency: Duration::from_millis(7),
                action: FaultAction::Pass
            }
        );
    }
}
