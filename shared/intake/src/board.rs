//! What each forge registration fetches, and why not: the fetch loops report every decision
//! here; a change of a backend's state is logged once (which registration, which backend,
//! why), and the board feeds the metric `jetrunner_scheduler_backend_blocked`, the `/readyz`
//! details and the records in the KV bucket `JR_INTAKES` that the status page and `jr status`
//! show.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use jr_bus::Bus;
use jr_bus::intake::{BackendIntake, Blocked, IntakeStatus, REFRESH_EVERY};
use jr_protocol::{BackendName, now_ms};
use jr_telemetry::Readiness;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::pacing::Condition;

/// The most often the records are written to `JR_INTAKES`.
const WRITE_EVERY: Duration = Duration::from_secs(1);

/// One registration's decision at one moment, as the fetch loop reports it.
pub struct Observation<'a> {
    pub registration: &'a str,
    /// Per backend: its condition, the assignments waiting for it, whether its labels are
    /// declared to the forge now.
    pub backends: Vec<(BackendName, Condition, Option<u64>, bool)>,
    pub declared_labels: &'a [String],
    pub room: usize,
}

#[derive(Debug)]
struct Entry {
    status: IntakeStatus,
    /// Changed since it was last written to the bucket.
    dirty: bool,
    /// This replica speaks for the intake (holds its lease, or no lease is used): only then is
    /// the record written to the bucket; a standby's view stays in its own `/readyz`.
    speaks: bool,
}

/// The registrations' records, kept by this replica for those whose lease it holds.
#[derive(Debug)]
pub struct IntakeBoard {
    forge: String,
    layout: String,
    replica: String,
    entries: Mutex<BTreeMap<String, Entry>>,
    changed: Notify,
    readiness: Option<Readiness>,
}

impl IntakeBoard {
    pub fn new(forge: &str, layout: &str, replica: &str, readiness: Option<Readiness>) -> Self {
        Self {
            forge: forge.to_owned(),
            layout: layout.to_owned(),
            replica: replica.to_owned(),
            entries: Mutex::new(BTreeMap::new()),
            changed: Notify::new(),
            readiness,
        }
    }

