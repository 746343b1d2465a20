//! The burst tier: parsing the runtime value, the stable bucket, protected jobs, tier choice.

use std::time::Duration;

use jr_placement::tier::{
    BurstProblem, BurstSetting, DefaultReason, JobKey, ProtectedMatcher, TierChoice, burst_bucket,
    choose_tier, parse_burst,
};
use proptest::prelude::*;

fn on(percent: u8) -> BurstSetting {
    BurstSetting {
        enabled: true,
        percent,
    }
}

fn job(repository: &str, workflow: &str, job: &str, labels: &[&str]) -> JobKey {
    JobKey {
        repository: repository.into(),
        workflow: workflow.into(),
        job: job.into(),
        labels: labels.iter().map(|&l| l.to_owned()).collect(),
    }
}

/// Lets a job through every check except the bucket: burst if its bucket is below the percent.
fn under_pressure(
    setting: &BurstSetting,
    protected: &[ProtectedMatcher],
    job: &JobKey,
) -> TierChoice {
    choose_tier(setting, protected, job, true, Duration::ZERO, None)
}

#[test]
fn accepted_forms_parse_without_warning() {
    let cases = [
        ("off", BurstSetting::OFF),
        (" OFF\n", BurstSetting::OFF),
        ("on", on(100)),
        ("On", on(100)),
        ("on:30", on(30)),
        ("ON:30%", on(30)),
        ("on: 30 %", on(30)),
        ("30", on(30)),
        ("\t30%  ", on(30)),
        ("0", on(0)),
        ("100%", on(100)),
        ("007", on(7)),
    ];
    for (raw, expected) in cases {
        assert_eq!(parse_burst(raw), (expected, None), "{raw:?}");
    }
}

#[test]
fn invalid_values_fall_back_to_off_with_a_warning_naming_them() {
    let cases = [
        ("", BurstProblem::Empty),
        ("   ", BurstProblem::Empty),
        ("on:150", BurstProblem::PercentOutOfRange),
        ("101%", BurstProblem::PercentOutOfRange),
        ("99999999999999999999999", BurstProblem::PercentOutOfRange),
        ("-5", BurstProblem::Unrecognised),
        ("+5", BurstProblem::Unrecognised),
        ("abc", BurstProblem::Unrecognised),
        ("on:3.5", BurstProblem::Unrecognised),
        ("on:", BurstProblem::Unrecognised),
        ("off:30", BurstProblem::Unrecognised),
        ("%", BurstProblem::Unrecognised),
        ("30%%", BurstProblem::Unrecognised),
        ("true", BurstProblem::Unrecognised),
    ];
    for (raw, problem) in cases {
        let (setting, warning) = parse_burst(raw);
        assert_eq!(setting, BurstSetting::OFF, "{raw:?}");
        let warning = warning.unwrap_or_else(|| panic!("{raw:?} should warn"));
        assert_eq!(warning.problem, problem, "{raw:?}");
        assert_eq!(warning.input, raw.trim());
    }
    let (_, warning) = parse_burst(" on:150 ");
    let text = warning.map(|w| w.to_string()).unwrap_or_default();
    assert_eq!(
        text,
        r#"invalid burst setting "on:150": the percentage is above 100; the burst tier is off"#
    );
}

#[test]
fn a_huge_bad_value_is_cut_in_the_warning() {
    let raw = "x".repeat(10_000);
    let (_, warning) = parse_burst(&raw);
    assert_eq!(warning.map(|w| w.input.len()), Some(64));
}

#[test]
fn buckets_are_pinned_forever() {
    // Computed independently from the documented construction; changing them moves jobs.
    assert_eq!(burst_bucket("acme/web", "ci.yml", "build"), 94);
    assert_eq!(burst_bucket("acme/web", "ci.yml", "test"), 59);
    assert_eq!(burst_bucket("a/b", "c", ""), 69);
    assert_eq!(burst_bucket("a", "b/c", ""), 87);
    assert_eq!(burst_bucket("", "", ""), 85);
    assert_eq!(burst_bucket("ünï/cödé", "wf", "jöb"), 15);
}

