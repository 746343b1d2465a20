//! Wiring of the kustomize base (k8s/base): every reference resolves (resources, ServiceAccounts,
//! ConfigMaps, Secrets, ports), and the configuration it ships is valid for the config crate and
//! names files the Deployments actually mount.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::*;
use serde_yaml::Value;

#[test]
fn every_yaml_file_under_k8s_parses() {
    let files = files_under(&repo_root().join("k8s"), &["yaml", "yml"]);
    assert!(
        files.len() >= 5,
        "expected the base manifests, found {files:?}"
    );
    for file in files {
        for doc in yaml_docs(&file) {
            assert!(
                doc.is_mapping(),
                "{}: every document is a mapping",
                file.display()
            );
        }
    }
}

#[test]
fn every_kustomization_resource_and_generator_file_exists() {
    let kustomizations = files_under(&repo_root().join("k8s"), &["yaml"])
        .into_iter()
        .filter(|f| f.file_name().is_some_and(|n| n == "kustomization.yaml"))
        .collect::<Vec<_>>();
    assert!(
        !kustomizations.is_empty(),
        "no kustomization.yaml under k8s/"
    );
    for file in kustomizations {
        let k = load_kustomization(file.parent().expect("parent"));
        assert!(k.missing.is_empty(), "{:#?}", k.missing);
        assert!(
            !k.objects.is_empty(),
            "{} lists no resources",
            file.display()
        );
        for object in &k.objects {
            assert!(
                str_at(&object.value, &["apiVersion"]).is_some() && !object.kind().is_empty(),
                "{} has no apiVersion/kind",
                object.describe()
            );
            assert!(
                !object.name().is_empty(),
                "{} has no name",
                object.describe()
            );
        }
    }
}

#[test]
fn resources_name_their_namespace_and_the_base_does_not_override_it() {
    let base = base();
    // A kustomization-wide namespace would move the jetrunner-jobs Role into jetrunner.
    assert!(
        at(&base.value, &["namespace"]).is_none(),
        "k8s/base/kustomization.yaml must not set `namespace:`"
    );
    let namespaces: BTreeSet<&str> = base.of_kind("Namespace").map(Object::name).collect();
    assert_eq!(namespaces, BTreeSet::from([NS, JOBS_NS]));
    let cluster_scoped = ["Namespace", "ClusterRole", "ClusterRoleBinding"];
    for object in &base.objects {
        if cluster_scoped.contains(&object.kind()) {
            continue;
        }
        let ns = object
            .namespace()
            .unwrap_or_else(|| panic!("{} names no namespace", object.describe()));
        assert!(
            namespaces.contains(ns),
            "{} is in a namespace the base does not create",
            object.describe()
        );
    }
    for generated in &base.generated {
        assert!(
            generated
                .namespace
                .as_deref()
                .is_some_and(|ns| namespaces.contains(ns)),
            "generated {} {} needs a namespace of the base",
            generated.kind,
            generated.name
        );
    }
}

#[test]
fn each_service_is_one_deployment_running_its_binary_with_the_mounted_config() {
    let base = base();
    let names: BTreeSet<&str> = base.of_kind("Deployment").map(Object::name).collect();
    assert_eq!(names, BTreeSet::from(SERVICES));
    for deployment in base.of_kind("Deployment") {
        assert_eq!(deployment.namespace(), Some(NS));
        let containers = seq_at(pod_spec(deployment), &["containers"]);
        assert_eq!(containers.len(), 1, "{}", deployment.describe());
        let command = command_of(&containers[0]);
        assert_eq!(
            command.first().map(String::as_str),
            Some(deployment.name()),
            "{} runs the binary of its name",
            deployment.describe()
        );
        assert!(BINARIES.contains(&deployment.name()));
        assert_eq!(config_arg(&command), Some(CONFIG_PATH));
        let source = resolve_file(&base, deployment, Path::new(CONFIG_PATH))
            .unwrap_or_else(|e| panic!("{}: {e}", deployment.describe()));
        assert_eq!(
            source,
            format!("ConfigMap/{CONFIG_MAP} key jetrunner.toml"),
            "{}",
            deployment.describe()
        );
    }
}

