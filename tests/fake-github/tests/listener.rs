//! The scale set listener against the strict fake, with an in-memory ledger and workloads that
//! start the JIT runner they were given: every job final once, no runner left, no session
//! left, pacing kept, redelivery and restarts without duplicates.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jr_fake_github::Route;
use jr_fake_github::{FakeGitHub, JobSpec, JobState};
use jr_github::guard::Guard;
use jr_github::listener::Outcome;
use jr_github::wire::{JitConfig, JobFacts};
use jr_github::{
    Credentials, Listener, RetryPolicy, RunnerRecord, ScaleSetClient, Settings, Sink, SinkError,
};
use jr_placement::{TrustLevel, TrustPolicy};
use tokio_util::sync::CancellationToken;

const PAT: &str = "ghp_listener";

/// Jobs are recorded by [`JobFacts::task_id`], the number jetrunner's ledger names them by
/// (their `runnerRequestId`, or one derived from their `jobId` where that is 0).
#[derive(Default)]
struct Ledger {
    /// Assignment (one runner) → (its JIT config, publishes seen).
    assignments: BTreeMap<String, (String, u32)>,
    /// The listener's runner records: assignment → busy.
    records: BTreeMap<String, bool>,
    /// Assignment → the runner that took a job, and that job's task id.
    claims: BTreeMap<String, (String, i64)>,
    /// Assignment → how the job its runner took ended (and that job's task id), or
    /// `withdrawn` (task id 0) when its runner was removed unused.
    finals: BTreeMap<String, (Outcome, i64, bool)>,
    /// Claims and terminals refused because they existed (redelivery).
    repeats: u32,
    cursor: Option<(String, i64)>,
    /// Most assignments not yet final at one time.
    peak_open: usize,
    /// Jobs the trust guard refused: task id → reason.
    refused: BTreeMap<i64, String>,
    /// Claims and terminals for assignments the ledger does not hold.
    ignored: u32,
    /// Assignments whose workload started its runner.
    started: BTreeSet<String>,
}

impl Ledger {
    /// Records a terminal once.
    fn finish(&mut self, assignment: &str, fin: (Outcome, i64, bool)) {
        self.records.remove(assignment);
        if !self.assignments.contains_key(assignment) {
            self.ignored += 1;
            return;
        }
        match self.finals.entry(assignment.to_owned()) {
            Entry::Occupied(_) => self.repeats += 1,
            Entry::Vacant(v) => {
                v.insert(fin);
            }
        }
    }

    fn open(&self) -> usize {
        self.assignments.len() - self.finals.len()
    }

    /// Open assignments whose workload has not started its runner: waiting for a slot.
    fn unstarted(&self) -> usize {
        self.assignments
            .keys()
            .filter(|a| !self.finals.contains_key(*a) && !self.started.contains(*a))
            .count()
    }
}

#[derive(Default)]
struct MemorySink {
    ledger: Mutex<Ledger>,
    capacity: AtomicUsize,
    /// Fail the assign call with this number (1 = the next one); 0: none.
    fail_assign: AtomicUsize,
    assign_calls: AtomicUsize,
    /// Assignments of other work waiting for the backend's slots.
    others_waiting: AtomicUsize,
    /// While set, the workloads start no new runner (the ones started keep polling).
    hold_new_runners: std::sync::atomic::AtomicBool,
}

impl MemorySink {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The ledger as the listener holds it (the test keeps another handle).
#[derive(Clone)]
struct Shared(Arc<MemorySink>);

impl std::ops::Deref for Shared {
    type Target = MemorySink;
    fn deref(&self) -> &MemorySink {
        &self.0
    }
}

impl Sink for Shared {
    async fn room(&self) -> usize {
        let open = self.ledger().open();
        self.capacity.load(Ordering::SeqCst).saturating_sub(open)
    }

    async fn runners(&self) -> Result<Vec<(String, RunnerRecord)>, SinkError> {
        let mut ledger = self.ledger();
        let records: Vec<(String, bool)> = ledger
            .records
            .iter()
            .map(|(a, b)| (a.clone(), *b))
            .collect();
        let mut runners = Vec::new();
        for (assignment, busy) in records {
            if !ledger.assignments.contains_key(&assignment) {
                runners.push((assignment, RunnerRecord::Unpublished));
            } else if ledger.finals.contains_key(&assignment) {
                ledger.records.remove(&assignment);
            } else if busy {
                runners.push((assignment, RunnerRecord::Busy));
            } else {
                runners.push((assignment, RunnerRecord::Free));
            }
        }
        Ok(runners)
    }

