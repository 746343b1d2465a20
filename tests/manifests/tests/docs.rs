//! docs/operations.md names the same streams, subjects, Secrets and labels as the code and the
//! manifests, so an operator following it finds what it describes.

mod common;

use common::*;

fn operations_doc() -> String {
    read(&repo_root().join("docs/operations.md"))
}

#[test]
fn operations_doc_names_the_streams_and_subject_filters_of_the_protocol() {
    let doc = operations_doc();
    for stream in [
        jr_protocol::STREAM_ASSIGNMENTS,
        jr_protocol::STREAM_EVENTS,
        jr_protocol::STREAM_COMMANDS,
    ] {
        assert!(
            doc.contains(&format!("`{stream}`")),
            "{stream} is documented"
        );
    }
    let pod = jr_protocol::BackendName::new("pod").expect("valid backend name");
    let filter = jr_protocol::subject::assignments_of(&pod);
    assert!(
        doc.contains(&format!("`{filter}`")),
        "{filter} is documented"
    );
    for kind in jr_protocol::Kind::ALL {
        if kind != jr_protocol::Kind::Assignment {
            assert!(
                doc.contains(&format!("`{}`", kind.as_str())),
                "kind {kind:?}"
            );
        }
    }
}

#[test]
fn operations_doc_names_the_secrets_ports_and_labels_of_the_manifests() {
    let doc = operations_doc();
    let base = base();
    for secret in base.of_kind("Secret") {
        assert!(
            doc.contains(&format!("`{}`", secret.name())),
            "Secret {} is documented",
            secret.name()
        );
    }
    for policy in base.of_kind("NetworkPolicy") {
        for rule in seq_at(&policy.value, &["spec", "ingress"]) {
            for peer in seq_at(rule, &["from"]) {
                let labels = string_map(at(peer, &["namespaceSelector", "matchLabels"]));
                for (key, value) in labels {
                    if key != "kubernetes.io/metadata.name" {
                        assert!(
                            doc.contains(&format!("{key}={value}")),
                            "label {key}={value}"
                        );
                    }
                }
            }
        }
    }
    for deployment in base.of_kind("Deployment") {
        for container in seq_at(pod_spec(deployment), &["containers"]) {
            for (_, port) in container_ports(container) {
                assert!(
                    doc.contains(&format!("| {port}")) || doc.contains(&format!(" {port} ")),
                    "port {port} of {} is documented",
                    deployment.name()
                );
            }
        }
    }
}
