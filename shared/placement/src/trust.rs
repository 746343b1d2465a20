//! Trust-aware routing: the forge context decides the most trusted backend a job may use, and
//! `runs-on` may only ask for a backend at or below that level.
//!
//! Without this, `runs-on` alone picks the backend, and the author of a fork's pull request
//! could ask for the Pod backend. [`TrustPolicy::max_trust`] turns the context into a maximum
//! level with a reason; [`decide`] then keeps the router's preferred backend when it is allowed,
//! or moves the job to the most trusted backend that is, recording why on the decision.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::PlacementError;
use crate::glob::glob_matches;

/// How much a backend is trusted with. Ordered: `Untrusted < Trusted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrustLevel {
    /// Isolated enough for code from anyone (e.g. a microVM sandbox).
    Untrusted,
    /// Shares more with the cluster (e.g. a Pod); only for code from trusted sources.
    Trusted,
}

impl fmt::Display for TrustLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Untrusted => "untrusted",
            Self::Trusted => "trusted",
        })
    }
}

/// What the forge says about the run a job belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ForgeContext {
    /// `owner/name` of the repository the run belongs to.
    pub repository: String,
    /// The repository's owner (user or organisation).
    pub owner: String,
    /// The triggering event: `push`, `pull_request`, `pull_request_target`, `schedule`, …
    pub event: String,
    /// Whether the code under test comes from a fork (a pull request's head repository differs
    /// from the base repository).
    pub head_is_fork: bool,
    /// Who triggered the run.
    pub actor: String,
}

/// Matches forge contexts. Every field that is given must match; a field left out matches
/// anything. Text fields are globs where `*` matches any run of characters, compared ignoring
/// ASCII case.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContextMatcher {
    /// Glob on `owner/name`.
    pub repository: Option<String>,
    /// Glob on the owner.
    pub owner: Option<String>,
    /// Glob on the event.
    pub event: Option<String>,
    /// Glob on the actor.
    pub actor: Option<String>,
    /// Whether the head must (or must not) come from a fork.
    pub fork: Option<bool>,
}

impl ContextMatcher {
    /// Whether `ctx` matches.
    pub fn matches(&self, ctx: &ForgeContext) -> bool {
        let field = |pattern: &Option<String>, value: &str| {
            pattern.as_deref().is_none_or(|p| glob_matches(p, value))
        };
        field(&self.repository, &ctx.repository)
            && field(&self.owner, &ctx.owner)
            && field(&self.event, &ctx.event)
            && field(&self.actor, &ctx.actor)
            && self.fork.is_none_or(|fork| fork == ctx.head_is_fork)
    }

    /// The given fields as `key=value` pairs for reasons, or `any context`.
    fn describe(&self) -> String {
        let text = [
            ("repository", &self.repository),
            ("owner", &self.owner),
            ("event", &self.event),
            ("actor", &self.actor),
        ];
        let mut parts: Vec<String> = text
            .iter()
            .filter_map(|(key, value)| value.as_ref().map(|v| format!("{key}={v}")))
            .collect();
        if let Some(fork) = self.fork {
            parts.push(format!("fork={fork}"));
        }
        if parts.is_empty() {
            "any context".to_owned()
        } else {
            parts.join(", ")
        }
    }
}

/// One policy rule: contexts that match may use backends up to `max_trust`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustRule {
    /// Which contexts the rule is for.
    pub matcher: ContextMatcher,
    /// The most trusted level those contexts may use.
    pub max_trust: TrustLevel,
}

/// The trust policy from configuration.
///
/// The first rule whose matcher matches gives the maximum level; with no match, `default_max`
/// does. Before all configured rules sits a built-in one that no rule can loosen: when the head
/// comes from a fork (a `pull_request` or `pull_request_target` event from a fork, or any other
/// event the forge marks as running fork code) the maximum is at most [`TrustLevel::Untrusted`],
/// whatever later rules say.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustPolicy {
    /// Configured rules, first match wins.
    pub rules: Vec<TrustRule>,
    /// The maximum when no rule matches.
    pub default_max: TrustLevel,
}