    async fn prepare(&self, assignment: &str) -> Result<(), SinkError> {
        self.ledger().records.insert(assignment.to_owned(), false);
        Ok(())
    }

    async fn forget(&self, assignment: &str) -> Result<(), SinkError> {
        self.ledger().records.remove(assignment);
        Ok(())
    }

    async fn assign(&self, assignment: &str, jit: &JitConfig) -> Result<(), SinkError> {
        let call = self.assign_calls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_assign.load(Ordering::SeqCst) == call {
            return Err(SinkError("injected: the ledger is down".into()));
        }
        let mut ledger = self.ledger();
        let entry = ledger
            .assignments
            .entry(assignment.to_owned())
            .or_insert((jit.encoded.clone(), 0));
        entry.1 += 1;
        let open = ledger.open();
        ledger.peak_open = ledger.peak_open.max(open);
        Ok(())
    }

    async fn backend_waiting(&self) -> usize {
        self.others_waiting.load(Ordering::SeqCst) + self.ledger().unstarted()
    }

    async fn started(&self, assignment: &str) -> Result<bool, SinkError> {
        Ok(self.ledger().started.contains(assignment))
    }

    async fn open(&self, assignment: &str) -> Result<bool, SinkError> {
        let ledger = self.ledger();
        Ok(ledger.assignments.contains_key(assignment) && !ledger.finals.contains_key(assignment))
    }

    async fn claimed(
        &self,
        job: &JobFacts,
        assignment: &str,
        runner_name: &str,
        _runner_id: i64,
    ) -> Result<(), SinkError> {
        let mut ledger = self.ledger();
        if !ledger.assignments.contains_key(assignment) {
            ledger.ignored += 1;
            return Ok(());
        }
        ledger.records.insert(assignment.to_owned(), true);
        let ledger = &mut *ledger;
        match ledger.claims.entry(assignment.to_owned()) {
            Entry::Occupied(_) => ledger.repeats += 1,
            Entry::Vacant(v) => {
                v.insert((runner_name.to_owned(), job.task_id()));
            }
        }
        Ok(())
    }

    async fn finished(
        &self,
        job: &JobFacts,
        assignment: &str,
        outcome: &Outcome,
    ) -> Result<(), SinkError> {
        self.ledger()
            .finish(assignment, (outcome.clone(), job.task_id(), false));
        Ok(())
    }

    async fn withdrawn(&self, assignment: &str, _reason: &str) -> Result<(), SinkError> {
        self.ledger()
            .finish(assignment, (Outcome::Cancelled, 0, true));
        Ok(())
    }

    async fn refused(&self, job: &JobFacts, reason: &str) -> Result<(), SinkError> {
        self.ledger()
            .refused
            .insert(job.task_id(), reason.to_owned());
        Ok(())
    }

    async fn save_cursor(&self, session: &str, last_message_id: i64) -> Result<(), SinkError> {
        self.ledger().cursor = Some((session.to_owned(), last_message_id));
        Ok(())
    }