#[test]
fn protected_matchers_match_given_fields_only() {
    let release = ProtectedMatcher {
        repository: Some("acme/*".into()),
        job: Some("release*".into()),
        ..ProtectedMatcher::default()
    };
    assert!(release.matches(&job("acme/web", "ci.yml", "release-arm", &[])));
    assert!(release.matches(&job("ACME/web", "other.yml", "Release", &["x"])));
    assert!(!release.matches(&job("acme/web", "ci.yml", "build", &[])));
    assert!(!release.matches(&job("other/web", "ci.yml", "release", &[])));

    let gpu = ProtectedMatcher {
        labels: vec!["gpu".into(), "arch-*".into()],
        ..Default::default()
    };
    assert!(gpu.matches(&job("a/b", "w", "j", &["ubuntu", "gpu", "arch-arm64"])));
    assert!(!gpu.matches(&job("a/b", "w", "j", &["gpu"])));

    assert!(ProtectedMatcher::default().matches(&job("a/b", "w", "j", &[])));
}

#[test]
fn each_check_keeps_the_job_home_for_its_own_reason() {
    let build = job("acme/web", "ci.yml", "test", &["pod"]); // bucket 59
    let protect = ProtectedMatcher {
        labels: vec!["pod".into()],
        ..Default::default()
    };
    let home = |reason| TierChoice::Default(reason);
    assert_eq!(
        under_pressure(&BurstSetting::OFF, &[], &build),
        home(DefaultReason::BurstOff)
    );
    assert_eq!(
        under_pressure(
            &on(100),
            &[
                ProtectedMatcher {
                    job: Some("x".into()),
                    ..Default::default()
                },
                protect
            ],
            &build
        ),
        home(DefaultReason::Protected { matcher: 1 })
    );
    assert_eq!(
        under_pressure(&on(59), &[], &build),
        home(DefaultReason::OutsidePercentage {
            bucket: 59,
            percent: 59
        })
    );
    assert_eq!(under_pressure(&on(60), &[], &build), TierChoice::Burst);
    let roomy = choose_tier(&on(60), &[], &build, false, Duration::from_secs(30), None);
    assert_eq!(roomy, home(DefaultReason::DefaultHasRoom));
}

#[test]
fn a_long_wait_sends_the_job_to_burst_even_when_the_default_has_room() {
    let build = job("acme/web", "ci.yml", "test", &[]);
    let threshold = Some(Duration::from_secs(60));
    let at = |wait| {
        choose_tier(
            &on(100),
            &[],
            &build,
            false,
            Duration::from_secs(wait),
            threshold,
        )
    };
    assert_eq!(at(60), TierChoice::Default(DefaultReason::DefaultHasRoom));
    assert_eq!(at(61), TierChoice::Burst);
}

fn any_job() -> impl Strategy<Value = JobKey> {
    (
        "[a-z]{1,6}/[a-z]{1,6}",
        "[a-z.]{1,8}",
        "[a-z-]{1,8}",
        proptest::collection::vec("[a-z]{1,4}", 0..3),
    )
        .prop_map(|(repository, workflow, job, labels)| JobKey {
            repository,
            workflow,
            job,
            labels,
        })
}

fn any_setting() -> impl Strategy<Value = BurstSetting> {
    (any::<bool>(), 0u8..=100).prop_map(|(enabled, percent)| BurstSetting { enabled, percent })
}

fn any_matcher() -> impl Strategy<Value = ProtectedMatcher> {
    let glob = || proptest::option::of("[a-z*/]{0,4}");
    (
        glob(),
        glob(),
        glob(),
        proptest::collection::vec("[a-z*]{1,3}", 0..2),
    )
        .prop_map(|(repository, workflow, job, labels)| ProtectedMatcher {
            repository,
            workflow,
            job,
            labels,
        })
}

