//! Properties of fair shares: only admissible jobs start, no repository starves another.

use std::collections::BTreeMap;

use jr_placement::quota::{Admission, Quotas, Usage, WaitReason, WaitingJob, admit, next_fair};
use proptest::prelude::*;

const REPOSITORIES: [(&str, &str); 4] = [
    ("acme/web", "acme"),
    ("acme/api", "acme"),
    ("other/web", "other"),
    ("solo/one", "solo"),
];

fn waiting_job(repo: usize, seq: u64) -> WaitingJob {
    let (repository, owner) = REPOSITORIES[repo % REPOSITORIES.len()];
    WaitingJob {
        repository: repository.into(),
        owner: owner.into(),
        seq,
    }
}

fn any_quotas() -> impl Strategy<Value = Quotas> {
    (
        proptest::option::of(0usize..5),
        proptest::option::of(0usize..8),
        proptest::collection::btree_map(0usize..4, 0u32..4, 0..4),
    )
        .prop_map(|(per_repository, per_owner, weights)| Quotas {
            per_repository,
            per_owner,
            weights: weights
                .into_iter()
                .map(|(r, w)| (REPOSITORIES[r].0.to_owned(), w))
                .collect(),
        })
}

fn any_usage() -> impl Strategy<Value = Usage> {
    proptest::collection::vec(0usize..4, 0..12).prop_map(|started| {
        let mut usage = Usage::default();
        for repo in started {
            let (repository, owner) = REPOSITORIES[repo];
            usage.start(repository, owner);
        }
        usage
    })
}

fn any_waiting() -> impl Strategy<Value = Vec<WaitingJob>> {
    proptest::collection::vec((0usize..4, 0u64..50), 0..12).prop_map(|jobs| {
        jobs.into_iter()
            .map(|(repo, seq)| waiting_job(repo, seq))
            .collect()
    })
}

proptest! {
    #[test]
    fn only_an_admissible_job_is_picked_and_one_is_whenever_any_is(
        quotas in any_quotas(), usage in any_usage(), waiting in any_waiting(),
    ) {
        let admissible = |job: &WaitingJob| admit(&quotas, &usage, &job.repository, &job.owner) == Admission::Admit;
        match next_fair(&waiting, &usage, &quotas) {
            Some(index) => {
                let picked = waiting.get(index);
                prop_assert!(picked.is_some_and(admissible));
            }
            None => prop_assert!(!waiting.iter().any(admissible)),
        }
    }

    #[test]
    fn the_pick_has_the_lowest_weighted_share_then_the_lowest_seq(
        quotas in any_quotas(), usage in any_usage(), waiting in any_waiting(),
    ) {
        let share = |job: &WaitingJob| {
            usage.repository(&job.repository) as f64 / f64::from(quotas.weight(&job.repository))
        };
        if let Some(picked) = next_fair(&waiting, &usage, &quotas).and_then(|i| waiting.get(i)) {
            for other in waiting.iter().filter(|j| admit(&quotas, &usage, &j.repository, &j.owner) == Admission::Admit) {
                prop_assert!(share(picked) <= share(other));
                if share(picked) == share(other) {
                    prop_assert!(picked.seq <= other.seq);
                }
            }
        }
    }

    #[test]
    fn picks_are_deterministic_and_ignore_queue_order_when_seqs_differ(
        quotas in any_quotas(), usage in any_usage(), waiting in any_waiting(), rotate in 0usize..12,
    ) {
        let picked = next_fair(&waiting, &usage, &quotas);
        prop_assert_eq!(picked, next_fair(&waiting, &usage, &quotas));
        let mut seqs: Vec<u64> = waiting.iter().map(|j| j.seq).collect();
        seqs.sort_unstable();
        seqs.dedup();
        if seqs.len() == waiting.len() && !waiting.is_empty() {
            let mut rotated = waiting.clone();
            rotated.rotate_left(rotate % waiting.len());
            let again = next_fair(&rotated, &usage, &quotas).and_then(|i| rotated.get(i));
            prop_assert_eq!(picked.and_then(|i| waiting.get(i)), again);
        }
    }

    #[test]
    fn a_single_job_is_not_starved_by_two_hundred_of_another_repository(
        running in 0usize..20, b_seq in 0u64..=200,
    ) {
        // A has 200 jobs queued, B one; both run the same number of jobs.
        let mut waiting: Vec<WaitingJob> = (0..=200u64)
            .filter(|&seq| seq != b_seq)
            .map(|seq| WaitingJob { repository: "a/many".into(), owner: "a".into(), seq })
            .collect();
        waiting.push(WaitingJob { repository: "b/one".into(), owner: "b".into(), seq: b_seq });
        let quotas = Quotas::default();
        let mut usage = Usage::default();
        for _ in 0..running {
            usage.start("a/many", "a");
            usage.start("b/one", "b");
        }
        let mut a_picks_before_b = 0;
        loop {
            let Some(index) = next_fair(&waiting, &usage, &quotas) else {
                return Err(TestCaseError::fail("nothing picked"));
            };
            let started = waiting.remove(index);
            if started.repository == "b/one" {
                break;
            }
            a_picks_before_b += 1;
            usage.start(&started.repository, &started.owner);
        }
        prop_assert!(a_picks_before_b <= 1, "{a_picks_before_b} jobs of a started first");
    }

    #[test]
    fn when_a_slot_frees_the_repository_running_less_gets_it(busy in 1usize..50, quiet in 0usize..50) {
        prop_assume!(quiet < busy);
        let waiting = [
            WaitingJob { repository: "busy/repo".into(), owner: "busy".into(), seq: 0 },
            WaitingJob { repository: "quiet/repo".into(), owner: "quiet".into(), seq: 1 },
        ];
        let mut usage = Usage::default();
        (0..busy).for_each(|_| usage.start("busy/repo", "busy"));
        (0..quiet).for_each(|_| usage.start("quiet/repo", "quiet"));
        prop_assert_eq!(next_fair(&waiting, &usage, &Quotas::default()), Some(1));
    }
}

