use std::collections::BTreeMap;

use super::*;

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) workloads: BTreeMap<String, ObservedWorkload>,
    pub(crate) full: bool,
    pub(crate) down: bool,
    pub(crate) creates: u32,
    pub(crate) deleted: Vec<String>,
}

/// A backend in memory: creates succeed unless it is full (429-like) or down (transient).
#[derive(Clone, Default)]
pub(crate) struct Fake(Arc<Mutex<Inner>>);

impl Fake {
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.0.lock().expect("test"))
    }
}

impl Backend for Fake {
    async fn create(&self, spec: &WorkloadSpec) -> Result<String, BackendError> {
        self.with(|s| {
            s.creates += 1;
            if s.down {
                return Err(BackendError::Transient {
                    op: "create",
                    message: "connection refused".into(),
                    retry_after: None,
                });
            }
            if s.full {
                return Err(BackendError::Full {
                    op: "create",
                    retry_after: Duration::from_secs(30),
                });
            }
            let name = spec.name();
            s.workloads.insert(
                name.clone(),
                ObservedWorkload {
                    workload: name.clone(),
                    assignment_id: spec.assignment_id,
                    attempt: spec.attempt,
                    phase: WorkloadPhase::Running,
                    reason: None,
                    worker: spec.worker_id.clone(),
                },
            );
            Ok(name)
        })
    }

    async fn delete(&self, workload: &str) -> Result<(), BackendError> {
        self.with(|s| {
            if s.down {
                return Err(BackendError::Transient {
                    op: "delete",
                    message: "connection refused".into(),
                    retry_after: None,
                });
            }
            s.workloads.remove(workload);
            s.deleted.push(workload.to_owned());
            Ok(())
        })
    }

    async fn list(&self) -> Result<Vec<ObservedWorkload>, BackendError> {
        self.with(|s| {
            if s.down {
                return Err(BackendError::Transient {
                    op: "list",
                    message: "connection refused".into(),
                    retry_after: None,
                });
            }
            Ok(s.workloads.values().cloned().collect())
        })
    }

    async fn observe(
        &self,
        _tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        shutdown.await;
    }
}

fn spec(n: u32) -> WorkloadSpec {
    crate::backend::test_spec(n)
}

fn provider(name: &str, weight: u32, fake: &Fake) -> Provider<Fake> {
    Provider {
        name: name.into(),
        backend: fake.clone(),
        weight,
        max_runners: None,
        disabled: false,
        tier: Tier::Default,
    }
}

fn count(refs: &[String], provider: &str) -> usize {
    refs.iter()
        .filter(|r| r.starts_with(&format!("{provider}/")))
        .count()
}

#[tokio::test]
async fn weights_share_the_work_and_references_name_the_provider() {
    let (a, b) = (Fake::default(), Fake::default());
    let providers = Providers::new(
        vec![provider("a", 3, &a), provider("b", 1, &b)],
        Duration::from_secs(300),
    );
    let mut refs = Vec::new();
    for n in 0..400 {
        refs.push(providers.create(&spec(n)).await.expect("test"));
    }
    assert_eq!((count(&refs, "a"), count(&refs, "b")), (300, 100));
    assert_eq!(a.with(|s| s.workloads.len()), 300);
    // A delete goes to the provider that made the workload.
    let first_b = refs.iter().find(|r| r.starts_with("b/")).expect("test");
    providers.delete(first_b).await.expect("test");
    assert_eq!(b.with(|s| s.deleted.len()), 1);
    assert_eq!(a.with(|s| s.deleted.len()), 0);
    let listed = providers.list().await.expect("test");
    assert_eq!(listed.len(), 399);
    assert!(
        listed
            .iter()
            .all(|o| o.workload.starts_with("a/") || o.workload.starts_with("b/"))
    );
}

#[tokio::test]
async fn a_full_provider_passes_the_attempt_to_the_next_and_all_full_is_back_pressure() {
    let (a, b) = (Fake::default(), Fake::default());
    a.with(|s| s.full = true);
    let providers = Providers::new(
        vec![provider("a", 10, &a), provider("b", 1, &b)],
        Duration::from_secs(300),
    );
    for n in 0..5 {
        let r = providers.create(&spec(n)).await.expect("test");
        assert!(r.starts_with("b/"), "{r}");
    }
    // "a" answered full once and is not asked again before its retry time.
    assert_eq!(a.with(|s| s.creates), 1);
    b.with(|s| s.full = true);
    let err = providers.create(&spec(9)).await.expect_err("test");
    assert!(
        matches!(err, BackendError::Full { retry_after, .. } if retry_after == Duration::from_secs(30)),
        "{err:?}"
    );
    let stats = providers.stats();
    assert_eq!((stats[0].full, stats[1].full), (1, 1));
    assert_eq!((stats[0].placed, stats[1].placed), (0, 5));
}

