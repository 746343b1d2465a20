//! The JSON the scale set service speaks. Unknown fields are ignored; fields the client needs
//! are required, so a changed protocol fails loudly instead of running on defaults.

use serde::{Deserialize, Deserializer, Serialize};

/// A field the service may send as `null` (its Go clients read `null` as the zero value).
fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", default)]
pub struct Statistics {
    #[serde(deserialize_with = "null_as_default")]
    pub total_available_jobs: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub total_acquired_jobs: i64,
    /// Waiting and running jobs of the scale set: the scaling target.
    #[serde(deserialize_with = "null_as_default")]
    pub total_assigned_jobs: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub total_running_jobs: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub total_registered_runners: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub total_busy_runners: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub total_idle_runners: i64,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct Label {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RunnerGroup {
    pub id: i64,
    pub name: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RunnerScaleSet {
    pub id: i64,
    pub name: String,
    pub runner_group_id: i64,
    #[serde(default)]
    pub labels: Vec<Label>,
    #[serde(default)]
    pub statistics: Option<Statistics>,
}

#[derive(Clone, Debug, Deserialize)]
pub(crate) struct List<T> {
    pub count: usize,
    #[serde(default = "Vec::new")]
    pub value: Vec<T>,
}

#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub session_id: String,
    #[serde(default)]
    pub owner_name: String,
    pub message_queue_url: String,
    pub message_queue_access_token: String,
    pub statistics: Option<Statistics>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("session_id", &self.session_id)
            .field("owner_name", &self.owner_name)
            .field("message_queue_url", &self.message_queue_url)
            .field("message_queue_access_token", &"<secret>")
            .finish()
    }
}

/// One message of the queue: a batch of job messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueMessage {
    pub id: i64,
    pub jobs: Vec<JobMessage>,
    pub statistics: Statistics,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RawQueueMessage {
    pub message_id: i64,
    pub message_type: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub body: String,
    /// Always sent by the service; a missing one reads as zeros rather than losing the message.
    #[serde(default, deserialize_with = "null_as_default")]
    pub statistics: Statistics,
}

/// What every job message says about its job.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", default)]
pub struct JobFacts {
    /// 0 on github.com since 2025 (the job is then known by `job_id` only).
    #[serde(deserialize_with = "null_as_default")]
    pub runner_request_id: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub job_id: String,
    #[serde(deserialize_with = "null_as_default")]
    pub repository_name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub owner_name: String,
    /// `{owner}/{repo}/.github/workflows/{file}@{ref}`.
    #[serde(deserialize_with = "null_as_default")]
    pub job_workflow_ref: String,
    #[serde(deserialize_with = "null_as_default")]
    pub job_display_name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub workflow_run_id: i64,
    #[serde(deserialize_with = "null_as_default")]
    pub event_name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub request_labels: Vec<String>,
}

impl JobFacts {
    /// What identifies the job: its `runnerRequestId`, or its `jobId` where the service sends
    /// 0 for the former.
    pub fn key(&self) -> String {
        if self.runner_request_id != 0 {
            self.runner_request_id.to_string()
        } else {
            format!("job-{}", self.job_id)
        }
    }

    /// The job as a number, for jetrunner's `forge_task_id` (assignments, claims, terminals
    /// and the sealed task's scope), which is an integer: its `runnerRequestId`, or, where
    /// the service sends 0 for that, a number derived from its `jobId` (the same job, the same
    /// number, on every replica and after restarts). Derived numbers are negative (62 bits of
    /// SHA-256, less one), so they are never taken for a `runnerRequestId`, which the service
    /// counts up from 1. It names the same job as [`JobFacts::key`].
    pub fn task_id(&self) -> i64 {
        use sha2::Digest;
        if self.runner_request_id != 0 {
            return self.runner_request_id;
        }
        let mut hasher = sha2::Sha256::new();
        hasher.update(b"jetrunner github job id\0");
        hasher.update(self.job_id.as_bytes());
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        // 62 bits always fit an i64; the fallback is unreachable.
        i64::try_from(u64::from_be_bytes(first) >> 2).map_or(-1, |n| -n - 1)
    }
}

/// A job message by its `messageType`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobMessage {
    /// Offered; must be acquired before it is assigned (GitHub Enterprise Server).
    Available(JobFacts),
    /// Assigned to this scale set: a runner of it will get it.
    Assigned(JobFacts),
    Started {
        job: JobFacts,
        runner_id: i64,
        runner_name: String,
    },
    Completed {
        job: JobFacts,
        result: String,
        runner_id: i64,
        runner_name: String,
    },
    /// A type this client does not know (ignored, but kept visible in logs).
    Other { message_type: String },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawJobMessage {
    message_type: String,
    #[serde(flatten)]
    facts: JobFacts,
    #[serde(default, deserialize_with = "null_as_default")]
    runner_id: i64,
    #[serde(default, deserialize_with = "null_as_default")]
    runner_name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    result: String,
}

impl JobMessage {
    pub(crate) fn parse(value: serde_json::Value) -> Result<JobMessage, serde_json::Error> {
        let raw: RawJobMessage = serde_json::from_value(value)?;
        Ok(match raw.message_type.as_str() {
            "JobAvailable" => JobMessage::Available(raw.facts),
            "JobAssigned" => JobMessage::Assigned(raw.facts),
            "JobStarted" => JobMessage::Started {
                job: raw.facts,
                runner_id: raw.runner_id,
                runner_name: raw.runner_name,
            },
            "JobCompleted" => JobMessage::Completed {
                job: raw.facts,
                result: raw.result,
                runner_id: raw.runner_id,
                runner_name: raw.runner_name,
            },
            _ => JobMessage::Other {
                message_type: raw.message_type,
            },
        })
    }