fn job(repository: &str, seq: u64) -> WaitingJob {
    let owner = repository.split('/').next().unwrap_or_default().to_owned();
    WaitingJob {
        repository: repository.to_owned(),
        owner,
        seq,
    }
}

fn usage(running: &[(&str, usize)]) -> Usage {
    let mut usage = Usage::default();
    for &(repository, count) in running {
        let owner = repository.split('/').next().unwrap_or_default();
        for _ in 0..count {
            usage.start(repository, owner);
        }
    }
    usage
}

#[test]
fn without_quotas_every_job_is_admitted() {
    let busy = usage(&[("acme/web", 1000)]);
    assert_eq!(
        admit(&Quotas::default(), &busy, "acme/web", "acme"),
        Admission::Admit
    );
}

#[test]
fn a_repository_at_its_quota_waits_with_the_quota_named() {
    let quotas = Quotas {
        per_repository: Some(2),
        ..Quotas::default()
    };
    let running = usage(&[("acme/web", 2)]);
    let Admission::Wait { reason } = admit(&quotas, &running, "acme/web", "acme") else {
        panic!("expected to wait");
    };
    assert_eq!(reason.kind(), "repository_quota");
    assert_eq!(
        reason.to_string(),
        "repository acme/web runs 2 of its quota of 2 jobs"
    );
    assert_eq!(
        admit(&quotas, &running, "acme/api", "acme"),
        Admission::Admit
    );
}

#[test]
fn an_owner_at_its_quota_waits_across_its_repositories() {
    let quotas = Quotas {
        per_owner: Some(3),
        ..Quotas::default()
    };
    let running = usage(&[("acme/web", 2), ("acme/api", 1)]);
    let waits = admit(&quotas, &running, "acme/docs", "acme");
    assert!(matches!(
        waits,
        Admission::Wait { reason: WaitReason::OwnerQuota { ref owner, running: 3, limit: 3 } }
            if owner == "acme"
    ));
    assert_eq!(
        admit(&quotas, &running, "other/web", "other"),
        Admission::Admit
    );
}

#[test]
fn a_quota_of_zero_makes_every_job_wait() {
    let quotas = Quotas {
        per_repository: Some(0),
        ..Quotas::default()
    };
    assert_ne!(
        admit(&quotas, &Usage::default(), "acme/web", "acme"),
        Admission::Admit
    );
    assert_eq!(
        next_fair(&[job("acme/web", 1)], &Usage::default(), &quotas),
        None
    );
}

#[test]
fn the_repository_with_fewer_running_jobs_goes_first() {
    let waiting = [job("big/repo", 1), job("big/repo", 2), job("small/repo", 3)];
    let running = usage(&[("big/repo", 4), ("small/repo", 1)]);
    assert_eq!(next_fair(&waiting, &running, &Quotas::default()), Some(2));
}

#[test]
fn equal_shares_go_to_the_earliest_job() {
    let waiting = [job("b/repo", 7), job("a/repo", 5), job("b/repo", 3)];
    assert_eq!(
        next_fair(&waiting, &Usage::default(), &Quotas::default()),
        Some(2)
    );
}

#[test]
fn an_over_quota_repository_is_passed_over() {
    let quotas = Quotas {
        per_repository: Some(1),
        ..Quotas::default()
    };
    let waiting = [job("busy/repo", 1), job("idle/repo", 9)];
    let running = usage(&[("busy/repo", 1), ("idle/repo", 0)]);
    assert_eq!(next_fair(&waiting, &running, &quotas), Some(1));
}

#[test]
fn weights_three_to_one_give_three_slots_to_one() {
    let quotas = Quotas {
        weights: BTreeMap::from([("heavy/repo".to_owned(), 3)]),
        ..Quotas::default()
    };
    let mut waiting: Vec<WaitingJob> = (0..20)
        .map(|seq| {
            job(
                if seq % 2 == 0 {
                    "heavy/repo"
                } else {
                    "light/repo"
                },
                seq,
            )
        })
        .collect();
    let mut running = Usage::default();
    for _ in 0..8 {
        let Some(index) = next_fair(&waiting, &running, &quotas) else {
            panic!("a job should start");
        };
        let started = waiting.remove(index);
        running.start(&started.repository, &started.owner);
    }
    assert_eq!(running.repository("heavy/repo"), 6);
    assert_eq!(running.repository("light/repo"), 2);
}

#[test]
fn finishing_never_goes_below_zero_and_drops_empty_counts() {
    let mut running = usage(&[("acme/web", 1)]);
    running.finish("acme/web", "acme");
    running.finish("acme/web", "acme");
    assert_eq!(running, Usage::default());
}

#[test]
fn weight_zero_counts_as_one() {
    let quotas = Quotas {
        weights: BTreeMap::from([("a/b".to_owned(), 0)]),
        ..Quotas::default()
    };
    assert_eq!(quotas.weight("a/b"), 1);
    assert_eq!(quotas.weight("c/d"), 1);
}