#[test]
fn deployments_use_existing_service_accounts() {
    let base = base();
    for deployment in base.of_kind("Deployment") {
        let account = str_at(pod_spec(deployment), &["serviceAccountName"])
            .unwrap_or_else(|| panic!("{} names no serviceAccountName", deployment.describe()));
        assert!(
            base.find("ServiceAccount", NS, account).is_some(),
            "{}: ServiceAccount {account} does not exist",
            deployment.describe()
        );
    }
}

#[test]
fn config_maps_and_secrets_referenced_by_pods_exist_with_the_keys_used() {
    let base = base();
    let mut checked = 0;
    let exists = |kind: &str, name: &str| base.keys_of(kind, NS, name);
    for deployment in base.of_kind("Deployment") {
        let spec = pod_spec(deployment);
        let who = deployment.describe();
        for volume in seq_at(spec, &["volumes"]) {
            let mut refs: Vec<(&str, &str, &[Value])> = Vec::new();
            if let Some(name) = str_at(volume, &["configMap", "name"]) {
                refs.push(("ConfigMap", name, seq_at(volume, &["configMap", "items"])));
            }
            if let Some(name) = str_at(volume, &["secret", "secretName"]) {
                refs.push(("Secret", name, seq_at(volume, &["secret", "items"])));
            }
            for source in seq_at(volume, &["projected", "sources"]) {
                if let Some(name) = str_at(source, &["secret", "name"]) {
                    refs.push(("Secret", name, seq_at(source, &["secret", "items"])));
                }
                if let Some(name) = str_at(source, &["configMap", "name"]) {
                    refs.push(("ConfigMap", name, seq_at(source, &["configMap", "items"])));
                }
            }
            for (kind, name, items) in refs {
                let keys = exists(kind, name)
                    .unwrap_or_else(|| panic!("{who}: volume uses missing {kind} {name}"));
                for item in items {
                    let key = str_at(item, &["key"]).expect("item key");
                    assert!(keys.contains(key), "{who}: {kind} {name} has no key {key}");
                }
                checked += 1;
            }
        }
        for container in seq_at(spec, &["containers"]) {
            for env in seq_at(container, &["env"]) {
                for (field, kind) in [("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")]
                {
                    if let Some(reference) = at(env, &["valueFrom", field]) {
                        let name = str_at(reference, &["name"]).expect("ref name");
                        let key = str_at(reference, &["key"]).expect("ref key");
                        let keys = exists(kind, name)
                            .unwrap_or_else(|| panic!("{who}: env uses missing {kind} {name}"));
                        assert!(keys.contains(key), "{who}: {kind} {name} has no key {key}");
                        checked += 1;
                    }
                }
            }
            for env_from in seq_at(container, &["envFrom"]) {
                for (field, kind) in [("secretRef", "Secret"), ("configMapRef", "ConfigMap")] {
                    if let Some(name) = str_at(env_from, &[field, "name"]) {
                        assert!(
                            exists(kind, name).is_some(),
                            "{who}: envFrom uses missing {kind} {name}"
                        );
                        checked += 1;
                    }
                }
            }
            let volume_names: BTreeSet<&str> = seq_at(spec, &["volumes"])
                .iter()
                .filter_map(|v| str_at(v, &["name"]))
                .collect();
            for mount in seq_at(container, &["volumeMounts"]) {
                let name = str_at(mount, &["name"]).expect("mount name");
                assert!(
                    volume_names.contains(name),
                    "{who}: mounts undeclared volume {name}"
                );
            }
        }
    }
    assert!(
        checked >= 8,
        "expected config and secret references, saw {checked}"
    );
}

