//! Checks of compose.yaml and the Dockerfile: references between services resolve, the jetrunner
//! services run a binary the image builds with the shared config mounted, published ports are
//! unique, and config/jetrunner.toml (with each service's overrides) agrees with the services,
//! ports and credentials of the simulated components.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use serde_yaml::Value;

const IMAGE: &str = "jetrunner:dev";
const CONFIG_SOURCE: &str = "./config/jetrunner.toml";

fn compose() -> Value {
    let mut docs = yaml_docs(&repo_root().join("compose.yaml"));
    assert_eq!(docs.len(), 1, "compose.yaml is one document");
    docs.remove(0)
}

fn services(compose: &Value) -> BTreeMap<String, Value> {
    at(compose, &["services"])
        .and_then(Value::as_mapping)
        .expect("compose.yaml has services")
        .iter()
        .map(|(k, v)| (k.as_str().expect("service name").to_owned(), v.clone()))
        .collect()
}

/// Services built from the jetrunner image.
fn jetrunner_image_services(compose: &Value) -> BTreeMap<String, Value> {
    services(compose)
        .into_iter()
        .filter(|(_, s)| str_at(s, &["image"]) == Some(IMAGE))
        .collect()
}

/// Resolves `${VAR:-default}` / `${VAR-default}` to the default, as compose does with VAR unset.
fn interpolate_defaults(raw: &str) -> String {
    let mut out = String::new();
    let mut rest = raw;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing brace") + start;
        let inner = &rest[start + 2..end];
        let default = inner
            .split_once(":-")
            .or_else(|| inner.split_once('-'))
            .map(|(_, d)| d)
            .unwrap_or_else(|| panic!("${{{inner}}} has no default: compose would use \"\""));
        out.push_str(default);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// A service's environment as (name, value) with defaults interpolated.
fn environment(service: &Value) -> Vec<(String, String)> {
    match at(service, &["environment"]) {
        None => Vec::new(),
        Some(Value::Mapping(m)) => m
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    Value::Bool(b) => b.to_string(),
                    other => panic!("environment value {other:?}"),
                };
                (
                    k.as_str().expect("env name").to_owned(),
                    interpolate_defaults(&value),
                )
            })
            .collect(),
        Some(Value::Sequence(items)) => items
            .iter()
            .map(|i| {
                let s = i.as_str().expect("env item");
                let (k, v) = s.split_once('=').unwrap_or((s, ""));
                (k.to_owned(), interpolate_defaults(v))
            })
            .collect(),
        Some(other) => panic!("environment is {other:?}"),
    }
}

/// `depends_on` as name → condition (short form means service_started).
fn depends_on(service: &Value) -> BTreeMap<String, String> {
    match at(service, &["depends_on"]) {
        None => BTreeMap::new(),
        Some(Value::Sequence(names)) => names
            .iter()
            .map(|n| {
                (
                    n.as_str().expect("name").to_owned(),
                    "service_started".to_owned(),
                )
            })
            .collect(),
        Some(Value::Mapping(m)) => m
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().expect("name").to_owned(),
                    str_at(v, &["condition"])
                        .unwrap_or("service_started")
                        .to_owned(),
                )
            })
            .collect(),
        Some(other) => panic!("depends_on is {other:?}"),
    }
}

/// Published ports as (host ip, host port, container port).
fn published(service: &Value) -> Vec<(String, u16, u16)> {
    seq_at(service, &["ports"])
        .iter()
        .map(|p| {
            let spec = p.as_str().expect("ports use the short string form");
            let spec = spec.split('/').next().unwrap_or(spec);
            let parts: Vec<&str> = spec.split(':').collect();
            let num = |s: &str| s.parse::<u16>().unwrap_or_else(|_| panic!("port {spec}"));
            match parts.as_slice() {
                [host, container] => ("0.0.0.0".to_owned(), num(host), num(container)),
                [ip, host, container] => ((*ip).to_owned(), num(host), num(container)),
                _ => panic!("port {spec} must publish host:container"),
            }
        })
        .collect()
}

/// The value after `flag` in a command.
fn flag<'a>(command: &'a [String], flag: &str) -> Option<&'a str> {
    command
        .iter()
        .position(|a| a == flag)
        .and_then(|i| command.get(i + 1))
        .map(String::as_str)
}

/// The config as each jetrunner service sees it (file plus its environment overrides).
fn config_of(service: &Value) -> jr_config::Config {
    load_config(
        &repo_root().join("config/jetrunner.toml"),
        &environment(service),
    )
}

