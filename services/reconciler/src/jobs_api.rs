//! `GET /api/assignments`: the job list of the status page and `jr jobs`, newest first.
//!
//! Query parameters, all optional: `forge` (an assignment's `forge_instance`), `backend`,
//! `provider`, `repository`, `state` (`pending`, `starting`, `running`, `finishing`,
//! `completed`, `failed`), `result` (`success`, `failure`, `cancelled`, `skipped`), `since` and
//! `until` (unix ms of the forge's fetch), `limit` (1–500, default 50) and `after` (the `next`
//! of the previous page). Answers `{"jobs": [...], "next": "<cursor>" | null}`; a parameter it
//! cannot use is a 400 naming it.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use jr_store::{Cursor, JobFilter, MAX_PAGE};
use serde::Deserialize;

use crate::status::StatusState;

const STATES: [&str; 6] = [
    "pending",
    "starting",
    "running",
    "finishing",
    "completed",
    "failed",
];
const RESULTS: [&str; 4] = ["success", "failure", "cancelled", "skipped"];

/// The query string as given (empty values count as absent).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobQuery {
    forge: Option<String>,
    backend: Option<String>,
    provider: Option<String>,
    repository: Option<String>,
    state: Option<String>,
    result: Option<String>,
    since: Option<String>,
    until: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

fn given(value: Option<String>) -> Option<String> {
    value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

fn bad(parameter: &str, message: String) -> String {
    format!("{parameter}: {message}")
}

impl JobQuery {
    /// The store filter, or what is wrong with the query.
    pub fn filter(self) -> Result<JobFilter, String> {
        let number = |name: &str, value: Option<String>| -> Result<Option<u64>, String> {
            given(value)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| bad(name, format!("{v:?} is not a number")))
                })
                .transpose()
        };
        let one_of = |name: &str, value: Option<String>, allowed: &[&str]| match given(value) {
            Some(v) if !allowed.contains(&v.as_str()) => Err(bad(
                name,
                format!("{v:?} is not one of {}", allowed.join(", ")),
            )),
            v => Ok(v),
        };
        let limit = number("limit", self.limit)?.unwrap_or(50);
        if limit == 0 || limit > u64::from(MAX_PAGE) {
            return Err(bad("limit", format!("must be 1 to {MAX_PAGE}")));
        }
        let after = match given(self.after) {
            Some(text) => Some(
                Cursor::parse(&text)
                    .ok_or_else(|| bad("after", format!("{text:?} is not a page cursor")))?,
            ),
            None => None,
        };
        Ok(JobFilter {
            forge: given(self.forge),
            backend: given(self.backend),
            provider: given(self.provider),
            repository: given(self.repository),
            state: one_of("state", self.state, &STATES)?,
            result: one_of("result", self.result, &RESULTS)?,
            since_ms: number("since", self.since)?,
            until_ms: number("until", self.until)?,
            after,
            limit: u32::try_from(limit).unwrap_or(MAX_PAGE),
        })
    }
}

/// An answer the API gives instead of its figures: `{"error": …}` with `status`.
fn refused(status: StatusCode, error: String) -> Response {
    (status, Json(serde_json::json!({ "error": error }))).into_response()
}

pub async fn jobs(
    State(s): State<Arc<StatusState>>,
    query: Result<Query<JobQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let filter = match query
        .map_err(|e| e.body_text())
        .and_then(|Query(q)| q.filter())
    {
        Ok(filter) => filter,
        Err(error) => return refused(StatusCode::BAD_REQUEST, error),
    };
    match s.store.jobs(&filter).await {
        Ok(page) => Json(page).into_response(),
        Err(e) => refused(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// `GET /api/history?minutes=N` (1–1440, default 60): per backend, the minutes with anything in
/// them, oldest first, each with the jobs fetched and ended and the mean queue wait (seconds
/// from fetch to workload) of the jobs fetched then. The page draws its charts from it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    minutes: Option<String>,
}

pub async fn history(
    State(s): State<Arc<StatusState>>,
    query: Result<Query<HistoryQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let minutes =
        match query
            .map_err(|e| e.body_text())
            .and_then(|Query(q)| match given(q.minutes) {
                None => Ok(60),
                Some(v) => v
                    .parse::<u32>()
                    .ok()
                    .filter(|m| (1..=1440).contains(m))
                    .ok_or_else(|| bad("minutes", format!("{v:?} is not 1 to 1440"))),
            }) {
            Ok(minutes) => minutes,
            Err(error) => {
                return (
                    StatusCode::BAD_REQUEST,
                    Json(serde_json::json!({ "error": error })),
                )
                    .into_response();
            }
        };
    match s.store.history(minutes).await {
        Ok(backends) => Json(serde_json::json!({
            "minutes": minutes,
            "now_ms": jr_protocol::now_ms(),
            "backends": backends,
        }))
        .into_response(),
        Err(e) => refused(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> JobQuery {
        let text = pairs
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&");
        let uri: axum::http::Uri = format!("/api/assignments?{text}").parse().expect("a uri");
        Query::<JobQuery>::try_from_uri(&uri).expect("a query").0
    }

    #[test]
    fn a_query_becomes_a_filter_or_an_error_naming_the_parameter() {
        let f = query(&[
            ("backend", "pod"),
            ("state", "failed"),
            ("limit", "10"),
            ("repository", ""),
        ])
        .filter()
        .expect("valid");
        assert_eq!(f.backend.as_deref(), Some("pod"));
        assert_eq!(f.state.as_deref(), Some("failed"));
        assert_eq!((f.limit, f.repository), (10, None));
        assert_eq!(JobQuery::default().filter().expect("defaults").limit, 50);
        for (pairs, says) in [
            (vec![("state", "done")], "state"),
            (vec![("result", "ok")], "result"),
            (vec![("limit", "0")], "limit"),
            (vec![("limit", "501")], "limit"),
            (vec![("since", "yesterday")], "since"),
            (vec![("after", "nonsense")], "after"),
        ] {
            let e = query(&pairs).filter().expect_err(says);
            assert!(e.starts_with(says), "{e}");
        }
    }
}
