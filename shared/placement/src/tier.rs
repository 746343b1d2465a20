//! The burst tier: an extra backend or provider that takes some jobs when the default tier is
//! under pressure.
//!
//! One runtime value (changeable without a restart) is read with [`parse_burst`]; it never fails,
//! an invalid value means "off" plus a [`BurstWarning`] to log and count. [`choose_tier`] then
//! sends a job to the burst tier only when the tier is on, the job is not protected, the job's
//! stable [`burst_bucket`] falls inside the percentage, and the default tier is full (or its
//! oldest job has waited longer than the configured threshold). Because the bucket is a hash of
//! repository, workflow and job, a re-run of the same job lands in the same tier.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::glob::glob_matches;

/// The burst switch as read from its runtime value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct BurstSetting {
    /// Whether the burst tier takes any work.
    pub enabled: bool,
    /// The share of eligible jobs it may take, 0–100.
    pub percent: u8,
}

impl BurstSetting {
    /// The safe default: the burst tier takes nothing.
    pub const OFF: Self = Self {
        enabled: false,
        percent: 0,
    };
}

/// Why a runtime burst value was not understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BurstProblem {
    /// The value is empty or only whitespace.
    Empty,
    /// A whole-number percentage above 100.
    PercentOutOfRange,
    /// Anything else: not `off`, `on`, `on:<0-100>` or `<0-100>` with an optional `%`.
    Unrecognised,
}

impl BurstProblem {
    /// A low-cardinality name for the warning metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Empty => "empty",
            Self::PercentOutOfRange => "percent_out_of_range",
            Self::Unrecognised => "unrecognised",
        }
    }
}

impl fmt::Display for BurstProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Empty => "the value is empty",
            Self::PercentOutOfRange => "the percentage is above 100",
            Self::Unrecognised => "expected off, on, on:<0-100> or <0-100>[%]",
        })
    }
}

/// An invalid runtime burst value, which was replaced by [`BurstSetting::OFF`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BurstWarning {
    /// The value as given, trimmed and cut to [`BurstWarning::MAX_INPUT_CHARS`] characters so a
    /// huge value cannot flood the logs.
    pub input: String,
    /// What is wrong with it.
    pub problem: BurstProblem,
}

impl BurstWarning {
    /// How much of a bad value a warning repeats.
    pub const MAX_INPUT_CHARS: usize = 64;

    fn new(raw: &str, problem: BurstProblem) -> Self {
        let input = raw.trim().chars().take(Self::MAX_INPUT_CHARS).collect();
        Self { input, problem }
    }
}

impl fmt::Display for BurstWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid burst setting {:?}: {}; the burst tier is off",
            self.input, self.problem
        )
    }
}

/// Reads the runtime burst value. Accepted, ignoring surrounding whitespace and ASCII case:
/// `off`; `on` (100 %); `on:30`, `on:30%`, `30`, `30%` (on, 30 %). The percentage is a whole
/// number from 0 to 100. Anything else gives [`BurstSetting::OFF`] and a warning naming the
/// value; this never fails, so a bad value cannot stop scheduling.
pub fn parse_burst(raw: &str) -> (BurstSetting, Option<BurstWarning>) {
    let value = raw.trim().to_ascii_lowercase();
    let parsed = match value.as_str() {
        "" => Err(BurstProblem::Empty),
        "off" => Ok(BurstSetting::OFF),
        "on" => Ok(BurstSetting {
            enabled: true,
            percent: 100,
        }),
        other => {
            let number = other.strip_prefix("on:").unwrap_or(other).trim();
            let number = number.strip_suffix('%').unwrap_or(number).trim_end();
            parse_percent(number).map(|percent| BurstSetting {
                enabled: true,
                percent,
            })
        }
    };
    match parsed {
        Ok(setting) => (setting, None),
        Err(problem) => (BurstSetting::OFF, Some(BurstWarning::new(raw, problem))),
    }
}

fn parse_percent(digits: &str) -> Result<u8, BurstProblem> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(BurstProblem::Unrecognised);
    }
    // Only digits remain, so the parse fails only on overflow: a very large number.
    match digits.parse::<u64>() {
        Ok(n) if n <= 100 => u8::try_from(n).map_err(|_| BurstProblem::PercentOutOfRange),
        _ => Err(BurstProblem::PercentOutOfRange),
    }
}

/// A job's burst bucket, 0–99: the job goes to the burst tier only if its bucket is below the
/// percentage. The bucket is the first 8 bytes (big-endian) of SHA-256 over a version tag and
/// the three fields, each preceded by its byte length as a big-endian u64, taken modulo 100.
/// Length prefixes keep `("a/b", "c")` and `("a", "b/c")` apart. This must never change: a
/// change would move jobs between tiers on their next run.
pub fn burst_bucket(repository: &str, workflow: &str, job: &str) -> u8 {
    let mut hash = Sha256::new();
    hash.update(b"jetrunner burst bucket v1\0");
    for field in [repository, workflow, job] {
        hash.update((field.len() as u64).to_be_bytes());
        hash.update(field.as_bytes());
    }
    let digest = hash.finalize();
    let first = digest.first_chunk::<8>().copied().unwrap_or_default();
    // Below 100, so the conversion cannot fail.
    u8::try_from(u64::from_be_bytes(first) % 100).unwrap_or(0)
}

