//! Reading and writing [`Rows`] with one statement per table: `= ANY($1)` to load, `UNNEST` of
//! column arrays to upsert. Times cross the wire as unix ms and are converted by `jr_ts`/`jr_ms`.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::StoreError;
use crate::rows::{
    AssignmentRow, AttemptRow, ClaimRow, FailureRow, RedispatchRow, Rows, TerminalRow, WorkloadRow,
    intern_phase, intern_result, intern_source,
};

/// Which records to load.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scope<'a> {
    Ids(&'a [Uuid]),
    /// Records whose state is not finished.
    Open,
    All,
}

impl Scope<'_> {
    fn filter(self, column: &str) -> String {
        match self {
            Scope::Ids(_) => format!("{column} = ANY($1)"),
            Scope::Open => format!(
                "{column} IN (SELECT id FROM assignments WHERE state NOT IN ('completed', 'failed'))"
            ),
            Scope::All => "TRUE".to_owned(),
        }
    }
}

fn q(op: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { op, source }
}

async fn fetch(
    conn: &mut PgConnection,
    sql: &str,
    scope: Scope<'_>,
) -> Result<Vec<PgRow>, StoreError> {
    let query = sqlx::query(sql);
    let query = match scope {
        Scope::Ids(ids) => query.bind(ids),
        Scope::Open | Scope::All => query,
    };
    query.fetch_all(conn).await.map_err(q("load"))
}

fn get<'r, T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>>(
    row: &'r PgRow,
    column: &str,
) -> Result<T, StoreError> {
    row.try_get(column).map_err(q("decode"))
}

