//! Loading the deployment artefacts for the checks: YAML documents, kustomizations (resources and
//! generated ConfigMaps/Secrets), the config files they reference, and small accessors over
//! `serde_yaml::Value`.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of these helpers"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

mod pods;
#[allow(
    unused_imports,
    reason = "not every test binary checks Kubernetes manifests"
)]
pub use pods::*;

/// The binaries the image builds; a container command must start with one of them.
pub const BINARIES: [&str; 10] = [
    "scheduler",
    "pod-worker",
    "vm-worker",
    "reconciler",
    "jr",
    "fake-forge",
    "fake-kube",
    "fake-sandbox",
    "fake-executor",
    "fake-github",
];

/// The four jetrunner services (each reads the shared config file).
pub const SERVICES: [&str; 4] = ["scheduler", "pod-worker", "vm-worker", "reconciler"];

/// Where every container expects the shared configuration file.
pub const CONFIG_PATH: &str = "/etc/jetrunner/jetrunner.toml";

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every non-empty YAML document of a file.
pub fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = read(path);
    let mut docs = Vec::new();
    for (i, document) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = Value::deserialize(document)
            .unwrap_or_else(|e| panic!("{} document {i}: not valid YAML: {e}", path.display()));
        if !value.is_null() {
            docs.push(value);
        }
    }
    docs
}

/// All files below `dir` (recursively) whose name ends with one of `exts`.
pub fn files_under(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries =
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("listing {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
            {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The string at a path of mapping keys, if every step exists and the leaf is a string.
pub fn str_at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a str> {
    at(value, path).and_then(Value::as_str)
}

/// The value at a path of mapping keys.
pub fn at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    let mut cursor = value;
    for key in path {
        cursor = cursor.as_mapping()?.get(*key)?;
    }
    Some(cursor)
}

/// The sequence at a path (empty when absent).
pub fn seq_at<'a>(value: &'a Value, path: &[&str]) -> &'a [Value] {
    at(value, path)
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// A mapping of strings to strings (labels, selectors); empty when absent.
pub fn string_map(value: Option<&Value>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(map) = value.and_then(Value::as_mapping) {
        for (k, v) in map {
            let key = k.as_str().expect("label keys are strings").to_owned();
            let val = match v {
                Value::String(s) => s.clone(),
                other => panic!("label {key} has a non-string value {other:?}"),
            };
            out.insert(key, val);
        }
    }
    out
}

/// `selector` ⊆ `labels`, and the selector is not empty.
pub fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// One Kubernetes object from a manifest file.
#[derive(Clone, Debug)]
pub struct Object {
    pub file: PathBuf,
    pub value: Value,
}

impl Object {
    pub fn kind(&self) -> &str {
        str_at(&self.value, &["kind"]).unwrap_or("")
    }
    pub fn name(&self) -> &str {
        str_at(&self.value, &["metadata", "name"]).unwrap_or("")
    }
    pub fn namespace(&self) -> Option<&str> {
        str_at(&self.value, &["metadata", "namespace"])
    }
    pub fn describe(&self) -> String {
        format!(
            "{} {}/{} ({})",
            self.kind(),
            self.namespace().unwrap_or("-"),
            self.name(),
            self.file.display()
        )
    }
}

/// A ConfigMap or Secret a kustomization generates, with its keys.
#[derive(Clone, Debug)]
pub struct Generated {
    pub kind: &'static str,
    pub name: String,
    pub namespace: Option<String>,
    pub keys: BTreeSet<String>,
    /// key → file the content comes from (for `files:` entries).
    pub files: BTreeMap<String, PathBuf>,
}

/// A kustomization with its resources (recursively) and generated objects.
#[derive(Debug)]
pub struct Kustomization {
    pub dir: PathBuf,
    pub value: Value,
    pub objects: Vec<Object>,
    pub generated: Vec<Generated>,
    /// Problems found while loading (missing files); the tests assert this is empty.
    pub missing: Vec<String>,
}

pub fn load_kustomization(dir: &Path) -> Kustomization {
    let file = dir.join("kustomization.yaml");
    let value = yaml_docs(&file)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{} is empty", file.display()));
    let mut k = Kustomization {
        dir: dir.to_path_buf(),
        value: value.clone(),
        objects: Vec::new(),
        generated: Vec::new(),
        missing: Vec::new(),
    };
    for entry in seq_at(&value, &["resources"]) {
        let rel = entry.as_str().expect("resource entries are strings");
        let path = dir.join(rel);
        if path.is_dir() {
            if path.join("kustomization.yaml").is_file() {
                let nested = load_kustomization(&path);
                k.objects.extend(nested.objects);
                k.generated.extend(nested.generated);
                k.missing.extend(nested.missing);
            } else {
                k.missing.push(format!(
                    "{}: resource {rel} is a directory without kustomization.yaml",
                    file.display()
                ));
            }
        } else if path.is_file() {
            for doc in yaml_docs(&path) {
                k.objects.push(Object {
                    file: path.clone(),
                    value: doc,
                });
            }
        } else {
            k.missing
                .push(format!("{}: resource {rel} does not exist", file.display()));
        }
    }
    for (field, kind) in [
        ("configMapGenerator", "ConfigMap"),
        ("secretGenerator", "Secret"),
    ] {
        for generator in seq_at(&value, &[field]) {
            let name = str_at(generator, &["name"])
                .unwrap_or_else(|| panic!("{}: {field} entry without a name", file.display()))
                .to_owned();
            let mut keys = BTreeSet::new();
            let mut files = BTreeMap::new();
            for entry in seq_at(generator, &["files"]) {
                let spec = entry.as_str().expect("generator files are strings");
                let (key, rel) = match spec.split_once('=') {
                    Some((key, rel)) => (key.to_owned(), rel.to_owned()),
                    None => (
                        Path::new(spec)
                            .file_name()
                            .and_then(|n| n.to_str())
                            .unwrap_or(spec)
                            .to_owned(),
                        spec.to_owned(),
                    ),
                };
                let path = dir.join(&rel);
                if !path.is_file() {
                    k.missing.push(format!(
                        "{}: {field} {name}: file {rel} does not exist",
                        file.display()
                    ));
                }
                if rel.starts_with("..") || Path::new(&rel).is_absolute() {
                    k.missing.push(format!(
                        "{}: {field} {name}: file {rel} is outside the kustomization \
                         directory (kustomize refuses it by default)",
                        file.display()
                    ));
                }
                keys.insert(key.clone());
                files.insert(key, path);
            }
            for entry in seq_at(generator, &["literals"]) {
                let literal = entry.as_str().expect("generator literals are strings");
                let (key, _) = literal
                    .split_once('=')
                    .unwrap_or_else(|| panic!("literal {literal:?} has no `=`"));
                keys.insert(key.to_owned());
            }
            k.generated.push(Generated {
                kind,
                name,
                namespace: str_at(generator, &["namespace"]).map(str::to_owned),
                keys,
                files,
            });
        }
    }
    k
}

impl Kustomization {
    pub fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Object> + 'a {
        self.objects.iter().filter(move |o| o.kind() == kind)
    }

    pub fn find(&self, kind: &str, namespace: &str, name: &str) -> Option<&Object> {
        self.objects
            .iter()
            .find(|o| o.kind() == kind && o.namespace() == Some(namespace) && o.name() == name)
    }

    /// Keys of a ConfigMap/Secret in the base, whether written out or generated.
    pub fn keys_of(&self, kind: &str, namespace: &str, name: &str) -> Option<BTreeSet<String>> {
        if let Some(object) = self.find(kind, namespace, name) {
            let mut keys = BTreeSet::new();
            for field in ["data", "stringData", "binaryData"] {
                keys.extend(string_keys(at(&object.value, &[field])));
            }
            return Some(keys);
        }
        self.generated
            .iter()
            .find(|g| g.kind == kind && g.name == name && g.namespace.as_deref() == Some(namespace))
            .map(|g| g.keys.clone())
    }

    /// The Deployment's pod template spec.
    pub fn deployment(&self, name: &str) -> &Object {
        self.of_kind("Deployment")
            .find(|d| d.name() == name)
            .unwrap_or_else(|| panic!("no Deployment {name}"))
    }
}