#[test]
fn depends_on_names_existing_services_and_health_conditions_have_healthchecks() {
    let compose = compose();
    let services = services(&compose);
    let mut edges = 0;
    for (name, service) in &services {
        for (dependency, condition) in depends_on(service) {
            let target = services
                .get(&dependency)
                .unwrap_or_else(|| panic!("{name} depends on unknown service {dependency}"));
            assert!(
                [
                    "service_started",
                    "service_healthy",
                    "service_completed_successfully"
                ]
                .contains(&condition.as_str()),
                "{name} → {dependency}: unknown condition {condition}"
            );
            if condition == "service_healthy" {
                assert!(
                    at(target, &["healthcheck", "test"]).is_some(),
                    "{name} waits for {dependency} to be healthy, which has no healthcheck"
                );
            }
            // A profile-only service cannot be a dependency of an always-on one.
            assert!(
                seq_at(target, &["profiles"]).is_empty()
                    || !seq_at(service, &["profiles"]).is_empty(),
                "{name} depends on {dependency}, which only runs in a profile"
            );
            edges += 1;
        }
    }
    assert!(
        edges >= 10,
        "expected the services to wait for NATS/Postgres, saw {edges} edges"
    );
    // No cycles: a topological order exists.
    let mut remaining: BTreeMap<&str, BTreeSet<String>> = services
        .iter()
        .map(|(n, s)| (n.as_str(), depends_on(s).into_keys().collect()))
        .collect();
    while !remaining.is_empty() {
        let ready: Vec<&str> = remaining
            .iter()
            .filter(|(_, deps)| deps.iter().all(|d| !remaining.contains_key(d.as_str())))
            .map(|(n, _)| *n)
            .collect();
        assert!(
            !ready.is_empty(),
            "depends_on cycle among {:?}",
            remaining.keys()
        );
        for n in ready {
            remaining.remove(n);
        }
    }
}

#[test]
fn jetrunner_services_run_a_built_binary_with_the_shared_config_mounted() {
    let compose = compose();
    let services = jetrunner_image_services(&compose);
    for expected in SERVICES
        .iter()
        .chain(&["fake-forge", "fake-kube", "fake-sandbox"])
    {
        assert!(
            services.contains_key(*expected),
            "compose runs {expected} from {IMAGE}"
        );
    }
    assert!(repo_root().join(CONFIG_SOURCE).is_file());
    for (name, service) in &services {
        let command = command_of(service);
        let binary = command
            .first()
            .unwrap_or_else(|| panic!("{name} has no command"));
        assert!(
            BINARIES.contains(&binary.as_str()),
            "{name} runs unknown binary {binary}"
        );
        assert!(
            at(service, &["build"]).is_some(),
            "{name} can build {IMAGE} itself"
        );
        if SERVICES.contains(&name.as_str()) {
            assert_eq!(binary, name, "service {name} runs its own binary");
            assert_eq!(config_arg(&command), Some(CONFIG_PATH), "{name}");
            let mounted = seq_at(service, &["volumes"]).iter().any(|v| {
                let parts: Vec<&str> = v.as_str().unwrap_or("").split(':').collect();
                parts.first() == Some(&CONFIG_SOURCE)
                    && parts.get(1) == Some(&CONFIG_PATH)
                    && parts.get(2) == Some(&"ro")
            });
            assert!(
                mounted,
                "{name} mounts {CONFIG_SOURCE} read-only at {CONFIG_PATH}"
            );
        }
    }
}

/// The binaries named by `ARG <name>="…"` in the Dockerfile.
fn arg_list<'a>(dockerfile: &'a str, name: &str) -> BTreeSet<&'a str> {
    let prefix = format!("ARG {name}=");
    let line = dockerfile
        .lines()
        .find(|l| l.trim_start().starts_with(&prefix))
        .unwrap_or_else(|| panic!("Dockerfile has {prefix}..."));
    line.split_once('=')
        .map(|(_, v)| v.trim().trim_matches('"'))
        .expect("value")
        .split_whitespace()
        .collect()
}