#[tokio::test]
async fn a_drained_or_capped_provider_takes_nothing_new_but_keeps_its_workloads() {
    let (a, b) = (Fake::default(), Fake::default());
    let mut capped = provider("a", 1, &a);
    capped.max_runners = Some(2);
    let providers = Providers::new(vec![capped, provider("b", 1, &b)], Duration::from_secs(300));
    let mut refs = Vec::new();
    for n in 0..10 {
        refs.push(providers.create(&spec(n)).await.expect("test"));
    }
    assert_eq!(count(&refs, "a"), 2, "{refs:?}");

    // Drain "b": a new Providers over the same provider (a restart with `disabled = true`).
    let mut drained = provider("b", 1, &b);
    drained.disabled = true;
    let restarted = Providers::new(
        vec![provider("a", 1, &a), drained],
        Duration::from_secs(300),
    );
    let listed = restarted.list().await.expect("test");
    assert_eq!(listed.len(), 10, "running work stays listed");
    for n in 10..14 {
        let r = restarted.create(&spec(n)).await.expect("test");
        assert!(r.starts_with("a/"), "{r}");
    }
    let b_ref = refs.iter().find(|r| r.starts_with("b/")).expect("test");
    restarted.delete(b_ref).await.expect("test");
    assert_eq!(b.with(|s| s.deleted.len()), 1);
    // Every provider drained: back-pressure, not an error.
    let mut only = provider("a", 1, &a);
    only.disabled = true;
    let none = Providers::new(vec![only], Duration::from_secs(300));
    assert!(matches!(
        none.create(&spec(99)).await,
        Err(BackendError::Full { .. })
    ));
}

#[tokio::test]
async fn an_attempt_sticks_to_its_provider_until_that_provider_is_unreachable() {
    let (a, b) = (Fake::default(), Fake::default());
    a.with(|s| s.down = true);
    let providers = Providers::new(
        vec![provider("a", 1, &a), provider("b", 1, &b)],
        Duration::from_secs(300),
    );
    // The first pick is "a" (list order on a tie); a timeout there may have created the
    // workload, so the retries go to "a" as well.
    for _ in 0..FAILURES_BEFORE_UNREACHABLE {
        assert!(matches!(
            providers.create(&spec(1)).await,
            Err(BackendError::Transient { .. })
        ));
    }
    assert_eq!(a.with(|s| s.creates), FAILURES_BEFORE_UNREACHABLE);
    assert_eq!(b.with(|s| s.creates), 0);
    // Unreachable now: the attempt moves.
    let r = providers.create(&spec(1)).await.expect("test");
    assert!(r.starts_with("b/"), "{r}");
    assert!(!providers.stats()[0].reachable);
}

#[tokio::test]
async fn an_unreachable_provider_is_held_then_written_off() {
    let (a, b) = (Fake::default(), Fake::default());
    let hold = Duration::from_millis(300);
    let providers = Providers::new(vec![provider("a", 1, &a), provider("b", 1, &b)], hold);
    let ra = providers.create(&spec(0)).await.expect("test");
    let rb = providers.create(&spec(1)).await.expect("test");
    assert!(ra.starts_with("a/") && rb.starts_with("b/"));
    assert_eq!(providers.list().await.expect("test").len(), 2);
    a.with(|s| s.down = true);
    // Held: "a"'s workload stays in every list, as Unknown once "a" counts as unreachable.
    for _ in 0..FAILURES_BEFORE_UNREACHABLE {
        let listed = providers.list().await.expect("test");
        assert_eq!(listed.len(), 2);
    }
    let listed = providers.list().await.expect("test");
    let held = listed.iter().find(|o| o.workload == ra).expect("test");
    assert_eq!(held.phase, WorkloadPhase::Unknown);
    assert_eq!(held.reason.as_deref(), Some("backend-unreachable"));
    // Past the hold: written off, the list no longer has it.
    tokio::time::sleep(hold).await;
    let listed = providers.list().await.expect("test");
    assert_eq!(
        listed
            .iter()
            .map(|o| o.workload.clone())
            .collect::<Vec<_>>(),
        vec![rb.clone()]
    );
    // Back again: its workloads are listed again (strays for the worker to delete).
    a.with(|s| s.down = false);
    assert_eq!(providers.list().await.expect("test").len(), 2);
    assert!(providers.stats()[0].reachable);
}

