//! The reconciler process: projector (per stream), plan loop and status API.
//!
//! The plan loop keeps the unfinished records in memory (an [`IncrementalPlanner`]): loaded
//! from Postgres at start and whenever a projector starts over, and otherwise updated with the
//! records each committed batch changed. A cycle plans what changed and what is due, then
//! sleeps until the next batch or the planner's next deadline.

use jr_protocol::now_ms;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use jr_protocol::{BackendName, STREAM_ASSIGNMENTS, STREAM_EVENTS};
use jr_service::Process;
use jr_store::Store;
use jr_telemetry::TaskSet;
use tokio_util::sync::CancellationToken;

use crate::executor::Executor;
use crate::metrics::{BackendLabel, ReconcilerMetrics};
use crate::planner::{IncrementalPlanner, PlannerConfig};
use crate::projector::{self, Feed, ProjectorState};
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

/// Shortest pause between two plan cycles woken by deadlines.
const MIN_PLAN_GAP: Duration = Duration::from_millis(100);

/// Pause after a projected batch before planning it: enough for a batch of the other stream
/// committed at the same moment to join the cycle. A cycle costs what changed, so reacting
/// fast is cheap; the delete of a finished job's workload waits no longer than this.
const REACT_GAP: Duration = Duration::from_millis(10);

/// A command still wanted this long after it was published is published again.
const REISSUE_AFTER: Duration = Duration::from_secs(30);

/// Connects and migrates, retrying while Postgres is not there yet.
async fn open_store(url: &str, shutdown: &CancellationToken) -> anyhow::Result<Option<Store>> {
    let mut backoff = jr_bus::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        match Store::connect(url).await {
            Ok(store) => match store.migrate().await {
                Ok(()) => return Ok(Some(store)),
                Err(e) => tracing::warn!(error = %e, "migrations failed; retrying"),
            },
            Err(e) => tracing::warn!(error = %e, "cannot connect to Postgres; retrying"),
        }
        if !backoff.pause(shutdown).await {
            return Ok(None);
        }
    }
}

