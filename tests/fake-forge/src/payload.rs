//! Builds the `Task` message a runner receives: single-job YAML, context, secrets.

use std::collections::BTreeMap;

use jr_forge::proto::runner::v1 as pb;
use prost_types::{Struct, Value, value::Kind};

use crate::model::{JobId, JobSpec};

pub(crate) struct TaskMaterial<'a> {
    pub task_id: i64,
    pub token: String,
    pub job_id: JobId,
    pub attempt: u32,
    pub spec: &'a JobSpec,
    /// Instance URL without trailing slash.
    pub server_url: &'a str,
}

/// The YAML job key: the name reduced to `[a-z0-9_-]`, `job` if nothing is left.
pub(crate) fn job_key(name: &str) -> String {
    let key: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if key.trim_matches('_').is_empty() {
        "job".to_owned()
    } else {
        key
    }
}

/// A JSON string literal is also a valid YAML double-quoted scalar.
fn quoted(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

pub(crate) fn workflow_yaml(spec: &JobSpec) -> String {
    let runs_on: Vec<String> = spec.runs_on.iter().map(|l| quoted(l)).collect();
    let mut yaml = format!(
        "name: {name}\n\"on\": push\njobs:\n  {key}:\n    name: {name}\n    runs-on: [{runs_on}]\n    steps:\n",
        name = quoted(&spec.name),
        key = job_key(&spec.name),
        runs_on = runs_on.join(", "),
    );
    if spec.steps == 0 {
        yaml.push_str("      []\n");
    }
    for i in 1..=spec.steps {
        yaml.push_str(&format!(
            "      - name: \"step {i}\"\n        run: \"echo step {i}\"\n"
        ));
    }
    yaml
}

fn text(s: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn object(fields: BTreeMap<String, Value>) -> Value {
    Value {
        kind: Some(Kind::StructValue(Struct { fields })),
    }
}

fn fields<const N: usize>(pairs: [(&str, Value); N]) -> BTreeMap<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

pub(crate) fn context(m: &TaskMaterial<'_>) -> Struct {
    let spec = m.spec;
    let server_url = format!("{}/", m.server_url);
    let owner = spec.repo.split('/').next().unwrap_or_default().to_owned();
    let repo_name = spec.repo.rsplit('/').next().unwrap_or_default().to_owned();
    let sha = format!("{:040x}", u128::from(m.job_id.0) * 0x9e37_79b9_7f4a_7c15);
    let git_ref = "refs/heads/main";
    let run_id = m.job_id.0.to_string();
    let repository = object(fields([
        ("full_name", text(spec.repo.clone())),
        ("name", text(repo_name)),
        ("owner", object(fields([("login", text(owner.clone()))]))),
    ]));
    let mut event_fields = fields([
        ("ref", text(git_ref)),
        ("after", text(sha.clone())),
        ("repository", repository.clone()),
    ]);
    let event_name = match &spec.pull_request_from_fork {
        None => "push",
        Some(fork) => {
            let side = |repo: Value| object(fields([("repo", repo), ("sha", text(sha.clone()))]));
            let head = object(fields([
                ("full_name", text(fork.clone())),
                (
                    "fork",
                    Value {
                        kind: Some(Kind::BoolValue(true)),
                    },
                ),
            ]));
            event_fields.insert(
                "pull_request".to_owned(),
                object(fields([("head", side(head)), ("base", side(repository))])),
            );
            "pull_request"
        }
    };
    let event = object(event_fields);
    let empty = || text("");
    Struct {
        fields: fields([
            ("action", empty()),
            ("action_path", empty()),
            ("action_ref", empty()),
            ("action_repository", empty()),
            ("action_status", empty()),
            ("actor", text("fake-user")),
            ("api_url", text(format!("{server_url}api/v1"))),
            ("base_ref", empty()),
            ("env", empty()),
            ("event", event),
            ("event_name", text(event_name)),
            ("event_path", empty()),
            ("graphql_url", empty()),
            ("head_ref", empty()),
            ("job", text(job_key(&spec.name))),
            ("ref", text(git_ref)),
            ("ref_name", text("main")),
            (
                "ref_protected",
                Value {
                    kind: Some(Kind::BoolValue(false)),
                },
            ),
            ("ref_type", text("branch")),
            ("path", empty()),
            ("repository", text(spec.repo.clone())),
            ("repository_owner", text(owner)),
            (
                "repositoryUrl",
                text(format!("{server_url}{}.git", spec.repo)),
            ),
            ("retention_days", text("90")),
            ("run_id", text(run_id.clone())),
            ("run_number", text(run_id)),
            ("run_attempt", text(m.attempt.to_string())),
            ("secret_source", text("Actions")),
            ("server_url", text(server_url.clone())),
            ("sha", text(sha)),
            ("triggering_actor", text("fake-user")),
            ("workflow", text(spec.name.clone())),
            ("workspace", empty()),
            ("gitea_default_actions_url", text("https://github.com")),
            ("token", text(m.token.clone())),
            (
                "gitea_runtime_token",
                text(format!("fake-runtime-token-{}", m.task_id)),
            ),
        ]),
    }
}

pub(crate) fn build_task(m: &TaskMaterial<'_>) -> pb::Task {
    let mut secrets = m.spec.secrets.clone();
    secrets.insert("GITHUB_TOKEN".to_owned(), m.token.clone());
    secrets.insert("GITEA_TOKEN".to_owned(), m.token.clone());
    pb::Task {
        id: m.task_id,
        workflow_payload: Some(workflow_yaml(m.spec).into_bytes()),
        context: Some(context(m)),
        secrets,
        needs: BTreeMap::new(),
        vars: m.spec.vars.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workflow_has_one_job_with_all_steps() {
        let spec = JobSpec {
            name: "Build & Test".into(),
            runs_on: vec!["pod".into()],
            steps: 2,
            ..JobSpec::default()
        };
        let yaml = workflow_yaml(&spec);
        assert!(yaml.contains("  build___test:\n"), "{yaml}");
        assert!(yaml.contains("runs-on: [\"pod\"]"), "{yaml}");
        assert_eq!(yaml.matches("- name:").count(), 2);
    }

    #[test]
    fn context_carries_the_task_token_and_keys_act_runner_reads() {
        let spec = JobSpec::default();
        let m = TaskMaterial {
            task_id: 7,
            token: "t".repeat(40),
            job_id: JobId(3),
            attempt: 1,
            spec: &spec,
            server_url: "http://x",
        };
        let ctx = context(&m);
        for key in [
            "event",
            "run_id",
            "run_number",
            "actor",
            "repository",
            "event_name",
            "sha",
            "ref",
            "ref_name",
            "ref_type",
            "head_ref",
            "base_ref",
            "token",
            "repository_owner",
            "retention_days",
            "job",
            "gitea_default_actions_url",
            "gitea_runtime_token",
            "server_url",
        ] {
            assert!(ctx.fields.contains_key(key), "missing {key}");
        }
        assert_eq!(ctx.fields.get("token"), Some(&text("t".repeat(40))));
        assert_eq!(ctx.fields.get("server_url"), Some(&text("http://x/")));
    }
}
