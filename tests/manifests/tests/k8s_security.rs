//! Security and availability of the kustomize base (k8s/base): least-privilege RBAC, tokens only
//! where needed, restricted pod security, NetworkPolicies, disruption budgets for singletons.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use serde_yaml::Value;

#[test]
fn role_bindings_reference_existing_roles_and_service_accounts() {
    let base = base();
    let bindings: Vec<&Object> = base.of_kind("RoleBinding").collect();
    assert!(!bindings.is_empty());
    for binding in bindings {
        let ns = binding.namespace().expect("RoleBinding namespace");
        assert_eq!(str_at(&binding.value, &["roleRef", "kind"]), Some("Role"));
        let role = str_at(&binding.value, &["roleRef", "name"]).expect("roleRef.name");
        assert!(
            base.find("Role", ns, role).is_some(),
            "{}: Role {ns}/{role} does not exist",
            binding.describe()
        );
        let subjects = seq_at(&binding.value, &["subjects"]);
        assert!(!subjects.is_empty());
        for subject in subjects {
            assert_eq!(str_at(subject, &["kind"]), Some("ServiceAccount"));
            let name = str_at(subject, &["name"]).expect("subject name");
            let sa_ns = str_at(subject, &["namespace"]).expect("subject namespace");
            assert!(
                base.find("ServiceAccount", sa_ns, name).is_some(),
                "{}: ServiceAccount {sa_ns}/{name} does not exist",
                binding.describe()
            );
        }
    }
}

