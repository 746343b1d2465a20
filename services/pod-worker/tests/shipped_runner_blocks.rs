//! The runner blocks shipped in the repository's configuration files are accepted by the
//! pod-worker, and the production one (k8s/base) yields executor Pods that meet the Pod Security
//! "restricted" profile and have requests and limits.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use jr_protocol::{AssignmentId, BackendName};
use jr_worker::WorkloadSpec;
use pod_worker::PodTemplate;
use pod_worker::template::build_objects;

fn template_of(file: &str) -> PodTemplate {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("config file");
    let config = jr_config::load_str(&text, file, std::iter::empty()).expect("valid config");
    let backend = config.backend.get("pod").expect("a pod backend");
    let json = |t: &Option<toml::Table>| {
        t.as_ref().map_or(serde_json::json!({}), |t| {
            serde_json::to_value(t).expect("runner block as JSON")
        })
    };
    let providers: BTreeMap<String, serde_json::Value> = backend
        .providers
        .iter()
        .map(|p| (p.name.clone(), json(&p.runner)))
        .collect();
    PodTemplate::new(&json(&backend.runner), &providers).expect("runner block accepted")
}

fn spec() -> WorkloadSpec {
    WorkloadSpec {
        assignment_id: AssignmentId::for_task("https://forge.example", 1),
        attempt: 1,
        backend: BackendName::new("pod").expect("name"),
        provider: None,
        labels: vec!["pod".into()],
        max_duration: Duration::from_secs(600),
        worker_id: "w".into(),
        facade_url: "https://facade".into(),
        executor_token: "t".into(),
        repository: "acme/widgets".into(),
        workflow: "ci".into(),
        job_name: "build".into(),
        fetched_at: 0,
        forge_env: None,
    }
}

#[test]
fn the_compose_runner_block_is_accepted() {
    template_of("config/jetrunner.toml")
        .runner_block(None)
        .expect("default block");
}

#[test]
fn the_production_runner_block_is_restricted_and_bounded() {
    let template = template_of("k8s/base/jetrunner.toml");
    let block = template.runner_block(None).expect("default block");
    let pod = build_objects(block, &spec()).pod;
    let spec = pod.spec.expect("pod spec");
    let pod_sc = spec.security_context.expect("pod securityContext");
    assert_eq!(pod_sc.run_as_non_root, Some(true));
    assert!(pod_sc.run_as_user.is_some_and(|u| u != 0), "runs as root");
    assert_eq!(
        pod_sc.seccomp_profile.map(|s| s.type_),
        Some("RuntimeDefault".to_owned())
    );
    let container = &spec.containers[0];
    let sc = container
        .security_context
        .as_ref()
        .expect("container securityContext");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.privileged, None);
    let dropped = sc
        .capabilities
        .as_ref()
        .and_then(|c| c.drop.clone())
        .unwrap_or_default();
    assert_eq!(dropped, vec!["ALL".to_owned()]);
    assert!(
        sc.capabilities
            .as_ref()
            .and_then(|c| c.add.as_ref())
            .is_none_or(Vec::is_empty)
    );
    let resources = container.resources.as_ref().expect("resources");
    for (what, section) in [
        ("requests", resources.requests.as_ref()),
        ("limits", resources.limits.as_ref()),
    ] {
        let section = section.unwrap_or_else(|| panic!("no {what}"));
        for key in ["cpu", "memory", "ephemeral-storage"] {
            assert!(section.contains_key(key), "{what}.{key} missing");
        }
    }
}
