//! The keys jetrunner writes on the workloads it makes: Kubernetes labels (and one annotation) on
//! executor Pods and their Secrets, OpenSandbox metadata on sandboxes. Both backends record the
//! same facts under the same keys, so one selector language finds jetrunner's workloads whatever
//! runs them.
//!
//! Every key is a valid Kubernetes label key (a DNS-subdomain prefix and a name of at most 63
//! characters), which OpenSandbox requires of sandbox metadata as well.

/// The prefix of every key below. Runner blocks may not set labels under it.
pub const PREFIX: &str = "jetrunner.dev/";

/// The assignment UUID.
pub const ASSIGNMENT: &str = "jetrunner.dev/assignment";
/// The attempt number (1, 2, …).
pub const ATTEMPT: &str = "jetrunner.dev/attempt";
/// The backend name (`pod`, `vm`, …).
pub const BACKEND: &str = "jetrunner.dev/backend";
/// The id of the worker that made the workload (sanitised to a label value).
pub const WORKER: &str = "jetrunner.dev/worker";
/// The assignment's provider, when it has one (sanitised to a label value).
pub const PROVIDER: &str = "jetrunner.dev/provider";
/// Sandboxes: unix seconds until which the sandbox must live (job limit + grace); drives expiry
/// renewal and survives restarts of the worker.
pub const DEADLINE: &str = "jetrunner.dev/deadline";
/// Pods: the job's `runs-on` labels, comma-separated. An annotation, because label values are
/// too restricted for the list.
pub const RUNS_ON: &str = "jetrunner.dev/runs-on";

/// Every key above.
pub const ALL: [&str; 7] = [
    ASSIGNMENT, ATTEMPT, BACKEND, WORKER, PROVIDER, DEADLINE, RUNS_ON,
];

/// The metadata keys vm-workers wrote on sandboxes before both backends shared the keys above.
/// They are never written any more, only read and listed, so sandboxes made before an upgrade
/// are still adopted and cleaned up.
pub mod legacy_sandbox {
    pub const PREFIX: &str = "jetrunner.io/";
    pub const ASSIGNMENT: &str = "jetrunner.io/assignment";
    pub const ATTEMPT: &str = "jetrunner.io/attempt";
    pub const BACKEND: &str = "jetrunner.io/backend";
    pub const WORKER: &str = "jetrunner.io/worker";
    pub const PROVIDER: &str = "jetrunner.io/provider";
    pub const DEADLINE: &str = "jetrunner.io/deadline";

    /// Every key above.
    pub const ALL: [&str; 6] = [ASSIGNMENT, ATTEMPT, BACKEND, WORKER, PROVIDER, DEADLINE];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_golden() {
        assert_eq!(
            ALL,
            [
                "jetrunner.dev/assignment",
                "jetrunner.dev/attempt",
                "jetrunner.dev/backend",
                "jetrunner.dev/worker",
                "jetrunner.dev/provider",
                "jetrunner.dev/deadline",
                "jetrunner.dev/runs-on",
            ]
        );
        assert_eq!(
            legacy_sandbox::ALL,
            [
                "jetrunner.io/assignment",
                "jetrunner.io/attempt",
                "jetrunner.io/backend",
                "jetrunner.io/worker",
                "jetrunner.io/provider",
                "jetrunner.io/deadline",
            ]
        );
    }

    #[test]
    fn legacy_keys_differ_from_the_current_ones_only_by_prefix() {
        for legacy in legacy_sandbox::ALL {
            let name = legacy
                .strip_prefix(legacy_sandbox::PREFIX)
                .expect("legacy prefix");
            assert!(
                ALL.contains(&format!("{PREFIX}{name}").as_str()),
                "{legacy}"
            );
        }
    }

    /// `prefix/name` with a DNS-subdomain prefix and a label name of 1 to 63 characters.
    #[test]
    fn keys_are_label_keys() {
        for key in ALL.iter().chain(legacy_sandbox::ALL.iter()) {
            let (prefix, name) = key.split_once('/').expect("prefixed");
            assert!(
                prefix.split('.').all(|part| !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())),
                "{key}"
            );
            assert!(!name.is_empty() && name.len() <= 63, "{key}");
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
                    && !name.starts_with('-')
                    && !name.ends_with('-'),
                "{key}"
            );
        }
    }
}
