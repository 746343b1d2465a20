use super::*;
use jr_bus::intake::Blocked;
use proptest::prelude::*;

fn name(n: &str) -> BackendName {
    BackendName::new(n.to_owned()).expect("valid backend name")
}

fn labels(l: &[&str]) -> Vec<String> {
    l.iter().map(|s| (*s).to_owned()).collect()
}

fn open(names: &[&str]) -> BTreeSet<BackendName> {
    names.iter().map(|n| name(n)).collect()
}

/// Pod `[pod, self-hosted]`, vm `[vm, self-hosted]`, `self-hosted` jobs to pod by default.
fn shared_label_router() -> Router {
    Router::from_parts(
        vec![
            (name("pod"), labels(&["pod", "self-hosted"])),
            (name("vm"), labels(&["self-hosted", "vm"])),
        ],
        vec![],
        Some(name("pod")),
    )
}

fn room(room: usize, lookahead: usize) -> Condition {
    Condition::Room { room, lookahead }
}

/// Every non-empty subset of `declared` the forge could hand out, and where it routes.
fn routed_sets(router: &Router, declared: &[String]) -> Vec<(Vec<String>, BackendName)> {
    let n = declared.len();
    (1_u32..(1 << n))
        .filter_map(|mask| {
            let set: Vec<String> = (0..n)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| declared[i].clone())
                .collect();
            router.route_of(&set).map(|b| (set, b))
        })
        .collect()
}

#[test]
fn every_label_is_declared_while_every_backend_takes_work() {
    let r = shared_label_router();
    assert_eq!(
        labels_to_declare(&r, &open(&["pod", "vm"])),
        labels(&["pod", "self-hosted", "vm"])
    );
}

#[test]
fn a_backend_without_a_live_worker_loses_its_labels_and_the_label_it_is_routed_by() {
    let r = shared_label_router();
    // `self-hosted` alone goes to pod: withdrawn with pod's own label.
    assert_eq!(labels_to_declare(&r, &open(&["vm"])), labels(&["vm"]));
    // `self-hosted` alone still goes to pod, which takes work: vm loses only its own label.
    assert_eq!(
        labels_to_declare(&r, &open(&["pod"])),
        labels(&["pod", "self-hosted"])
    );
    assert!(labels_to_declare(&r, &open(&[])).is_empty());
}

#[test]
fn a_rule_that_sends_a_shared_label_elsewhere_keeps_it_with_that_backend() {
    let r = Router::from_parts(
        vec![
            (name("pod"), labels(&["pod", "self-hosted"])),
            (name("vm"), labels(&["self-hosted", "vm"])),
        ],
        vec![("self-hosted".to_owned(), name("vm"))],
        Some(name("pod")),
    );
    // `self-hosted` alone goes to vm by the rule; `[pod, self-hosted]` only pod serves.
    assert_eq!(
        labels_to_declare(&r, &open(&["vm"])),
        labels(&["self-hosted", "vm"])
    );
    assert_eq!(labels_to_declare(&r, &open(&["pod"])), labels(&["pod"]));
}

#[test]
fn the_room_is_the_smallest_among_the_backends_the_declared_labels_reach() {
    let r = shared_label_router();
    let mut d = Declarer::new(&r, r.declared_labels().to_vec());
    let t0 = Instant::now();
    let conditions: BTreeMap<_, _> = [
        (name("pod"), Condition::Blocked(Blocked::NoWorker)),
        (name("vm"), room(3, 4)),
    ]
    .into_iter()
    .collect();
    // Pod's labels are still declared: nothing is fetched until they are withdrawn.
    let step = d.step(&r, &conditions, t0);
    assert_eq!(step.room, 0);
    assert_eq!(
        step.declare,
        Some(Declare {
            labels: labels(&["vm"])
        })
    );
    d.declared(&r, labels(&["vm"]), t0);
    let step = d.step(&r, &conditions, t0 + Duration::from_millis(1));
    assert_eq!(step.declare, None);
    assert_eq!(step.room, 3, "vm fetches while pod has no worker");
}

#[test]
fn labels_come_back_only_with_half_the_lookahead_free_and_not_faster_than_the_interval() {
    let r = shared_label_router();
    let mut d = Declarer::new(&r, r.declared_labels().to_vec());
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let c = |pod: Condition| -> BTreeMap<BackendName, Condition> {
        [(name("pod"), pod), (name("vm"), room(4, 4))]
            .into_iter()
            .collect()
    };
    let step = d.step(&r, &c(room(0, 4)), at(0));
    let withdrawn = step.declare.expect("pod full: withdrawn at once").labels;
    assert_eq!(withdrawn, labels(&["vm"]));
    d.declared(&r, withdrawn, at(0));
    // One slot of four: not yet.
    assert_eq!(d.step(&r, &c(room(1, 4)), at(1000)).declare, None);
    // Two of four, but only 100 ms after the last Declare: not yet.
    d.declared(&r, labels(&["vm"]), at(1000));
    assert_eq!(d.step(&r, &c(room(2, 4)), at(1100)).declare, None);
    let step = d.step(&r, &c(room(2, 4)), at(1600));
    assert_eq!(
        step.declare.map(|d| d.labels),
        Some(labels(&["pod", "self-hosted", "vm"]))
    );
    // Until the forge accepted it, the room is what the old declaration reaches.
    assert_eq!(step.room, 4);
}

