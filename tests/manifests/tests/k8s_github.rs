//! The GitHub overlay (k8s/github): its configuration is valid and serves Gitea and a GitHub scale
//! set side by side, the GitHub credential the configuration names is mounted into the scheduler
//! (and only there) from a Secret that has it, and executor Pods may reach GitHub over HTTPS.

mod common;

use std::path::Path;

use common::*;

fn overlay_dir() -> std::path::PathBuf {
    repo_root().join("k8s/github")
}

#[test]
fn the_overlay_builds_on_the_base_and_replaces_its_config() {
    let k = load_kustomization(&overlay_dir());
    assert!(k.missing.is_empty(), "{:#?}", k.missing);
    assert!(
        k.objects
            .iter()
            .any(|o| o.kind() == "Deployment" && o.name() == "scheduler"),
        "the base is not part of the overlay"
    );
    let generators = seq_at(&k.value, &["configMapGenerator"]);
    let replaced = generators.iter().any(|g| {
        str_at(g, &["name"]) == Some("jetrunner-config")
            && str_at(g, &["behavior"]) == Some("replace")
    });
    assert!(
        replaced,
        "the overlay must replace the base's jetrunner-config"
    );
}

#[test]
fn the_config_serves_gitea_and_a_github_scale_set_whose_key_the_scheduler_mounts() {
    let file = overlay_dir().join("jetrunner.toml");
    let config = load_config(&file, &[]);
    assert!(config.gitea().is_some(), "the Gitea forge is gone");
    let [github] = &config.github[..] else {
        panic!("one GitHub entry expected, found {}", config.github.len());
    };
    assert!(
        config.backend.contains_key(&github.backend),
        "backend {:?}",
        github.backend
    );
    let key = github
        .app_private_key_file
        .as_ref()
        .expect("the example signs in as a GitHub App");
    let dir = key.parent().expect("a directory").to_str().expect("utf-8");
    let file_name = key.file_name().and_then(|n| n.to_str()).expect("a file");
    // The patch mounts the Secret at that directory into the scheduler's container.
    let patch = yaml_docs(&overlay_dir().join("scheduler-github.yaml"));
    let [patch] = &patch[..] else {
        panic!("one patch document expected");
    };
    assert_eq!(str_at(patch, &["kind"]), Some("Deployment"));
    assert_eq!(str_at(patch, &["metadata", "name"]), Some("scheduler"));
    let spec = at(patch, &["spec", "template", "spec"]).expect("pod spec");
    let container = &seq_at(spec, &["containers"])[0];
    assert_eq!(str_at(container, &["name"]), Some("scheduler"));
    let mount = seq_at(container, &["volumeMounts"])
        .iter()
        .find(|m| str_at(m, &["mountPath"]) == Some(dir))
        .unwrap_or_else(|| panic!("nothing mounted at {dir}"));
    assert_eq!(
        at(mount, &["readOnly"]).and_then(serde_yaml::Value::as_bool),
        Some(true)
    );
    let volume_name = str_at(mount, &["name"]).expect("volume name");
    let volume = seq_at(spec, &["volumes"])
        .iter()
        .find(|v| str_at(v, &["name"]) == Some(volume_name))
        .expect("the mounted volume is declared");
    let secret = str_at(volume, &["secret", "secretName"]).expect("a Secret volume");
    let k = load_kustomization(&overlay_dir());
    let keys = k
        .keys_of("Secret", NS, secret)
        .unwrap_or_else(|| panic!("Secret {secret} is not in the overlay"));
    assert!(
        keys.contains(file_name),
        "Secret {secret} has no key {file_name}: {keys:?}"
    );
    // No other Deployment of the base mounts it.
    for deployment in k.of_kind("Deployment") {
        for v in seq_at(pod_spec(deployment), &["volumes"]) {
            assert_ne!(
                str_at(v, &["secret", "secretName"]),
                Some(secret),
                "{} mounts the GitHub credential",
                deployment.describe()
            );
        }
    }
}

#[test]
fn executor_pods_may_reach_github_over_https() {
    let k = load_kustomization(&overlay_dir());
    let allows_443 = k.of_kind("NetworkPolicy").any(|p| {
        p.namespace() == Some(JOBS_NS)
            && seq_at(&p.value, &["spec", "egress"]).iter().any(|rule| {
                seq_at(rule, &["ports"]).iter().any(|port| {
                    at(port, &["port"]).and_then(serde_yaml::Value::as_u64) == Some(443)
                }) && seq_at(rule, &["to"])
                    .iter()
                    .any(|to| str_at(to, &["ipBlock", "cidr"]) == Some("0.0.0.0/0"))
            })
    });
    assert!(
        allows_443,
        "no NetworkPolicy in {JOBS_NS} lets executor Pods reach GitHub"
    );
    assert!(Path::new(&overlay_dir().join("github-networkpolicy.yaml")).is_file());
}