/// The Dockerfile's stages: (the `FROM` line, the lines up to the next `FROM`).
fn stages(dockerfile: &str) -> Vec<(&str, Vec<&str>)> {
    let mut out: Vec<(&str, Vec<&str>)> = Vec::new();
    for line in dockerfile.lines() {
        if line.starts_with("FROM ") {
            out.push((line, Vec::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push(line);
        }
    }
    out
}

#[test]
fn dockerfile_builds_every_binary_the_manifests_run_into_one_non_root_image() {
    let dockerfile = read(&repo_root().join("Dockerfile"));
    let production = arg_list(&dockerfile, "BINARIES");
    let dev_only = arg_list(&dockerfile, "DEV_BINARIES");
    let built: BTreeSet<&str> = production.union(&dev_only).copied().collect();
    assert_eq!(built, BTreeSet::from(BINARIES));
    assert!(
        production.iter().all(|b| !b.starts_with("fake-")),
        "the production binaries include a fake: {production:?}"
    );
    assert!(
        dev_only.iter().all(|b| b.starts_with("fake-")),
        "{dev_only:?}"
    );
    assert!(dockerfile.contains("FROM rust:${RUST_VERSION}-bookworm AS builder"));
    assert!(dockerfile.contains("ARG RUST_VERSION=1.95"));
    assert!(dockerfile.contains("FROM debian:bookworm-slim AS runtime-base"));
    assert!(dockerfile.contains("cargo build --release --locked"));
    assert!(dockerfile.contains("--mount=type=cache,target=/usr/local/cargo/registry"));
    let stages = stages(&dockerfile);
    // The default target (the last stage) is the production image: the services, no fake.
    let (from, body) = stages.last().expect("stages");
    assert_eq!(*from, "FROM runtime-base AS runtime");
    let copies: Vec<&str> = body
        .iter()
        .copied()
        .filter(|l| l.starts_with("COPY"))
        .collect();
    assert_eq!(copies, vec!["COPY --from=builder /out/ /usr/local/bin/"]);
    // The dev target adds the fakes.
    let (_, dev) = stages
        .iter()
        .find(|(from, _)| *from == "FROM runtime-base AS dev")
        .expect("a dev stage");
    assert!(dev.contains(&"COPY --from=builder /out/ /usr/local/bin/"));
    assert!(dev.contains(&"COPY --from=dev-builder /out-dev/ /usr/local/bin/"));
    for (from, body) in stages
        .iter()
        .filter(|(f, _)| f.starts_with("FROM runtime-base AS "))
    {
        let user = body
            .iter()
            .rev()
            .find(|l| l.starts_with("USER "))
            .unwrap_or_else(|| panic!("{from} sets USER"));
        assert!(
            !user.contains("root") && !user.contains(" 0"),
            "{from}: {user}"
        );
    }
    // compose builds the dev image; every command there starts with a binary it has.
    let compose = compose();
    for (name, service) in jetrunner_image_services(&compose) {
        assert_eq!(
            str_at(&service, &["build", "target"]),
            Some("dev"),
            "{name} builds the dev target"
        );
        let command = command_of(&service);
        assert!(built.contains(command[0].as_str()), "{name}: {command:?}");
        let test: Vec<&str> = seq_at(&service, &["healthcheck", "test"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        if let ["CMD", binary, ..] = test.as_slice() {
            assert!(built.contains(binary), "{name} healthcheck runs {binary}");
        }
    }
    // Kubernetes runs the production image, so only production binaries.
    let base = base();
    for deployment in base.of_kind("Deployment") {
        for container in seq_at(pod_spec(deployment), &["containers"]) {
            let command = command_of(container);
            assert!(
                production.contains(command[0].as_str()),
                "{}",
                deployment.describe()
            );
        }
    }
}

#[test]
fn published_host_ports_do_not_collide() {
    let compose = compose();
    let mut seen: BTreeMap<u16, (String, String)> = BTreeMap::new();
    for (name, service) in services(&compose) {
        for (ip, host, _) in published(&service) {
            if let Some((other, other_ip)) = seen.get(&host) {
                let overlap = ip == *other_ip || ip == "0.0.0.0" || other_ip == "0.0.0.0";
                assert!(!overlap, "host port {host} published by {other} and {name}");
            }
            seen.insert(host, (name.clone(), ip));
        }
    }
    assert!(
        seen.contains_key(&8080) && seen.contains_key(&8090),
        "{seen:?}"
    );
}

#[test]
fn config_is_valid_as_each_service_sees_it_and_ports_match() {
    let compose = compose();
    let services = services(&compose);
    for name in SERVICES {
        let service = &services[name];
        let config = config_of(service);
        let ops = match name {
            "scheduler" => Some(config.scheduler.ops_listen),
            "pod-worker" => config.pod_worker.ops_listen,
            "vm-worker" => config.vm_worker.ops_listen,
            _ => Some(config.reconciler.ops_listen),
        }
        .unwrap_or_else(|| panic!("config sets {name}'s ops_listen"));
        let test: Vec<&str> = seq_at(service, &["healthcheck", "test"])
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            test,
            vec![
                "CMD",
                "jr",
                "health",
                &format!("http://127.0.0.1:{}/healthz", ops.port())
            ],
            "{name} healthcheck"
        );
        let ports = published(service);
        let publishes = |container: u16| ports.iter().any(|(_, _, c)| *c == container);
        match name {
            "scheduler" => assert!(publishes(config.facade.listen.port()), "facade"),
            "reconciler" => assert!(publishes(config.reconciler.status_listen.port()), "status"),
            _ => {}
        }
        for (_, _, container) in &ports {
            let listens = [
                Some(ops.port()),
                (name == "scheduler").then(|| config.facade.listen.port()),
                (name == "reconciler").then(|| config.reconciler.status_listen.port()),
            ];
            assert!(
                listens.contains(&Some(*container)),
                "{name} publishes unused port {container}"
            );
        }
    }
}

#[test]
fn config_urls_point_at_compose_services_that_listen_there() {
    let compose = compose();
    let services = services(&compose);
    let scheduler = &services["scheduler"];
    let config = config_of(scheduler);
    // The port a compose service listens on: --listen of a fake, or a well-known default.
    let listens = |name: &str, port: u16| -> bool {
        let service = services
            .get(name)
            .unwrap_or_else(|| panic!("no compose service {name}"));
        match flag(&command_of(service), "--listen") {
            Some(addr) => addr == format!("0.0.0.0:{port}"),
            None => match name {
                "nats" => port == 4222,
                "postgres" => port == 5432,
                "scheduler" => port == config.facade.listen.port(),
                "gitea" => port == 3000,
                _ => false,
            },
        }
    };
    let mut urls = vec![
        ("nats.url", config.nats.url.clone()),
        ("database.url", config.database.url.clone()),
        ("forge.url", config.forge.url.clone()),
        ("facade.public_url", config.facade.public_url.clone()),
    ];
    for (name, backend) in &config.backend {
        if let Some(url) = backend.kubernetes.as_ref().and_then(|k| k.api_url.clone()) {
            urls.push(("backend.*.kubernetes.api_url", url));
        }
        if let Some(sandbox) = &backend.opensandbox {
            urls.push(("backend.*.opensandbox.url", sandbox.url.clone()));
            let fake = command_of(&services["fake-sandbox"]);
            assert_eq!(
                flag(&fake, "--api-key"),
                sandbox.api_key.as_deref(),
                "backend.{name}"
            );
            let pool = flag(&fake, "--pool").expect("fake-sandbox --pool");
            let (pool_name, size) = pool.split_once('=').expect("pool=size");
            assert_eq!(pool_name, sandbox.pool);
            let size: usize = size.parse().expect("pool size");
            assert!(
                size >= backend.capacity,
                "pool {size} < capacity {}",
                backend.capacity
            );
        }
    }
    for (key, url) in urls {
        let (host, port) = host_port(&url);
        assert!(
            listens(&host, port),
            "{key} = {url}: compose service {host} does not listen on {port}"
        );
    }
    let fake_forge = command_of(&services["fake-forge"]);
    assert_eq!(
        flag(&fake_forge, "--registration-token"),
        config.forge.registration_token.as_deref(),
        "the scheduler registers with the token fake-forge accepts"
    );
    for fake in ["fake-kube", "fake-sandbox"] {
        let command = command_of(&services[fake]);
        let executor = flag(&command, "--executor-cmd").expect("--executor-cmd");
        assert_eq!(executor, "/usr/local/bin/fake-executor");
    }
    // The scheduler persists its runner credentials on a volume.
    let dir = config
        .forge
        .credentials_file
        .parent()
        .expect("dir")
        .display()
        .to_string();
    let persisted = seq_at(scheduler, &["volumes"])
        .iter()
        .filter_map(Value::as_str)
        .any(|v| v.split(':').nth(1) == Some(dir.as_str()));
    assert!(persisted, "scheduler keeps {dir} on a volume");
}

#[test]
fn named_volumes_are_declared_and_gitea_is_an_opt_in_profile() {
    let compose = compose();
    let declared: BTreeSet<String> = at(&compose, &["volumes"])
        .and_then(Value::as_mapping)
        .map(|m| {
            m.keys()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let services = services(&compose);
    for (name, service) in &services {
        for volume in seq_at(service, &["volumes"])
            .iter()
            .filter_map(Value::as_str)
        {
            let source = volume.split(':').next().unwrap_or("");
            if !source.starts_with('.') && !source.starts_with('/') {
                assert!(
                    declared.contains(source),
                    "{name} uses undeclared volume {source}"
                );
            }
        }
    }
    let gitea = &services["gitea"];
    let profiles: Vec<&str> = seq_at(gitea, &["profiles"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(profiles, vec!["real-gitea"]);
    let env: BTreeMap<String, String> = environment(gitea).into_iter().collect();
    assert_eq!(
        env.get("GITEA__actions__ENABLED").map(String::as_str),
        Some("true")
    );
    let nats_command = command_of(&services["nats"]);
    for arg in ["-js", "-sd", "-m"] {
        assert!(
            nats_command.iter().any(|a| a == arg),
            "nats runs with {arg}"
        );
    }
    // The scheduler's forge can be switched to Gitea through the environment.
    let scheduler_env: BTreeSet<String> = environment(&services["scheduler"])
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(scheduler_env.contains("JETRUNNER__FORGE__URL"));
}