pub async fn run(p: Process) -> anyhow::Result<()> {
    let shutdown = p.shutdown.token();
    let cfg = p.config.reconciler.clone();
    let topology = jr_bus::Topology::new()
        .replicas(p.config.nats.stream_replicas)
        .stream_limits(jr_service::stream_limits(&p.config.nats));
    p.bus
        .ensure_topology_retrying(&topology, &shutdown)
        .await
        .context("declaring streams")?;
    p.bus
        .key_value(
            jr_bus::permissions::PLACEMENT_BUCKET,
            "placement switches set by operators (key burst: off, on, on:<percent>)",
            10,
        )
        .await
        .context("declaring the KV bucket of the placement switches")?;
    let Some(store) = open_store(&p.config.database.url, &shutdown).await? else {
        return Ok(());
    };
    p.readiness.set("database", true);

    let states: Vec<(&'static str, Arc<ProjectorState>)> = [STREAM_ASSIGNMENTS, STREAM_EVENTS]
        .into_iter()
        .map(|s| (s, Arc::new(ProjectorState::default())))
        .collect();
    let mut tasks = TaskSet::new(p.shutdown.clone());
    let status = Arc::new(StatusState {
        store: store.clone(),
        bus: p.bus.clone(),
        capacity: p
            .config
            .enabled_backends()
            .map(|(n, b)| (n.to_string(), b.capacity))
            .collect::<BTreeMap<_, _>>(),
        provider_capacity: p
            .config
            .enabled_backends()
            .map(|(n, b)| {
                let providers = b
                    .providers
                    .iter()
                    .map(|pr| (pr.name.clone(), pr.max_runners.unwrap_or(b.capacity)))
                    .collect::<BTreeMap<_, _>>();
                (n.to_string(), providers)
            })
            .collect(),
        registrations: p.config.intake_names(),
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

    // One replica projects and plans: the holder of the lease in `JR_RECONCILER`. Any replica
    // serves the status API (it reads the projection).
    let policy = jr_service::lease_policy(&p.config)?;
    let lease_store = p
        .bus
        .key_value(
            jr_bus::permissions::RECONCILER_BUCKET,
            "the reconciler's lease (key lease.reconciler)",
            1,
        )
        .await
        .context("declaring the KV bucket JR_RECONCILER")?;
    let me = jr_bus::lease::replica_id("reconciler");
    tracing::info!(replica = %me, "reconciler replica");
    let mut leadership = jr_bus::lease::spawn_lease(
        jr_bus::lease::LeaseSpec {
            store: lease_store,
            key: LEASE_KEY.to_owned(),
            me,
            policy,
        },
        shutdown.clone(),
    );
    let mut result = Ok(());
    loop {
        // A standby has nothing to project: it is ready to serve the status API.
        p.readiness.set("projection", true);
        let Some(term) = leadership.until_acting(&shutdown).await else {
            break;
        };
        metrics.leader.set(1);
        tracing::info!(
            term,
            "holding the reconciler lease: projecting and planning"
        );
        let lead = shutdown.child_token();
        let watch = {
            let (mut l, lead) = (leadership.clone(), lead.clone());
            tokio::spawn(async move {
                l.lost().await;
                lead.cancel();
            })
        };
        result = match lead_term(&p, &store, &states, &metrics, lead).await {
            // A term that ended because the lease was lost (a NATS fault, a stall) must not
            // stop the process: its projector tasks were aborted, their uncommitted batches
            // roll back, and the next term starts from the stored checkpoints.
            Ok(unfinished) if !unfinished.is_empty() && !shutdown.is_cancelled() => {
                tracing::warn!(
                    tasks = ?unfinished,
                    "projector tasks did not stop within 15 s of the lease's loss; aborted them"
                );
                Ok(())
            }
            Ok(unfinished) if !unfinished.is_empty() => Err(anyhow::anyhow!(
                "projector tasks did not stop within 15 s of shutdown: {unfinished:?}"
            )),
            Ok(_) => Ok(()),
            Err(error) => Err(error),
        };
        watch.abort();
        metrics.leader.set(0);
        if result.is_err() || shutdown.is_cancelled() {
            break;
        }
        tracing::warn!("lost the reconciler lease: projecting and planning stop");
    }
    shutdown.cancel();
    let report = tasks.join_all(Duration::from_secs(15)).await;
    result?;
    anyhow::ensure!(
        report.is_clean(),
        "reconciler tasks failed: {:?} unfinished: {:?}",
        report.failed,
        report.unfinished
    );
    Ok(())
}

/// The key of the reconciler's lease in [`jr_bus::permissions::RECONCILER_BUCKET`].
const LEASE_KEY: &str = "lease.reconciler";

/// Projects both streams and plans while `lead` holds: the projectors start from the stored
/// checkpoints and the planner from the projection, as at start, so a replica that takes over
/// continues exactly where the last holder's commits ended.
async fn lead_term(
    p: &Process,
    store: &Store,
    states: &[(&'static str, Arc<ProjectorState>)],
    metrics: &Arc<ReconcilerMetrics>,
    lead: CancellationToken,
) -> anyhow::Result<Vec<String>> {
    let cfg = &p.config.reconciler;
    let feed = Arc::new(Feed::new());
    let mut tasks = TaskSet::new(jr_telemetry::Shutdown::from(lead.clone()));
    for (stream, state) in states {
        state.caught_up.store(false, Ordering::Release);
        let (bus, store, state, feed, stop) = (
            p.bus.clone(),
            store.clone(),
            state.clone(),
            feed.clone(),
            lead.clone(),
        );
        let (stream, max_batch, linger) = (*stream, cfg.max_batch, cfg.batch_linger);
        tasks.spawn(format!("projector {stream}"), async move {
            projector::run(bus, store, stream, max_batch, linger, state, feed, stop).await
        });
    }
    let mut planner = IncrementalPlanner::new(planner_config(cfg), REISSUE_AFTER);
    let mut executor = Executor::new(p.bus.clone(), metrics.clone(), REISSUE_AFTER)
        .with_traces(feed.traces.clone());
    let backends: Vec<BackendName> = p.config.enabled_backends().map(|(n, _)| n).collect();
    // The planner's clock never goes back, even if the system clock does.
    let mut now = 0;
    loop {
        if feed.needs_reload() {
            let load = async { store.snapshot(now_ms()).await };
            match feed.reload(load).await {
                Ok(snapshot) => {
                    tracing::info!(
                        assignments = snapshot.assignments.len(),
                        "loaded the unfinished assignments from the projection"
                    );
                    planner.load(snapshot.assignments);
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the projection; loading later"),
            }
        }
        for record in feed.take() {
            planner.update(record);
        }
        let caught_up = states
            .iter()
            .all(|(_, s)| s.caught_up.load(Ordering::Acquire));
        p.readiness.set("projection", caught_up);
        now = now_ms().max(now);
        // Planning on a projection that is still replaying would act on old state; a replica
        // whose lease ran out plans nothing more.
        if caught_up && !feed.needs_reload() && !lead.is_cancelled() {
            let commands = planner.plan(now);
            let failed = executor.execute(&commands, now).await;
            planner.not_issued(&failed);
            update_gauges(&planner, metrics, &backends);
        }
        // Until the next deadline (at least a gap, at most `plan_interval`), or a projected batch.
        let wait = planner
            .next_wake(now)
            .map_or(cfg.plan_interval, |at| {
                Duration::from_millis(at.saturating_sub(now_ms()) + 1)
            })
            .clamp(MIN_PLAN_GAP, cfg.plan_interval.max(MIN_PLAN_GAP));
        tokio::select! {
            _ = lead.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
            // Newly projected facts are planned on promptly, but a busy stream does not make
            // cycles back to back.
            _ = async { feed.applied().await; tokio::time::sleep(REACT_GAP).await } => {}
        }
    }
    let report = tasks.join_all(Duration::from_secs(15)).await;
    anyhow::ensure!(
        report.failed.is_empty(),
        "projector tasks failed: {:?} unfinished: {:?}",
        report.failed,
        report.unfinished
    );
    // Tasks still running after the bound were aborted; the caller decides what that means.
    Ok(report.unfinished)
}

/// Queue depth (assignments waiting for a slot), the oldest wait and slot use per backend, from
/// the records in memory.
fn update_gauges(
    planner: &IncrementalPlanner,
    metrics: &ReconcilerMetrics,
    backends: &[BackendName],
) {
    for backend in backends {
        let label = BackendLabel {
            backend: backend.to_string(),
        };
        metrics
            .queue_depth
            .get_or_create(&label)
            .set(i64::try_from(planner.queued(backend)).unwrap_or(i64::MAX));
        metrics
            .slots_used
            .get_or_create(&label)
            .set(i64::try_from(planner.slots_used(backend)).unwrap_or(i64::MAX));
        let waited = planner
            .oldest_waiting(backend)
            .map_or(0, |since| jr_protocol::now_ms().saturating_sub(since));
        metrics
            .oldest_wait
            .get_or_create(&label)
            .set(waited as f64 / 1000.0);
    }
}
