//! Table encoding of [`AssignmentRecord`]s: one plain row struct per table, built from a record
//! (encode) and turned back into records (decode). Derived columns (`state`, lifecycle times,
//! the attempt's mirrored observation) are written for readers and ignored when decoding.

use jr_protocol::{AssignmentId, BackendName, TaskResult, TerminalSource, WorkloadPhase};
use uuid::Uuid;

use crate::StoreError;
use crate::model::{
    AssignmentInfo, AssignmentRecord, AttemptRecord, ClaimRecord, FailureRecord, Observation,
    RedispatchRecord, TerminalRecord, WorkloadRecord,
};

/// Unix ms as stored (bigint before `jr_ts`). Times beyond i64 cannot occur in practice.
pub(crate) fn db_ms(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

pub(crate) fn from_db_ms(ms: i64) -> u64 {
    u64::try_from(ms).unwrap_or(0)
}

pub(crate) fn db_int(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

pub(crate) fn from_db_int(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}

pub(crate) fn phase_str(phase: WorkloadPhase) -> &'static str {
    match phase {
        WorkloadPhase::Pending => "pending",
        WorkloadPhase::Running => "running",
        WorkloadPhase::Succeeded => "succeeded",
        WorkloadPhase::Failed => "failed",
        WorkloadPhase::Terminating => "terminating",
        WorkloadPhase::Gone => "gone",
        WorkloadPhase::Unknown => "unknown",
    }
}

fn parse_phase(text: &str) -> WorkloadPhase {
    match text {
        "pending" => WorkloadPhase::Pending,
        "running" => WorkloadPhase::Running,
        "succeeded" => WorkloadPhase::Succeeded,
        "failed" => WorkloadPhase::Failed,
        "terminating" => WorkloadPhase::Terminating,
        "gone" => WorkloadPhase::Gone,
        _ => WorkloadPhase::Unknown,
    }
}

fn result_str(result: TaskResult) -> &'static str {
    match result {
        TaskResult::Success => "success",
        TaskResult::Failure => "failure",
        TaskResult::Cancelled => "cancelled",
        TaskResult::Skipped => "skipped",
    }
}

fn parse_result(text: &str) -> Result<TaskResult, StoreError> {
    match text {
        "success" => Ok(TaskResult::Success),
        "failure" => Ok(TaskResult::Failure),
        "cancelled" => Ok(TaskResult::Cancelled),
        "skipped" => Ok(TaskResult::Skipped),
        other => Err(StoreError::decode(
            "terminal_markers",
            format!("unknown result {other:?}"),
        )),
    }
}

fn source_str(source: TerminalSource) -> &'static str {
    match source {
        TerminalSource::Executor => "executor",
        TerminalSource::FailTask => "fail-task",
        TerminalSource::Withdrawn => "withdrawn",
    }
}

fn parse_source(text: &str) -> Result<TerminalSource, StoreError> {
    match text {
        "executor" => Ok(TerminalSource::Executor),
        "fail-task" => Ok(TerminalSource::FailTask),
        "withdrawn" => Ok(TerminalSource::Withdrawn),
        other => Err(StoreError::decode(
            "terminal_markers",
            format!("unknown source {other:?}"),
        )),
    }
}