    async fn load_cursor(&self) -> Result<Option<(String, i64)>, SinkError> {
        Ok(self.ledger().cursor.clone())
    }
}

fn client(fake: &FakeGitHub) -> ScaleSetClient {
    ScaleSetClient::new(Settings {
        url: "https://github.com/acme".into(),
        api: Some(fake.url()),
        credentials: Credentials::Pat(PAT.into()),
        retry: RetryPolicy {
            attempts: 4,
            base: Duration::from_millis(10),
            cap: Duration::from_millis(50),
            max_retry_after: Duration::from_secs(2),
        },
        user_agent: "jetrunner-test".into(),
    })
    .expect("client")
}

/// Plays the workloads: every assignment's runner starts with its JIT config and finishes
/// (`failed` for every third job); a runner that finds no job polls again. An assignment
/// final before its workload started (withdrawn, or lost) is never started.
async fn workloads(fake: FakeGitHub, sink: Arc<MemorySink>, stop: CancellationToken) {
    let mut started: BTreeMap<String, i64> = BTreeMap::new();
    let mut waiting: Vec<(String, i64)> = Vec::new();
    while !stop.is_cancelled() {
        let hold = sink.hold_new_runners.load(Ordering::SeqCst);
        let fresh: Vec<(String, String)> = if hold {
            Vec::new()
        } else {
            let ledger = sink.ledger();
            ledger
                .assignments
                .iter()
                .filter(|(a, _)| !started.contains_key(*a) && !ledger.finals.contains_key(*a))
                .map(|(a, (jit, _))| (a.clone(), jit.clone()))
                .collect()
        };
        for (assignment, jit) in fresh {
            sink.ledger().started.insert(assignment.clone());
            let Ok((runner, job)) = fake.start_runner(&jit) else {
                started.insert(assignment, 0);
                continue;
            };
            started.insert(assignment.clone(), runner);
            match job {
                Some(job) => finish(&fake, runner, job),
                None => waiting.push((assignment, runner)),
            }
        }
        waiting.retain(|(_, runner)| match fake.poll_runner(*runner) {
            Some(job) => {
                finish(&fake, *runner, job);
                false
            }
            None => true,
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn finish(fake: &FakeGitHub, runner: i64, job: i64) {
    let result = if job % 3 == 0 { "failed" } else { "succeeded" };
    fake.finish_runner(runner, result).expect("finish");
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `listener` until `stop` (keeping its session at the end when `keep_session`).
fn spawn(
    listener: Listener<Shared>,
    stop: &CancellationToken,
    keep_session: bool,
) -> tokio::task::JoinHandle<Result<(), jr_github::ListenError>> {
    let stop = stop.clone();
    tokio::spawn(async move { listener.run(stop, keep_session).await })
}

/// Waits until the ledger holds `jobs` terminals.
async fn all_final(run: &Run, jobs: usize) {
    until("every job final", || {
        run.sink.ledger().finals.values().filter(|f| !f.2).count() == jobs
    })
    .await;
}

struct Run {
    fake: FakeGitHub,
    sink: Arc<MemorySink>,
    scale_set: i64,
}

async fn start(acquire_step: bool, capacity: usize) -> Run {
    let fake = FakeGitHub::start(PAT).await.expect("fake");
    fake.set_poll_hold(Duration::from_millis(100));
    fake.set_acquire_step(acquire_step);
    let set = client(&fake)
        .ensure_scale_set("default", "jetrunner", &[])
        .await
        .expect("scale set");
    let sink = Arc::new(MemorySink::default());
    sink.capacity.store(capacity, Ordering::SeqCst);
    Run {
        fake,
        sink,
        scale_set: set.id,
    }
}

fn listener(run: &Run) -> Listener<Shared> {
    Listener {
        stats: Default::default(),
        client: client(&run.fake),
        scale_set: run.scale_set,
        owner: "jr-test".into(),
        forge: "github".into(),
        max_capacity: 4,
        min_idle: 0,
        work_folder: "_work".into(),
        guard: None,
        sink: Shared(run.sink.clone()),
    }
}

/// The number the ledger knows the fake's job `request_id` by.
fn task_id(run: &Run, request_id: i64) -> i64 {
    let job = run.fake.job(request_id).expect("job");
    JobFacts {
        runner_request_id: job.message_request_id,
        job_id: job.job_id,
        ..JobFacts::default()
    }
    .task_id()
}

/// Every enqueued job is final once in the ledger, on the runner that took it, with the
/// result that runner reported, and GitHub agrees; no runner is left registered.
fn assert_all_final_once(run: &Run, jobs: &[i64]) {
    let named: Vec<i64> = jobs.iter().map(|j| task_id(run, *j)).collect();
    let ledger = run.sink.ledger();
    for (job, named) in jobs.iter().zip(&named) {
        let finals: Vec<_> = ledger
            .finals
            .iter()
            .filter(|(_, (_, r, withdrawn))| r == named && !withdrawn)
            .collect();
        let [(assignment, (outcome, _, _))] = finals[..] else {
            panic!("job {job}: terminals {finals:?}");
        };
        let expected = if job % 3 == 0 {
            Outcome::Failed
        } else {
            Outcome::Succeeded
        };
        assert_eq!(outcome, &expected, "job {job}");
        assert_eq!(
            ledger.claims.get(assignment).map(|c| c.1),
            Some(*named),
            "job {job} not claimed on the runner that finished it"
        );
        let state = run.fake.job(*job).map(|j| j.state);
        assert!(
            matches!(state, Some(JobState::Completed { .. })),
            "job {job} on GitHub: {state:?}"
        );
    }
    // Every runner is final: it ran a job, or was withdrawn unused.
    assert_eq!(
        ledger.open(),
        0,
        "runners not final: {:?}",
        ledger
            .assignments
            .keys()
            .filter(|a| !ledger.finals.contains_key(*a))
            .collect::<Vec<_>>()
    );
    assert_eq!(ledger.repeats, 0, "a claim or terminal recorded twice");
    assert!(
        run.fake.runners().is_empty(),
        "runners left: {:?}",
        run.fake.runners()
    );
}

/// Waits until the scale set is idle on the listener's side: every runner final.
async fn all_runners_final(run: &Run) {
    until("every runner final", || run.sink.ledger().open() == 0).await;
}

#[tokio::test]
async fn every_assigned_job_is_claimed_and_final_once_and_no_runner_is_left() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    let l = listener(&run);
    let handle = spawn(l, &stop, false);
    let jobs: Vec<i64> = (0..12)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    all_final(&run, jobs.len()).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &jobs);
    assert_eq!(
        run.fake.session(run.scale_set),
        None,
        "the session was not deleted on shutdown"
    );
    assert!(run.sink.ledger().assignments.values().all(|(_, n)| *n == 1));
    // One runner per job: none made past what GitHub asked for.
    assert_eq!(run.sink.ledger().assignments.len(), jobs.len());
}

#[tokio::test]
async fn jobs_github_com_sends_without_a_request_id_are_each_claimed_and_final_once() {
    let run = start(false, 100).await;
    run.fake.set_zero_request_ids(true);
    let stop = CancellationToken::new();
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    let handle = spawn(listener(&run), &stop, false);
    let jobs: Vec<i64> = (0..6)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    all_final(&run, jobs.len()).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    let named: BTreeSet<i64> = jobs.iter().map(|j| task_id(&run, *j)).collect();
    assert_eq!(named.len(), jobs.len(), "two jobs are named alike");
    assert!(
        named.iter().all(|n| *n < 0),
        "a job without a request id is named like one with: {named:?}"
    );
    assert_all_final_once(&run, &jobs);
}

#[tokio::test]
async fn acquiring_keeps_to_the_room_and_offers_wait_for_it() {
    let run = start(true, 2).await;
    let stop = CancellationToken::new();
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    let l = listener(&run);
    let handle = spawn(l, &stop, false);
    let jobs: Vec<i64> = (0..7)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    all_final(&run, jobs.len()).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &jobs);
    let peak = run.sink.ledger().peak_open;
    assert!(peak <= 2, "{peak} jobs open at once with room for 2");
}

#[tokio::test]
async fn github_com_assigns_no_more_than_the_capacity_the_listener_announces() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    let mut l = listener(&run);
    l.max_capacity = 2;
    let handle = spawn(l, &stop, false);
    // The service learns the capacity from the listener's polls.
    until("the first poll", || {
        run.fake.max_capacity(run.scale_set) == Some(2)
    })
    .await;
    let jobs: Vec<i64> = (0..7)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    all_final(&run, jobs.len()).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &jobs);
    let peak = run.sink.ledger().peak_open;
    assert!(peak <= 2, "{peak} jobs open at once with a capacity of 2");
}

#[tokio::test]
async fn a_failed_ledger_write_and_a_restart_lose_nothing_and_duplicate_nothing() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    // Four jobs; the second runner's publish fails after the first was published: the first
    // assignment (and the runner in it) must stay as published, the second runner is removed
    // from GitHub unused and another made.
    run.sink.fail_assign.store(2, Ordering::SeqCst);
    let mut jobs: Vec<i64> = (0..4)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    let first_stop = CancellationToken::new();
    let first = listener(&run);
    let handle = spawn(first, &first_stop, true);
    all_final(&run, jobs.len()).await;
    // The listener stops without deleting its session, as a crash would leave it.
    first_stop.cancel();
    handle.await.expect("join").expect("listener");
    let session = run.fake.session(run.scale_set).expect("session kept");
    jobs.extend((0..4).map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"]))));
    // A new listener (a restart or another replica taking the lead) resumes it by id: no 409.
    let second = listener(&run);
    let handle = spawn(second, &stop, false);
    all_final(&run, jobs.len()).await;
    assert_eq!(
        run.sink.ledger().cursor.as_ref().map(|c| c.0.clone()),
        Some(session)
    );
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &jobs);
    // Every runner whose config the ledger holds ran a job; the only runner removed unused
    // is the one made for the failed publish.
    let ledger = run.sink.ledger();
    let published: Vec<&String> = ledger.assignments.values().map(|(jit, _)| jit).collect();
    let removed = run.fake.removed_runners();
    for runner in &removed {
        if published.contains(&&runner.encoded_jit_config) {
            assert!(
                runner.started,
                "a published runner config was thrown away: {}",
                runner.name
            );
        }
    }
    assert_eq!(
        removed.iter().filter(|r| !r.started).count(),
        1,
        "{removed:?}"
    );
    assert_eq!(run.sink.assign_calls.load(Ordering::SeqCst), jobs.len() + 1);
}