pub(crate) async fn load_rows(
    conn: &mut PgConnection,
    scope: Scope<'_>,
) -> Result<Rows, StoreError> {
    let mut rows = Rows::default();
    let sql = format!(
        "SELECT id, forge_instance, forge_task_id, backend, provider, placement, labels, repository, job_name, \
         max_duration_secs, current_attempt, jr_ms(fetched_at) AS fetched_at, jr_ms(updated_at) AS updated_at \
         FROM assignments WHERE {}",
        scope.filter("id")
    );
    for r in fetch(conn, &sql, scope).await? {
        rows.assignments.push(AssignmentRow {
            id: get(&r, "id")?,
            forge_instance: get(&r, "forge_instance")?,
            forge_task_id: get(&r, "forge_task_id")?,
            backend: get(&r, "backend")?,
            provider: get(&r, "provider")?,
            placement: get(&r, "placement")?,
            labels: get(&r, "labels")?,
            repository: get(&r, "repository")?,
            job_name: get(&r, "job_name")?,
            max_duration_secs: get(&r, "max_duration_secs")?,
            current_attempt: get(&r, "current_attempt")?,
            state: "",
            fetched_at: get(&r, "fetched_at")?,
            first_published_at: None,
            last_published_at: None,
            first_workload_at: None,
            claimed_at: None,
            terminal_at: None,
            failed_at: None,
            finished_at: None,
            updated_at: get(&r, "updated_at")?,
        });
    }
    let sql = format!(
        "SELECT assignment_id, attempt, backend, workload, token_hash, worker_id, \
         jr_ms(published_at) AS published_at, jr_ms(requested_at) AS requested_at, \
         jr_ms(created_at) AS created_at FROM attempts WHERE {}",
        scope.filter("assignment_id")
    );
    for r in fetch(conn, &sql, scope).await? {
        rows.attempts.push(AttemptRow {
            assignment_id: get(&r, "assignment_id")?,
            attempt: get(&r, "attempt")?,
            backend: get(&r, "backend")?,
            workload: get(&r, "workload")?,
            token_hash: get(&r, "token_hash")?,
            worker_id: get(&r, "worker_id")?,
            published_at: get(&r, "published_at")?,
            requested_at: get(&r, "requested_at")?,
            created_at: get(&r, "created_at")?,
            observed_phase: None,
            phase_reason: None,
            last_observed_at: None,
            released_at: None,
            holds_slot: false,
        });
    }
    let sql = format!(
        "SELECT assignment_id, attempt, forge_task_id, executor, jr_ms(claimed_at) AS claimed_at \
         FROM claims WHERE {}",
        scope.filter("assignment_id")
    );
    for r in fetch(conn, &sql, scope).await? {
        rows.claims.push(ClaimRow {
            assignment_id: get(&r, "assignment_id")?,
            attempt: get(&r, "attempt")?,
            forge_task_id: get(&r, "forge_task_id")?,
            executor: get(&r, "executor")?,
            claimed_at: get(&r, "claimed_at")?,
        });
    }
    let sql = format!(
        "SELECT assignment_id, attempt, forge_task_id, result, source, log_closed, reason, \
         jr_ms(at) AS at, jr_ms(executor_finished_at) AS executor_finished_at \
         FROM terminal_markers WHERE {}",
        scope.filter("assignment_id")
    );
    for r in fetch(conn, &sql, scope).await? {
        let result: Option<String> = get(&r, "result")?;
        let source: Option<String> = get(&r, "source")?;
        rows.terminals.push(TerminalRow {
            assignment_id: get(&r, "assignment_id")?,
            attempt: get(&r, "attempt")?,
            forge_task_id: get(&r, "forge_task_id")?,
            result: result.as_deref().map(intern_result).transpose()?,
            source: source.as_deref().map(intern_source).transpose()?,
            log_closed: get(&r, "log_closed")?,
            reason: get(&r, "reason")?,
            at: get(&r, "at")?,
            executor_finished_at: get(&r, "executor_finished_at")?,
        });
    }
    let sql = format!(
        "SELECT assignment_id, attempt, forge_task_id, reason, jr_ms(failed_at) AS failed_at \
         FROM task_failures WHERE {}",
        scope.filter("assignment_id")
    );
    for r in fetch(conn, &sql, scope).await? {
        rows.failures.push(FailureRow {
            assignment_id: get(&r, "assignment_id")?,
            attempt: get(&r, "attempt")?,
            forge_task_id: get(&r, "forge_task_id")?,
            reason: get(&r, "reason")?,
            failed_at: get(&r, "failed_at")?,
        });
    }
    let sql = format!(
        "SELECT assignment_id, next_attempt, from_attempt, reason, jr_ms(at) AS at \
         FROM redispatches WHERE {}",
        scope.filter("assignment_id")
    );
    for r in fetch(conn, &sql, scope).await? {
        rows.redispatches.push(RedispatchRow {
            assignment_id: get(&r, "assignment_id")?,
            next_attempt: get(&r, "next_attempt")?,
            from_attempt: get(&r, "from_attempt")?,
            reason: get(&r, "reason")?,
            at: get(&r, "at")?,
        });
    }
    let sql = format!(
        "SELECT backend, workload, assignment_id, attempt, jr_ms(first_seen) AS first_seen, \
         jr_ms(created_at) AS created_at, phase, reason, jr_ms(last_seen) AS last_seen, observed_seq, \
         jr_ms(unreachable_since) AS unreachable_since, jr_ms(released_at) AS released_at \
         FROM workloads WHERE {}",
        scope.filter("assignment_id")
    );
    for r in fetch(conn, &sql, scope).await? {
        let phase: Option<String> = get(&r, "phase")?;
        rows.workloads.push(WorkloadRow {
            backend: get(&r, "backend")?,
            workload: get(&r, "workload")?,
            assignment_id: get(&r, "assignment_id")?,
            attempt: get(&r, "attempt")?,
            first_seen: get(&r, "first_seen")?,
            created_at: get(&r, "created_at")?,
            phase: phase.as_deref().map(intern_phase),
            reason: get(&r, "reason")?,
            last_seen: get(&r, "last_seen")?,
            observed_seq: get(&r, "observed_seq")?,
            unreachable_since: get(&r, "unreachable_since")?,
            released_at: get(&r, "released_at")?,
        });
    }
    Ok(rows)
}

fn col<T, U>(rows: &[T], f: impl Fn(&T) -> U) -> Vec<U> {
    rows.iter().map(f).collect()
}

fn opt_str(value: Option<&'static str>) -> Option<String> {
    value.map(str::to_owned)
}

