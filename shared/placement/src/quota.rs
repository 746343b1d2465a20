//! Fair shares inside a backend: per-repository and per-owner concurrency quotas, and which
//! waiting job starts next.
//!
//! A job over quota waits (it stays queued, no attempt is spent); it is never failed. When a slot
//! frees, [`next_fair`] starts the admissible job whose repository has the smallest weighted share
//! of running work, so a repository with hundreds of queued jobs cannot starve one with a single
//! job: the single job starts at the next slot turnover.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Concurrency quotas and weights for one backend.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Quotas {
    /// At most this many running jobs per repository, when set.
    pub per_repository: Option<usize>,
    /// At most this many running jobs per owner (over all their repositories), when set.
    pub per_owner: Option<usize>,
    /// Relative shares by repository (`owner/name`); a repository not listed has weight 1.
    /// Configuration refuses 0; a 0 here counts as 1 so no repository is starved outright.
    pub weights: BTreeMap<String, u32>,
}

impl Quotas {
    /// The weight `repository` gets in [`next_fair`]: its configured weight, at least 1.
    pub fn weight(&self, repository: &str) -> u32 {
        self.weights.get(repository).copied().unwrap_or(1).max(1)
    }
}

/// Jobs running now in one backend, counted per repository and per owner.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Usage {
    /// Running jobs by repository (`owner/name`); absent means none.
    pub per_repository: BTreeMap<String, usize>,
    /// Running jobs by owner; absent means none.
    pub per_owner: BTreeMap<String, usize>,
}

impl Usage {
    /// Jobs running for `repository`.
    pub fn repository(&self, repository: &str) -> usize {
        self.per_repository.get(repository).copied().unwrap_or(0)
    }

    /// Jobs running for `owner`.
    pub fn owner(&self, owner: &str) -> usize {
        self.per_owner.get(owner).copied().unwrap_or(0)
    }

    /// Counts a job that started.
    pub fn start(&mut self, repository: &str, owner: &str) {
        let repo = self
            .per_repository
            .entry(repository.to_owned())
            .or_insert(0);
        *repo = repo.saturating_add(1);
        let own = self.per_owner.entry(owner.to_owned()).or_insert(0);
        *own = own.saturating_add(1);
    }

    /// Counts a job that finished; counts never go below zero, and zero counts are removed.
    pub fn finish(&mut self, repository: &str, owner: &str) {
        decrement(&mut self.per_repository, repository);
        decrement(&mut self.per_owner, owner);
    }
}

fn decrement(counts: &mut BTreeMap<String, usize>, key: &str) {
    if let Some(count) = counts.get_mut(key) {
        *count = count.saturating_sub(1);
        if *count == 0 {
            counts.remove(key);
        }
    }
}

/// Whether a job may start now.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Admission {
    /// Within every quota.
    Admit,
    /// Over a quota: the job stays queued, without spending an attempt.
    Wait {
        /// Which quota is full.
        reason: WaitReason,
    },
}

/// The quota a waiting job is over.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WaitReason {
    /// The repository runs its quota already.
    RepositoryQuota {
        /// `owner/name`.
        repository: String,
        /// Jobs it runs now.
        running: usize,
        /// Its quota.
        limit: usize,
    },
    /// The owner runs its quota already.
    OwnerQuota {
        /// The owner.
        owner: String,
        /// Jobs it runs now.
        running: usize,
        /// Its quota.
        limit: usize,
    },
}

impl WaitReason {
    /// A low-cardinality name for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::RepositoryQuota { .. } => "repository_quota",
            Self::OwnerQuota { .. } => "owner_quota",
        }
    }
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RepositoryQuota {
                repository,
                running,
                limit,
            } => {
                write!(
                    f,
                    "repository {repository} runs {running} of its quota of {limit} jobs"
                )
            }
            Self::OwnerQuota {
                owner,
                running,
                limit,
            } => {
                write!(
                    f,
                    "owner {owner} runs {running} of its quota of {limit} jobs"
                )
            }
        }
    }
}

/// Whether a job of `repository` (owned by `owner`) may start, given what runs now. The
/// repository quota is checked first. A quota of 0 makes every such job wait.
pub fn admit(quotas: &Quotas, usage: &Usage, repository: &str, owner: &str) -> Admission {
    let running = usage.repository(repository);
    if let Some(limit) = quotas.per_repository.filter(|&limit| running >= limit) {
        let repository = repository.to_owned();
        return Admission::Wait {
            reason: WaitReason::RepositoryQuota {
                repository,
                running,
                limit,
            },
        };
    }
    let running = usage.owner(owner);
    if let Some(limit) = quotas.per_owner.filter(|&limit| running >= limit) {
        let owner = owner.to_owned();
        return Admission::Wait {
            reason: WaitReason::OwnerQuota {
                owner,
                running,
                limit,
            },
        };
    }
    Admission::Admit
}

/// A job queued for a backend.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WaitingJob {
    /// `owner/name`.
    pub repository: String,
    /// The repository's owner.
    pub owner: String,
    /// Arrival order (e.g. the stream sequence); lower arrived earlier.
    pub seq: u64,
}

/// The index in `waiting` of the job to start next, or `None` when every waiting job is over
/// quota (or none waits).
///
/// Among admissible jobs, the one whose repository has the lowest running/weight ratio wins;
/// ties go to the lowest `seq`, then to the earliest position in `waiting`. The caller counts the
/// started job in `usage` before asking again, so a repository that just got a slot ranks behind
/// one with fewer running jobs.
pub fn next_fair(waiting: &[WaitingJob], usage: &Usage, quotas: &Quotas) -> Option<usize> {
    waiting
        .iter()
        .enumerate()
        .filter(|(_, job)| admit(quotas, usage, &job.repository, &job.owner) == Admission::Admit)
        .map(|(index, job)| {
            let share = Share {
                running: usage.repository(&job.repository),
                weight: quotas.weight(&job.repository),
            };
            (share, job.seq, index)
        })
        .min_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)))
        .map(|(_, _, index)| index)
}

/// A repository's running/weight ratio, compared exactly (no floating point): 2/2 equals 1/1.
#[derive(Debug, Clone, Copy)]
struct Share {
    running: usize,
    weight: u32,
}

impl Ord for Share {
    fn cmp(&self, other: &Self) -> Ordering {
        // a/wa < b/wb  ⇔  a·wb < b·wa; u128 cannot overflow for usize × u32.
        let left = self.running as u128 * u128::from(other.weight);
        let right = other.running as u128 * u128::from(self.weight);
        left.cmp(&right)
    }
}

impl PartialEq for Share {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Share {}

impl PartialOrd for Share {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_compare_exactly() {
        let half = Share {
            running: 1,
            weight: 2,
        };
        let same_half = Share {
            running: 2,
            weight: 4,
        };
        let third = Share {
            running: 1,
            weight: 3,
        };
        assert_eq!(half, same_half);
        assert!(third < half);
        let huge = Share {
            running: usize::MAX,
            weight: u32::MAX,
        };
        assert_eq!(
            huge.cmp(&Share {
                running: usize::MAX,
                weight: u32::MAX
            }),
            Ordering::Equal
        );
    }
}
