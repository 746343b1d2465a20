//! The scheduler's Prometheus metrics, read at scrape time from the fetchers' and the facade's
//! counters (forge errors, dispatches, facade auth refusals, claims, terminals).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use jr_facade::{Facade, Ledger};
use jr_gitea_intake::Dispatcher;
use jr_gitea_intake::fetcher::DispatchStats;
use jr_intake::board::IntakeBoard;

pub struct SchedulerCollector<L: Ledger> {
    /// The Gitea/Forgejo fetch loops' dispatcher, when a Gitea forge is configured.
    pub dispatcher: Option<Arc<Dispatcher>>,
    /// Every intake's health.
    pub board: Arc<IntakeBoard>,
    /// Each GitHub scale set listener's figures, by `[[github]]` name.
    pub github: Vec<(String, Arc<jr_github::ListenerStats>)>,
    pub facade: Arc<Facade<L>>,
}

impl<L: Ledger> std::fmt::Debug for SchedulerCollector<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SchedulerCollector")
    }
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    let metric = encoder.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(metric)
}

impl<L: Ledger> Collector for SchedulerCollector<L> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let no_gitea = DispatchStats::default();
        let d = self.dispatcher.as_ref().map_or(&no_gitea, |d| &d.stats);
        let e = &mut encoder;
        counter(
            e,
            "scheduler_tasks_fetched",
            "Tasks received from the forge",
            d.fetched.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "scheduler_assignments_dispatched",
            "Assignments made durable in JetStream",
            d.dispatched.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "scheduler_assignments_duplicate",
            "Dispatches JetStream recognised as repeats",
            d.duplicates.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "scheduler_tasks_unroutable",
            "Tasks no backend serves, failed at the forge",
            d.unroutable.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "scheduler_fetch_errors",
            "FetchTask calls that failed",
            d.fetch_errors.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "scheduler_fetch_paused",
            "Fetch decisions skipped because no backend of the registration had room",
            d.paused.load(Ordering::Relaxed),
        )?;
        {
            let unclaimed = self.dispatcher.as_ref().map_or(0, |d| d.unclaimed.len());
            let unclaimed = i64::try_from(unclaimed).unwrap_or(i64::MAX);
            let g = ConstGauge::new(unclaimed);
            let metric = e.encode_descriptor(
                "scheduler_unclaimed_tasks",
                "Tasks fetched from the forge that no executor has claimed yet (kept alive)",
                None,
                g.metric_type(),
            )?;
            g.encode(metric)?;
        }
        counter(
            e,
            "scheduler_intake_stream_full",
            "Times a full JR_ASSIGNMENTS stream paused intake (backpressure, nothing failed)",
            d.stream_full.load(Ordering::Relaxed),
        )?;
        {
            let blocked = i64::try_from(d.intake_blocked.load(Ordering::Relaxed)).unwrap_or(0);
            let g = ConstGauge::new(blocked);
            let metric = e.encode_descriptor(
                "scheduler_intake_blocked",
                "Fetched tasks waiting for room in a full JR_ASSIGNMENTS stream (intake paused)",
                None,
                g.metric_type(),
            )?;
            g.encode(metric)?;
        }
        counter(
            e,
            "scheduler_fetch_takeovers",
            "Times this replica took over fetching for a registration (its lease)",
            d.takeovers.load(Ordering::Relaxed),
        )?;
        {
            let g = ConstGauge::new(0i64);
            let mut family = e.encode_descriptor(
                "scheduler_fetch_leader",
                "1 while this replica holds the registration's lease and fetches for it, else 0",
                None,
                g.metric_type(),
            )?;
            let registrations = self
                .dispatcher
                .iter()
                .flat_map(|d| d.forges.registrations().into_iter().map(move |r| (d, r)));
            for (dispatcher, registration) in registrations {
                let acting = dispatcher
                    .leases
                    .get(&registration.name)
                    .is_none_or(|l| l.acting().is_some());
                let labels = [("registration", registration.name.as_str())];
                ConstGauge::new(i64::from(acting)).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let g = ConstGauge::new(0i64);
            let mut family = e.encode_descriptor(
                "scheduler_backend_blocked",
                "1 while a registration fetches nothing for a backend, by reason (full, no-worker, unreachable); only on the replica fetching for the registration",
                None,
                g.metric_type(),
            )?;
            for intake in self.board.snapshot() {
                for backend in &intake.backends {
                    for reason in jr_bus::intake::Blocked::ALL {
                        let labels = [
                            ("registration", intake.registration.as_str()),
                            ("backend", backend.backend.as_str()),
                            ("reason", reason.as_str()),
                        ];
                        let value = i64::from(backend.blocked == Some(reason));
                        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
        }
        {
            let g = ConstGauge::new(0i64);
            let mut family = e.encode_descriptor(
                "scheduler_registration_fetching",
                "1 while a registration may take tasks from the forge (a backend it serves takes work), else 0",
                None,
                g.metric_type(),
            )?;
            for intake in self.board.snapshot() {
                let labels = [("registration", intake.registration.as_str())];
                ConstGauge::new(i64::from(intake.fetching))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let g = ConstGauge::new(0i64);
            let mut family = e.encode_descriptor(
                "intake_up",
                "1 while an intake (a forge registration, a GitHub scale set) works, 0 while its forge is unreachable or refuses it (retried meanwhile)",
                None,
                g.metric_type(),
            )?;
            for intake in self.board.snapshot() {
                let labels = [
                    ("intake", intake.registration.as_str()),
                    ("kind", intake.forge.as_str()),
                ];
                ConstGauge::new(i64::from(intake.error.is_none()))
                    .encode(family.encode_family(&labels)?)?;
            }
        }
        counter(
            e,
            "scheduler_label_declares",
            "Declares that changed the labels of a shared registration (backends withdrawn or declared again)",
            d.declares.load(Ordering::Relaxed),
        )?;
        let f = self.facade.stats();
        {
            let c = ConstCounter::new(0u64);
            let mut family = e.encode_descriptor(
                "facade_auth_refusals",
                "Executor calls refused as unauthenticated, by reason",
                None,
                c.metric_type(),
            )?;
            for (reason, n) in &f.auth_refusals {
                let labels = [("reason", reason.as_str())];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        counter(
            e,
            "facade_claims_won",
            "Tasks handed to their executor",
            f.claims_won,
        )?;
        counter(
            e,
            "facade_claims_lost",
            "FetchTask calls that lost the once-only claim",
            f.claims_lost,
        )?;
        counter(
            e,
            "facade_fetches_pending",
            "FetchTask answered 'no task yet'",
            f.fetches_pending,
        )?;
        counter(
            e,
            "facade_permission_denied",
            "Calls for another task or before the claim",
            f.permission_denied,
        )?;
        counter(
            e,
            "facade_terminals",
            "Final results accepted by the forge",
            f.terminals_published,
        )?;
        counter(
            e,
            "facade_finals_answered_here",
            "Retried final UpdateTask calls answered without the forge (the final was already accepted)",
            f.finals_answered_here,
        )?;
        counter(
            e,
            "facade_finals_found_at_forge",
            "Finals the forge already held when they reached a replica that had not served their attempt (recorded, not forwarded again)",
            f.finals_found_at_forge,
        )?;
        counter(
            e,
            "facade_forwarded_calls",
            "UpdateTask/UpdateLog calls forwarded to the forge",
            f.forwarded_calls,
        )?;
        counter(
            e,
            "facade_forward_errors",
            "Forwarded calls answered with an error",
            f.forward_errors,
        )?;
        counter(
            e,
            "facade_proxied_requests",
            "Artifact/cache requests proxied to the forge",
            f.proxied_requests,
        )?;
        counter(
            e,
            "facade_ledger_errors",
            "JetStream lookups or publishes of the facade that failed",
            f.ledger_errors,
        )?;
        self.encode_github(e)
    }
}

impl<L: Ledger> SchedulerCollector<L> {
    /// `github_*{forge}`: what each scale set listener did, and the service's statistics.
    fn encode_github(&self, e: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use jr_github::ListenerStats;
        type Read = fn(&ListenerStats) -> &std::sync::atomic::AtomicU64;
        let counters: [(&str, &str, Read); 10] = [
            (
                "github_sessions",
                "Message sessions opened or resumed",
                |s| &s.sessions,
            ),
            ("github_messages", "Scale set messages handled", |s| {
                &s.messages
            }),
            (
                "github_jobs_assigned",
                "Jobs GitHub assigned to the scale set",
                |s| &s.jobs_assigned,
            ),
            (
                "github_jobs_started",
                "Jobs that started on a runner",
                |s| &s.jobs_started,
            ),
            ("github_jobs_completed", "Jobs that completed", |s| {
                &s.jobs_completed
            }),
            (
                "github_runners_made",
                "Just-in-time runners made and published",
                |s| &s.runners_made,
            ),
            (
                "github_acquire_failures",
                "Acquire calls that failed",
                |s| &s.acquire_failures,
            ),
            (
                "github_jit_failures",
                "JIT runner configs GitHub did not make",
                |s| &s.jit_failures,
            ),
            (
                "github_runners_removed",
                "Idle runners removed beyond min_idle while the scale set was idle",
                |s| &s.runners_removed,
            ),
            (
                "github_runners_lost",
                "Runners found gone before they took a job (made again while jobs wait)",
                |s| &s.runners_lost,
            ),
        ];
        let gauges: [(&str, &str, Read); 6] = [
            (
                "github_runners_idle",
                "Runners made and not known to have taken a job",
                |s| &s.runners_idle,
            ),
            (
                "github_runners_busy",
                "Runners GitHub holds busy with a job",
                |s| &s.runners_busy,
            ),
            (
                "github_jobs_held",
                "Jobs assigned to the scale set and not over, as the listener saw them",
                |s| &s.jobs_held,
            ),
            (
                "github_available_jobs",
                "Jobs available to the scale set (GitHub's statistics)",
                |s| &s.available_jobs,
            ),
            (
                "github_assigned_jobs",
                "Jobs assigned to the scale set (GitHub's statistics)",
                |s| &s.assigned_jobs,
            ),
            (
                "github_running_jobs",
                "Jobs running in the scale set (GitHub's statistics)",
                |s| &s.running_jobs,
            ),
        ];
        if self.github.is_empty() {
            return Ok(());
        }
        for (name, help, read) in counters {
            let c = ConstCounter::new(0u64);
            let mut family = e.encode_descriptor(name, help, None, c.metric_type())?;
            for (forge, stats) in &self.github {
                let value = read(stats).load(Ordering::Relaxed);
                ConstCounter::new(value)
                    .encode(family.encode_family(&[("forge", forge.as_str())])?)?;
            }
        }
        for (name, help, read) in gauges {
            let g = ConstGauge::new(0i64);
            let mut family = e.encode_descriptor(name, help, None, g.metric_type())?;
            for (forge, stats) in &self.github {
                let value = i64::try_from(read(stats).load(Ordering::Relaxed)).unwrap_or(i64::MAX);
                ConstGauge::new(value)
                    .encode(family.encode_family(&[("forge", forge.as_str())])?)?;
            }
        }
        Ok(())
    }
}