pub(crate) async fn write_rows(conn: &mut PgConnection, rows: &Rows) -> Result<(), StoreError> {
    if !rows.assignments.is_empty() {
        let r = &rows.assignments;
        let labels: Vec<String> = col(r, |a| {
            serde_json::to_string(&a.labels).unwrap_or_else(|_| "[]".to_owned())
        });
        sqlx::query(
            "INSERT INTO assignments (id, forge_instance, forge_task_id, backend, provider, labels, \
               repository, job_name, max_duration_secs, current_attempt, state, fetched_at, \
               first_published_at, last_published_at, first_workload_at, claimed_at, terminal_at, \
               failed_at, finished_at, updated_at, placement) \
             SELECT id, forge_instance, forge_task_id, backend, provider, \
               ARRAY(SELECT jsonb_array_elements_text(labels::jsonb)), repository, job_name, \
               max_duration_secs, current_attempt, state, jr_ts(fetched_at), jr_ts(first_published_at), \
               jr_ts(last_published_at), jr_ts(first_workload_at), jr_ts(claimed_at), jr_ts(terminal_at), \
               jr_ts(failed_at), jr_ts(finished_at), jr_ts(updated_at), placement \
             FROM UNNEST($1::uuid[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::text[], \
               $8::text[], $9::int8[], $10::int4[], $11::text[], $12::int8[], $13::int8[], $14::int8[], \
               $15::int8[], $16::int8[], $17::int8[], $18::int8[], $19::int8[], $20::int8[], $21::text[]) \
               AS t(id, forge_instance, forge_task_id, backend, provider, labels, repository, job_name, \
               max_duration_secs, current_attempt, state, fetched_at, first_published_at, \
               last_published_at, first_workload_at, claimed_at, terminal_at, failed_at, finished_at, \
               updated_at, placement) \
             ON CONFLICT (id) DO UPDATE SET forge_instance = excluded.forge_instance, \
               forge_task_id = excluded.forge_task_id, backend = excluded.backend, \
               provider = excluded.provider, labels = excluded.labels, repository = excluded.repository, \
               job_name = excluded.job_name, max_duration_secs = excluded.max_duration_secs, \
               current_attempt = excluded.current_attempt, state = excluded.state, \
               fetched_at = excluded.fetched_at, first_published_at = excluded.first_published_at, \
               last_published_at = excluded.last_published_at, \
               first_workload_at = excluded.first_workload_at, claimed_at = excluded.claimed_at, \
               terminal_at = excluded.terminal_at, failed_at = excluded.failed_at, \
               finished_at = excluded.finished_at, updated_at = excluded.updated_at, \
               placement = excluded.placement",
        )
        .bind(col(r, |a| a.id))
        .bind(col(r, |a| a.forge_instance.clone()))
        .bind(col(r, |a| a.forge_task_id))
        .bind(col(r, |a| a.backend.clone()))
        .bind(col(r, |a| a.provider.clone()))
        .bind(labels)
        .bind(col(r, |a| a.repository.clone()))
        .bind(col(r, |a| a.job_name.clone()))
        .bind(col(r, |a| a.max_duration_secs))
        .bind(col(r, |a| a.current_attempt))
        .bind(col(r, |a| a.state.to_owned()))
        .bind(col(r, |a| a.fetched_at))
        .bind(col(r, |a| a.first_published_at))
        .bind(col(r, |a| a.last_published_at))
        .bind(col(r, |a| a.first_workload_at))
        .bind(col(r, |a| a.claimed_at))
        .bind(col(r, |a| a.terminal_at))
        .bind(col(r, |a| a.failed_at))
        .bind(col(r, |a| a.finished_at))
        .bind(col(r, |a| a.updated_at))
        .bind(col(r, |a| a.placement.clone()))
        .execute(&mut *conn)
        .await
        .map_err(q("write assignments"))?;
    }
    if !rows.attempts.is_empty() {
        let r = &rows.attempts;
        sqlx::query(
            "INSERT INTO attempts (assignment_id, attempt, backend, workload, token_hash, worker_id, \
               published_at, requested_at, created_at, observed_phase, phase_reason, last_observed_at, \
               released_at, holds_slot) \
             SELECT assignment_id, attempt, backend, workload, token_hash, worker_id, jr_ts(published_at), \
               jr_ts(requested_at), jr_ts(created_at), observed_phase, phase_reason, \
               jr_ts(last_observed_at), jr_ts(released_at), holds_slot \
             FROM UNNEST($1::uuid[], $2::int4[], $3::text[], $4::text[], $5::text[], $6::text[], \
               $7::int8[], $8::int8[], $9::int8[], $10::text[], $11::text[], $12::int8[], $13::int8[], \
               $14::bool[]) \
               AS t(assignment_id, attempt, backend, workload, token_hash, worker_id, published_at, \
               requested_at, created_at, observed_phase, phase_reason, last_observed_at, released_at, \
               holds_slot) \
             ON CONFLICT (assignment_id, attempt) DO UPDATE SET backend = excluded.backend, \
               workload = excluded.workload, token_hash = excluded.token_hash, \
               worker_id = excluded.worker_id, published_at = excluded.published_at, \
               requested_at = excluded.requested_at, created_at = excluded.created_at, \
               observed_phase = excluded.observed_phase, phase_reason = excluded.phase_reason, \
               last_observed_at = excluded.last_observed_at, released_at = excluded.released_at, \
               holds_slot = excluded.holds_slot",
        )
        .bind(col(r, |a| a.assignment_id))
        .bind(col(r, |a| a.attempt))
        .bind(col(r, |a| a.backend.clone()))
        .bind(col(r, |a| a.workload.clone()))
        .bind(col(r, |a| a.token_hash.clone()))
        .bind(col(r, |a| a.worker_id.clone()))
        .bind(col(r, |a| a.published_at))
        .bind(col(r, |a| a.requested_at))
        .bind(col(r, |a| a.created_at))
        .bind(col(r, |a| opt_str(a.observed_phase)))
        .bind(col(r, |a| a.phase_reason.clone()))
        .bind(col(r, |a| a.last_observed_at))
        .bind(col(r, |a| a.released_at))
        .bind(col(r, |a| a.holds_slot))
        .execute(&mut *conn)
        .await
        .map_err(q("write attempts"))?;
    }
    if !rows.claims.is_empty() {
        let r = &rows.claims;
        sqlx::query(
            "INSERT INTO claims (assignment_id, attempt, forge_task_id, executor, claimed_at) \
             SELECT assignment_id, attempt, forge_task_id, executor, jr_ts(claimed_at) \
             FROM UNNEST($1::uuid[], $2::int4[], $3::int8[], $4::text[], $5::int8[]) \
               AS t(assignment_id, attempt, forge_task_id, executor, claimed_at) \
             ON CONFLICT (assignment_id) DO UPDATE SET attempt = excluded.attempt, \
               forge_task_id = excluded.forge_task_id, executor = excluded.executor, \
               claimed_at = excluded.claimed_at",
        )
        .bind(col(r, |c| c.assignment_id))
        .bind(col(r, |c| c.attempt))
        .bind(col(r, |c| c.forge_task_id))
        .bind(col(r, |c| c.executor.clone()))
        .bind(col(r, |c| c.claimed_at))
        .execute(&mut *conn)
        .await
        .map_err(q("write claims"))?;
    }
    if !rows.terminals.is_empty() {
        let r = &rows.terminals;
        sqlx::query(
            "INSERT INTO terminal_markers (assignment_id, attempt, forge_task_id, result, source, \
               log_closed, reason, at, executor_finished_at) \
             SELECT assignment_id, attempt, forge_task_id, result, source, log_closed, reason, jr_ts(at), \
               jr_ts(executor_finished_at) \
             FROM UNNEST($1::uuid[], $2::int4[], $3::int8[], $4::text[], $5::text[], $6::bool[], \
               $7::text[], $8::int8[], $9::int8[]) \
               AS t(assignment_id, attempt, forge_task_id, result, source, log_closed, reason, at, \
               executor_finished_at) \
             ON CONFLICT (assignment_id) DO UPDATE SET attempt = excluded.attempt, \
               forge_task_id = excluded.forge_task_id, result = excluded.result, \
               source = excluded.source, log_closed = excluded.log_closed, reason = excluded.reason, \
               at = excluded.at, executor_finished_at = excluded.executor_finished_at",
        )
        .bind(col(r, |t| t.assignment_id))
        .bind(col(r, |t| t.attempt))
        .bind(col(r, |t| t.forge_task_id))
        .bind(col(r, |t| opt_str(t.result)))
        .bind(col(r, |t| opt_str(t.source)))
        .bind(col(r, |t| t.log_closed))
        .bind(col(r, |t| t.reason.clone()))
        .bind(col(r, |t| t.at))
        .bind(col(r, |t| t.executor_finished_at))
        .execute(&mut *conn)
        .await
        .map_err(q("write terminal_markers"))?;
    }
    if !rows.failures.is_empty() {
        let r = &rows.failures;
        sqlx::query(
            "INSERT INTO task_failures (assignment_id, attempt, forge_task_id, reason, failed_at) \
             SELECT assignment_id, attempt, forge_task_id, reason, jr_ts(failed_at) \
             FROM UNNEST($1::uuid[], $2::int4[], $3::int8[], $4::text[], $5::int8[]) \
               AS t(assignment_id, attempt, forge_task_id, reason, failed_at) \
             ON CONFLICT (assignment_id) DO UPDATE SET attempt = excluded.attempt, \
               forge_task_id = excluded.forge_task_id, reason = excluded.reason, \
               failed_at = excluded.failed_at",
        )
        .bind(col(r, |f| f.assignment_id))
        .bind(col(r, |f| f.attempt))
        .bind(col(r, |f| f.forge_task_id))
        .bind(col(r, |f| f.reason.clone()))
        .bind(col(r, |f| f.failed_at))
        .execute(&mut *conn)
        .await
        .map_err(q("write task_failures"))?;
    }
    if !rows.redispatches.is_empty() {
        let r = &rows.redispatches;
        sqlx::query(
            "INSERT INTO redispatches (assignment_id, next_attempt, from_attempt, reason, at) \
             SELECT assignment_id, next_attempt, from_attempt, reason, jr_ts(at) \
             FROM UNNEST($1::uuid[], $2::int4[], $3::int4[], $4::text[], $5::int8[]) \
               AS t(assignment_id, next_attempt, from_attempt, reason, at) \
             ON CONFLICT (assignment_id, next_attempt) DO UPDATE SET from_attempt = excluded.from_attempt, \
               reason = excluded.reason, at = excluded.at",
        )
        .bind(col(r, |d| d.assignment_id))
        .bind(col(r, |d| d.next_attempt))
        .bind(col(r, |d| d.from_attempt))
        .bind(col(r, |d| d.reason.clone()))
        .bind(col(r, |d| d.at))
        .execute(&mut *conn)
        .await
        .map_err(q("write redispatches"))?;
    }
    if !rows.workloads.is_empty() {
        // Workload references are unique per backend; should two assignments ever claim the same
        // one, the statement must still succeed (one upsert per key), or the projector would stall.
        let mut seen = std::collections::HashSet::new();
        let unique: Vec<&WorkloadRow> = rows
            .workloads
            .iter()
            .rev()
            .filter(|w| seen.insert((&w.backend, &w.workload)))
            .collect();
        let r = unique.as_slice();
        sqlx::query(
            "INSERT INTO workloads (backend, workload, assignment_id, attempt, first_seen, created_at, \
               phase, reason, last_seen, observed_seq, unreachable_since, released_at) \
             SELECT backend, workload, assignment_id, attempt, jr_ts(first_seen), jr_ts(created_at), phase, \
               reason, jr_ts(last_seen), observed_seq, jr_ts(unreachable_since), jr_ts(released_at) \
             FROM UNNEST($1::text[], $2::text[], $3::uuid[], $4::int4[], $5::int8[], $6::int8[], \
               $7::text[], $8::text[], $9::int8[], $10::int8[], $11::int8[], $12::int8[]) \
               AS t(backend, workload, assignment_id, attempt, first_seen, created_at, phase, reason, \
               last_seen, observed_seq, unreachable_since, released_at) \
             ON CONFLICT (backend, workload) DO UPDATE SET assignment_id = excluded.assignment_id, \
               attempt = excluded.attempt, first_seen = excluded.first_seen, \
               created_at = excluded.created_at, phase = excluded.phase, reason = excluded.reason, \
               last_seen = excluded.last_seen, observed_seq = excluded.observed_seq, \
               unreachable_since = excluded.unreachable_since, released_at = excluded.released_at",
        )
        .bind(col(r, |w| w.backend.clone()))
        .bind(col(r, |w| w.workload.clone()))
        .bind(col(r, |w| w.assignment_id))
        .bind(col(r, |w| w.attempt))
        .bind(col(r, |w| w.first_seen))
        .bind(col(r, |w| w.created_at))
        .bind(col(r, |w| opt_str(w.phase)))
        .bind(col(r, |w| w.reason.clone()))
        .bind(col(r, |w| w.last_seen))
        .bind(col(r, |w| w.observed_seq))
        .bind(col(r, |w| w.unreachable_since))
        .bind(col(r, |w| w.released_at))
        .execute(&mut *conn)
        .await
        .map_err(q("write workloads"))?;
    }
    Ok(())
}