    pub fn facts(&self) -> Option<&JobFacts> {
        match self {
            JobMessage::Available(f) | JobMessage::Assigned(f) => Some(f),
            JobMessage::Started { job, .. } | JobMessage::Completed { job, .. } => Some(job),
            JobMessage::Other { .. } => None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RunnerReference {
    pub id: i64,
    pub name: String,
    #[serde(default)]
    pub runner_scale_set_id: i64,
}

/// A one-use runner registration: the runner starts with `--jitconfig <encoded>`. A secret.
#[derive(Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JitConfig {
    pub runner: RunnerReference,
    #[serde(rename = "encodedJITConfig")]
    pub encoded: String,
}

impl std::fmt::Debug for JitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JitConfig")
            .field("runner", &self.runner)
            .field("encoded", &"<secret>")
            .finish()
    }
}

/// What the REST workflow run says about where its code comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunOrigin {
    pub event: String,
    pub repository: String,
    pub head_repository: String,
    /// Who triggered the run (`triggering_actor`, else `actor`), empty when not given.
    pub actor: String,
}

impl RunOrigin {
    /// The run's code comes from another repository than the one it runs for.
    pub fn from_fork(&self) -> bool {
        !self.head_repository.eq_ignore_ascii_case(&self.repository)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_messages_by_type() {
        let started = serde_json::json!({
            "messageType": "JobStarted", "runnerRequestId": 7, "jobId": "j",
            "repositoryName": "app", "ownerName": "acme", "eventName": "push",
            "requestLabels": ["x"], "runnerId": 3, "runnerName": "r-3", "unknown": 1,
        });
        let parsed = JobMessage::parse(started).expect("parse");
        let JobMessage::Started {
            job,
            runner_id,
            runner_name,
        } = parsed
        else {
            panic!("not started");
        };
        assert_eq!(
            (job.runner_request_id, runner_id, runner_name.as_str()),
            (7, 3, "r-3")
        );
        let other = JobMessage::parse(serde_json::json!({"messageType": "Bogus"})).expect("parse");
        assert_eq!(
            other,
            JobMessage::Other {
                message_type: "Bogus".into()
            }
        );
    }

    #[test]
    fn nulls_read_as_empty_values() {
        let assigned = serde_json::json!({
            "messageType": "JobAssigned", "runnerRequestId": 0, "jobId": "j-1",
            "requestLabels": null, "jobWorkflowRef": null, "workflowRunId": null,
        });
        let JobMessage::Assigned(facts) = JobMessage::parse(assigned).expect("parse") else {
            panic!("not assigned");
        };
        assert!(facts.request_labels.is_empty() && facts.job_workflow_ref.is_empty());
        assert_eq!(facts.key(), "job-j-1");
    }

    #[test]
    fn a_job_without_a_request_id_gets_a_negative_task_id_of_its_own() {
        let job = |request: i64, id: &str| JobFacts {
            runner_request_id: request,
            job_id: id.into(),
            ..JobFacts::default()
        };
        assert_eq!(job(42, "a").task_id(), 42, "a request id is the task id");
        let a = job(0, "6f1d0a52-2c9b-4d3e-9a59-1f7c7d6f0a11").task_id();
        let b = job(0, "0b8e6c1e-7d2a-4f4f-8c3e-5e2f3a9d7b22").task_id();
        assert!(a < 0 && b < 0, "{a} {b}");
        assert_ne!(a, b, "two jobs, one task id");
        assert_eq!(
            a,
            job(0, "6f1d0a52-2c9b-4d3e-9a59-1f7c7d6f0a11").task_id(),
            "the same job, another task id"
        );
    }

    #[test]
    fn a_jit_config_is_never_printed() {
        let jit: JitConfig = serde_json::from_value(serde_json::json!({
            "runner": {"id": 1, "name": "n"}, "encodedJITConfig": "c2VjcmV0"
        }))
        .expect("parse");
        assert!(!format!("{jit:?}").contains("c2VjcmV0"));
    }
}