#[tokio::test]
async fn a_trusted_scale_set_refuses_fork_code_and_runs_the_rest() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    let mut l = listener(&run);
    l.guard = Some(Guard {
        policy: TrustPolicy {
            rules: Vec::new(),
            default_max: TrustLevel::Trusted,
        },
        backend_trust: TrustLevel::Trusted,
    });
    let handle = spawn(l, &stop, false);
    let pull = |fork: bool| {
        let mut spec = JobSpec::push(&["jetrunner"]);
        spec.event_name = "pull_request".into();
        spec.git_ref = "refs/pull/7/merge".into();
        spec.from_fork = fork;
        spec
    };
    let allowed = vec![
        run.fake.enqueue(JobSpec::push(&["jetrunner"])),
        run.fake.enqueue(pull(false)),
        run.fake.enqueue(JobSpec::push(&["jetrunner"])),
    ];
    let forks = vec![run.fake.enqueue(pull(true)), run.fake.enqueue(pull(true))];
    until("the allowed jobs final and the forks refused", || {
        let ledger = run.sink.ledger();
        ledger.finals.len() == allowed.len() && ledger.refused.len() == forks.len()
    })
    .await;
    until("the refused runs cancelled on GitHub", || {
        forks.iter().all(|f| matches!(run.fake.job(*f).map(|j| j.state), Some(JobState::Completed { result }) if result == "canceled"))
    })
    .await;
    // Their cancellations come back as completions of jobs no runner was made for: nothing
    // is withdrawn for them.
    until("every message handled", || {
        run.fake.undelivered(run.scale_set) == 0
    })
    .await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &allowed);
    let ledger = run.sink.ledger();
    for fork in &forks {
        assert!(
            ledger.refused[&task_id(&run, *fork)].contains("fork pull request"),
            "{:?}",
            ledger.refused
        );
        let fork = task_id(&run, *fork);
        assert!(
            ledger.claims.values().all(|(_, job)| *job != fork),
            "a fork's job ran on a runner of ours"
        );
    }
    assert!(
        ledger.finals.values().all(|(_, _, withdrawn)| !withdrawn),
        "a runner was withdrawn for a job that had none: {:?}",
        ledger.finals
    );
    assert_eq!(run.fake.count(Route::CancelRun), 2);
}

