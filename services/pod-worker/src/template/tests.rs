use std::collections::BTreeMap;
use std::time::Duration;

use jr_protocol::{AssignmentId, BackendName};
use jr_worker::WorkloadSpec;
use serde_json::json;

use super::*;
use crate::error::PodWorkerError;

fn spec() -> WorkloadSpec {
    WorkloadSpec {
        assignment_id: AssignmentId::for_task("https://forge.example", 42),
        attempt: 2,
        backend: BackendName::new("pod").expect("valid backend name"),
        provider: Some("big".into()),
        labels: vec!["pod".into(), "self-hosted".into()],
        max_duration: Duration::from_secs(3600),
        worker_id: "pod-worker-7f9c@node/1".into(),
        facade_url: "https://facade.example:8443".into(),
        executor_token: "s3cr3t-token-value".into(),
        repository: "acme/widgets".into(),
        workflow: "ci".into(),
        job_name: "build".into(),
        fetched_at: 0,
        forge_env: None,
    }
}

#[test]
fn later_scalars_replace_and_mappings_merge_key_by_key() {
    let base = json!({"image": "a", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}});
    let over = json!({"image": "b", "resources": {"limits": {"cpu": "2"}}});
    assert_eq!(
        layer(&base, &over),
        json!({"image": "b", "resources": {"limits": {"cpu": "2", "memory": "1Gi"}}})
    );
}

#[test]
fn lists_replace_whole_and_null_clears() {
    let base =
        json!({"args": ["x", "y"], "runtime_class_name": "kata", "env": {"A": "1", "B": "2"}});
    let over = json!({"args": ["z"], "runtime_class_name": null, "env": {"B": null}});
    assert_eq!(
        layer(&base, &over),
        json!({"args": ["z"], "env": {"A": "1"}})
    );
}

#[test]
fn empty_strings_and_tables_clear_because_toml_has_no_null() {
    let base = json!({"runtime_class_name": "kata", "node_selector": {"pool": "ci"}, "tolerations": [{"key": "k"}]});
    let over = json!({"runtime_class_name": "", "node_selector": {}, "tolerations": []});
    assert_eq!(layer(&base, &over), json!({"tolerations": []}));
    let block = RunnerBlock::from_value(
        &json!({"image": "a", "runtime_class_name": "", "service_account_name": ""}),
    )
    .expect("empty optional strings are unset");
    assert_eq!(
        (block.runtime_class_name, block.service_account_name),
        (None, None)
    );
}

#[test]
fn nulls_in_a_new_mapping_mean_absent_and_layers_fold_in_order() {
    let merged = merge_layers([
        &json!({"image": "a"}),
        &json!({"env": {"A": null, "B": "2"}}),
        &json!({"image": "c"}),
    ]);
    assert_eq!(merged, json!({"image": "c", "env": {"B": "2"}}));
}

#[test]
fn runner_block_refuses_unknown_keys_naming_them() {
    let err =
        RunnerBlock::from_value(&json!({"image": "a", "imagee": "b"})).expect_err("unknown key");
    assert_eq!(
        err,
        PodWorkerError::UnknownKey {
            layer: None,
            key: "imagee".into()
        }
    );
    let err = RunnerBlock::from_value(&json!({"image": "a", "resources": {"limit": {"cpu": "1"}}}))
        .expect_err("unknown nested key");
    assert_eq!(
        err,
        PodWorkerError::UnknownKey {
            layer: None,
            key: "resources.limit".into()
        }
    );
    let err = RunnerBlock::from_value(
        &json!({"image": "a", "tolerations": [{"key": "k", "efect": "NoSchedule"}]}),
    )
    .expect_err("unknown key in a list item");
    assert_eq!(
        err.to_string(),
        "runner block: unknown key `tolerations[0].efect`"
    );
}

