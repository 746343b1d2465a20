//! The job list against a real Postgres (127.0.0.1:5432, user postgres, trust): filters,
//! the order (newest first) and keyset paging. Each test has its own database.

use jr_protocol::Envelope;
use jr_store::testkit::{ASSIGNMENTS_STREAM, Builder, EVENTS_STREAM};
use jr_store::{Cursor, JobFilter, Store};
use sqlx::Connection;

const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

async fn database() -> anyhow::Result<(String, Store)> {
    let name = format!("jr_jobs_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    admin.close().await?;
    let store = Store::connect(&format!("postgres://postgres@127.0.0.1:5432/{name}")).await?;
    store.migrate().await?;
    Ok((name, store))
}

async fn drop_database(name: &str, store: Store) -> anyhow::Result<()> {
    store.pool().close().await;
    let mut admin = sqlx::PgConnection::connect(ADMIN_URL).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    Ok(())
}

fn ids(page: &jr_store::JobPage) -> Vec<String> {
    page.jobs.iter().map(|j| j.id.clone()).collect()
}

#[tokio::test]
async fn jobs_are_listed_newest_first_filtered_and_paged() -> anyhow::Result<()> {
    let (name, store) = database().await?;
    // Four jobs fetched at 1 s, 2 s, 3 s and 4 s: one succeeded, one waits, one failed, one
    // runs on the vm backend.
    let done = Builder::new(1, "pod");
    let waiting = Builder::new(2, "pod");
    let failed = Builder::new(3, "pod");
    let vm = Builder::new(4, "vm");
    let assignments: Vec<(u64, Envelope)> = vec![
        (1, done.assignment(1, 1_005)),
        (2, waiting.assignment(1, 2_005)),
        (3, failed.assignment(1, 3_005)),
        (4, vm.assignment(1, 4_005)),
    ];
    let events: Vec<(u64, Envelope)> = vec![
        (1, done.created(1, 1_100)),
        (2, done.claimed(1, 1_200)),
        (3, done.terminal(1, 1_300, true)),
        (4, done.released(1, 1_400)),
        (5, failed.created(1, 3_100)),
        (6, failed.terminal_failed(1, 3_200, "workload lost")),
        (7, failed.task_failed(1, 3_300, "workload lost")),
        (10, failed.released(1, 3_400)),
        (8, vm.created(1, 4_100)),
        (9, vm.claimed(1, 4_200)),
    ];
    store.apply_batch(ASSIGNMENTS_STREAM, &assignments).await?;
    store.apply_batch(EVENTS_STREAM, &events).await?;
    let id = |b: &Builder| b.id.to_string();
    let all = |filter: JobFilter| {
        let store = store.clone();
        async move {
            store
                .jobs(&JobFilter {
                    limit: 50,
                    ..filter
                })
                .await
        }
    };

    let page = all(JobFilter::default()).await?;
    assert_eq!(ids(&page), [id(&vm), id(&failed), id(&waiting), id(&done)]);
    assert_eq!(page.next, None);
    assert_eq!(
        page.jobs[0].at_ms, 4_000,
        "the forge's fetch time orders the list"
    );

    let pod = all(JobFilter {
        backend: Some("pod".into()),
        ..Default::default()
    })
    .await?;
    assert_eq!(ids(&pod), [id(&failed), id(&waiting), id(&done)]);

    let failures = all(JobFilter {
        state: Some("failed".into()),
        ..Default::default()
    })
    .await?;
    assert_eq!(ids(&failures), [id(&failed)]);
    assert_eq!(failures.jobs[0].reason.as_deref(), Some("workload lost"));
    assert_eq!(failures.jobs[0].result.as_deref(), Some("failure"));

    let succeeded = all(JobFilter {
        result: Some("success".into()),
        ..Default::default()
    })
    .await?;
    assert_eq!(ids(&succeeded), [id(&done)]);
    assert!(succeeded.jobs[0].claimed_at_ms.is_some() && succeeded.jobs[0].ended_at_ms.is_some());

    let window = all(JobFilter {
        since_ms: Some(2_000),
        until_ms: Some(4_000),
        ..Default::default()
    })
    .await?;
    assert_eq!(ids(&window), [id(&failed), id(&waiting)]);

    let nothing = all(JobFilter {
        repository: Some("org/other".into()),
        ..Default::default()
    })
    .await?;
    assert!(nothing.jobs.is_empty());

    // Pages of two: every job once, in order, then no next page.
    let first = store
        .jobs(&JobFilter {
            limit: 2,
            ..Default::default()
        })
        .await?;
    assert_eq!(ids(&first), [id(&vm), id(&failed)]);
    let cursor = Cursor::parse(first.next.as_deref().unwrap_or_default()).expect("a cursor");
    let second = store
        .jobs(&JobFilter {
            limit: 2,
            after: Some(cursor),
            ..Default::default()
        })
        .await?;
    assert_eq!(ids(&second), [id(&waiting), id(&done)]);
    assert_eq!(second.next, None);
    drop_database(&name, store).await
}

#[tokio::test]
async fn history_counts_jobs_fetched_and_ended_per_minute_and_their_wait() -> anyhow::Result<()> {
    let (name, store) = database().await?;
    let now = jr_protocol::now_ms();
    // Two pod jobs fetched now (one got its workload after 2 s and ended), one an hour and a
    // half ago (outside the window).
    let recent = Builder::new(1, "pod");
    let waiting = Builder::new(2, "pod");
    let old = Builder::new(3, "pod");
    let assignments: Vec<(u64, Envelope)> = vec![
        (1, recent.assignment(1, now + 5)),
        (2, waiting.assignment(1, now + 5)),
        (3, old.assignment(1, now - 90 * 60_000)),
    ];
    let events: Vec<(u64, Envelope)> = vec![
        (1, recent.created(1, now + 2_000)),
        (2, recent.claimed(1, now + 2_100)),
        (3, recent.terminal(1, now + 2_200, true)),
        (4, recent.released(1, now + 2_300)),
    ];
    store.apply_batch(ASSIGNMENTS_STREAM, &assignments).await?;
    store.apply_batch(EVENTS_STREAM, &events).await?;
    let history = store.history(60).await?;
    let pod = history.get("pod").cloned().unwrap_or_default();
    let fetched: u64 = pod.iter().map(|m| m.fetched).sum();
    let ended: u64 = pod.iter().map(|m| m.ended).sum();
    assert_eq!((fetched, ended), (2, 1), "{pod:?}");
    let wait = pod.iter().find_map(|m| m.wait_secs).expect("a wait");
    assert!((wait - 2.0).abs() < 0.5, "{wait}");
    assert!(!history.contains_key("vm"));
    drop_database(&name, store).await
}
