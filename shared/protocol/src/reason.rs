//! Why a workload is reported, deleted or replaced: the machine-readable reasons workers put in
//! `workload-observed` and the reconciler puts in `delete-workload`, `redispatch` and
//! `fail-task` (and so in `redispatched` and `task-failed`). On the wire every reason field is a
//! free string: a [`Reason`]'s name, a name with a detail (`create-refused: <message>`), or text a
//! backend supplied (an OpenSandbox status reason). Consumers match on the names, so they never
//! change.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    // Reported by workers with an observation.
    /// The Pod was evicted.
    Evicted,
    /// A container was killed for using too much memory.
    OomKilled,
    /// The image cannot be pulled (or its name is invalid).
    ImagePullFailed,
    /// The Pod cannot be scheduled.
    Unschedulable,
    /// A container could not start.
    StartFailed,
    /// A container's configuration is broken (a missing Secret, a bad mount).
    ConfigError,
    /// The workload outlived its time limit.
    DeadlineExceeded,
    /// A sandbox failed without saying why.
    Failed,
    /// The backend has not answered for a while; the phase is `unknown` until it does. Also the
    /// reconciler's reason when that lasts longer than it waits.
    BackendUnreachable,
    /// A workload the worker had announced was gone when it started again.
    VanishedWhileWorkerDown,
    /// The backend refused to create the workload for good; with the backend's message as
    /// detail.
    CreateRefused,

    // Decided by the reconciler.
    /// The task is final and its executor finished reporting (or never ran here).
    TaskFinished,
    /// The task is final but its executor did not close its log in time.
    TerminalGraceExpired,
    /// The workload belongs to an attempt that is no longer the current one.
    SupersededAttempt,
    /// A second workload of the current attempt.
    DuplicateWorkload,
    /// Events about an assignment whose assignment message is unknown.
    OrphanUnknownAssignment,
    /// Nobody claimed the task while the workload was healthy for the claim timeout.
    ClaimTimeout,
    /// The workload failed; the observed reason, if any, as detail.
    WorkloadFailed,
    /// The workload exited before the task was final; the observed reason as detail.
    WorkloadExited,
    /// The workload disappeared; the observed reason as detail.
    WorkloadGone,
    /// The workload was released before the task was final.
    WorkloadReleased,
    /// The workload's phase stayed unknown for longer than the lost timeout.
    WorkloadUnknown,
    /// `fail-task`: the claiming executor's workload broke; its condition as detail.
    LostAfterClaim,
    /// `fail-task`: every attempt was used up; the attempt and the last reason as detail.
    AttemptsExhausted,
}

impl Reason {
    /// Every reason, in declaration order.
    pub const ALL: [Reason; 24] = [
        Reason::Evicted,
        Reason::OomKilled,
        Reason::ImagePullFailed,
        Reason::Unschedulable,
        Reason::StartFailed,
        Reason::ConfigError,
        Reason::DeadlineExceeded,
        Reason::Failed,
        Reason::BackendUnreachable,
        Reason::VanishedWhileWorkerDown,
        Reason::CreateRefused,
        Reason::TaskFinished,
        Reason::TerminalGraceExpired,
        Reason::SupersededAttempt,
        Reason::DuplicateWorkload,
        Reason::OrphanUnknownAssignment,
        Reason::ClaimTimeout,
        Reason::WorkloadFailed,
        Reason::WorkloadExited,
        Reason::WorkloadGone,
        Reason::WorkloadReleased,
        Reason::WorkloadUnknown,
        Reason::LostAfterClaim,
        Reason::AttemptsExhausted,
    ];

    /// The name on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Evicted => "evicted",
            Reason::OomKilled => "oom-killed",
            Reason::ImagePullFailed => "image-pull-failed",
            Reason::Unschedulable => "unschedulable",
            Reason::StartFailed => "start-failed",
            Reason::ConfigError => "config-error",
            Reason::DeadlineExceeded => "deadline-exceeded",
            Reason::Failed => "failed",
            Reason::BackendUnreachable => "backend-unreachable",
            Reason::VanishedWhileWorkerDown => "vanished-while-worker-down",
            Reason::CreateRefused => "create-refused",
            Reason::TaskFinished => "task-finished",
            Reason::TerminalGraceExpired => "terminal-grace-expired",
            Reason::SupersededAttempt => "superseded-attempt",
            Reason::DuplicateWorkload => "duplicate-workload",
            Reason::OrphanUnknownAssignment => "orphan-unknown-assignment",
            Reason::ClaimTimeout => "claim-timeout",
            Reason::WorkloadFailed => "workload-failed",
            Reason::WorkloadExited => "workload-exited",
            Reason::WorkloadGone => "workload-gone",
            Reason::WorkloadReleased => "workload-released",
            Reason::WorkloadUnknown => "workload-unknown",
            Reason::LostAfterClaim => "lost-after-claim",
            Reason::AttemptsExhausted => "attempts-exhausted",
        }
    }

    /// `<name>: <detail>`, the form of a reason that carries more.
    pub fn with_detail(self, detail: impl fmt::Display) -> String {
        format!("{}: {detail}", self.as_str())
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The names are a contract with every consumer of the streams (the projection, the
    /// planner, dashboards): they never change.
    #[test]
    fn names_are_golden() {
        assert_eq!(
            Reason::ALL.map(Reason::as_str),
            [
                "evicted",
                "oom-killed",
                "image-pull-failed",
                "unschedulable",
                "start-failed",
                "config-error",
                "deadline-exceeded",
                "failed",
                "backend-unreachable",
                "vanished-while-worker-down",
                "create-refused",
                "task-finished",
                "terminal-grace-expired",
                "superseded-attempt",
                "duplicate-workload",
                "orphan-unknown-assignment",
                "claim-timeout",
                "workload-failed",
                "workload-exited",
                "workload-gone",
                "workload-released",
                "workload-unknown",
                "lost-after-claim",
                "attempts-exhausted",
            ]
        );
    }

    #[test]
    fn names_are_distinct_kebab_case() {
        let names: BTreeSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
        for name in names {
            assert!(
                !name.starts_with('-')
                    && !name.ends_with('-')
                    && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
                "{name}"
            );
        }
    }

    #[test]
    fn details_follow_the_name() {
        assert_eq!(
            Reason::CreateRefused.with_detail("pool not found"),
            "create-refused: pool not found"
        );
        assert_eq!(Reason::ClaimTimeout.to_string(), "claim-timeout");
    }
}