#[test]
fn runner_block_requires_image_and_reserves_jetrunner_keys() {
    assert_eq!(
        RunnerBlock::from_value(&json!({"args": []})),
        Err(PodWorkerError::MissingKey {
            layer: None,
            key: "image".into()
        })
    );
    let err =
        RunnerBlock::from_value(&json!({"image": "a", "env": {"JETRUNNER_RUNNER_TOKEN": "x"}}))
            .expect_err("reserved");
    assert_eq!(err.kind(), "reserved_key");
    let err =
        RunnerBlock::from_value(&json!({"image": "a", "labels": {"jetrunner.dev/backend": "x"}}))
            .expect_err("reserved");
    assert_eq!(
        err,
        PodWorkerError::ReservedKey {
            layer: None,
            key: "labels.jetrunner.dev/backend".into()
        }
    );
    let err = RunnerBlock::from_value(&json!({"image": "a", "command": "not-a-list"}))
        .expect_err("wrong type");
    assert_eq!(err.kind(), "invalid_value");
}

#[test]
fn runner_block_parses_kubernetes_objects_and_numeric_quantities() {
    let block = RunnerBlock::from_value(&json!({
        "image": "ghcr.io/x/executor:1",
        "resources": {"limits": {"cpu": 2, "memory": "4Gi"}},
        "tolerations": [{"key": "ci", "operator": "Exists", "effect": "NoSchedule"}],
        "security_context": {"runAsNonRoot": true},
        "pod_security_context": {"fsGroup": 1000},
        "image_pull_secrets": ["regcred"],
    }))
    .expect("valid block");
    let limits = block.resources.and_then(|r| r.limits).expect("limits");
    assert_eq!(limits["cpu"].0, "2");
    assert_eq!(block.tolerations[0].operator.as_deref(), Some("Exists"));
    assert_eq!(
        block.security_context.and_then(|s| s.run_as_non_root),
        Some(true)
    );
    assert_eq!(block.image_pull_secrets, vec!["regcred".to_owned()]);
}

#[test]
fn provider_blocks_are_layered_over_defaults_and_errors_name_the_provider() {
    let defaults = json!({"image": "base", "node_selector": {"pool": "ci"}});
    let providers = BTreeMap::from([(
        "big".to_owned(),
        json!({"resources": {"requests": {"cpu": "8"}}, "node_selector": null}),
    )]);
    let template = PodTemplate::new(&defaults, &providers).expect("valid template");
    let big = template.runner_block(Some("big")).expect("provider block");
    assert_eq!(big.image, "base");
    assert!(big.node_selector.is_empty());
    assert_eq!(
        template.runner_block(None).expect("defaults").node_selector["pool"],
        "ci"
    );
    assert_eq!(
        template
            .runner_block(Some("nope"))
            .expect_err("unknown provider")
            .kind(),
        "unknown_provider"
    );

    let bad = BTreeMap::from([("big".to_owned(), json!({"nodeSelector": {}}))]);
    let err = PodTemplate::new(&defaults, &bad).expect_err("unknown key");
    assert_eq!(
        err.to_string(),
        "runner block of provider `big`: unknown key `nodeSelector`"
    );
}

#[test]
fn defaults_may_lack_the_image_when_every_provider_sets_it() {
    let providers = BTreeMap::from([("a".to_owned(), json!({"image": "x"}))]);
    let template = PodTemplate::new(&json!({}), &providers).expect("valid");
    assert!(template.runner_block(Some("a")).is_ok());
    assert!(template.runner_block(None).is_err());
    assert!(PodTemplate::new(&json!({}), &BTreeMap::new()).is_err());
}

