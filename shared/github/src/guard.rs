//! The trust guard of a scale set whose runners run on a trusted backend.
//!
//! On GitHub any runner of a scale set may take any job assigned to it, so where a job runs is
//! decided by the scale set, not per job (docs/github.md). The guard checks each assigned job
//! against the same trust policy the Gitea forge routes by, with GitHub's facts: the event, the
//! repository and owner from the message, and from the workflow run the head repository (for
//! `pull_request` events) and the actor (when a rule matches on actors). A job that may not use
//! the scale set's backend gets no runner, and its workflow run is cancelled.
//!
//! `pull_request_target` runs the base repository's workflow with the pull request's input;
//! its run is not known to name the fork as head, so on a trusted scale set it always counts as
//! a fork's (route such workflows to an untrusted scale set).

use jr_placement::{ForgeContext, TrustLevel, TrustPolicy};

use crate::wire::{JobFacts, RunOrigin};

/// Events whose run's head repository tells whether it runs a fork's code. Other events
/// (`push`, `schedule`, `workflow_dispatch`, `workflow_run`, `issue_comment`, …) run the base
/// repository's own workflow; configured rules can still restrict them by event.
pub fn head_names_the_fork(event: &str) -> bool {
    matches!(
        event.to_ascii_lowercase().as_str(),
        "pull_request" | "pull_request_review" | "pull_request_review_comment"
    )
}

/// Events that always count as a fork's on a trusted scale set (see the module notes).
pub fn counts_as_fork(event: &str) -> bool {
    event.eq_ignore_ascii_case("pull_request_target")
}

#[derive(Clone, Debug)]
pub struct Guard {
    pub policy: TrustPolicy,
    /// The trust level of the backend the scale set's runners run on.
    pub backend_trust: TrustLevel,
}

/// What the guard says about one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// The job may not run on this scale set's backend.
    Refused {
        reason: String,
    },
}

impl Guard {
    /// Whether `job` needs its workflow run looked up before a verdict: for the head of a
    /// pull request, or for the actor when a rule matches on actors.
    pub fn needs_origin(&self, job: &JobFacts) -> bool {
        self.backend_trust > TrustLevel::Untrusted
            && (head_names_the_fork(&job.event_name)
                || self.policy.rules.iter().any(|r| r.matcher.actor.is_some()))
    }

    /// The verdict for `job`, with the run's origin when [`Guard::needs_origin`] said so.
    pub fn check(&self, job: &JobFacts, origin: Option<&RunOrigin>) -> Verdict {
        if self.backend_trust == TrustLevel::Untrusted {
            return Verdict::Allowed;
        }
        let repository = format!("{}/{}", job.owner_name, job.repository_name);
        let head_is_fork = counts_as_fork(&job.event_name)
            || match origin {
                Some(origin) => origin.from_fork(),
                // Without the lookup a pull request counts as a fork's.
                None => head_names_the_fork(&job.event_name),
            };
        let ctx = ForgeContext {
            repository,
            owner: job.owner_name.clone(),
            event: job.event_name.clone(),
            head_is_fork,
            actor: origin.map(|o| o.actor.clone()).unwrap_or_default(),
        };
        let allowed = self.policy.max_trust(&ctx);
        if allowed.max_trust >= self.backend_trust {
            Verdict::Allowed
        } else {
            Verdict::Refused {
                reason: format!(
                    "{}; this scale set runs on a {} backend",
                    allowed.reason, self.backend_trust
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use jr_placement::{ContextMatcher, TrustRule};

    use super::*;

    fn job(event: &str) -> JobFacts {
        JobFacts {
            owner_name: "acme".into(),
            repository_name: "app".into(),
            event_name: event.into(),
            ..JobFacts::default()
        }
    }

    fn origin(event: &str, head: &str) -> RunOrigin {
        RunOrigin {
            event: event.into(),
            repository: "acme/app".into(),
            head_repository: head.into(),
            actor: "octo".into(),
        }
    }

    fn guard(trust: TrustLevel) -> Guard {
        Guard {
            policy: TrustPolicy {
                rules: vec![TrustRule {
                    matcher: ContextMatcher {
                        actor: Some("mallory".into()),
                        ..ContextMatcher::default()
                    },
                    max_trust: TrustLevel::Untrusted,
                }],
                default_max: TrustLevel::Trusted,
            },
            backend_trust: trust,
        }
    }

    #[test]
    fn fork_code_is_refused_on_a_trusted_scale_set_and_base_code_is_not() {
        let g = guard(TrustLevel::Trusted);
        assert_eq!(g.check(&job("push"), None), Verdict::Allowed);
        let event = "pull_request";
        assert!(g.needs_origin(&job(event)));
        let fork = g.check(&job(event), Some(&origin(event, "contributor/app")));
        assert!(
            matches!(&fork, Verdict::Refused { reason } if reason.contains("fork")),
            "{fork:?}"
        );
        assert_eq!(
            g.check(&job(event), Some(&origin(event, "acme/app"))),
            Verdict::Allowed,
            "from the base"
        );
        // No lookup answer: treated as a fork's.
        assert!(matches!(
            g.check(&job(event), None),
            Verdict::Refused { .. }
        ));
        // pull_request_target always counts as a fork's on a trusted scale set.
        let target = "pull_request_target";
        assert!(matches!(
            g.check(&job(target), Some(&origin(target, "acme/app"))),
            Verdict::Refused { .. }
        ));
        // Without actor rules, a push needs no lookup.
        let plain = Guard {
            policy: TrustPolicy {
                rules: Vec::new(),
                default_max: TrustLevel::Trusted,
            },
            backend_trust: TrustLevel::Trusted,
        };
        assert!(!plain.needs_origin(&job("push")) && plain.needs_origin(&job(event)));
    }

    #[test]
    fn configured_rules_apply_with_github_facts_and_untrusted_scale_sets_take_anything() {
        let g = guard(TrustLevel::Trusted);
        // The policy has an actor rule: every event's run is looked up for its actor.
        assert!(g.needs_origin(&job("push")));
        let mut by_mallory = origin("pull_request", "acme/app");
        by_mallory.actor = "mallory".into();
        assert!(
            matches!(g.check(&job("pull_request"), Some(&by_mallory)), Verdict::Refused { reason } if reason.contains("trust rule 1"))
        );
        let vm = guard(TrustLevel::Untrusted);
        assert!(!vm.needs_origin(&job("pull_request_target")));
        assert_eq!(
            vm.check(&job("pull_request_target"), None),
            Verdict::Allowed
        );
    }
}