    fn entry<'a>(
        &self,
        entries: &'a mut BTreeMap<String, Entry>,
        intake: &str,
        kind: Option<(&str, &str)>,
    ) -> &'a mut Entry {
        let (forge, layout) = kind.unwrap_or((&self.forge, &self.layout));
        entries.entry(intake.to_owned()).or_insert_with(|| Entry {
            status: IntakeStatus {
                registration: intake.to_owned(),
                forge: forge.to_owned(),
                layout: layout.to_owned(),
                declared_labels: Vec::new(),
                fetching: false,
                backends: Vec::new(),
                replica: self.replica.clone(),
                updated_at_ms: now_ms(),
                error: None,
            },
            dirty: true,
            speaks: false,
        })
    }

    /// Records whether an intake works: `error` is why not (its whole chain), `None` once it
    /// does. `speaks`: this replica holds the intake's lease (its record goes to the bucket).
    /// `kind`: `(forge, layout)` when not the Gitea/Forgejo registration's.
    pub fn report(
        &self,
        intake: &str,
        kind: Option<(&str, &str)>,
        error: Option<String>,
        speaks: bool,
    ) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = self.entry(&mut entries, intake, kind);
        entry.speaks |= speaks;
        if entry.status.error != error {
            entry.status.error = error;
            entry.dirty = true;
            if let Some(readiness) = &self.readiness {
                readiness.set_detail(&format!("intake.{intake}"), detail(&entry.status));
            }
            self.changed.notify_one();
        }
    }

    /// Records a fetch loop's decision; logs each backend whose state changed.
    pub fn observe(&self, o: &Observation<'_>) {
        let now = now_ms();
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = self.entry(&mut entries, o.registration, None);
        // Only the lease holder's fetch loop decides.
        entry.speaks = true;
        let before = std::mem::take(&mut entry.status.backends);
        let mut changed = entry.status.declared_labels != o.declared_labels
            || entry.status.fetching != (o.room > 0);
        for (backend, condition, waiting, declared) in &o.backends {
            let blocked = condition.blocked();
            let previous = before.iter().find(|b| b.backend == backend.as_str());
            let since_ms = match previous {
                Some(p) if p.blocked == blocked => p.since_ms,
                _ => {
                    changed = true;
                    log_change(
                        o.registration,
                        backend,
                        previous.and_then(|p| p.blocked),
                        blocked,
                    );
                    now
                }
            };
            changed |= previous.is_none_or(|p| p.declared != *declared);
            entry.status.backends.push(BackendIntake {
                backend: backend.to_string(),
                blocked,
                room: Some(condition.room() as u64),
                waiting: *waiting,
                declared: *declared,
                since_ms,
            });
        }
        entry.status.declared_labels = o.declared_labels.to_vec();
        entry.status.fetching = o.room > 0;
        if changed {
            entry.dirty = true;
            if let Some(readiness) = &self.readiness {
                readiness.set_detail(&format!("intake.{}", o.registration), detail(&entry.status));
            }
            self.changed.notify_one();
        }
    }

    /// This replica stopped fetching for `registration` (lease lost): another writes its
    /// record now; what this replica knows of the intake's health stays.
    pub fn forget(&self, registration: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = entries.get_mut(registration) {
            entry.speaks = false;
            entry.status.backends.clear();
            entry.status.fetching = false;
            if let Some(readiness) = &self.readiness {
                readiness.set_detail(&format!("intake.{registration}"), detail(&entry.status));
            }
        }
    }

    /// The records this replica keeps.
    pub fn snapshot(&self) -> Vec<IntakeStatus> {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|e| e.status.clone())
            .collect()
    }

    /// Records to write now: the changed ones, or all of them when `all`; marks them written.
    fn take_due(&self, all: bool) -> Vec<IntakeStatus> {
        let now = now_ms();
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries
            .values_mut()
            .filter(|e| e.speaks && (all || e.dirty))
            .map(|e| {
                e.dirty = false;
                e.status.updated_at_ms = now;
                e.status.clone()
            })
            .collect()
    }

    fn mark_dirty(&self, registration: &str) {
        if let Some(e) = self
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(registration)
        {
            e.dirty = true;
        }
    }

    /// Writes the records to `JR_INTAKES` when they change and every [`REFRESH_EVERY`], until
    /// shutdown. NATS trouble is retried; the records are for people, so a write that fails
    /// only delays what the status page shows.
    pub async fn run_writer(&self, bus: Bus, shutdown: CancellationToken) {
        let mut store = None;
        let mut refresh = tokio::time::interval(REFRESH_EVERY);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_write: Option<tokio::time::Instant> = None;
        loop {
            let all = tokio::select! {
                () = shutdown.cancelled() => return,
                _ = refresh.tick() => true,
                () = self.changed.notified() => false,
            };
            // A busy backend turns full and free again at every job: changes are written at
            // most once per WRITE_EVERY, together (the logs, metrics and /readyz follow at once).
            if !all && let Some(last) = last_write {
                let rest = WRITE_EVERY.saturating_sub(last.elapsed());
                if !rest.is_zero() {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(rest) => {}
                    }
                }
            }
            last_write = Some(tokio::time::Instant::now());
            let due = self.take_due(all);
            if due.is_empty() {
                continue;
            }
            if store.is_none() {
                match jr_bus::intake::open_or_create(&bus).await {
                    Ok(s) => store = Some(s),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot open the intake records' bucket; retrying");
                        due.iter().for_each(|s| self.mark_dirty(&s.registration));
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
            let Some(kv) = store.as_ref() else { continue };
            for status in due {
                if let Err(e) = kv
                    .put(status.registration.as_str(), status.encode().into())
                    .await
                {
                    tracing::debug!(registration = %status.registration, error = %e, "writing the intake record failed; retrying");
                    self.mark_dirty(&status.registration);
                }
            }
        }
    }
}