#[test]
fn pod_has_deterministic_name_jetrunner_labels_and_no_token() {
    let spec = spec();
    let block = RunnerBlock::from_value(
        &json!({"image": "exec:1", "labels": {"team": "ci"}, "env": {"EXTRA": "1"}}),
    )
    .expect("block");
    let objects = build_objects(&block, &spec);
    let pod = serde_json::to_value(&objects.pod).expect("pod json");
    assert_eq!(pod["metadata"]["name"], json!(spec.name()));
    let labels = &pod["metadata"]["labels"];
    assert_eq!(labels[LABEL_MANAGED_BY], "jetrunner");
    assert_eq!(
        labels[LABEL_ASSIGNMENT],
        json!(spec.assignment_id.to_string())
    );
    assert_eq!(labels[LABEL_ATTEMPT], "2");
    assert_eq!(labels[LABEL_BACKEND], "pod");
    assert_eq!(labels[LABEL_WORKER], "pod-worker-7f9c-node-1");
    assert_eq!(labels[LABEL_PROVIDER], "big");
    assert_eq!(labels["team"], "ci");
    assert_eq!(
        pod["metadata"]["annotations"][ANNOTATION_RUNS_ON],
        "pod,self-hosted"
    );
    assert_eq!(pod["spec"]["restartPolicy"], "Never");
    assert_eq!(pod["spec"]["activeDeadlineSeconds"], 3600);
    assert_eq!(pod["spec"]["automountServiceAccountToken"], false);

    let env = pod["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env list");
    let var = |n: &str| {
        env.iter()
            .find(|v| v["name"] == n)
            .cloned()
            .expect("env var present")
    };
    assert_eq!(
        var("JETRUNNER_FACADE_URL")["value"],
        "https://facade.example:8443"
    );
    assert_eq!(
        var("JETRUNNER_ASSIGNMENT_ID")["value"],
        json!(spec.assignment_id.to_string())
    );
    assert_eq!(var("JETRUNNER_LABELS")["value"], "pod,self-hosted");
    assert_eq!(var("EXTRA")["value"], "1");
    let token_ref = &var("JETRUNNER_RUNNER_TOKEN")["valueFrom"]["secretKeyRef"];
    assert_eq!(token_ref["name"], json!(spec.name()));
    assert_eq!(token_ref["key"], TOKEN_KEY);
    assert!(
        !pod.to_string().contains("s3cr3t-token-value"),
        "the token must never be in the Pod"
    );

    let secret = objects.secret;
    assert_eq!(secret.metadata.name.as_deref(), Some(spec.name().as_str()));
    let token = secret
        .data
        .as_ref()
        .and_then(|d| d.get(TOKEN_KEY))
        .expect("token in secret");
    assert_eq!(token.0, b"s3cr3t-token-value");
}

#[test]
fn label_values_are_sanitised() {
    assert_eq!(label_value("worker@host:1"), "worker-host-1");
    assert_eq!(label_value("--x--"), "x");
    assert_eq!(label_value(&"a".repeat(80)).len(), 63);
    assert_eq!(label_value("@@@"), "");
}

#[test]
fn selector_names_the_backend() {
    let backend = BackendName::new("pod").expect("valid");
    assert_eq!(
        selector(&backend),
        "app.kubernetes.io/managed-by=jetrunner,jetrunner.dev/backend=pod"
    );
}

#[test]
fn a_github_job_tells_the_entrypoint_and_a_gitea_job_does_not() {
    let block = RunnerBlock::from_value(&json!({"image": "exec:1"})).expect("block");
    let forge_var = |spec: &WorkloadSpec| {
        let pod = serde_json::to_value(build_objects(&block, spec).pod).expect("pod json");
        pod["spec"]["containers"][0]["env"]
            .as_array()
            .expect("env list")
            .iter()
            .find(|v| v["name"] == "JETRUNNER_FORGE")
            .map(|v| v["value"].clone())
    };
    assert_eq!(forge_var(&spec()), None);
    let github = WorkloadSpec {
        forge_env: jr_protocol::ForgeKind::GitHub("acme".to_owned()).executor_forge_env(),
        ..spec()
    };
    assert_eq!(forge_var(&github), Some(json!("github")));
}
