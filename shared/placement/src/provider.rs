//! Providers inside one backend: which one takes the next workload, and when an unreachable one
//! is given up on.
//!
//! Placement asks [`WeightedPicker::pick`] for a provider. When that provider answers "full"
//! (429, quota) or cannot be reached, the caller adds its name to `exclude` and picks again for
//! the same job, so the job moves to the next provider without spending an attempt. When every
//! provider is excluded or has no room, `pick` answers `None`: that is backpressure, and the
//! caller waits (the job stays queued, no attempt is spent).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// How long an unreachable provider's workloads are held before they are written off, unless
/// configured otherwise (`unreachable_hold`).
pub const DEFAULT_UNREACHABLE_HOLD: Duration = Duration::from_secs(5 * 60);

/// What placement knows about one provider at the moment of a pick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderView {
    /// The provider's configured name, unique within its backend.
    pub name: String,
    /// Its share of new work relative to the other providers. Configuration refuses 0; a
    /// provider with weight 0 is never picked.
    pub weight: u32,
    /// At most this many workloads at once, when set.
    pub max_runners: Option<usize>,
    /// Drained: nothing new is placed here, running work finishes.
    pub disabled: bool,
    /// Workloads it runs now (including ones being created).
    pub used: usize,
    /// Whether its API answered lately. An unreachable provider gets no new work.
    pub reachable: bool,
    /// It answered "full" and is not asked again before this instant.
    pub full_until: Option<Instant>,
}

impl ProviderView {
    /// An enabled, reachable provider with no work, no limit and no recent "full" answer.
    pub fn new(name: impl Into<String>, weight: u32) -> Self {
        ProviderView {
            name: name.into(),
            weight,
            max_runners: None,
            disabled: false,
            used: 0,
            reachable: true,
            full_until: None,
        }
    }

    /// Whether new work may go here at `now`: a positive weight, not drained, reachable, not
    /// recently full, and below `max_runners` when that is set.
    pub fn has_room(&self, now: Instant) -> bool {
        self.weight > 0
            && !self.disabled
            && self.reachable
            && self.full_until.is_none_or(|until| until <= now)
            && self.max_runners.is_none_or(|max| self.used < max)
    }
}

/// Smooth weighted round-robin (the nginx algorithm) over the providers with room.
///
/// On every pick each eligible provider's current weight grows by its weight; the one with the
/// highest current weight (the first in list order on a tie) is chosen and its current weight
/// drops by the sum of the eligible weights. Over `n` picks from a fixed eligible set each
/// provider is chosen within one of `n · weight / Σweight` times, and choices interleave (3:1
/// gives a a b a, not a a a b). Current weights are kept by provider name, so reordering,
/// adding or removing providers keeps the others' positions; a provider no longer listed is
/// forgotten. The picker is deterministic: the same calls give the same answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightedPicker {
    current: BTreeMap<String, i64>,
}

impl WeightedPicker {
    /// A picker that has picked nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The provider for the next workload among `providers` that have room at `now` and are not
    /// in `exclude` (the ones that answered "full" or were unreachable for this job), or `None`
    /// when there is none: the caller then waits, without spending an attempt.
    pub fn pick(
        &mut self,
        providers: &[ProviderView],
        exclude: &BTreeSet<String>,
        now: Instant,
    ) -> Option<String> {
        self.current
            .retain(|name, _| providers.iter().any(|p| &p.name == name));
        let mut total: i64 = 0;
        let mut best: Option<(&str, i64)> = None;
        let eligible = providers
            .iter()
            .filter(|p| p.has_room(now) && !exclude.contains(&p.name));
        for provider in eligible {
            let weight = i64::from(provider.weight);
            let current = self.current.entry(provider.name.clone()).or_insert(0);
            *current = current.saturating_add(weight);
            total = total.saturating_add(weight);
            if best.is_none_or(|(_, highest)| *current > highest) {
                best = Some((&provider.name, *current));
            }
        }
        let (chosen, _) = best?;
        if let Some(current) = self.current.get_mut(chosen) {
            *current = current.saturating_sub(total);
        }
        Some(chosen.to_owned())
    }
}

/// What to do with an unreachable provider's workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreachable {
    /// Keep them: the provider may come back, and its workloads may still be running.
    Hold {
        /// How long until they are written off.
        remaining: Duration,
    },
    /// Give them up: record them as lost so their jobs can be dispatched elsewhere.
    WriteOff,
}

