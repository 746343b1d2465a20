//! Projection apply throughput by batch size, against a throwaway database on the local
//! Postgres: `cargo run --release -p jr-store --example apply_bench [postgres-admin-url]`.

use std::time::Instant;

use anyhow::Context;
use jr_store::Store;
use jr_store::testkit::random_history;
use sqlx::Connection;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let admin_url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let name = format!("jr_store_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&admin_url)
        .await
        .context("connect")?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    if std::env::var_os("BENCH_ASYNC_COMMIT").is_some() {
        // Shows how much of the small-batch cost is the commit's WAL flush.
        sqlx::query(&format!(
            "ALTER DATABASE {name} SET synchronous_commit = off"
        ))
        .execute(&mut admin)
        .await?;
    }
    let base = admin_url
        .rsplit_once('/')
        .map_or(admin_url.as_str(), |(b, _)| b);
    let store = Store::connect(&format!("{base}/{name}")).await?;
    store.migrate().await?;

    let history = random_history(1, 2_000);
    let events = &history.events;
    println!(
        "history: {} assignment messages, {} events",
        history.assignments.len(),
        events.len()
    );
    for batch in [1usize, 16, 128, 512] {
        store.reset().await?;
        let items = if batch == 1 {
            &events[..2_000.min(events.len())]
        } else {
            &events[..]
        };
        let started = Instant::now();
        for chunk in items.chunks(batch) {
            store.apply_batch("JR_EVENTS", chunk).await?;
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "batch {batch:>4}: {:>6} events in {secs:>6.2} s = {:>8.0} events/s",
            items.len(),
            items.len() as f64 / secs
        );
    }
    store.pool().close().await;
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    Ok(())
}