#[test]
fn the_config_the_base_ships_is_valid_for_the_config_crate() {
    let base = base();
    let (file, config) = base_config(&base);
    assert!(
        file.starts_with(repo_root().join("k8s/base")),
        "the ConfigMap is generated from a file inside the base"
    );
    // The Deployments pass the database URL from a Secret as an override: it must be a key the
    // config crate accepts, with a value it accepts.
    let db_url = base
        .find("Secret", NS, "jetrunner-database")
        .and_then(|s| str_at(&s.value, &["stringData", "url"]))
        .expect("Secret jetrunner-database has stringData.url");
    for deployment in base.of_kind("Deployment") {
        let container = &seq_at(pod_spec(deployment), &["containers"])[0];
        let env: Vec<(String, String)> = seq_at(container, &["env"])
            .iter()
            .map(|e| {
                let name = str_at(e, &["name"]).expect("env name").to_owned();
                // The Pod's name (a worker's id) stands in as a valid one.
                if str_at(e, &["valueFrom", "fieldRef", "fieldPath"]) == Some("metadata.name") {
                    return (name, "pod-worker-7d9f8c6b5d-x2x4q".to_owned());
                }
                let value = str_at(e, &["value"]).map(str::to_owned).unwrap_or_else(|| {
                    assert_eq!(
                        str_at(e, &["valueFrom", "secretKeyRef", "name"]),
                        Some("jetrunner-database"),
                        "{}: unexpected env source for {name}",
                        deployment.describe()
                    );
                    db_url.to_owned()
                });
                (name, value)
            })
            .collect();
        let with_env = load_config(&file, &env);
        assert_eq!(with_env.backend.len(), config.backend.len());
    }
    // Executor Pods go to the namespace the pod-worker's Role covers, through the in-cluster API.
    let pod_backends: Vec<_> = config
        .backend
        .values()
        .filter(|b| b.kind == jr_config::BackendKind::Pod)
        .collect();
    assert!(!pod_backends.is_empty());
    for backend in pod_backends {
        let kube = backend
            .kubernetes
            .as_ref()
            .expect("pod backend has kubernetes");
        assert_eq!(kube.namespace, JOBS_NS);
        assert!(
            kube.api_url.is_none(),
            "in-cluster config, not a fixed API URL"
        );
    }
    // Secrets are read from files, never inline in the ConfigMap.
    assert!(config.scheduler.seal_keys.is_empty(), "seal keys inline");
    assert!(config.forge.registration_token.is_none(), "token inline");
    assert!(config.pod_worker.token_key.is_none() && config.vm_worker.token_key.is_none());
    for backend in config.backend.values() {
        if let Some(sandbox) = &backend.opensandbox {
            assert!(sandbox.api_key.is_none(), "OpenSandbox API key inline");
        }
    }
}