#[test]
fn only_the_pod_worker_is_granted_anything_and_only_pods_and_secrets_in_the_jobs_namespace() {
    let base = base();
    for kind in ["ClusterRole", "ClusterRoleBinding"] {
        assert_eq!(
            base.of_kind(kind).count(),
            0,
            "the base grants nothing cluster-wide"
        );
    }
    let roles: Vec<&Object> = base.of_kind("Role").collect();
    assert_eq!(roles.len(), 1, "exactly one Role (the pod-worker's)");
    let role = roles[0];
    assert_eq!(role.namespace(), Some(JOBS_NS));
    let allowed: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::from([
        (
            "pods",
            BTreeSet::from(["get", "list", "watch", "create", "delete"]),
        ),
        (
            "secrets",
            BTreeSet::from(["get", "list", "create", "delete", "patch"]),
        ),
    ]);
    // The list above is what the pod-worker's code calls, no more and no less.
    let called = pod_worker_api_calls();
    let listed: BTreeMap<String, BTreeSet<String>> = allowed
        .iter()
        .map(|(r, v)| ((*r).to_owned(), v.iter().map(|s| (*s).to_owned()).collect()))
        .collect();
    assert_eq!(
        called, listed,
        "verbs the pod-worker calls (left) differ from what its Role may grant (right)"
    );
    let mut granted: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for rule in seq_at(&role.value, &["rules"]) {
        let groups: Vec<&str> = seq_at(rule, &["apiGroups"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(groups, vec![""], "core API group only");
        assert!(at(rule, &["nonResourceURLs"]).is_none());
        let verbs: Vec<&str> = seq_at(rule, &["verbs"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for resource in seq_at(rule, &["resources"])
            .iter()
            .filter_map(Value::as_str)
        {
            let permitted = allowed
                .get(resource)
                .unwrap_or_else(|| panic!("the Role grants {resource}"));
            for verb in &verbs {
                assert!(
                    permitted.contains(verb),
                    "the Role grants {verb} on {resource}"
                );
                granted
                    .entry(resource.to_owned())
                    .or_default()
                    .insert((*verb).to_owned());
            }
        }
    }
    // ...and enough for the pod-worker to do its job.
    let expected: BTreeMap<String, BTreeSet<String>> = allowed
        .iter()
        .map(|(r, v)| ((*r).to_owned(), v.iter().map(|s| (*s).to_owned()).collect()))
        .collect();
    assert_eq!(granted, expected);
    let bound: Vec<(String, String)> = base
        .of_kind("RoleBinding")
        .filter(|b| str_at(&b.value, &["roleRef", "name"]) == Some(role.name()))
        .flat_map(|b| seq_at(&b.value, &["subjects"]).iter())
        .map(|s| {
            (
                str_at(s, &["namespace"]).unwrap_or("").to_owned(),
                str_at(s, &["name"]).unwrap_or("").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        bound,
        vec![(NS.to_owned(), "jetrunner-pod-worker".to_owned())]
    );
    assert_eq!(
        str_at(
            pod_spec(base.deployment("pod-worker")),
            &["serviceAccountName"]
        ),
        Some("jetrunner-pod-worker")
    );
}

#[test]
fn only_the_pod_worker_mounts_a_service_account_token() {
    let base = base();
    for deployment in base.of_kind("Deployment") {
        let spec = pod_spec(deployment);
        let account = str_at(spec, &["serviceAccountName"]).expect("serviceAccountName");
        let sa = base
            .find("ServiceAccount", NS, account)
            .expect("ServiceAccount exists");
        let pod_setting = at(spec, &["automountServiceAccountToken"]).and_then(Value::as_bool);
        let sa_setting = at(&sa.value, &["automountServiceAccountToken"]).and_then(Value::as_bool);
        // The pod's setting wins over the ServiceAccount's; Kubernetes mounts when both are unset.
        let mounted = pod_setting.or(sa_setting).unwrap_or(true);
        assert_eq!(
            mounted,
            deployment.name() == "pod-worker",
            "{}: token mounted = {mounted}",
            deployment.describe()
        );
        if deployment.name() != "pod-worker" {
            assert_eq!(
                sa_setting,
                Some(false),
                "{account} disables automount itself too"
            );
        }
    }
}

#[test]
fn pods_run_as_non_root_on_a_read_only_root_with_resources() {
    let base = base();
    for deployment in base.of_kind("Deployment") {
        let who = deployment.describe();
        let spec = pod_spec(deployment);
        assert_eq!(
            at(spec, &["securityContext", "runAsNonRoot"]).and_then(Value::as_bool),
            Some(true),
            "{who}"
        );
        assert_ne!(
            at(spec, &["securityContext", "runAsUser"]).and_then(Value::as_u64),
            Some(0)
        );
        assert_eq!(
            str_at(spec, &["securityContext", "seccompProfile", "type"]),
            Some("RuntimeDefault"),
            "{who}"
        );
        for container in seq_at(spec, &["containers"]) {
            let sc = at(container, &["securityContext"]).unwrap_or_else(|| panic!("{who}"));
            assert_eq!(
                at(sc, &["readOnlyRootFilesystem"]).and_then(Value::as_bool),
                Some(true)
            );
            assert_eq!(
                at(sc, &["allowPrivilegeEscalation"]).and_then(Value::as_bool),
                Some(false)
            );
            assert!(at(sc, &["privileged"]).and_then(Value::as_bool) != Some(true));
            let dropped: Vec<&str> = seq_at(sc, &["capabilities", "drop"])
                .iter()
                .filter_map(Value::as_str)
                .collect();
            assert!(dropped.contains(&"ALL"), "{who} drops all capabilities");
            assert!(
                seq_at(sc, &["capabilities", "add"]).is_empty(),
                "{who} adds capabilities"
            );
            for path in [
                ["resources", "requests", "cpu"],
                ["resources", "requests", "memory"],
                ["resources", "limits", "memory"],
            ] {
                assert!(
                    at(container, &path).is_some(),
                    "{who} sets {}",
                    path.join(".")
                );
            }
            // With a read-only root, /tmp must be a volume.
            let tmp = seq_at(container, &["volumeMounts"])
                .iter()
                .any(|m| str_at(m, &["mountPath"]) == Some("/tmp"));
            assert!(tmp, "{who} mounts a writable /tmp");
        }
    }
}

#[test]
fn every_deployment_has_one_pod_disruption_budget_that_never_blocks_a_drain() {
    let base = base();
    let mut covered: BTreeMap<String, usize> = BTreeMap::new();
    for pdb in base.of_kind("PodDisruptionBudget") {
        let selector = string_map(at(&pdb.value, &["spec", "selector", "matchLabels"]));
        let matched: Vec<&Object> = base
            .of_kind("Deployment")
            .filter(|d| d.namespace() == pdb.namespace() && selects(&selector, &pod_labels(d)))
            .collect();
        assert_eq!(
            matched.len(),
            1,
            "{} selects {} Deployments",
            pdb.describe(),
            matched.len()
        );
        let deployment = matched[0];
        *covered.entry(deployment.name().to_owned()).or_default() += 1;
        let min = at(&pdb.value, &["spec", "minAvailable"]);
        let max = at(&pdb.value, &["spec", "maxUnavailable"]);
        assert!(
            min.is_some() != max.is_some(),
            "{}: set exactly one bound",
            pdb.describe()
        );
        let replicas = at(&deployment.value, &["spec", "replicas"])
            .and_then(Value::as_u64)
            .unwrap_or(1);
        if let Some(min) = min.and_then(Value::as_u64) {
            assert!(
                min < replicas,
                "{}: minAvailable {min} of {replicas} blocks drains",
                pdb.describe()
            );
        }
        if let Some(max) = max.and_then(Value::as_u64) {
            assert!(
                max >= 1,
                "{}: maxUnavailable 0 blocks drains",
                pdb.describe()
            );
        }
    }
    let deployments: BTreeSet<String> = base
        .of_kind("Deployment")
        .map(|d| d.name().to_owned())
        .collect();
    assert_eq!(
        covered.keys().cloned().collect::<BTreeSet<_>>(),
        deployments
    );
    assert!(covered.values().all(|n| *n == 1), "{covered:?}");
}

/// Every service runs two replicas: a lease picks the scheduler replica that fetches and the
/// reconciler that plans; worker replicas share their backend's capacity.
const REPLICATED: [&str; 4] = ["scheduler", "reconciler", "pod-worker", "vm-worker"];

#[test]
fn every_deployment_is_replicated() {
    let base = base();
    let deployments: BTreeSet<&str> = base.of_kind("Deployment").map(|d| d.name()).collect();
    assert_eq!(deployments, REPLICATED.into_iter().collect::<BTreeSet<_>>());
}

/// Worker replicas of one backend need distinct worker ids (workloads carry them and capacity
/// is shared under them): each takes its Pod's name.
#[test]
fn worker_replicas_take_their_identity_from_the_pod_name() {
    let base = base();
    for (name, var) in [
        ("pod-worker", "JETRUNNER__POD_WORKER__WORKER_ID"),
        ("vm-worker", "JETRUNNER__VM_WORKER__WORKER_ID"),
    ] {
        let deployment = base
            .of_kind("Deployment")
            .find(|d| d.name() == name)
            .unwrap_or_else(|| panic!("Deployment {name}"));
        let env = at(
            &deployment.value,
            &["spec", "template", "spec", "containers"],
        )
        .and_then(Value::as_sequence)
        .and_then(|c| c.first())
        .and_then(|c| c.get("env"))
        .and_then(Value::as_sequence)
        .cloned()
        .unwrap_or_default();
        let field = env
            .iter()
            .find(|e| e.get("name").and_then(Value::as_str) == Some(var))
            .and_then(|e| str_at(e, &["valueFrom", "fieldRef", "fieldPath"]));
        assert_eq!(field, Some("metadata.name"), "{}", deployment.describe());
    }
}

#[test]
fn leased_services_run_two_replicas_on_different_nodes_and_keep_one_through_drains() {
    let base = base();
    for name in REPLICATED {
        let deployment = base
            .of_kind("Deployment")
            .find(|d| d.name() == name)
            .unwrap_or_else(|| panic!("Deployment {name}"));
        let d = &deployment.value;
        assert_eq!(
            at(d, &["spec", "replicas"]).and_then(Value::as_u64),
            Some(2),
            "{}",
            deployment.describe()
        );
        assert_eq!(
            str_at(d, &["spec", "strategy", "type"]),
            Some("RollingUpdate"),
            "{}",
            deployment.describe()
        );
        assert_eq!(
            at(d, &["spec", "strategy", "rollingUpdate", "maxUnavailable"]).and_then(Value::as_u64),
            Some(0),
            "{}: a rollout keeps both replicas until the new one is ready",
            deployment.describe()
        );
        let terms = at(
            d,
            &[
                "spec",
                "template",
                "spec",
                "affinity",
                "podAntiAffinity",
                "preferredDuringSchedulingIgnoredDuringExecution",
            ],
        )
        .and_then(Value::as_sequence)
        .unwrap_or_else(|| panic!("{}: no pod anti-affinity", deployment.describe()));
        assert!(
            terms.iter().any(|t| {
                str_at(t, &["podAffinityTerm", "topologyKey"]) == Some("kubernetes.io/hostname")
                    && selects(
                        &string_map(at(t, &["podAffinityTerm", "labelSelector", "matchLabels"])),
                        &pod_labels(deployment),
                    )
            }),
            "{}: anti-affinity must spread its own Pods over nodes",
            deployment.describe()
        );
        let pdb = base
            .of_kind("PodDisruptionBudget")
            .find(|p| {
                selects(
                    &string_map(at(&p.value, &["spec", "selector", "matchLabels"])),
                    &pod_labels(deployment),
                )
            })
            .unwrap_or_else(|| panic!("{}: no PodDisruptionBudget", deployment.describe()));
        assert_eq!(
            at(&pdb.value, &["spec", "minAvailable"]).and_then(Value::as_u64),
            Some(1),
            "{}: a drain must leave one replica",
            pdb.describe()
        );
    }
}

fn policies_in<'a>(base: &'a Kustomization, ns: &'a str) -> impl Iterator<Item = &'a Object> + 'a {
    base.of_kind("NetworkPolicy")
        .filter(move |p| p.namespace() == Some(ns))
}

fn policy_types(policy: &Object) -> BTreeSet<String> {
    seq_at(&policy.value, &["spec", "policyTypes"])
        .iter()
        .filter_map(|t| t.as_str().map(str::to_owned))
        .collect()
}

fn selects_all(policy: &Object) -> bool {
    at(&policy.value, &["spec", "podSelector"])
        .and_then(Value::as_mapping)
        .is_some_and(|m| m.is_empty())
}

#[test]
fn services_namespace_denies_ingress_except_facade_from_jobs_and_metrics_scraping() {
    let base = base();
    let deny = policies_in(&base, NS).find(|p| {
        selects_all(p)
            && policy_types(p).contains("Ingress")
            && seq_at(&p.value, &["spec", "ingress"]).is_empty()
    });
    assert!(deny.is_some(), "a default deny-ingress policy in {NS}");
    let mut facade_from_jobs = false;
    let mut metrics_from_monitoring = false;
    for policy in policies_in(&base, NS) {
        let selector = string_map(at(&policy.value, &["spec", "podSelector", "matchLabels"]));
        let selected: Vec<&Object> = base
            .of_kind("Deployment")
            .filter(|d| selects_all(policy) || selects(&selector, &pod_labels(d)))
            .collect();
        assert!(
            !selected.is_empty(),
            "{} selects no pods",
            policy.describe()
        );
        for rule in seq_at(&policy.value, &["spec", "ingress"]) {
            let from = seq_at(rule, &["from"]);
            assert!(
                !from.is_empty(),
                "{}: a rule without `from` admits everyone",
                policy.describe()
            );
            let ports = seq_at(rule, &["ports"]);
            assert!(
                !ports.is_empty(),
                "{}: a rule without ports admits all",
                policy.describe()
            );
            for port in ports {
                let port = at(port, &["port"]).expect("port");
                let declared = selected
                    .iter()
                    .any(|d| port_declared(seq_at(pod_spec(d), &["containers"]), port));
                assert!(
                    declared,
                    "{}: port {port:?} is on no selected pod",
                    policy.describe()
                );
            }
            let from_ns = |name: &str| {
                from.iter().any(|f| {
                    str_at(
                        f,
                        &[
                            "namespaceSelector",
                            "matchLabels",
                            "kubernetes.io/metadata.name",
                        ],
                    ) == Some(name)
                })
            };
            let named = |name: &str| ports.iter().any(|p| str_at(p, &["port"]) == Some(name));
            if from_ns(JOBS_NS)
                && named("facade")
                && selected.iter().any(|d| d.name() == "scheduler")
            {
                facade_from_jobs = true;
            }
            let by_label = from.iter().any(|f| {
                !string_map(at(f, &["namespaceSelector", "matchLabels"])).is_empty()
                    && !from_ns(JOBS_NS)
            });
            if by_label && named("ops") && selected.len() == SERVICES.len() {
                metrics_from_monitoring = true;
            }
        }
    }
    assert!(
        facade_from_jobs,
        "executors in {JOBS_NS} may reach the facade"
    );
    assert!(
        metrics_from_monitoring,
        "a labelled monitoring namespace may scrape every ops port"
    );
}

#[test]
fn jobs_namespace_may_only_reach_the_facade_dns_and_the_forge() {
    let base = base();
    let deny = policies_in(&base, JOBS_NS).find(|p| {
        let types = policy_types(p);
        selects_all(p)
            && types.contains("Ingress")
            && types.contains("Egress")
            && seq_at(&p.value, &["spec", "ingress"]).is_empty()
            && seq_at(&p.value, &["spec", "egress"]).is_empty()
    });
    assert!(
        deny.is_some(),
        "a default deny (ingress and egress) policy in {JOBS_NS}"
    );
    let facade_port = {
        let container = &seq_at(pod_spec(base.deployment("scheduler")), &["containers"])[0];
        container_ports(container)
            .into_iter()
            .find(|(n, _)| n.as_deref() == Some("facade"))
            .expect("facade port")
            .1
    };
    let mut reached: BTreeSet<&str> = BTreeSet::new();
    for policy in policies_in(&base, JOBS_NS) {
        assert!(
            seq_at(&policy.value, &["spec", "ingress"]).is_empty(),
            "{}: nothing may connect to executor Pods",
            policy.describe()
        );
        for rule in seq_at(&policy.value, &["spec", "egress"]) {
            let to = seq_at(rule, &["to"]);
            let ports: Vec<u64> = seq_at(rule, &["ports"])
                .iter()
                .map(|p| {
                    at(p, &["port"])
                        .and_then(Value::as_u64)
                        .expect("numeric egress port")
                })
                .collect();
            assert!(
                !to.is_empty() && !ports.is_empty(),
                "{}: open egress rule",
                policy.describe()
            );
            for peer in to {
                let ns = str_at(
                    peer,
                    &[
                        "namespaceSelector",
                        "matchLabels",
                        "kubernetes.io/metadata.name",
                    ],
                );
                let pods = string_map(at(peer, &["podSelector", "matchLabels"]));
                let target = if ns == Some(NS)
                    && selects(&pods, &pod_labels(base.deployment("scheduler")))
                    && ports == vec![facade_port]
                {
                    "facade"
                } else if ns == Some("kube-system")
                    && pods.get("k8s-app").map(String::as_str) == Some("kube-dns")
                    && ports.iter().all(|p| *p == 53)
                {
                    "dns"
                } else if let Some(cidr) = str_at(peer, &["ipBlock", "cidr"]) {
                    assert!(
                        cidr != "0.0.0.0/0" && cidr != "::/0",
                        "egress to everywhere"
                    );
                    assert!(at(peer, &["ipBlock", "except"]).is_none());
                    "forge"
                } else {
                    panic!(
                        "{}: unexpected egress peer {peer:?} ports {ports:?}",
                        policy.describe()
                    )
                };
                reached.insert(target);
            }
        }
    }
    assert_eq!(reached, BTreeSet::from(["facade", "dns", "forge"]));
}

/// Kubernetes verbs the pod-worker backend calls, per resource, read from its source: every
/// `self.pods.<method>(` / `self.secrets.<method>(` call (also when rustfmt splits it over
/// lines) and the Pod watcher (list + watch).
fn pod_worker_api_calls() -> BTreeMap<String, BTreeSet<String>> {
    let dir = repo_root().join("services/pod-worker/src/backend");
    let mut calls: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files_under(&dir, &["rs"]) {
        let source = read(&file);
        let compact: String = source.split_whitespace().collect();
        for (field, resource) in [("self.pods", "pods"), ("self.secrets", "secrets")] {
            for (at, _) in compact.match_indices(&format!("{field}.")) {
                let rest = &compact[at + field.len() + 1..];
                let method: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let verbs: &[&str] = match method.as_str() {
                    "get" | "get_opt" => &["get"],
                    "list" => &["list"],
                    "create" => &["create"],
                    "delete" => &["delete"],
                    "patch" => &["patch"],
                    "replace" => &["update"],
                    "delete_collection" => &["deletecollection"],
                    "clone" => {
                        // Handed to the watcher, which lists and watches.
                        if compact[..at].ends_with("watcher::watcher(") {
                            &["list", "watch"]
                        } else {
                            &[]
                        }
                    }
                    other => panic!("{}: unknown API call {field}.{other}", file.display()),
                };
                calls
                    .entry(resource.to_owned())
                    .or_default()
                    .extend(verbs.iter().map(|v| (*v).to_owned()));
            }
        }
    }
    calls
}

#[test]
fn the_executor_pod_reference_is_restricted_and_bounded() {
    let docs = yaml_docs(&repo_root().join("k8s/executor-pod-template.yaml"));
    let pod = docs
        .iter()
        .find(|d| str_at(d, &["kind"]) == Some("Pod"))
        .expect("a Pod in k8s/executor-pod-template.yaml");
    let spec = at(pod, &["spec"]).expect("spec");
    assert_eq!(
        at(spec, &["securityContext", "runAsNonRoot"]).and_then(Value::as_bool),
        Some(true)
    );
    assert_eq!(
        str_at(spec, &["securityContext", "seccompProfile", "type"]),
        Some("RuntimeDefault")
    );
    assert_eq!(
        at(spec, &["automountServiceAccountToken"]).and_then(Value::as_bool),
        Some(false)
    );
    for container in seq_at(spec, &["containers"]) {
        let sc = at(container, &["securityContext"]).expect("container securityContext");
        assert_eq!(
            at(sc, &["allowPrivilegeEscalation"]).and_then(Value::as_bool),
            Some(false)
        );
        let dropped: Vec<&str> = seq_at(sc, &["capabilities", "drop"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(dropped, vec!["ALL"]);
        assert!(at(sc, &["privileged"]).is_none());
        for section in ["requests", "limits"] {
            for key in ["cpu", "memory", "ephemeral-storage"] {
                assert!(
                    at(container, &["resources", section, key]).is_some(),
                    "resources.{section}.{key} missing"
                );
            }
        }
    }
}