#[tokio::test]
async fn a_job_cancelled_before_it_runs_leaves_its_runner_until_the_scale_set_is_idle() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let handle = spawn(listener(&run), &stop, false);
    let jobs: Vec<i64> = (0..4)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    until("a runner made for every job", || {
        run.sink.ledger().assignments.len() == jobs.len()
    })
    .await;
    // Before any workload starts its runner, one job is cancelled: one runner is too many,
    // but while jobs wait any free runner may be the one GitHub hands the next job to.
    run.fake.cancel(jobs[1]);
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    let rest = [jobs[0], jobs[2], jobs[3]];
    all_final(&run, rest.len()).await;
    // The scale set is idle now: the runner left over is removed unused.
    all_runners_final(&run).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &rest);
    let ledger = run.sink.ledger();
    let withdrawn: Vec<_> = ledger.finals.values().filter(|f| f.2).collect();
    assert_eq!(
        withdrawn,
        vec![&(Outcome::Cancelled, 0, true)],
        "{:?}",
        ledger.finals
    );
    assert_eq!(ledger.assignments.len(), jobs.len());
}

#[tokio::test]
async fn a_runner_lost_before_it_took_a_job_is_made_again() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let handle = spawn(listener(&run), &stop, false);
    let jobs: Vec<i64> = (0..3)
        .map(|_| run.fake.enqueue(JobSpec::push(&["jetrunner"])))
        .collect();
    until("a runner made for every job", || {
        run.sink.ledger().assignments.len() == jobs.len()
    })
    .await;
    // One workload is lost before its runner started: `fail-task` removes the runner from
    // GitHub and ends its assignment as withdrawn. Nothing else tells the listener; GitHub
    // still has three jobs waiting.
    let lost = run
        .sink
        .ledger()
        .assignments
        .keys()
        .next()
        .cloned()
        .expect("a runner");
    let name = jr_github::listener::runner_name(&lost, 1);
    let runner = client(&run.fake)
        .runner_by_name(&name)
        .await
        .expect("lookup")
        .expect("registered");
    client(&run.fake)
        .remove_runner(runner.id)
        .await
        .expect("remove");
    Shared(run.sink.clone())
        .withdrawn(&lost, "workload lost")
        .await
        .expect("withdrawn");
    until("the lost runner made again", || {
        run.sink.ledger().assignments.len() == jobs.len() + 1
    })
    .await;
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    all_final(&run, jobs.len()).await;
    all_runners_final(&run).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert_all_final_once(&run, &jobs);
    assert_eq!(
        run.sink.ledger().finals.values().filter(|f| f.2).count(),
        1,
        "only the lost runner withdrawn"
    );
}