pub(crate) fn backend(table: &'static str, name: String) -> Result<BackendName, StoreError> {
    BackendName::new(name).map_err(|e| StoreError::decode(table, e.to_string()))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AssignmentRow {
    pub id: Uuid,
    pub forge_instance: Option<String>,
    pub forge_task_id: Option<i64>,
    pub backend: Option<String>,
    pub provider: Option<String>,
    pub placement: Option<String>,
    pub labels: Vec<String>,
    pub repository: Option<String>,
    pub job_name: Option<String>,
    pub max_duration_secs: Option<i64>,
    pub current_attempt: i32,
    pub state: &'static str,
    pub fetched_at: Option<i64>,
    pub first_published_at: Option<i64>,
    pub last_published_at: Option<i64>,
    pub first_workload_at: Option<i64>,
    pub claimed_at: Option<i64>,
    pub terminal_at: Option<i64>,
    pub failed_at: Option<i64>,
    pub finished_at: Option<i64>,
    pub updated_at: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AttemptRow {
    pub assignment_id: Uuid,
    pub attempt: i32,
    pub backend: Option<String>,
    pub workload: Option<String>,
    pub token_hash: Option<String>,
    pub worker_id: Option<String>,
    pub published_at: Option<i64>,
    pub requested_at: Option<i64>,
    pub created_at: Option<i64>,
    pub observed_phase: Option<&'static str>,
    pub phase_reason: Option<String>,
    pub last_observed_at: Option<i64>,
    pub released_at: Option<i64>,
    pub holds_slot: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClaimRow {
    pub assignment_id: Uuid,
    pub attempt: i32,
    pub forge_task_id: i64,
    pub executor: String,
    pub claimed_at: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TerminalRow {
    pub assignment_id: Uuid,
    pub attempt: Option<i32>,
    pub forge_task_id: Option<i64>,
    pub result: Option<&'static str>,
    pub source: Option<&'static str>,
    pub log_closed: bool,
    pub reason: Option<String>,
    pub at: Option<i64>,
    pub executor_finished_at: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FailureRow {
    pub assignment_id: Uuid,
    pub attempt: i32,
    pub forge_task_id: i64,
    pub reason: String,
    pub failed_at: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RedispatchRow {
    pub assignment_id: Uuid,
    pub next_attempt: i32,
    pub from_attempt: i32,
    pub reason: String,
    pub at: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WorkloadRow {
    pub backend: String,
    pub workload: String,
    pub assignment_id: Uuid,
    pub attempt: i32,
    pub first_seen: i64,
    pub created_at: Option<i64>,
    pub phase: Option<&'static str>,
    pub reason: Option<String>,
    pub last_seen: Option<i64>,
    pub observed_seq: Option<i64>,
    pub unreachable_since: Option<i64>,
    pub released_at: Option<i64>,
}

/// All rows of some records, table by table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Rows {
    pub assignments: Vec<AssignmentRow>,
    pub attempts: Vec<AttemptRow>,
    pub claims: Vec<ClaimRow>,
    pub terminals: Vec<TerminalRow>,
    pub failures: Vec<FailureRow>,
    pub redispatches: Vec<RedispatchRow>,
    pub workloads: Vec<WorkloadRow>,
}

impl Rows {
    /// Gives back what the vectors hold beyond their length (for rows kept a long time).
    pub fn shrink_to_fit(&mut self) {
        self.assignments.shrink_to_fit();
        self.attempts.shrink_to_fit();
        self.claims.shrink_to_fit();
        self.terminals.shrink_to_fit();
        self.failures.shrink_to_fit();
        self.redispatches.shrink_to_fit();
        self.workloads.shrink_to_fit();
    }

    /// Appends the rows of `after` that differ from the rows of `before` (`None` = new record).
    /// Records only grow, so no row ever has to be deleted.
    pub fn push_changed(&mut self, before: Option<&AssignmentRecord>, after: &AssignmentRecord) {
        let old = before.map(encode).unwrap_or_default();
        let new = encode(after);
        fn changed<T: PartialEq + Clone>(out: &mut Vec<T>, old: &[T], new: Vec<T>) {
            out.extend(new.into_iter().filter(|row| !old.contains(row)));
        }
        changed(&mut self.assignments, &old.assignments, new.assignments);
        changed(&mut self.attempts, &old.attempts, new.attempts);
        changed(&mut self.claims, &old.claims, new.claims);
        changed(&mut self.terminals, &old.terminals, new.terminals);
        changed(&mut self.failures, &old.failures, new.failures);
        changed(&mut self.redispatches, &old.redispatches, new.redispatches);
        changed(&mut self.workloads, &old.workloads, new.workloads);
    }
}

pub(crate) fn encode(record: &AssignmentRecord) -> Rows {
    let id = record.id.0;
    let state = record.state();
    let info = record.info.as_ref();
    let published = record.attempts.values().filter_map(|a| a.published_at);
    let released_max = record
        .workloads
        .values()
        .filter_map(|w| w.released_at)
        .max();
    let finished_at = state
        .is_finished()
        .then(|| record.final_at().into_iter().chain(released_max).max())
        .flatten();
    let assignment = AssignmentRow {
        id,
        forge_instance: info.map(|i| i.forge_instance.clone()),
        forge_task_id: info.map(|i| i.forge_task_id),
        backend: record.backend().map(|b| b.as_str().to_owned()),
        provider: info.and_then(|i| i.provider.clone()),
        placement: info.and_then(|i| i.placement.clone()),
        labels: info.map(|i| i.labels.clone()).unwrap_or_default(),
        repository: info.map(|i| i.repository.clone()),
        job_name: info.map(|i| i.job_name.clone()),
        max_duration_secs: info.map(|i| db_ms(i.max_duration_secs)),
        current_attempt: db_int(record.current_attempt()),
        state: state.as_str(),
        fetched_at: info.map(|i| db_ms(i.fetched_at)),
        first_published_at: published.clone().min().map(db_ms),
        last_published_at: published.max().map(db_ms),
        first_workload_at: record
            .attempts
            .values()
            .filter_map(|a| a.created_at)
            .min()
            .map(db_ms),
        claimed_at: record.claim.as_ref().map(|c| db_ms(c.claimed_at)),
        terminal_at: record.terminal.as_ref().and_then(|t| t.at).map(db_ms),
        failed_at: record.failure.as_ref().map(|f| db_ms(f.failed_at)),
        finished_at: finished_at.map(db_ms),
        updated_at: db_ms(record.updated_at),
    };
    let attempts = record
        .attempts
        .values()
        .map(|a| {
            let workload = record.attempt_workload(a.attempt);
            let observation = workload.and_then(|w| w.observation.as_ref());
            AttemptRow {
                assignment_id: id,
                attempt: db_int(a.attempt),
                backend: a.backend.as_ref().map(|b| b.as_str().to_owned()),
                workload: a.workload.clone(),
                token_hash: a.token_hash.clone(),
                worker_id: a.worker_id.clone(),
                published_at: a.published_at.map(db_ms),
                requested_at: a.requested_at.map(db_ms),
                created_at: a.created_at.map(db_ms),
                observed_phase: observation.map(|o| phase_str(o.phase)),
                phase_reason: observation.and_then(|o| o.reason.clone()),
                last_observed_at: observation.map(|o| db_ms(o.at)),
                released_at: workload.and_then(|w| w.released_at).map(db_ms),
                holds_slot: record.attempt_holds_slot(a.attempt),
            }
        })
        .collect();
    let claims = record
        .claim
        .iter()
        .map(|c| ClaimRow {
            assignment_id: id,
            attempt: db_int(c.attempt),
            forge_task_id: c.forge_task_id,
            executor: c.executor.clone(),
            claimed_at: db_ms(c.claimed_at),
        })
        .collect();
    let terminals = record
        .terminal
        .iter()
        .map(|t| TerminalRow {
            assignment_id: id,
            attempt: t.attempt.map(db_int),
            forge_task_id: t.forge_task_id,
            result: t.result.map(result_str),
            source: t.source.map(source_str),
            log_closed: t.log_closed,
            reason: t.reason.clone(),
            at: t.at.map(db_ms),
            executor_finished_at: t.executor_finished_at.map(db_ms),
        })
        .collect();
    let failures = record
        .failure
        .iter()
        .map(|f| FailureRow {
            assignment_id: id,
            attempt: db_int(f.attempt),
            forge_task_id: f.forge_task_id,
            reason: f.reason.clone(),
            failed_at: db_ms(f.failed_at),
        })
        .collect();
    let redispatches = record
        .redispatches
        .values()
        .map(|r| RedispatchRow {
            assignment_id: id,
            next_attempt: db_int(r.next_attempt),
            from_attempt: db_int(r.from_attempt),
            reason: r.reason.clone(),
            at: db_ms(r.at),
        })
        .collect();
    let workloads = record
        .workloads
        .values()
        .map(|w| WorkloadRow {
            backend: w.backend.as_str().to_owned(),
            workload: w.workload.clone(),
            assignment_id: id,
            attempt: db_int(w.attempt),
            first_seen: db_ms(w.first_seen),
            created_at: w.created_at.map(db_ms),
            phase: w.observation.as_ref().map(|o| phase_str(o.phase)),
            reason: w.observation.as_ref().and_then(|o| o.reason.clone()),
            last_seen: w.observation.as_ref().map(|o| db_ms(o.at)),
            observed_seq: w.observation.as_ref().map(|o| db_ms(o.seq)),
            unreachable_since: w
                .observation
                .as_ref()
                .and_then(|o| o.unreachable_since)
                .map(db_ms),
            released_at: w.released_at.map(db_ms),
        })
        .collect();
    Rows {
        assignments: vec![assignment],
        attempts,
        claims,
        terminals,
        failures,
        redispatches,
        workloads,
    }
}

/// Rebuilds records from rows (any order). Rows of other tables without an `assignments` row
/// still produce a record, though the store always writes one.
pub(crate) fn decode(rows: Rows) -> Result<Vec<AssignmentRecord>, StoreError> {
    let mut records = std::collections::BTreeMap::<Uuid, AssignmentRecord>::new();
    fn record(
        records: &mut std::collections::BTreeMap<Uuid, AssignmentRecord>,
        id: Uuid,
    ) -> &mut AssignmentRecord {
        records
            .entry(id)
            .or_insert_with(|| AssignmentRecord::new(AssignmentId(id)))
    }
    for row in rows.assignments {
        let r = record(&mut records, row.id);
        r.updated_at = from_db_ms(row.updated_at);
        if let (
            Some(forge_instance),
            Some(forge_task_id),
            Some(backend_name),
            Some(repository),
            Some(job_name),
        ) = (
            row.forge_instance,
            row.forge_task_id,
            row.backend,
            row.repository,
            row.job_name,
        ) {
            r.info = Some(AssignmentInfo {
                forge_instance,
                forge_task_id,
                backend: backend("assignments", backend_name)?,
                provider: row.provider,
                placement: row.placement,
                labels: row.labels,
                repository,
                job_name,
                max_duration_secs: row.max_duration_secs.map(from_db_ms).unwrap_or(0),
                fetched_at: row.fetched_at.map(from_db_ms).unwrap_or(0),
            });
        }
    }
    for row in rows.attempts {
        let attempt = from_db_int(row.attempt);
        let backend = row.backend.map(|b| backend("attempts", b)).transpose()?;
        record(&mut records, row.assignment_id).attempts.insert(
            attempt,
            AttemptRecord {
                attempt,
                published_at: row.published_at.map(from_db_ms),
                backend,
                workload: row.workload,
                token_hash: row.token_hash,
                worker_id: row.worker_id,
                requested_at: row.requested_at.map(from_db_ms),
                created_at: row.created_at.map(from_db_ms),
            },
        );
    }
    for row in rows.claims {
        record(&mut records, row.assignment_id).claim = Some(ClaimRecord {
            attempt: from_db_int(row.attempt),
            forge_task_id: row.forge_task_id,
            executor: row.executor,
            claimed_at: from_db_ms(row.claimed_at),
        });
    }
    for row in rows.terminals {
        record(&mut records, row.assignment_id).terminal = Some(TerminalRecord {
            attempt: row.attempt.map(from_db_int),
            forge_task_id: row.forge_task_id,
            result: row.result.map(parse_result).transpose()?,
            source: row.source.map(parse_source).transpose()?,
            log_closed: row.log_closed,
            reason: row.reason,
            at: row.at.map(from_db_ms),
            executor_finished_at: row.executor_finished_at.map(from_db_ms),
        });
    }
    for row in rows.failures {
        record(&mut records, row.assignment_id).failure = Some(FailureRecord {
            attempt: from_db_int(row.attempt),
            forge_task_id: row.forge_task_id,
            reason: row.reason,
            failed_at: from_db_ms(row.failed_at),
        });
    }
    for row in rows.redispatches {
        let next_attempt = from_db_int(row.next_attempt);
        record(&mut records, row.assignment_id).redispatches.insert(
            next_attempt,
            RedispatchRecord {
                from_attempt: from_db_int(row.from_attempt),
                next_attempt,
                reason: row.reason,
                at: from_db_ms(row.at),
            },
        );
    }
    for row in rows.workloads {
        let backend = backend("workloads", row.backend)?;
        let observation = match (row.phase, row.last_seen, row.observed_seq) {
            (Some(phase), Some(at), Some(seq)) => Some(Observation {
                phase: parse_phase(phase),
                reason: row.reason,
                at: from_db_ms(at),
                seq: from_db_ms(seq),
                unreachable_since: row.unreachable_since.map(from_db_ms),
            }),
            _ => None,
        };
        record(&mut records, row.assignment_id).workloads.insert(
            (backend.clone(), row.workload.clone()),
            WorkloadRecord {
                backend,
                workload: row.workload,
                attempt: from_db_int(row.attempt),
                first_seen: from_db_ms(row.first_seen),
                created_at: row.created_at.map(from_db_ms),
                observation,
                released_at: row.released_at.map(from_db_ms),
            },
        );
    }
    Ok(records.into_values().collect())
}

/// Maps a phase read from the database onto the static vocabulary.
pub(crate) fn intern_phase(text: &str) -> &'static str {
    phase_str(parse_phase(text))
}

pub(crate) fn intern_result(text: &str) -> Result<&'static str, StoreError> {
    parse_result(text).map(result_str)
}

pub(crate) fn intern_source(text: &str) -> Result<&'static str, StoreError> {
    parse_source(text).map(source_str)
}
