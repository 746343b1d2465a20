//! The job list of the status page and `jr jobs`: assignments newest first, filtered and paged
//! (keyset paging on the time the job was fetched, so a page stays put while new jobs arrive).

use serde::Serialize;
use uuid::Uuid;

use crate::{Store, StoreError};

/// The most rows one page holds.
pub const MAX_PAGE: u32 = 500;

/// Which jobs, all optional.
#[derive(Clone, Debug, Default)]
pub struct JobFilter {
    /// The assignment's `forge_instance` (a Gitea URL, `github:<name>`).
    pub forge: Option<String>,
    pub backend: Option<String>,
    pub provider: Option<String>,
    pub repository: Option<String>,
    /// An assignment state (`pending` … `failed`).
    pub state: Option<String>,
    /// The final result (`success`, `failure`, `cancelled`, `skipped`).
    pub result: Option<String>,
    /// Fetched at or after (unix ms).
    pub since_ms: Option<u64>,
    /// Fetched before (unix ms).
    pub until_ms: Option<u64>,
    /// Continue after this row (the `next` of the previous page).
    pub after: Option<Cursor>,
    /// Rows per page (1 to [`MAX_PAGE`]).
    pub limit: u32,
}

/// Where a page ends: the last row's time and id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub at_ms: u64,
    pub id: Uuid,
}

impl Cursor {
    /// `<unix ms>.<uuid>`, as the API hands it out.
    pub fn parse(text: &str) -> Option<Cursor> {
        let (at, id) = text.split_once('.')?;
        Some(Cursor {
            at_ms: at.parse().ok()?,
            id: id.parse().ok()?,
        })
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.at_ms, self.id)
    }
}

/// One job of the list.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct JobRow {
    pub id: String,
    pub forge: Option<String>,
    pub forge_task_id: Option<i64>,
    pub backend: Option<String>,
    pub provider: Option<String>,
    pub repository: Option<String>,
    pub job_name: Option<String>,
    pub state: String,
    pub attempt: i32,
    /// When the forge handed the job out (or, before the assignment is known, the row's last
    /// change), unix ms: the list's order.
    pub at_ms: u64,
    pub claimed_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    pub result: Option<String>,
    /// Who decided the end (`executor`, `fail-task`, `withdrawn`, …).
    pub source: Option<String>,
    /// Why it failed or was withdrawn, when said.
    pub reason: Option<String>,
}

/// A page of jobs and where the next one starts.
#[derive(Clone, Debug, Serialize)]
pub struct JobPage {
    pub jobs: Vec<JobRow>,
    pub next: Option<String>,
}

type Raw = (
    Uuid,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    String,
    i32,
    i64,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<String>,
);

