//! Builds the executor Pod and its token Secret from a [`RunnerBlock`] and a [`WorkloadSpec`].

use std::collections::BTreeMap;

use jr_protocol::BackendName;
use jr_worker::WorkloadSpec;
use jr_worker::backend::{
    ENV_ASSIGNMENT_ID, ENV_FACADE_URL, ENV_FORGE, ENV_LABELS, ENV_RUNNER_TOKEN,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Container, EnvVar, EnvVarSource, LocalObjectReference, Pod, PodSpec, Secret, SecretKeySelector,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::RunnerBlock;

pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "jetrunner";
/// The keys both backends share (docs in `jr_protocol::labels`).
pub use jr_protocol::labels::{
    ASSIGNMENT as LABEL_ASSIGNMENT, ATTEMPT as LABEL_ATTEMPT, BACKEND as LABEL_BACKEND,
    PROVIDER as LABEL_PROVIDER, RUNS_ON as ANNOTATION_RUNS_ON, WORKER as LABEL_WORKER,
};
/// The Secret key holding the executor token.
pub const TOKEN_KEY: &str = "runner-token";
pub const CONTAINER_NAME: &str = "executor";

/// A Pod and the Secret (same name) that carries its executor token.
#[derive(Clone, Debug)]
pub struct ExecutorObjects {
    pub pod: Pod,
    pub secret: Secret,
}

/// The label selector of every jetrunner Pod of one backend.
pub fn selector(backend: &BackendName) -> String {
    format!("{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_BACKEND}={backend}")
}

/// Makes any text a valid label value: at most 63 characters of `[A-Za-z0-9._-]`, starting and
/// ending with an alphanumeric (other characters become `-`). Empty input stays empty.
pub fn label_value(text: &str) -> String {
    let replaced: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    replaced
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

fn jetrunner_labels(spec: &WorkloadSpec) -> BTreeMap<String, String> {
    let worker = label_value(&spec.worker_id);
    let mut labels = BTreeMap::from([
        (LABEL_MANAGED_BY.to_owned(), MANAGED_BY.to_owned()),
        (LABEL_ASSIGNMENT.to_owned(), spec.assignment_id.to_string()),
        (LABEL_ATTEMPT.to_owned(), spec.attempt.to_string()),
        (LABEL_BACKEND.to_owned(), spec.backend.to_string()),
        (
            LABEL_WORKER.to_owned(),
            if worker.is_empty() {
                "unknown".to_owned()
            } else {
                worker
            },
        ),
    ]);
    if let Some(provider) = spec
        .provider
        .as_deref()
        .map(label_value)
        .filter(|p| !p.is_empty())
    {
        labels.insert(LABEL_PROVIDER.to_owned(), provider);
    }
    labels
}

fn plain_env(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value),
        value_from: None,
    }
}

fn non_empty<T>(items: Vec<T>) -> Option<Vec<T>> {
    if items.is_empty() { None } else { Some(items) }
}

/// Builds the Pod and its Secret. The token is only in the Secret; the Pod refers to it with a
/// `secretKeyRef`, so whoever can read Pods cannot read tokens.
pub fn build_objects(block: &RunnerBlock, spec: &WorkloadSpec) -> ExecutorObjects {
    let name = spec.name();
    let labels = jetrunner_labels(spec);

    let mut env = vec![
        plain_env(ENV_FACADE_URL, spec.facade_url.clone()),
        plain_env(ENV_ASSIGNMENT_ID, spec.assignment_id.to_string()),
        plain_env(ENV_LABELS, spec.labels.join(",")),
        EnvVar {
            name: ENV_RUNNER_TOKEN.to_owned(),
            value: None,
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: name.clone(),
                    key: TOKEN_KEY.to_owned(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
        },
    ];
    if let Some(forge) = spec.forge_env {
        env.push(plain_env(ENV_FORGE, forge.to_owned()));
    }
    env.extend(block.env.iter().map(|(k, v)| plain_env(k, v.clone())));

    let mut pod_labels = block.labels.clone();
    pod_labels.extend(labels.clone());
    let mut annotations = block.annotations.clone();
    if !spec.labels.is_empty() {
        annotations.insert(ANNOTATION_RUNS_ON.to_owned(), spec.labels.join(","));
    }

    let container = Container {
        name: CONTAINER_NAME.to_owned(),
        image: Some(block.image.clone()),
        command: non_empty(block.command.clone()),
        args: non_empty(block.args.clone()),
        env: Some(env),
        resources: block.resources.clone(),
        security_context: block.security_context.clone(),
        ..Container::default()
    };
    // The deadline is a backstop for a wedged executor; round up so short jobs never get 0.
    let deadline = i64::try_from(spec.max_duration.as_secs().max(1)).unwrap_or(i64::MAX);
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(pod_labels),
            annotations: if annotations.is_empty() {
                None
            } else {
                Some(annotations)
            },
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".to_owned()),
            active_deadline_seconds: Some(deadline),
            runtime_class_name: block.runtime_class_name.clone(),
            node_selector: if block.node_selector.is_empty() {
                None
            } else {
                Some(block.node_selector.clone())
            },
            tolerations: non_empty(block.tolerations.clone()),
            service_account_name: block.service_account_name.clone(),
            // An executor gets API credentials only when a service account is asked for.
            automount_service_account_token: if block.service_account_name.is_some() {
                None
            } else {
                Some(false)
            },
            security_context: block.pod_security_context.clone(),
            image_pull_secrets: non_empty(
                block
                    .image_pull_secrets
                    .iter()
                    .map(|n| LocalObjectReference { name: n.clone() })
                    .collect(),
            ),
            enable_service_links: Some(false),
            ..PodSpec::default()
        }),
        status: None,
    };
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_owned()),
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_owned(),
            ByteString(spec.executor_token.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    };
    ExecutorObjects { pod, secret }
}

/// The ownerReference that makes the Secret go with its Pod (Kubernetes garbage collection).
pub fn owner_reference(pod: &Pod) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "v1".to_owned(),
        kind: "Pod".to_owned(),
        name: pod.metadata.name.clone()?,
        uid: pod.metadata.uid.clone()?,
        block_owner_deletion: None,
        controller: None,
    })
}