/// The facts about a job that tier choice looks at.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JobKey {
    /// `owner/name`.
    pub repository: String,
    /// The workflow (its file name or name, whichever the router records).
    pub workflow: String,
    /// The job's name within the workflow.
    pub job: String,
    /// The job's `runs-on` labels.
    pub labels: Vec<String>,
}

/// Jobs that never leave the default tier. Every field that is given must match; a field left
/// out matches anything (so a matcher with nothing given protects every job). Text fields are
/// globs where `*` matches any run of characters, compared ignoring ASCII case; each entry of
/// `labels` must match at least one of the job's labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProtectedMatcher {
    /// Glob on `owner/name`.
    pub repository: Option<String>,
    /// Glob on the workflow.
    pub workflow: Option<String>,
    /// Glob on the job name.
    pub job: Option<String>,
    /// Globs that must each match one of the job's `runs-on` labels.
    pub labels: Vec<String>,
}

impl ProtectedMatcher {
    /// Whether this matcher protects `job`.
    pub fn matches(&self, job: &JobKey) -> bool {
        let field = |pattern: &Option<String>, value: &str| {
            pattern.as_deref().is_none_or(|p| glob_matches(p, value))
        };
        field(&self.repository, &job.repository)
            && field(&self.workflow, &job.workflow)
            && field(&self.job, &job.job)
            && self
                .labels
                .iter()
                .all(|wanted| job.labels.iter().any(|label| glob_matches(wanted, label)))
    }
}

/// Where a job goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierChoice {
    /// The default tier, and why not the burst tier.
    Default(DefaultReason),
    /// The burst tier.
    Burst,
}

/// Why a job stays in the default tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DefaultReason {
    /// The burst tier is switched off.
    BurstOff,
    /// The job matches the protected matcher at this index.
    Protected {
        /// Index into the protected matchers.
        matcher: usize,
    },
    /// The job's bucket is not below the percentage.
    OutsidePercentage {
        /// The job's [`burst_bucket`].
        bucket: u8,
        /// The configured percentage.
        percent: u8,
    },
    /// The default tier has room and its queue has not waited past the threshold.
    DefaultHasRoom,
}

impl DefaultReason {
    /// A low-cardinality name for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BurstOff => "burst_off",
            Self::Protected { .. } => "protected",
            Self::OutsidePercentage { .. } => "outside_percentage",
            Self::DefaultHasRoom => "default_has_room",
        }
    }
}

/// Chooses the tier for `job`. Burst only when the tier is enabled, no protected matcher
/// matches, the job's bucket is below the percentage, and the default tier is full or its
/// oldest waiting job has waited longer than `wait_threshold` (when one is configured). The
/// reasons are checked in that order, and the first that keeps the job home is returned.
pub fn choose_tier(
    setting: &BurstSetting,
    protected: &[ProtectedMatcher],
    job: &JobKey,
    default_full: bool,
    oldest_wait: Duration,
    wait_threshold: Option<Duration>,
) -> TierChoice {
    if !setting.enabled {
        return TierChoice::Default(DefaultReason::BurstOff);
    }
    if let Some(matcher) = protected.iter().position(|m| m.matches(job)) {
        return TierChoice::Default(DefaultReason::Protected { matcher });
    }
    let bucket = burst_bucket(&job.repository, &job.workflow, &job.job);
    if bucket >= setting.percent {
        let percent = setting.percent;
        return TierChoice::Default(DefaultReason::OutsidePercentage { bucket, percent });
    }
    let waited_too_long = wait_threshold.is_some_and(|threshold| oldest_wait > threshold);
    if default_full || waited_too_long {
        TierChoice::Burst
    } else {
        TierChoice::Default(DefaultReason::DefaultHasRoom)
    }
}

/// The KV key of a provider's drain switch.
pub fn drain_key(backend: &str, provider: &str) -> String {
    format!("drain.{backend}.{provider}")
}

/// Whether a drain switch's value drains the provider, and the warning for a bad value.
pub fn interpret_drain(value: Option<&[u8]>) -> (bool, Option<String>) {
    let Some(bytes) = value else {
        return (false, None);
    };
    let text = String::from_utf8_lossy(bytes);
    match text.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "drain" | "drained" => (true, None),
        "off" | "false" | "" => (false, None),
        _ => (
            false,
            Some(format!(
                "drain switch {:?} is not valid: the provider is not drained; use on or off",
                text.chars().take(64).collect::<String>()
            )),
        ),
    }
}