#[tokio::test]
async fn a_provider_that_cannot_be_listed_at_start_holds_the_start_up_to_the_hold() {
    let (a, b) = (Fake::default(), Fake::default());
    a.with(|s| s.down = true);
    let hold = Duration::from_millis(200);
    let providers = Providers::new(vec![provider("a", 1, &a), provider("b", 1, &b)], hold);
    assert!(providers.list().await.is_err());
    for _ in 0..FAILURES_BEFORE_UNREACHABLE {
        let _ = providers.list().await;
    }
    tokio::time::sleep(hold).await;
    assert_eq!(providers.list().await.expect("test").len(), 0);
}

#[tokio::test]
async fn observations_are_tagged_and_unreachable_reports_go_to_the_observer() {
    let (a, b) = (Fake::default(), Fake::default());
    let providers = Arc::new(Providers::new(
        vec![provider("a", 1, &a), provider("b", 1, &b)],
        Duration::from_secs(300),
    ));
    let ra = providers.create(&spec(0)).await.expect("test");
    let (tx, mut rx) = mpsc::channel(16);
    let stop = CancellationToken::new();
    let observer = {
        let (providers, stop) = (providers.clone(), stop.clone());
        tokio::spawn(async move { providers.observe(tx, stop.cancelled_owned()).await })
    };
    // Wait until the observer is registered.
    while lock(&providers.state).observer.is_none() {
        tokio::task::yield_now().await;
    }
    a.with(|s| s.down = true);
    for _ in 0..FAILURES_BEFORE_UNREACHABLE {
        let _ = providers.list().await;
    }
    let report = rx.recv().await.expect("test");
    assert_eq!(report.workload, ra);
    assert_eq!(report.phase, WorkloadPhase::Unknown);
    stop.cancel();
    observer.await.expect("test");
}

fn burst_provider(name: &str, fake: &Fake) -> Provider<Fake> {
    Provider {
        tier: Tier::Burst,
        ..provider(name, 1, fake)
    }
}

fn job(n: u32) -> WorkloadSpec {
    WorkloadSpec {
        job_name: format!("job-{n}"),
        fetched_at: jr_protocol::now_ms(),
        ..spec(n)
    }
}

fn on(percent: u8) -> jr_placement::BurstSetting {
    jr_placement::BurstSetting {
        enabled: true,
        percent,
    }
}

#[tokio::test]
async fn the_burst_tier_takes_nothing_while_off_and_nothing_while_the_default_tier_has_room() {
    let (home, cloud) = (Fake::default(), Fake::default());
    let providers = Providers::new(
        vec![provider("home", 1, &home), burst_provider("cloud", &cloud)],
        Duration::from_secs(300),
    );
    for n in 0..20 {
        let r = providers.create(&job(n)).await.expect("default tier");
        assert!(r.starts_with("home/"), "{r}");
    }
    providers.burst().set(on(100));
    for n in 20..40 {
        let r = providers
            .create(&job(n))
            .await
            .expect("default tier has room");
        assert!(r.starts_with("home/"), "{r}");
    }
    // Default tier full, burst off: back-pressure, the burst provider is never asked.
    home.with(|s| s.full = true);
    providers.burst().set(jr_placement::BurstSetting::OFF);
    let err = providers.create(&job(40)).await.expect_err("no room");
    assert!(matches!(err, BackendError::Full { .. }), "{err:?}");
    assert_eq!(cloud.with(|s| s.creates), 0);
}

#[tokio::test]
async fn with_the_default_tier_full_the_burst_tier_takes_exactly_the_jobs_in_its_percentage() {
    let (home, cloud) = (Fake::default(), Fake::default());
    home.with(|s| s.full = true);
    let protected = vec![jr_placement::ProtectedMatcher {
        job: Some("job-3*".into()),
        ..Default::default()
    }];
    let burst = Arc::new(Burst::new(protected, None));
    burst.set(on(30));
    let providers = Providers::new(
        vec![provider("home", 1, &home), burst_provider("cloud", &cloud)],
        Duration::from_secs(300),
    )
    .with_burst(burst);
    let mut bursted = Vec::new();
    for n in 0..400 {
        let spec = job(n);
        let in_bucket =
            jr_placement::burst_bucket(&spec.repository, &spec.workflow, &spec.job_name) < 30;
        let protected = spec.job_name.starts_with("job-3");
        match providers.create(&spec).await {
            Ok(r) => {
                assert!(r.starts_with("cloud/"), "{r}");
                assert!(in_bucket && !protected, "job {n} went to the burst tier");
                bursted.push(n);
            }
            Err(BackendError::Wait { .. }) => {
                assert!(!in_bucket || protected, "job {n} was kept home");
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    let eligible = (0..400)
        .filter(|n| !job(*n).job_name.starts_with("job-3"))
        .count();
    let share = bursted.len() as f64 / eligible as f64;
    assert!(
        (0.25..=0.35).contains(&share),
        "{} of {eligible} eligible jobs",
        bursted.len()
    );
}