#[tokio::test]
async fn warm_runners_wait_for_jobs_and_min_idle_is_kept() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let mut l = listener(&run);
    l.min_idle = 2;
    let handle = spawn(l, &stop, false);
    until("two warm runners", || {
        run.sink.ledger().assignments.len() == 2
    })
    .await;
    let warm: BTreeSet<String> = run.sink.ledger().assignments.keys().cloned().collect();
    // GitHub hands a job to whichever idle runner asks first; a runner made for the job could
    // start and ask before the warm ones poll again. Held back until the job runs, so the check
    // is whether the warm runners are online and take it.
    // Their workloads start them before any job exists: they register and wait.
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    until("the warm runners online", || {
        run.fake.runners().iter().filter(|r| r.started).count() == 2
    })
    .await;
    run.sink.hold_new_runners.store(true, Ordering::SeqCst);
    let job = run.fake.enqueue(JobSpec::push(&["jetrunner"]));
    until("the job running", || {
        matches!(
            run.fake.job(job).map(|j| j.state),
            Some(JobState::Running { .. } | JobState::Completed { .. })
        )
    })
    .await;
    run.sink.hold_new_runners.store(false, Ordering::SeqCst);
    all_final(&run, 1).await;
    // The job ran on a runner made before it, and a new one keeps two idle.
    let ran_on = run
        .sink
        .ledger()
        .finals
        .iter()
        .find(|(_, f)| !f.2)
        .map(|(a, _)| a.clone())
        .expect("the job's final");
    assert!(
        warm.contains(&ran_on),
        "the job did not run on a warm runner"
    );
    until("two idle runners again", || {
        let ledger = run.sink.ledger();
        ledger.open() == 2 && ledger.assignments.len() == 3
    })
    .await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
    assert!(matches!(
        run.fake.job(job).map(|j| j.state),
        Some(JobState::Completed { .. })
    ));
}

#[tokio::test]
async fn warm_runners_yield_their_slots_to_other_work_waiting_and_come_back() {
    let run = start(false, 100).await;
    let stop = CancellationToken::new();
    let mut l = listener(&run);
    l.min_idle = 2;
    let handle = spawn(l, &stop, false);
    let work = tokio::spawn(workloads(run.fake.clone(), run.sink.clone(), stop.clone()));
    until("two warm runners online", || {
        run.fake.runners().iter().filter(|r| r.started).count() == 2
    })
    .await;
    // Another forge's assignment waits for a slot of the backend: one warm runner yields.
    run.sink.others_waiting.store(1, Ordering::SeqCst);
    until("one warm runner withdrawn", || {
        run.sink.ledger().finals.values().filter(|f| f.2).count() == 1
    })
    .await;
    assert_eq!(
        run.sink.ledger().open(),
        1,
        "only one yields per assignment waiting"
    );
    // It got its slot: the warm runners come back.
    run.sink.others_waiting.store(0, Ordering::SeqCst);
    until("two warm runners again", || run.sink.ledger().open() == 2).await;
    stop.cancel();
    handle.await.expect("join").expect("listener");
    work.await.expect("workloads");
}