/// Whether a provider unreachable since `unreachable_since` is still held at `now`, given the
/// configured `hold`. The hold ends exactly `hold` after the provider became unreachable. A
/// `now` before `unreachable_since` (clock values from different reads) counts as no time spent.
pub fn unreachable_verdict(
    unreachable_since: Instant,
    now: Instant,
    hold: Duration,
) -> Unreachable {
    let elapsed = now.saturating_duration_since(unreachable_since);
    match hold.checked_sub(elapsed) {
        Some(remaining) if !remaining.is_zero() => Unreachable::Hold { remaining },
        _ => Unreachable::WriteOff,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(name: &str, weight: u32) -> ProviderView {
        ProviderView::new(name, weight)
    }

    fn picks(picker: &mut WeightedPicker, providers: &[ProviderView], n: usize) -> Vec<String> {
        let now = Instant::now();
        (0..n)
            .filter_map(|_| picker.pick(providers, &BTreeSet::new(), now))
            .collect()
    }

    fn count(picked: &[String], name: &str) -> usize {
        picked.iter().filter(|p| p.as_str() == name).count()
    }

    #[test]
    fn weights_five_one_one_give_the_nginx_sequence() {
        let providers = [provider("a", 5), provider("b", 1), provider("c", 1)];
        let picked = picks(&mut WeightedPicker::new(), &providers, 7);
        assert_eq!(picked, ["a", "a", "b", "a", "c", "a", "a"]);
    }

    #[test]
    fn three_to_one_over_four_hundred_is_three_hundred_to_one_hundred() {
        let providers = [provider("east", 3), provider("west", 1)];
        let picked = picks(&mut WeightedPicker::new(), &providers, 400);
        assert_eq!(count(&picked, "east"), 300);
        assert_eq!(count(&picked, "west"), 100);
    }

    #[test]
    fn excluding_the_provider_that_answered_full_yields_the_other() {
        let providers = [provider("east", 3), provider("west", 1)];
        let mut picker = WeightedPicker::new();
        let now = Instant::now();
        let first = picker.pick(&providers, &BTreeSet::new(), now);
        assert_eq!(first.as_deref(), Some("east"));
        let full = BTreeSet::from(["east".to_owned()]);
        assert_eq!(picker.pick(&providers, &full, now).as_deref(), Some("west"));
    }

    #[test]
    fn all_excluded_means_wait() {
        let providers = [provider("east", 3), provider("west", 1)];
        let all = BTreeSet::from(["east".to_owned(), "west".to_owned()]);
        let mut picker = WeightedPicker::new();
        assert_eq!(picker.pick(&providers, &all, Instant::now()), None);
        assert_eq!(picker.pick(&[], &BTreeSet::new(), Instant::now()), None);
    }

    #[test]
    fn drained_unreachable_zero_weight_and_at_capacity_providers_get_nothing() {
        let now = Instant::now();
        let drained = ProviderView {
            disabled: true,
            ..provider("drained", 9)
        };
        let gone = ProviderView {
            reachable: false,
            ..provider("gone", 9)
        };
        let zero = provider("zero", 0);
        let at_max = ProviderView {
            max_runners: Some(2),
            used: 2,
            ..provider("at-max", 9)
        };
        let open = provider("open", 1);
        let providers = [drained, gone, zero, at_max, open];
        let picked = picks(&mut WeightedPicker::new(), &providers, 20);
        assert_eq!(count(&picked, "open"), 20);
        assert!(!providers[3].has_room(now));
        let below_max = ProviderView {
            used: 1,
            ..providers[3].clone()
        };
        assert!(below_max.has_room(now));
    }

    #[test]
    fn a_provider_that_answered_full_is_skipped_until_its_backoff_ends() {
        let now = Instant::now();
        let later = now + Duration::from_secs(10);
        let full = ProviderView {
            full_until: Some(later),
            ..provider("full", 5)
        };
        let providers = [full, provider("other", 1)];
        let mut picker = WeightedPicker::new();
        let none = BTreeSet::new();
        assert_eq!(
            picker.pick(&providers, &none, now).as_deref(),
            Some("other")
        );
        assert_eq!(
            picker.pick(&providers, &none, later).as_deref(),
            Some("full")
        );
    }

    #[test]
    fn reordering_the_list_keeps_the_interleaving() {
        let forward = [provider("a", 3), provider("b", 1)];
        let backward = [provider("b", 1), provider("a", 3)];
        let mut picker = WeightedPicker::new();
        let mut picked = picks(&mut picker, &forward, 2);
        picked.extend(picks(&mut picker, &backward, 2));
        assert_eq!(picked, ["a", "a", "b", "a"]);
    }

    #[test]
    fn a_removed_provider_is_forgotten() {
        let mut picker = WeightedPicker::new();
        picks(&mut picker, &[provider("a", 1), provider("b", 1)], 3);
        picks(&mut picker, &[provider("b", 1)], 1);
        let names: Vec<&str> = picker.current.keys().map(String::as_str).collect();
        assert_eq!(names, ["b"]);
    }

    #[test]
    fn unreachable_workloads_are_held_then_written_off() {
        let since = Instant::now();
        let hold = DEFAULT_UNREACHABLE_HOLD;
        assert_eq!(
            unreachable_verdict(since, since, hold),
            Unreachable::Hold { remaining: hold }
        );
        let minute = since + Duration::from_secs(60);
        assert_eq!(
            unreachable_verdict(since, minute, hold),
            Unreachable::Hold {
                remaining: Duration::from_secs(240)
            }
        );
        assert_eq!(
            unreachable_verdict(since, since + hold, hold),
            Unreachable::WriteOff
        );
        assert_eq!(
            unreachable_verdict(since, since + hold + Duration::from_secs(1), hold),
            Unreachable::WriteOff
        );
    }

    #[test]
    fn a_now_before_the_outage_counts_as_no_time_spent() {
        let now = Instant::now();
        let since = now + Duration::from_secs(5);
        let hold = Duration::from_secs(30);
        assert_eq!(
            unreachable_verdict(since, now, hold),
            Unreachable::Hold { remaining: hold }
        );
        assert_eq!(
            unreachable_verdict(since, now, Duration::ZERO),
            Unreachable::WriteOff
        );
    }
}