#[test]
fn config_listen_ports_match_the_declared_container_ports() {
    let base = base();
    let (_, config) = base_config(&base);
    let port_of = |deployment: &str, name: &str| -> u64 {
        let container = &seq_at(pod_spec(base.deployment(deployment)), &["containers"])[0];
        container_ports(container)
            .into_iter()
            .find(|(n, _)| n.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{deployment} declares no port {name}"))
            .1
    };
    let expected = [
        ("scheduler", "facade", Some(config.facade.listen)),
        ("scheduler", "ops", Some(config.scheduler.ops_listen)),
        ("pod-worker", "ops", config.pod_worker.ops_listen),
        ("vm-worker", "ops", config.vm_worker.ops_listen),
        ("reconciler", "ops", Some(config.reconciler.ops_listen)),
        (
            "reconciler",
            "status",
            Some(config.reconciler.status_listen),
        ),
    ];
    for (deployment, port, listen) in expected {
        let listen = listen.unwrap_or_else(|| panic!("config sets the {deployment} {port} listen"));
        assert!(
            listen.ip().is_unspecified(),
            "{deployment} {port} must listen on all interfaces, not {listen}"
        );
        assert_eq!(
            port_of(deployment, port),
            u64::from(listen.port()),
            "{deployment} port {port}"
        );
        if port == "ops" {
            let annotation = str_at(
                &base.deployment(deployment).value,
                &[
                    "spec",
                    "template",
                    "metadata",
                    "annotations",
                    "prometheus.io/port",
                ],
            );
            assert_eq!(annotation, Some(listen.port().to_string().as_str()));
        }
    }
}

#[test]
fn files_the_config_names_are_mounted_for_the_services_that_read_them() {
    let base = base();
    let (_, config) = base_config(&base);
    let mut wanted: Vec<(&str, &str, std::path::PathBuf)> = Vec::new();
    let mut want = |service: &'static str, key: &'static str, path: Option<&std::path::PathBuf>| {
        if let Some(path) = path {
            wanted.push((service, key, path.clone()));
        }
    };
    want(
        "scheduler",
        "forge.registration_token_file",
        config.forge.registration_token_file.as_ref(),
    );
    want(
        "scheduler",
        "forge.runner_token_file",
        config.forge.runner_token_file.as_ref(),
    );
    want(
        "scheduler",
        "scheduler.seal_keys_file",
        config.scheduler.seal_keys_file.as_ref(),
    );
    want(
        "scheduler",
        "facade.tls_cert_file",
        config.facade.tls_cert_file.as_ref(),
    );
    want(
        "scheduler",
        "facade.tls_key_file",
        config.facade.tls_key_file.as_ref(),
    );
    want(
        "scheduler",
        "facade.trust_bundle_file",
        config.facade.trust_bundle_file.as_ref(),
    );
    want(
        "pod-worker",
        "pod_worker.token_key_file",
        config.pod_worker.token_key_file.as_ref(),
    );
    want(
        "vm-worker",
        "vm_worker.token_key_file",
        config.vm_worker.token_key_file.as_ref(),
    );
    for backend in config.backend.values() {
        if let Some(sandbox) = &backend.opensandbox {
            want(
                "vm-worker",
                "backend.*.opensandbox.api_key_file",
                sandbox.api_key_file.as_ref(),
            );
        }
    }
    for service in SERVICES {
        want(
            service,
            "nats.credentials_file",
            config.nats.credentials_file.as_ref(),
        );
        // Each service's own NATS user: its secret files must be mounted in its Deployment.
        if let Some(auth) = config.service_nats(&service.replace('-', "_")) {
            for (key, path) in [
                ("nats.credentials_file", &auth.credentials_file),
                ("nats.password_file", &auth.password_file),
                ("nats.nkey_seed_file", &auth.nkey_seed_file),
            ] {
                want(service, key, path.as_ref());
            }
        }
    }
    // The k8s config reads its secrets from files, so this list is not empty.
    assert!(wanted.len() >= 6, "{wanted:?}");
    for (service, key, path) in wanted {
        let deployment = base.deployment(service);
        resolve_file(&base, deployment, &path)
            .unwrap_or_else(|e| panic!("{service} reads `{key}` = {}: {e}", path.display()));
    }
    // Each service mounts only the Secrets it reads.
    let secrets_of = |service: &str| -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for volume in seq_at(pod_spec(base.deployment(service)), &["volumes"]) {
            names.extend(str_at(volume, &["secret", "secretName"]).map(str::to_owned));
            for source in seq_at(volume, &["projected", "sources"]) {
                names.extend(str_at(source, &["secret", "name"]).map(str::to_owned));
            }
        }
        names
    };
    assert!(
        !secrets_of("reconciler")
            .iter()
            .any(|s| s != "jetrunner-database" && s != "jetrunner-nats-reconciler")
    );
    // A service's NATS password is mounted by that service alone.
    for service in SERVICES {
        for other in SERVICES.iter().filter(|o| **o != service) {
            assert!(
                !secrets_of(service).contains(&format!("jetrunner-nats-{other}")),
                "{service} mounts the NATS password of {other}"
            );
        }
        assert!(
            secrets_of(service).contains(&format!("jetrunner-nats-{service}")),
            "{service} does not mount its own NATS password"
        );
    }
    for service in ["pod-worker", "vm-worker", "reconciler"] {
        assert!(
            !secrets_of(service).contains("jetrunner-scheduler"),
            "{service} must not see the seal keys"
        );
    }
    // The scheduler writes its registered credentials: that file must be on a writable volume,
    // since the root filesystem is read-only.
    let scheduler = base.deployment("scheduler");
    let err = resolve_file(&base, scheduler, &config.forge.credentials_file)
        .expect_err("credentials file must not be on a ConfigMap/Secret");
    assert!(err.contains("scratch volume"), "{err}");
}

