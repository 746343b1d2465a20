//! Trust routing: the forge context caps the backend's trust; runs-on may only ask for less.

use jr_placement::PlacementError;
use jr_placement::trust::{
    ContextMatcher, ForgeContext, TrustDecision, TrustLevel, TrustPolicy, TrustRule, decide,
};
use proptest::prelude::*;

use TrustLevel::{Trusted, Untrusted};

fn ctx(repository: &str, event: &str, head_is_fork: bool, actor: &str) -> ForgeContext {
    ForgeContext {
        repository: repository.into(),
        owner: repository.split('/').next().unwrap_or_default().into(),
        event: event.into(),
        head_is_fork,
        actor: actor.into(),
    }
}

fn backends(list: &[(&str, TrustLevel)]) -> Vec<(String, TrustLevel)> {
    list.iter()
        .map(|&(name, level)| (name.to_owned(), level))
        .collect()
}

fn trusting() -> TrustPolicy {
    TrustPolicy {
        rules: vec![],
        default_max: Trusted,
    }
}

#[test]
fn a_fork_pull_request_asking_for_pod_runs_on_vm() {
    let all = backends(&[("pod", Trusted), ("vm", Untrusted)]);
    let pod = backends(&[("pod", Trusted)]);
    for event in ["pull_request", "pull_request_target"] {
        let decision = decide(
            &trusting(),
            &ctx("acme/web", event, true, "stranger"),
            &pod,
            &all,
        );
        assert_eq!(
            decision,
            Ok(TrustDecision {
                backend: "vm".into(),
                max_trust: Untrusted,
                reason: "fork pull request: at most untrusted; runs-on asked for pod".into(),
                downgraded: true,
            })
        );
    }
}

#[test]
fn no_rule_can_loosen_the_fork_cap() {
    let everyone_trusted = TrustPolicy {
        rules: vec![TrustRule {
            matcher: ContextMatcher::default(),
            max_trust: Trusted,
        }],
        default_max: Trusted,
    };
    let fork = ctx("acme/web", "pull_request", true, "maintainer");
    assert_eq!(everyone_trusted.max_trust(&fork).max_trust, Untrusted);
    let not_fork = ctx("acme/web", "pull_request", false, "maintainer");
    assert_eq!(everyone_trusted.max_trust(&not_fork).max_trust, Trusted);
}

#[test]
fn the_first_matching_rule_decides_and_is_named_in_the_reason() {
    let policy = TrustPolicy {
        rules: vec![
            TrustRule {
                matcher: ContextMatcher {
                    owner: Some("acme".into()),
                    fork: Some(false),
                    ..Default::default()
                },
                max_trust: Trusted,
            },
            TrustRule {
                matcher: ContextMatcher::default(),
                max_trust: Untrusted,
            },
        ],
        default_max: Trusted,
    };
    let ours = policy.max_trust(&ctx("acme/web", "push", false, "dev"));
    assert_eq!(
        (ours.max_trust, ours.reason.as_str()),
        (
            Trusted,
            "trust rule 1 (owner=acme, fork=false): at most trusted"
        )
    );
    let theirs = policy.max_trust(&ctx("other/web", "push", false, "dev"));
    assert_eq!(
        (theirs.max_trust, theirs.reason.as_str()),
        (Untrusted, "trust rule 2 (any context): at most untrusted")
    );
    let none = TrustPolicy {
        rules: vec![],
        default_max: Untrusted,
    }
    .max_trust(&ctx("a/b", "push", false, "x"));
    assert_eq!(none.reason, "no trust rule matched: at most untrusted");
}

#[test]
fn an_allowed_first_choice_is_kept_unchanged() {
    let candidates = backends(&[("pod", Trusted), ("vm", Untrusted)]);
    let decision = decide(
        &trusting(),
        &ctx("acme/web", "push", false, "dev"),
        &candidates,
        &candidates,
    );
    assert_eq!(
        decision.map(|d| (d.backend, d.downgraded, d.reason)),
        Ok((
            "pod".into(),
            false,
            "no trust rule matched: at most trusted".into()
        ))
    );
}

#[test]
fn a_later_allowed_candidate_wins_over_other_backends() {
    let candidates = backends(&[("pod", Trusted), ("vm-small", Untrusted)]);
    let all = backends(&[("pod", Trusted), ("vm", Untrusted), ("vm-small", Untrusted)]);
    let decision = decide(
        &trusting(),
        &ctx("a/b", "pull_request", true, "x"),
        &candidates,
        &all,
    );
    assert_eq!(
        decision.map(|d| (d.backend, d.downgraded)),
        Ok(("vm-small".into(), true))
    );
}

#[test]
fn the_fallback_is_the_most_trusted_allowed_backend_first_listed_on_a_tie() {
    let policy = TrustPolicy {
        rules: vec![],
        default_max: Untrusted,
    };
    let pod = backends(&[("pod", Trusted)]);
    let all = backends(&[("pod", Trusted), ("vm-b", Untrusted), ("vm-a", Untrusted)]);
    let decision = decide(&policy, &ctx("a/b", "push", false, "x"), &pod, &all);
    assert_eq!(decision.map(|d| d.backend), Ok("vm-b".into()));
}

