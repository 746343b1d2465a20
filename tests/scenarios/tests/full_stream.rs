//! A full `JR_ASSIGNMENTS` stream is backpressure, not failure: with room for 20 assignments and
//! 40 jobs queued, 20 run, intake stops (the scheduler logs the stream and its limits once,
//! `jetrunner_scheduler_intake_blocked` is 1, the task in hand is kept alive at the forge past
//! its zombie timeout, the rest wait at the forge unfetched) and nothing fails; once an operator
//! raises the limit, intake resumes by itself and every job succeeds. Needs the service binaries
//! built; run with `--test-threads=1`.

use std::time::{Duration, Instant};

use jr_fake_forge::{Outcome, Status};
use jr_protocol::STREAM_ASSIGNMENTS;
use jr_scenarios::{System, SystemSpec};

const ROOM: i64 = 20;
const JOBS: u32 = 40;
const ZOMBIE_TIMEOUT: Duration = Duration::from_secs(15);

async fn scheduler_metric(system: &System, name: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!(
        "http://127.0.0.1:{}/metrics",
        system.ports.scheduler_ops
    ))
    .await?
    .text()
    .await?;
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

async fn eventually<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await? {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_assignment_stream_pauses_intake_and_loses_nothing() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 4,
        vm_capacity: 2,
        forge_behaviour: jr_fake_forge::Behaviour {
            zombie_timeout: ZOMBIE_TIMEOUT,
            ..Default::default()
        },
        keepalive: Duration::from_secs(3),
        extra_toml: format!(
            "\n[nats.streams.assignments]\nmax_messages = {ROOM}\nmax_bytes = 16777216\n"
        ),
        ..Default::default()
    })
    .await?;
    for i in 0..JOBS {
        let label = if i % 3 == 2 { "vm" } else { "pod" };
        system.enqueue(label, 1, &[("JR_FAKE_DURATION_MS", "200")]);
    }
    let js =
        jr_bus::async_nats::jetstream::new(jr_bus::async_nats::connect(system.nats.url()).await?);
    // The first ROOM jobs fill the stream and finish; intake then stops with one task in hand.
    let blocked = eventually(
        "intake blocked by the full stream",
        Duration::from_secs(120),
        || {
            let system = &system;
            async move {
                Ok(scheduler_metric(system, "jetrunner_scheduler_intake_blocked").await? >= 1.0)
            }
        },
    )
    .await;
    if let Err(e) = blocked {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let blocked_at = Instant::now();
    // The line is written as the gauge rises; the log file may trail it by a moment.
    let full_line = || -> anyhow::Result<Option<String>> {
        Ok(std::fs::read_to_string(system.scheduler.log_path())?
            .lines()
            .find(|l| l.contains("stream JR_ASSIGNMENTS is full"))
            .map(str::to_owned))
    };
    let logged = eventually("the full stream logged", Duration::from_secs(10), || {
        let found = full_line().map(|l| l.is_some());
        async move { found }
    })
    .await;
    if let Err(e) = logged {
        anyhow::bail!(
            "{e}: no log line names the full stream:\n{}",
            std::fs::read_to_string(system.scheduler.log_path())?
        );
    }
    let line = full_line()?.unwrap_or_default();
    assert!(
        line.contains(&format!("{ROOM}/{ROOM} messages")),
        "the log line does not give the limit: {line}"
    );
    let stream = js
        .get_stream(STREAM_ASSIGNMENTS)
        .await?
        .info()
        .await?
        .clone();
    assert_eq!(stream.state.messages, ROOM as u64);

    // Held past the forge's zombie timeout: the task in hand is kept alive, the others wait
    // at the forge unfetched, nothing fails.
    while blocked_at.elapsed() < ZOMBIE_TIMEOUT + Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let snapshot = system.forge.snapshot();
    let failed: Vec<_> = snapshot
        .jobs
        .iter()
        .filter(|j| j.status.is_final() && j.status != Status::Done(Outcome::Success))
        .map(|j| (j.id, j.status))
        .collect();
    assert!(
        failed.is_empty(),
        "jobs failed while the stream was full: {failed:?}"
    );
    let fetched = snapshot.tasks.len();
    assert!(
        fetched <= ROOM as usize + 2,
        "{fetched} tasks fetched with room for {ROOM} assignments: intake did not stop"
    );
    assert!(
        snapshot.queued_count() >= JOBS as usize - ROOM as usize - 2,
        "{} jobs queued at the forge",
        snapshot.queued_count()
    );
    // One task in hand per registration (one per backend here) at most.
    let in_hand = scheduler_metric(&system, "jetrunner_scheduler_intake_blocked").await?;
    assert!(
        (1.0..=2.0).contains(&in_hand),
        "{in_hand} tasks waiting for room"
    );
    assert!(
        scheduler_metric(&system, "jetrunner_scheduler_intake_stream_full_total").await? >= 1.0
    );

    // An operator raises the limit: intake resumes by itself and everything succeeds.
    let mut config = stream.config.clone();
    config.max_messages = 10_000;
    js.update_stream(config).await?;
    if let Err(e) = system.wait_all_final(Duration::from_secs(120)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    let snapshot = system.forge.snapshot();
    let not_succeeded: Vec<_> = snapshot
        .jobs
        .iter()
        .filter(|j| j.status != Status::Done(Outcome::Success))
        .map(|j| (j.id, j.status))
        .collect();
    assert!(not_succeeded.is_empty(), "{not_succeeded:?}");
    assert_eq!(snapshot.tasks.len(), JOBS as usize, "a job ran twice");
    let log = std::fs::read_to_string(system.scheduler.log_path())?;
    assert!(log.contains("has room again: intake resumes"), "{log}");
    assert_eq!(
        scheduler_metric(&system, "jetrunner_scheduler_intake_blocked").await?,
        0.0
    );
    system.wait_no_workloads(Duration::from_secs(60)).await?;
    let violations = system.violations();
    assert!(violations.is_empty(), "{violations:#?}");
    Ok(())
}