fn ms(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn signed(v: Option<u64>) -> Option<i64> {
    v.map(|v| i64::try_from(v).unwrap_or(i64::MAX))
}

impl Store {
    /// A page of jobs matching `filter`, newest first.
    pub async fn jobs(&self, filter: &JobFilter) -> Result<JobPage, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let rows: Vec<Raw> = sqlx::query_as(
            "SELECT id, forge_instance, forge_task_id, backend, provider, repository, job_name, \
                    state, current_attempt, at, claimed, ended, result, source, reason \
             FROM (SELECT a.*, jr_ms(coalesce(a.fetched_at, a.updated_at)) AS at, \
                          jr_ms(a.claimed_at) AS claimed, \
                          jr_ms(coalesce(a.finished_at, a.failed_at, a.terminal_at)) AS ended, \
                          t.result, t.source, coalesce(f.reason, t.reason) AS reason \
                   FROM assignments a \
                   LEFT JOIN terminal_markers t ON t.assignment_id = a.id \
                   LEFT JOIN task_failures f ON f.assignment_id = a.id) j \
             WHERE ($1::text IS NULL OR forge_instance = $1) \
               AND ($2::text IS NULL OR backend = $2) \
               AND ($3::text IS NULL OR provider = $3) \
               AND ($4::text IS NULL OR repository = $4) \
               AND ($5::text IS NULL OR state = $5) \
               AND ($6::text IS NULL OR result = $6) \
               AND ($7::bigint IS NULL OR at >= $7) \
               AND ($8::bigint IS NULL OR at < $8) \
               AND ($9::bigint IS NULL OR (at, id) < ($9, $10)) \
             ORDER BY at DESC, id DESC LIMIT $11",
        )
        .bind(&filter.forge)
        .bind(&filter.backend)
        .bind(&filter.provider)
        .bind(&filter.repository)
        .bind(&filter.state)
        .bind(&filter.result)
        .bind(signed(filter.since_ms))
        .bind(signed(filter.until_ms))
        .bind(signed(filter.after.map(|c| c.at_ms)))
        .bind(filter.after.map(|c| c.id).unwrap_or_default())
        .bind(i64::from(limit) + 1)
        .fetch_all(self.pool())
        .await
        .map_err(|source| StoreError::Query { op: "jobs", source })?;
        let more = rows.len() > limit as usize;
        let jobs: Vec<JobRow> = rows
            .into_iter()
            .take(limit as usize)
            .map(|r| JobRow {
                id: r.0.to_string(),
                forge: r.1,
                forge_task_id: r.2,
                backend: r.3,
                provider: r.4,
                repository: r.5,
                job_name: r.6,
                state: r.7,
                attempt: r.8,
                at_ms: ms(r.9),
                claimed_at_ms: r.10.map(ms),
                ended_at_ms: r.11.map(ms),
                result: r.12,
                source: r.13,
                reason: r.14,
            })
            .collect();
        let next = more.then(|| jobs.last()).flatten().and_then(|last| {
            Some(
                Cursor {
                    at_ms: last.at_ms,
                    id: last.id.parse().ok()?,
                }
                .to_string(),
            )
        });
        Ok(JobPage { jobs, next })
    }
}

/// One minute of one backend's history.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Minute {
    /// The minute's start, unix ms.
    pub at_ms: u64,
    /// Jobs the forge handed out in the minute.
    pub fetched: u64,
    /// Jobs that ended in the minute (completed or failed).
    pub ended: u64,
    /// Mean seconds from fetch to a workload, of the jobs fetched in the minute that have one.
    pub wait_secs: Option<f64>,
}

impl Store {
    /// Per backend, the last `minutes` minutes (those with anything in them), oldest first:
    /// throughput and queue wait for the status page's charts.
    pub async fn history(
        &self,
        minutes: u32,
    ) -> Result<std::collections::BTreeMap<String, Vec<Minute>>, StoreError> {
        let rows: Vec<(String, i64, i64, i64, Option<f64>)> = sqlx::query_as(
            "WITH recent AS ( \
               SELECT backend, fetched_at, first_workload_at, coalesce(finished_at, failed_at) AS ended_at \
               FROM assignments \
               WHERE backend IS NOT NULL \
                 AND (fetched_at >= now() - make_interval(mins => $1) \
                      OR coalesce(finished_at, failed_at) >= now() - make_interval(mins => $1))), \
             fetched AS ( \
               SELECT backend, date_trunc('minute', fetched_at) AS minute, count(*) AS n, \
                      avg(extract(epoch FROM first_workload_at - fetched_at))::float8 AS wait \
               FROM recent WHERE fetched_at >= now() - make_interval(mins => $1) GROUP BY 1, 2), \
             ended AS ( \
               SELECT backend, date_trunc('minute', ended_at) AS minute, count(*) AS n \
               FROM recent WHERE ended_at >= now() - make_interval(mins => $1) GROUP BY 1, 2) \
             SELECT coalesce(f.backend, e.backend), jr_ms(coalesce(f.minute, e.minute)), \
                    coalesce(f.n, 0), coalesce(e.n, 0), f.wait \
             FROM fetched f FULL JOIN ended e ON f.backend = e.backend AND f.minute = e.minute \
             ORDER BY 1, 2",
        )
        .bind(i32::try_from(minutes).unwrap_or(i32::MAX))
        .fetch_all(self.pool())
        .await
        .map_err(|source| StoreError::Query {
            op: "history",
            source,
        })?;
        let mut out: std::collections::BTreeMap<String, Vec<Minute>> = Default::default();
        for (backend, at, fetched, ended, wait) in rows {
            out.entry(backend).or_default().push(Minute {
                at_ms: ms(at),
                fetched: ms(fetched),
                ended: ms(ended),
                wait_secs: wait,
            });
        }
        Ok(out)
    }
}