/// The `/readyz` detail of an intake: why it does not work, or its blocked backends, or
/// nothing.
fn detail(status: &IntakeStatus) -> Option<String> {
    if let Some(error) = &status.error {
        return Some(format!("not working, retried: {error}"));
    }
    let blocked: Vec<String> = status
        .backends
        .iter()
        .filter_map(|b| {
            b.blocked
                .map(|reason| format!("backend {}: {}", b.backend, reason.explain()))
        })
        .collect();
    (!blocked.is_empty()).then(|| {
        format!(
            "{} ({}); declared labels {:?}",
            blocked.join("; "),
            if status.fetching {
                "fetching for the others"
            } else {
                "fetching nothing"
            },
            status.declared_labels
        )
    })
}

fn log_change(
    registration: &str,
    backend: &BackendName,
    was: Option<Blocked>,
    is: Option<Blocked>,
) {
    match (was, is) {
        // A full backend is ordinary backpressure: it changes with every job at saturation.
        (_, Some(Blocked::Full)) | (Some(Blocked::Full) | None, None) => tracing::debug!(
            registration,
            %backend,
            state = is.map_or("taking work", Blocked::as_str),
            "backend state changed"
        ),
        (_, Some(reason)) => tracing::warn!(
            registration,
            %backend,
            reason = reason.as_str(),
            "no work is fetched for backend {backend}: {}",
            reason.explain()
        ),
        (Some(reason), None) => tracing::info!(
            registration,
            %backend,
            was = reason.as_str(),
            "backend {backend} takes work again"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(n: &str) -> BackendName {
        BackendName::new(n.to_owned()).expect("valid")
    }

    #[test]
    fn a_blocked_backend_is_recorded_with_its_reason_since_it_changed() {
        let readiness = Readiness::new();
        let board = IntakeBoard::new("gitea", "shared", "scheduler_1", Some(readiness.clone()));
        let labels = vec!["vm".to_owned()];
        let observe = |pod: Condition| {
            board.observe(&Observation {
                registration: "shared",
                backends: vec![
                    (name("pod"), pod, Some(0), false),
                    (
                        name("vm"),
                        Condition::Room {
                            room: 2,
                            lookahead: 2,
                        },
                        Some(0),
                        true,
                    ),
                ],
                declared_labels: &labels,
                room: 2,
            })
        };
        observe(Condition::Blocked(Blocked::NoWorker));
        let first = board.snapshot();
        let pod = &first[0].backends[0];
        assert_eq!(pod.blocked, Some(Blocked::NoWorker));
        assert!(first[0].fetching);
        let detail = readiness.details();
        let text = detail.get("intake.shared").expect("a /readyz detail");
        assert!(
            text.contains("backend pod") && text.contains("no live worker"),
            "{text}"
        );
        // The same state again keeps its start.
        observe(Condition::Blocked(Blocked::NoWorker));
        assert_eq!(board.snapshot()[0].backends[0].since_ms, pod.since_ms);
        assert_eq!(
            board.take_due(false).len(),
            1,
            "written once after the change"
        );
        observe(Condition::Blocked(Blocked::NoWorker));
        assert!(board.take_due(false).is_empty(), "nothing new to write");
        observe(Condition::Room {
            room: 1,
            lookahead: 2,
        });
        assert_eq!(board.snapshot()[0].backends[0].blocked, None);
        assert!(readiness.details().is_empty(), "detail cleared");
        assert_eq!(board.take_due(false).len(), 1);
        board.forget("shared");
        assert!(
            board.take_due(true).is_empty(),
            "a replica without the lease writes nothing"
        );
        // A forge refusing the runner: reported with its reason, cleared when it works.
        board.report(
            "shared",
            None,
            Some("registration refused: 401".to_owned()),
            true,
        );
        let text = readiness.details()["intake.shared"].clone();
        assert!(text.contains("401"), "{text}");
        assert_eq!(
            board.take_due(false)[0].error.as_deref(),
            Some("registration refused: 401")
        );
        board.report("shared", None, None, true);
        assert!(readiness.details().is_empty());
    }
}