fn string_keys(value: Option<&Value>) -> BTreeSet<String> {
    value
        .and_then(Value::as_mapping)
        .map(|m| {
            m.keys()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The kustomize base every deployment check is about.
pub fn base() -> Kustomization {
    load_kustomization(&repo_root().join("k8s/base"))
}

/// Pod spec of a Deployment.
pub fn pod_spec(deployment: &Object) -> &Value {
    at(&deployment.value, &["spec", "template", "spec"])
        .unwrap_or_else(|| panic!("{} has no pod template spec", deployment.describe()))
}

pub fn pod_labels(deployment: &Object) -> BTreeMap<String, String> {
    string_map(at(
        &deployment.value,
        &["spec", "template", "metadata", "labels"],
    ))
}

/// Container ports as (name, number).
pub fn container_ports(container: &Value) -> Vec<(Option<String>, u64)> {
    seq_at(container, &["ports"])
        .iter()
        .map(|p| {
            (
                str_at(p, &["name"]).map(str::to_owned),
                at(p, &["containerPort"])
                    .and_then(Value::as_u64)
                    .expect("containerPort is a number"),
            )
        })
        .collect()
}

/// Whether a port reference (number or name) names a port of one of the containers.
pub fn port_declared(containers: &[Value], port: &Value) -> bool {
    containers.iter().any(|c| {
        container_ports(c).iter().any(|(name, number)| match port {
            Value::Number(n) => n.as_u64() == Some(*number),
            Value::String(s) => name.as_deref() == Some(s.as_str()),
            _ => false,
        })
    })
}

/// The command of a container or compose service as strings.
pub fn command_of(value: &Value) -> Vec<String> {
    seq_at(value, &["command"])
        .iter()
        .map(|v| v.as_str().expect("command items are strings").to_owned())
        .collect()
}

/// The value after `--config` in a command.
pub fn config_arg(command: &[String]) -> Option<&str> {
    command
        .iter()
        .position(|a| a == "--config")
        .and_then(|i| command.get(i + 1))
        .map(String::as_str)
}

/// `host:port` of an http(s)/nats/postgres URL (port defaulted by scheme).
pub fn host_port(url: &str) -> (String, u16) {
    let (scheme, rest) = url
        .split_once("://")
        .unwrap_or_else(|| panic!("{url} has no scheme"));
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    match authority.rsplit_once(':') {
        Some((host, port)) => (
            host.to_owned(),
            port.parse()
                .unwrap_or_else(|_| panic!("{url}: bad port {port}")),
        ),
        None => {
            let port = match scheme {
                "http" => 80,
                "https" => 443,
                "nats" | "tls" => 4222,
                "postgres" | "postgresql" => 5432,
                other => panic!("{url}: no default port for {other}"),
            };
            (authority.to_owned(), port)
        }
    }
}

/// Loads a config file the way the services do, with the given environment overrides.
pub fn load_config(path: &Path, env: &[(String, String)]) -> jr_config::Config {
    jr_config::load_str(&read(path), &path.display().to_string(), env.to_vec())
        .unwrap_or_else(|e| panic!("{} with env {env:?}: {e}", path.display()))
}