#[test]
fn no_allowed_backend_is_an_error_that_says_why() {
    let pod = backends(&[("pod", Trusted)]);
    let error = decide(
        &trusting(),
        &ctx("acme/web", "pull_request", true, "x"),
        &pod,
        &pod,
    );
    let Err(error) = error else {
        panic!("expected an error, got {error:?}")
    };
    assert_eq!(error.kind(), "no_trusted_backend");
    assert_eq!(
        error.to_string(),
        "no backend may run this job: fork pull request: at most untrusted; runs-on asked for [\"pod\"] and no configured backend is at or below untrusted"
    );
    let none = decide(&trusting(), &ctx("a/b", "push", false, "x"), &[], &pod);
    assert_eq!(none, Err(PlacementError::NoCandidateBackend));
}

#[test]
fn matchers_glob_and_ignore_ascii_case() {
    let matcher = ContextMatcher {
        repository: Some("Acme/*".into()),
        event: Some("pull_request*".into()),
        actor: Some("*[bot]".into()),
        ..Default::default()
    };
    assert!(matcher.matches(&ctx(
        "acme/web",
        "pull_request_target",
        false,
        "renovate[bot]"
    )));
    assert!(!matcher.matches(&ctx("acme/web", "push", false, "renovate[bot]")));
    assert!(!matcher.matches(&ctx("acme/web", "pull_request", false, "human")));
}

fn any_level() -> impl Strategy<Value = TrustLevel> {
    prop_oneof![Just(Untrusted), Just(Trusted)]
}

fn any_ctx() -> impl Strategy<Value = ForgeContext> {
    (
        "[ab]/[xy]",
        prop_oneof![
            Just("push"),
            Just("pull_request"),
            Just("pull_request_target"),
            Just("schedule")
        ],
        any::<bool>(),
        "[uv]",
    )
        .prop_map(|(repository, event, fork, actor)| ctx(&repository, event, fork, &actor))
}

fn any_policy() -> impl Strategy<Value = TrustPolicy> {
    let glob = || proptest::option::of(prop_oneof![Just("*".to_owned()), "[abxyuv*/_a-z]{1,6}"]);
    let matcher = (
        glob(),
        glob(),
        glob(),
        glob(),
        proptest::option::of(any::<bool>()),
    )
        .prop_map(|(repository, owner, event, actor, fork)| ContextMatcher {
            repository,
            owner,
            event,
            actor,
            fork,
        });
    let rule =
        (matcher, any_level()).prop_map(|(matcher, max_trust)| TrustRule { matcher, max_trust });
    (proptest::collection::vec(rule, 0..4), any_level())
        .prop_map(|(rules, default_max)| TrustPolicy { rules, default_max })
}

/// Backends whose name carries their level, so a decision's name tells its level.
fn any_backends(min: usize) -> impl Strategy<Value = Vec<(String, TrustLevel)>> {
    proptest::collection::vec(("[a-c]", any_level()), min..4).prop_map(|list| {
        list.into_iter()
            .map(|(name, level)| (format!("{level}-{name}"), level))
            .collect()
    })
}

fn level_of(backend: &str) -> TrustLevel {
    if backend.starts_with("trusted-") {
        Trusted
    } else {
        Untrusted
    }
}

proptest! {
    #[test]
    fn the_chosen_backend_is_never_above_the_allowed_maximum(
        policy in any_policy(), ctx in any_ctx(), candidates in any_backends(0), all in any_backends(0),
    ) {
        let allowed = policy.max_trust(&ctx).max_trust;
        match decide(&policy, &ctx, &candidates, &all) {
            Ok(decision) => {
                prop_assert_eq!(decision.max_trust, allowed);
                prop_assert!(level_of(&decision.backend) <= allowed);
                let known = candidates.iter().chain(&all).any(|(name, _)| *name == decision.backend);
                prop_assert!(known);
                if ctx.head_is_fork {
                    prop_assert_eq!(allowed, Untrusted);
                }
            }
            Err(PlacementError::NoCandidateBackend) => prop_assert!(candidates.is_empty()),
            Err(PlacementError::NoTrustedBackend { .. }) => {
                prop_assert!(candidates.iter().chain(&all).all(|(_, l)| *l > allowed));
            }
        }
    }

    #[test]
    fn a_fork_pull_request_never_gets_a_trusted_backend(
        policy in any_policy(), mut ctx in any_ctx(), candidates in any_backends(1), all in any_backends(0),
        event in prop_oneof![Just("pull_request"), Just("pull_request_target")],
    ) {
        ctx.event = event.to_owned();
        ctx.head_is_fork = true;
        if let Ok(decision) = decide(&policy, &ctx, &candidates, &all) {
            prop_assert_eq!(level_of(&decision.backend), Untrusted);
            prop_assert!(decision.reason.starts_with("fork pull request: at most untrusted"));
        }
    }

    #[test]
    fn an_allowed_first_candidate_is_chosen_unchanged(
        policy in any_policy(), ctx in any_ctx(), candidates in any_backends(1), all in any_backends(0),
    ) {
        let allowed = policy.max_trust(&ctx);
        if let Some((first, _)) = candidates.first().filter(|(_, l)| *l <= allowed.max_trust) {
            let decision = decide(&policy, &ctx, &candidates, &all);
            prop_assert_eq!(decision, Ok(TrustDecision {
                backend: first.clone(), max_trust: allowed.max_trust, reason: allowed.reason, downgraded: false,
            }));
        }
    }
}
