//! The reconciler process: projector (per stream), plan loop and status API.

use jr_protocol::now_ms;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use jr_protocol::{STREAM_ASSIGNMENTS, STREAM_EVENTS};
use jr_service::Process;
use jr_store::Store;
use jr_telemetry::TaskSet;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::executor::Executor;
use crate::metrics::{BackendLabel, ReconcilerMetrics};
use crate::planner::{PlannerConfig, plan};
use crate::projector::{self, ProjectorState};
use crate::status::{StatusState, router};

pub fn planner_config(c: &jr_config::ReconcilerConfig) -> PlannerConfig {
    PlannerConfig {
        claim_timeout: c.claim_timeout,
        terminal_grace: c.terminal_grace,
        lost_timeout: c.lost_timeout,
        unreachable_hold: c.unreachable_hold,
        orphan_grace: c.orphan_grace,
        max_attempts: c.max_attempts,
        ..PlannerConfig::default()
    }
}

/// Shortest pause between two plans triggered by projected batches.
const MIN_PLAN_GAP: Duration = Duration::from_millis(100);

/// Connects and migrates, retrying while Postgres is not there yet.
async fn open_store(url: &str, shutdown: &CancellationToken) -> anyhow::Result<Option<Store>> {
    let mut delay = Duration::from_millis(200);
    loop {
        match Store::connect(url).await {
            Ok(store) => match store.migrate().await {
                Ok(()) => return Ok(Some(store)),
                Err(e) => tracing::warn!(error = %e, "migrations failed; retrying"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot connect to Postgres; retrying"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

pub async fn run(p: Process) -> anyhow::Result<()> {
    let shutdown = p.shutdown.token();
    let cfg = p.config.reconciler.clone();
    let topology = jr_bus::Topology::new()
        .replicas(p.config.nats.stream_replicas)
        .stream_limits(jr_service::stream_limits(&p.config.nats));
    p.bus
        .ensure_topology(&topology)
        .await
        .context("declaring streams")?;
    let Some(store) = open_store(&p.config.database.url, &shutdown).await? else {
        return Ok(());
    };
    p.readiness.set("database", true);

    let applied = Arc::new(Notify::new());
    let states: Vec<(&'static str, Arc<ProjectorState>)> = [STREAM_ASSIGNMENTS, STREAM_EVENTS]
        .into_iter()
        .map(|s| (s, Arc::new(ProjectorState::default())))
        .collect();
    let mut tasks = TaskSet::new(p.shutdown.clone());
    for (stream, state) in &states {
        let (bus, store, state, applied, stop) = (
            p.bus.clone(),
            store.clone(),
            state.clone(),
            applied.clone(),
            shutdown.clone(),
        );
        let (stream, max_batch) = (*stream, cfg.max_batch);
        tasks.spawn(format!("projector {stream}"), async move {
            projector::run(bus, store, stream, max_batch, state, applied, stop).await
        });
    }

    let status = Arc::new(StatusState {
        store: store.clone(),
        bus: p.bus.clone(),
        capacity: p
            .config
            .enabled_backends()
            .map(|(n, b)| (n.to_string(), b.capacity))
            .collect::<BTreeMap<_, _>>(),
    });
    let listener = tokio::net::TcpListener::bind(cfg.status_listen)
        .await
        .with_context(|| format!("binding reconciler.status_listen {}", cfg.status_listen))?;
    {
        let stop = shutdown.clone();
        tasks.spawn("status api", async move {
            axum::serve(listener, router(status))
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        });
    }

    let metrics = Arc::new(ReconcilerMetrics::default());
    metrics.register(&mut p.metrics.registry(), states.clone());
    let planner = planner_config(&cfg);
    let mut executor = Executor::new(p.bus.clone(), metrics.clone(), Duration::from_secs(30));
    let backends: Vec<String> = p
        .config
        .enabled_backends()
        .map(|(n, _)| n.to_string())
        .collect();
    loop {
        let caught_up = states
            .iter()
            .all(|(_, s)| s.caught_up.load(Ordering::Acquire));
        p.readiness.set("projection", caught_up);
        // Planning on a projection that is still replaying would act on old state.
        if caught_up {
            match store.snapshot(now_ms()).await {
                Ok(snapshot) => {
                    let commands = plan(&snapshot, now_ms(), &planner);
                    executor.execute(&commands).await;
                    update_gauges(&p.bus, &store, &metrics, &backends).await;
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the projection; planning later"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(cfg.plan_interval) => {}
            // Newly projected facts are planned on promptly, but a busy stream does not make the
            // snapshot load back to back.
            _ = async { applied.notified().await; tokio::time::sleep(MIN_PLAN_GAP).await } => {}
        }
    }
    let report = tasks.join_all(Duration::from_secs(15)).await;
    anyhow::ensure!(
        report.is_clean(),
        "reconciler tasks failed: {:?} unfinished: {:?}",
        report.failed,
        report.unfinished
    );
    Ok(())
}

/// Queue depth (the worker consumer's pending count) and projected slot use per backend.
async fn update_gauges(
    bus: &jr_bus::Bus,
    store: &Store,
    metrics: &ReconcilerMetrics,
    backends: &[String],
) {
    for backend in backends {
        if let Ok(c) = bus
            .consumer_info(STREAM_ASSIGNMENTS, &format!("{backend}-worker"))
            .await
        {
            metrics
                .queue_depth
                .get_or_create(&BackendLabel {
                    backend: backend.clone(),
                })
                .set(c.num_pending as i64);
        }
    }
    if let Ok(slots) = store.slots_used().await {
        for backend in backends {
            let used = slots
                .iter()
                .find(|s| &s.backend == backend)
                .map_or(0, |s| s.used);
            metrics
                .slots_used
                .get_or_create(&BackendLabel {
                    backend: backend.clone(),
                })
                .set(used as i64);
        }
    }
}