/// The most trusted level a context may use, and why.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AllowedTrust {
    /// The most trusted level allowed.
    pub max_trust: TrustLevel,
    /// Why, for the assignment and the status page.
    pub reason: String,
}

impl TrustPolicy {
    /// The most trusted level `ctx` may use, and why.
    pub fn max_trust(&self, ctx: &ForgeContext) -> AllowedTrust {
        if ctx.head_is_fork {
            // Whatever the configured rules say: fork code never gets more than untrusted.
            let max_trust = TrustLevel::Untrusted;
            let what = if ctx.event.to_ascii_lowercase().starts_with("pull_request") {
                "fork pull request".to_owned()
            } else {
                format!("{} event from a fork", ctx.event)
            };
            return AllowedTrust {
                max_trust,
                reason: format!("{what}: at most {max_trust}"),
            };
        }
        let matched = self
            .rules
            .iter()
            .enumerate()
            .find(|(_, rule)| rule.matcher.matches(ctx));
        match matched {
            Some((index, rule)) => AllowedTrust {
                max_trust: rule.max_trust,
                reason: format!(
                    "trust rule {} ({}): at most {}",
                    index + 1,
                    rule.matcher.describe(),
                    rule.max_trust
                ),
            },
            None => AllowedTrust {
                max_trust: self.default_max,
                reason: format!("no trust rule matched: at most {}", self.default_max),
            },
        }
    }
}

/// Where trust routing sends a job, recorded on the assignment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TrustDecision {
    /// The backend that runs the job.
    pub backend: String,
    /// The most trusted level the job was allowed.
    pub max_trust: TrustLevel,
    /// Why, e.g. `fork pull request: at most untrusted; runs-on asked for pod`.
    pub reason: String,
    /// Whether trust moved the job away from the router's first choice.
    pub downgraded: bool,
}

/// Chooses the backend for a job from the forge context.
///
/// `candidates` are the backends serving the job's `runs-on`, in router preference order;
/// `all_backends` are every configured backend. The first candidate at or below the allowed
/// level is chosen (`downgraded` when it is not the first candidate). When no candidate is
/// allowed, the most trusted backend of `all_backends` at or below the level is chosen (the
/// first listed on a tie) and `downgraded` is set. With no candidates, or no allowed backend at
/// all, the job cannot be routed and an error says why.
pub fn decide(
    policy: &TrustPolicy,
    ctx: &ForgeContext,
    candidates: &[(String, TrustLevel)],
    all_backends: &[(String, TrustLevel)],
) -> Result<TrustDecision, PlacementError> {
    let AllowedTrust { max_trust, reason } = policy.max_trust(ctx);
    let Some((first, _)) = candidates.first() else {
        return Err(PlacementError::NoCandidateBackend);
    };
    let chosen = candidates
        .iter()
        .enumerate()
        .find(|(_, (_, level))| *level <= max_trust);
    if let Some((index, (backend, _))) = chosen {
        let downgraded = index != 0;
        let reason = if downgraded {
            format!("{reason}; runs-on asked for {first}")
        } else {
            reason
        };
        let backend = backend.clone();
        return Ok(TrustDecision {
            backend,
            max_trust,
            reason,
            downgraded,
        });
    }
    // Most trusted allowed backend; `rev` so that `max_by_key` keeps the first listed on a tie.
    let fallback = all_backends
        .iter()
        .rev()
        .filter(|(_, level)| *level <= max_trust)
        .max_by_key(|(_, level)| *level);
    match fallback {
        Some((backend, _)) => Ok(TrustDecision {
            backend: backend.clone(),
            max_trust,
            reason: format!("{reason}; runs-on asked for {first}"),
            downgraded: true,
        }),
        None => Err(PlacementError::NoTrustedBackend {
            max_trust,
            reason,
            requested: candidates.iter().map(|(name, _)| name.clone()).collect(),
        }),
    }
}