#[test]
fn probes_check_health_and_readiness_on_declared_ports() {
    let base = base();
    for deployment in base.of_kind("Deployment") {
        for container in seq_at(pod_spec(deployment), &["containers"]) {
            let containers = std::slice::from_ref(container);
            for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
                let get = at(container, &[probe, "httpGet"])
                    .unwrap_or_else(|| panic!("{} has no {probe} httpGet", deployment.describe()));
                assert_eq!(
                    str_at(get, &["path"]),
                    Some(path),
                    "{}",
                    deployment.describe()
                );
                let port = at(get, &["port"]).expect("probe port");
                assert!(
                    port_declared(containers, port),
                    "{} {probe} port {port:?} is not declared by the container",
                    deployment.describe()
                );
            }
            if let Some(get) = at(container, &["startupProbe", "httpGet"]) {
                assert!(port_declared(containers, at(get, &["port"]).expect("port")));
            }
        }
    }
}

#[test]
fn services_select_deployment_pods_and_target_declared_ports() {
    let base = base();
    let services: Vec<&Object> = base.of_kind("Service").collect();
    let names: BTreeSet<&str> = services.iter().map(|s| s.name()).collect();
    assert!(
        names.contains("jetrunner-facade") && names.contains("jetrunner-status"),
        "{names:?}"
    );
    for service in services {
        let selector = string_map(at(&service.value, &["spec", "selector"]));
        let matched: Vec<&Object> = base
            .of_kind("Deployment")
            .filter(|d| d.namespace() == service.namespace() && selects(&selector, &pod_labels(d)))
            .collect();
        assert_eq!(
            matched.len(),
            1,
            "{} selects {} Deployments",
            service.describe(),
            matched.len()
        );
        let containers = seq_at(pod_spec(matched[0]), &["containers"]);
        for port in seq_at(&service.value, &["spec", "ports"]) {
            let target = at(port, &["targetPort"])
                .or_else(|| at(port, &["port"]))
                .expect("port");
            assert!(
                port_declared(containers, target),
                "{} targets undeclared port {target:?}",
                service.describe()
            );
        }
    }
    let (_, config) = base_config(&base);
    // facade.public_url names the facade Service: <service>.<namespace>.svc:<port>.
    let (host, port) = host_port(&config.facade.public_url);
    let mut labels = host.split('.');
    let (svc, ns) = (labels.next().unwrap_or(""), labels.next().unwrap_or(""));
    let facade = base
        .find("Service", ns, svc)
        .unwrap_or_else(|| panic!("facade.public_url host {host} is not a Service of the base"));
    let ports: Vec<u64> = seq_at(&facade.value, &["spec", "ports"])
        .iter()
        .filter_map(|p| at(p, &["port"]).and_then(Value::as_u64))
        .collect();
    assert!(ports.contains(&u64::from(port)), "{ports:?} vs {port}");
    let tls = config.facade.tls_cert_file.is_some();
    assert_eq!(config.facade.public_url.starts_with("https://"), tls);
}