proptest! {
    #[test]
    fn any_input_parses_to_a_valid_setting_or_off_with_a_warning(raw in "\\PC{0,20}|(on:)?[ 0-9%.+-]{0,6}") {
        let (setting, warning) = parse_burst(&raw);
        prop_assert!(setting.percent <= 100);
        if warning.is_some() {
            prop_assert_eq!(setting, BurstSetting::OFF);
        }
    }

    #[test]
    fn every_percentage_round_trips_in_every_form(percent in 0u8..=100, upper in any::<bool>()) {
        for form in [format!("{percent}"), format!("{percent}%"), format!(" on:{percent} "), format!("on:{percent}%")] {
            let form = if upper { form.to_uppercase() } else { form };
            prop_assert_eq!(parse_burst(&form), (on(percent), None));
        }
    }

    #[test]
    fn buckets_are_below_one_hundred(r in "\\PC{0,20}", w in "\\PC{0,20}", j in "\\PC{0,20}") {
        prop_assert!(burst_bucket(&r, &w, &j) < 100);
    }

    #[test]
    fn protected_jobs_never_burst(
        setting in any_setting(), mut protected in proptest::collection::vec(any_matcher(), 0..3),
        job in any_job(), full in any::<bool>(), wait in 0u64..100, threshold in proptest::option::of(0u64..100),
    ) {
        protected.push(ProtectedMatcher { repository: Some(job.repository.clone()), ..Default::default() });
        let choice = choose_tier(&setting, &protected, &job, full, Duration::from_secs(wait), threshold.map(Duration::from_secs));
        prop_assert_ne!(choice, TierChoice::Burst);
    }

    #[test]
    fn off_never_bursts_and_the_same_job_gets_the_same_answer(
        setting in any_setting(), protected in proptest::collection::vec(any_matcher(), 0..3),
        job in any_job(), full in any::<bool>(), wait in 0u64..100, threshold in proptest::option::of(0u64..100),
    ) {
        let (wait, threshold) = (Duration::from_secs(wait), threshold.map(Duration::from_secs));
        let first = choose_tier(&setting, &protected, &job, full, wait, threshold);
        prop_assert_eq!(first, choose_tier(&setting, &protected, &job.clone(), full, wait, threshold));
        let off = BurstSetting { enabled: false, ..setting };
        prop_assert_eq!(choose_tier(&off, &protected, &job, full, wait, threshold), TierChoice::Default(DefaultReason::BurstOff));
        if !full && threshold.is_none_or(|t| wait <= t) {
            prop_assert_ne!(first, TierChoice::Burst);
        }
    }

    #[test]
    fn raising_the_percentage_only_adds_jobs_to_burst(job in any_job(), low in 0u8..=100, high in 0u8..=100) {
        let (low, high) = (low.min(high), low.max(high));
        if under_pressure(&on(low), &[], &job) == TierChoice::Burst {
            prop_assert_eq!(under_pressure(&on(high), &[], &job), TierChoice::Burst);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn the_burst_share_of_many_distinct_jobs_is_the_percentage_within_five(
        percent in 0u8..=100, seed in any::<u64>(),
    ) {
        // 4000 jobs: the binomial spread at 50 % is 0.8 points, so ±5 is over six deviations.
        let jobs = 4000;
        let burst = (0..jobs)
            .map(|i| job(&format!("org{}/repo{i}", seed % 97), "ci.yml", &format!("job-{seed}-{i}"), &[]))
            .filter(|j| under_pressure(&on(percent), &[], j) == TierChoice::Burst)
            .count();
        let share = burst as f64 * 100.0 / f64::from(jobs);
        prop_assert!((share - f64::from(percent)).abs() <= 5.0, "{share:.1} % at {percent} %");
    }
}

#[test]
fn every_percentage_takes_its_share_of_two_thousand_fixed_jobs_within_five() {
    let jobs: Vec<JobKey> = (0..2000)
        .map(|i| {
            job(
                &format!("owner{}/repo{i}", i % 13),
                "build.yml",
                "test",
                &[],
            )
        })
        .collect();
    for percent in 0..=100u8 {
        let burst = jobs
            .iter()
            .filter(|j| under_pressure(&on(percent), &[], j) == TierChoice::Burst)
            .count();
        let share = burst as f64 / 20.0;
        assert!(
            (share - f64::from(percent)).abs() <= 5.0,
            "{share:.1} % at {percent} %"
        );
    }
}

#[test]
fn thirty_percent_takes_thirty_percent_of_two_thousand_jobs_and_the_same_ones_again() {
    let jobs: Vec<JobKey> = (0..2000)
        .map(|i| {
            job(
                &format!("acme/repo{}", i % 37),
                "ci.yml",
                &format!("job{i}"),
                &[],
            )
        })
        .collect();
    let run = || -> Vec<bool> {
        jobs.iter()
            .map(|j| under_pressure(&on(30), &[], j) == TierChoice::Burst)
            .collect()
    };
    let first = run();
    let share = first.iter().filter(|&&b| b).count();
    assert!((500..=700).contains(&share), "{share} of 2000");
    assert_eq!(first, run());
}
