//! Properties of provider placement: shares follow weights, only providers with room are picked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use jr_placement::provider::{ProviderView, Unreachable, WeightedPicker, unreachable_verdict};
use proptest::prelude::*;

fn open(name: String, weight: u32) -> ProviderView {
    ProviderView::new(name, weight)
}

/// A provider in any state, with `full_until` up to 3 s either side of `now`.
fn any_provider(index: usize, now: Instant) -> impl Strategy<Value = ProviderView> {
    (
        0u32..5,
        proptest::option::of(0usize..4),
        any::<bool>(),
        0usize..5,
        any::<bool>(),
        proptest::option::of(-3i64..3),
    )
        .prop_map(
            move |(weight, max_runners, disabled, used, reachable, full)| ProviderView {
                name: format!("p{index}"),
                weight,
                max_runners,
                disabled,
                used,
                reachable,
                full_until: full.map(|secs| {
                    let offset = Duration::from_secs(secs.unsigned_abs());
                    if secs < 0 {
                        now.checked_sub(offset).unwrap_or(now)
                    } else {
                        now + offset
                    }
                }),
            },
        )
}

fn any_providers(now: Instant) -> impl Strategy<Value = Vec<ProviderView>> {
    (0usize..6).prop_flat_map(move |n| (0..n).map(|i| any_provider(i, now)).collect::<Vec<_>>())
}

proptest! {
    #[test]
    fn each_share_is_within_one_pick_of_its_weight(
        weights in proptest::collection::vec(1u32..20, 1..6),
        picks in 0usize..600,
    ) {
        let providers: Vec<ProviderView> =
            weights.iter().enumerate().map(|(i, &w)| open(format!("p{i}"), w)).collect();
        let mut picker = WeightedPicker::new();
        let now = Instant::now();
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for _ in 0..picks {
            let chosen = picker.pick(&providers, &BTreeSet::new(), now);
            prop_assert!(chosen.is_some());
            *counts.entry(chosen.unwrap_or_default()).or_insert(0) += 1;
        }
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        for provider in &providers {
            let count = counts.get(&provider.name).copied().unwrap_or(0);
            // |count − n·w/Σw| ≤ 1, multiplied through by Σw.
            let expected = picks as u64 * u64::from(provider.weight);
            prop_assert!(
                (count * total).abs_diff(expected) <= total,
                "{} picked {count} times of {picks}, weight {} of {total}",
                provider.name, provider.weight,
            );
        }
    }

    #[test]
    fn only_providers_with_room_that_are_not_excluded_are_picked(
        (now, rounds) in Just(Instant::now()).prop_flat_map(|now| {
            let round = (any_providers(now), proptest::collection::btree_set(0usize..6, 0..3));
            (Just(now), proptest::collection::vec(round, 1..20))
        }),
    ) {
        let mut picker = WeightedPicker::new();
        for (providers, excluded) in rounds {
            let exclude: BTreeSet<String> = excluded.iter().map(|i| format!("p{i}")).collect();
            let eligible: Vec<&ProviderView> = providers
                .iter()
                .filter(|p| p.has_room(now) && !exclude.contains(&p.name))
                .collect();
            match picker.pick(&providers, &exclude, now) {
                None => prop_assert!(eligible.is_empty()),
                Some(name) => {
                    prop_assert!(eligible.iter().any(|p| p.name == name), "{name} not eligible");
                    prop_assert!(!exclude.contains(&name));
                }
            }
        }
    }

    #[test]
    fn the_same_calls_give_the_same_picks(
        (now, rounds) in Just(Instant::now()).prop_flat_map(|now| {
            (Just(now), proptest::collection::vec(any_providers(now), 1..20))
        }),
    ) {
        let (mut first, mut second) = (WeightedPicker::new(), WeightedPicker::new());
        for providers in rounds {
            let none = BTreeSet::new();
            prop_assert_eq!(first.pick(&providers, &none, now), second.pick(&providers, &none, now));
        }
    }

    #[test]
    fn holds_end_exactly_after_the_hold(since_offset in 0u64..1000, hold in 0u64..1000, at in 0u64..2000) {
        let base = Instant::now();
        let since = base + Duration::from_millis(since_offset);
        let now = base + Duration::from_millis(at);
        let hold = Duration::from_millis(hold);
        let elapsed = now.saturating_duration_since(since);
        match unreachable_verdict(since, now, hold) {
            Unreachable::WriteOff => prop_assert!(elapsed >= hold),
            Unreachable::Hold { remaining } => {
                prop_assert!(elapsed < hold);
                prop_assert_eq!(remaining + elapsed, hold);
            }
        }
    }
}

#[test]
fn three_to_one_is_seventy_five_to_twenty_five_within_ten_percent_over_four_hundred() {
    let providers = [open("east".into(), 3), open("west".into(), 1)];
    let mut picker = WeightedPicker::new();
    let now = Instant::now();
    let east = (0..400)
        .filter_map(|_| picker.pick(&providers, &BTreeSet::new(), now))
        .filter(|name| name == "east")
        .count();
    assert!((270..=330).contains(&east), "east got {east} of 400");
}

#[test]
fn a_full_answer_moves_the_job_to_the_next_provider_and_all_full_means_wait() {
    let providers = [
        open("east".into(), 1),
        open("west".into(), 1),
        open("north".into(), 1),
    ];
    let mut picker = WeightedPicker::new();
    let now = Instant::now();
    let mut full = BTreeSet::new();
    let mut tried = Vec::new();
    // Every provider answers "full" in turn; the job tries each once, then waits.
    while let Some(name) = picker.pick(&providers, &full, now) {
        tried.push(name.clone());
        full.insert(name);
    }
    tried.sort();
    assert_eq!(tried, ["east", "north", "west"]);
}