#[test]
fn an_unchanged_declaration_is_applied_again_now_and_then() {
    let r = shared_label_router();
    let mut d = Declarer::new(&r, r.declared_labels().to_vec());
    let t0 = Instant::now();
    let c: BTreeMap<_, _> = [(name("pod"), room(2, 2)), (name("vm"), room(2, 2))]
        .into_iter()
        .collect();
    // First step: the declaration of a new holder is applied once.
    let all = labels(&["pod", "self-hosted", "vm"]);
    assert_eq!(
        d.step(&r, &c, t0).declare.map(|d| d.labels),
        Some(all.clone())
    );
    d.declared(&r, all.clone(), t0);
    assert_eq!(d.step(&r, &c, t0 + Duration::from_secs(1)).declare, None);
    assert_eq!(
        d.step(&r, &c, t0 + d.reapply_every)
            .declare
            .map(|d| d.labels),
        Some(all)
    );
}

/// A random deployment: 2–4 backends over six labels, rules and a default.
fn deployment() -> impl Strategy<Value = Router> {
    let universe = ["a", "b", "c", "d", "e", "f"];
    (
        prop::collection::vec(prop::sample::subsequence(universe.to_vec(), 1..4), 2..5),
        prop::collection::vec((prop::sample::select(universe.to_vec()), 0..4_usize), 0..4),
        prop::option::of(0..4_usize),
    )
        .prop_map(|(sets, rules, default)| {
            let backends: Vec<(BackendName, Vec<String>)> = sets
                .iter()
                .enumerate()
                .map(|(i, l)| (name(&format!("b{i}")), labels(l)))
                .collect();
            let pick = |i: usize| backends.get(i).map(|(b, _)| b.clone());
            let rules = rules
                .into_iter()
                .filter_map(|(label, i)| pick(i).map(|b| (label.to_owned(), b)))
                .collect();
            let default = default.and_then(pick);
            Router::from_parts(backends, rules, default)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// No job the forge can hand out under the declared labels routes to a backend that does
    /// not take work; labels only one backend declares are declared exactly while it takes
    /// work; and the reach is exactly where declared label sets route.
    #[test]
    fn declared_labels_lead_only_to_backends_taking_work(
        router in deployment(),
        open_mask in 0_u32..16,
    ) {
        let backends = router.backends().to_vec();
        let open: BTreeSet<BackendName> = backends
            .iter()
            .enumerate()
            .filter(|(i, _)| open_mask & (1 << i) != 0)
            .map(|(_, (b, _))| b.clone())
            .collect();
        let declared = labels_to_declare(&router, &open);
        let routed = routed_sets(&router, &declared);
        for (set, backend) in &routed {
            prop_assert!(open.contains(backend), "{set:?} routes to {backend}, which takes no work (open {open:?}, declared {declared:?})");
        }
        for (backend, own) in &backends {
            for label in own {
                let only_here = backends.iter().filter(|(_, l)| l.contains(label)).count() == 1;
                if only_here {
                    prop_assert_eq!(declared.contains(label), open.contains(backend), "label {} of {}", label, backend);
                }
            }
        }
        if open.len() == backends.len() {
            prop_assert_eq!(&declared, router.declared_labels());
        }
        let reach = reachable(&router, &declared);
        let expected: BTreeSet<BackendName> = routed.into_iter().map(|(_, b)| b).collect();
        prop_assert_eq!(reach, expected);
    }

    /// Over random sequences of rooms, dead workers and Declares the forge accepts or refuses:
    /// whenever the registration may fetch `room` tasks, every label set the forge has declared
    /// routes to a backend with at least that much room.
    #[test]
    fn a_fetch_never_takes_more_than_the_backend_it_may_route_to_has_room_for(
        router in deployment(),
        steps in prop::collection::vec(
            (prop::collection::vec((0..4_usize, 0..3_u8), 4), 0..700_u64, any::<bool>()),
            1..40,
        ),
    ) {
        let backends: Vec<BackendName> = router.backends().iter().map(|(b, _)| b.clone()).collect();
        let mut declarer = Declarer::new(&router, router.declared_labels().to_vec());
        let mut forge: Vec<String> = router.declared_labels().to_vec();
        let mut now = Instant::now();
        for (rooms, advance, accepted) in steps {
            now += Duration::from_millis(advance);
            let conditions: BTreeMap<BackendName, Condition> = backends
                .iter()
                .zip(rooms)
                .map(|(b, (r, kind))| {
                    let c = match kind {
                        0 => Condition::Blocked(Blocked::NoWorker),
                        1 => Condition::Blocked(Blocked::Unreachable),
                        _ => room(r, 3),
                    };
                    (b.clone(), c)
                })
                .collect();
            let step = declarer.step(&router, &conditions, now);
            if let Some(declare) = step.declare {
                if accepted {
                    forge = declare.labels.clone();
                    declarer.declared(&router, declare.labels, now);
                } else {
                    declarer.failed(now);
                }
                // The loop declares first and decides again before fetching.
                continue;
            }
            if step.room > 0 {
                for (set, backend) in routed_sets(&router, &forge) {
                    let has = conditions.get(&backend).map_or(0, |c| c.room());
                    prop_assert!(has >= step.room, "{set:?} may be handed out and routes to {backend} with room {has} < {}", step.room);
                }
            }
        }
    }
}

/// The property above fails when the rule is broken: declaring every label of every backend
/// (the old shared registration) lets a job route to a backend without room.
#[test]
fn declaring_every_label_would_hand_out_jobs_for_a_backend_without_a_worker() {
    let r = shared_label_router();
    let everything = r.declared_labels().to_vec();
    let open = open(&["vm"]);
    let bad: Vec<_> = routed_sets(&r, &everything)
        .into_iter()
        .filter(|(_, b)| !open.contains(b))
        .collect();
    assert!(!bad.is_empty());
    assert!(
        routed_sets(&r, &labels_to_declare(&r, &open))
            .iter()
            .all(|(_, b)| open.contains(b))
    );
}
