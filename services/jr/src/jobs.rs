//! `jr jobs`: the job list of the status page (`GET /api/assignments`), newest first, with the
//! same filters; text, or the API's JSON with `--json`. `--forge` (a global option) filters
//! by the forge the job came from.

use crate::{Options, print_json, status_get};

/// The filters of `jr jobs`, as the status API names them.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct JobArgs {
    #[arg(long)]
    backend: Option<String>,
    #[arg(long)]
    provider: Option<String>,
    /// `owner/name`.
    #[arg(long)]
    repository: Option<String>,
    /// pending, starting, running, finishing, completed or failed.
    #[arg(long)]
    state: Option<String>,
    /// success, failure, cancelled or skipped.
    #[arg(long)]
    result: Option<String>,
    /// Fetched at or after this unix time in ms.
    #[arg(long)]
    since: Option<u64>,
    /// Fetched before this unix time in ms.
    #[arg(long)]
    until: Option<u64>,
    /// Rows (1–500).
    #[arg(long, default_value = "50")]
    limit: u32,
    /// The `next` cursor a previous page printed.
    #[arg(long)]
    after: Option<String>,
}

/// The API path of `args` (and the forge filter).
fn path(args: &JobArgs, forge: Option<&str>) -> String {
    let mut query: Vec<(&str, String)> = Vec::new();
    let mut add = |k: &'static str, v: Option<String>| {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            query.push((k, v));
        }
    };
    add("forge", forge.map(|f| f.trim_end_matches('/').to_owned()));
    add("backend", args.backend.clone());
    add("provider", args.provider.clone());
    add("repository", args.repository.clone());
    add("state", args.state.clone());
    add("result", args.result.clone());
    add("since", args.since.map(|v| v.to_string()));
    add("until", args.until.map(|v| v.to_string()));
    add("limit", Some(args.limit.to_string()));
    add("after", args.after.clone());
    let text: Vec<String> = query
        .into_iter()
        .map(|(k, v)| format!("{k}={}", encode(&v)))
        .collect();
    format!("/api/assignments?{}", text.join("&"))
}

/// Percent-encodes a query value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

pub async fn jobs(args: &JobArgs, options: &Options) -> anyhow::Result<()> {
    let body = status_get(&options.api, &path(args, options.forge.as_deref())).await?;
    if options.json {
        return print_json(&body);
    }
    print!("{}", render(&body));
    Ok(())
}

fn render(body: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let jobs = body["jobs"].as_array().cloned().unwrap_or_default();
    if jobs.is_empty() {
        out.push_str("no job matches\n");
    }
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "-".to_owned(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    for j in &jobs {
        let _ = writeln!(
            out,
            "{}  {:<9} {:<8} {:<10} #{} {:<24} {:<28} {} {}",
            text(&j["id"]),
            text(&j["backend"]),
            text(&j["state"]),
            text(&j["result"]),
            text(&j["attempt"]),
            text(&j["repository"]),
            text(&j["job_name"]),
            text(&j["provider"]),
            j["reason"]
                .as_str()
                .map(|r| format!("({r})"))
                .unwrap_or_default(),
        );
    }
    if let Some(next) = body["next"].as_str() {
        let _ = writeln!(out, "more: --after {next}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_become_the_apis_query_and_rows_are_printed() {
        let args = JobArgs {
            backend: Some("pod".into()),
            repository: Some("acme/widgets".into()),
            state: Some("failed".into()),
            limit: 10,
            ..Default::default()
        };
        assert_eq!(
            path(&args, Some("http://forge:3000/")),
            "/api/assignments?forge=http%3A%2F%2Fforge%3A3000&backend=pod&repository=acme%2Fwidgets&state=failed&limit=10"
        );
        let text = render(&serde_json::json!({"jobs": [
            {"id": "a1", "backend": "pod", "state": "failed", "result": "failure", "attempt": 2,
             "repository": "acme/widgets", "job_name": "build", "provider": null,
             "reason": "workload lost"}], "next": "5.a1"}));
        assert!(
            text.contains("a1") && text.contains("(workload lost)"),
            "{text}"
        );
        assert!(text.contains("more: --after 5.a1"), "{text}");
        assert_eq!(
            render(&serde_json::json!({"jobs": [], "next": null})),
            "no job matches\n"
        );
    }
}
