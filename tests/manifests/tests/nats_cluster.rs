//! The production NATS of k8s/nats: a three-node JetStream cluster (StatefulSet `nats`, routes
//! through the headless Service, one PVC per server, lame duck mode on stop, a budget of one
//! server away, NetworkPolicies), and the services' side of it in k8s/base/jetrunner.toml: every
//! server as a seed and R3 streams. The optional Helm values describe the same cluster.
//!
//! `nats.conf` is read with a small parser of the NATS configuration syntax below, and checked by
//! `nats-server -t` itself with the environment the Pod gets (`$NATS_SERVER_BIN` or `PATH`, as
//! the bus tests; scripts/lib.sh installs it).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_yaml::Value;

const NATS_NS: &str = "nats";
const STATEFUL_SET: &str = "nats";
const CONFIG_MAP: &str = "nats-config";
const CONF_KEY: &str = "nats.conf";
/// The servers' Secret with the jetrunner users' passwords (k8s/nats/secret.yaml).
const USERS_SECRET: &str = "jetrunner-nats-users";

// ---------------------------------------------------------------------------------------------
// The NATS configuration syntax (enough of it for nats.conf): `key: value`, `key = value` or
// `key value`; blocks `{ }`; lists `[ ]` separated by commas or newlines; quoted or bare strings;
// `#` and `//` comments; `include <path>` (kept as an entry with the key `include`).

#[derive(Clone, Debug, PartialEq)]
enum Conf {
    Str(String),
    List(Vec<Conf>),
    Map(Vec<(String, Conf)>),
}

impl Conf {
    fn get(&self, key: &str) -> Option<&Conf> {
        match self {
            Conf::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    fn path(&self, path: &[&str]) -> Option<&Conf> {
        path.iter().try_fold(self, |c, key| c.get(key))
    }
    fn str_at(&self, path: &[&str]) -> Option<&str> {
        match self.path(path)? {
            Conf::Str(s) => Some(s),
            _ => None,
        }
    }
    fn includes(&self) -> Vec<&str> {
        match self {
            Conf::Map(entries) => entries
                .iter()
                .filter(|(k, _)| k == "include")
                .filter_map(|(_, v)| match v {
                    Conf::Str(s) => Some(s.as_str()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }
}

struct Parser<'a> {
    text: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }
    fn line(&self) -> usize {
        self.text[..self.pos]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }
    /// Skips whitespace, separators (`,` `;`) and comments.
    fn skip(&mut self) {
        while let Some(b) = self.peek() {
            if b.is_ascii_whitespace() || b == b',' || b == b';' {
                self.pos += 1;
            } else if b == b'#' || (b == b'/' && self.text.get(self.pos + 1) == Some(&b'/')) {
                while self.peek().is_some_and(|b| b != b'\n') {
                    self.pos += 1;
                }
            } else {
                break;
            }
        }
    }
    /// Skips blanks within a line (between a key and its value).
    fn skip_blanks(&mut self) {
        while self.peek().is_some_and(|b| b == b' ' || b == b'\t') {
            self.pos += 1;
        }
    }
    fn token(&mut self, stop: &[u8]) -> String {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|b| !b.is_ascii_whitespace() && !stop.contains(&b))
        {
            self.pos += 1;
        }
        assert!(
            self.pos > start,
            "nats.conf line {}: expected a token",
            self.line()
        );
        String::from_utf8(self.text[start..self.pos].to_vec()).expect("nats.conf is UTF-8")
    }
    fn quoted(&mut self) -> String {
        let quote = self.peek().expect("a quote");
        self.pos += 1;
        let start = self.pos;
        while self.peek().is_some_and(|b| b != quote) {
            self.pos += 1;
        }
        assert!(
            self.peek().is_some(),
            "nats.conf line {}: unterminated string",
            self.line()
        );
        let s = String::from_utf8(self.text[start..self.pos].to_vec()).expect("UTF-8");
        self.pos += 1;
        s
    }
    /// Entries up to `end` (`}`) or the end of the text (`None`).
    fn map(&mut self, end: Option<u8>) -> Conf {
        let mut entries = Vec::new();
        loop {
            self.skip();
            match self.peek() {
                None => {
                    assert!(end.is_none(), "nats.conf: unterminated block");
                    break;
                }
                Some(b) if Some(b) == end => {
                    self.pos += 1;
                    break;
                }
                Some(b'"' | b'\'') => {
                    let key = self.quoted();
                    let value = self.entry_value();
                    entries.push((key, value));
                }
                Some(_) => {
                    let key = self.token(b":={}[],;#");
                    if key == "include" {
                        self.skip_blanks();
                        let path = if matches!(self.peek(), Some(b'"' | b'\'')) {
                            self.quoted()
                        } else {
                            self.token(b";,}")
                        };
                        entries.push((key, Conf::Str(path)));
                    } else {
                        let value = self.entry_value();
                        entries.push((key, value));
                    }
                }
            }
        }
        Conf::Map(entries)
    }
    fn entry_value(&mut self) -> Conf {
        self.skip_blanks();
        if matches!(self.peek(), Some(b':' | b'=')) {
            self.pos += 1;
        }
        self.skip_blanks();
        self.value()
    }
    fn value(&mut self) -> Conf {
        match self.peek() {
            Some(b'{') => {
                self.pos += 1;
                self.map(Some(b'}'))
            }
            Some(b'[') => {
                self.pos += 1;
                let mut items = Vec::new();
                loop {
                    self.skip();
                    match self.peek() {
                        Some(b']') => {
                            self.pos += 1;
                            break;
                        }
                        None => panic!("nats.conf: unterminated list"),
                        Some(_) => items.push(self.value()),
                    }
                }
                Conf::List(items)
            }
            Some(b'"' | b'\'') => Conf::Str(self.quoted()),
            Some(_) => Conf::Str(self.token(b",;]}#")),
            None => panic!("nats.conf: a key without a value at the end"),
        }
    }
}

fn parse_conf(text: &str) -> Conf {
    Parser {
        text: text.as_bytes(),
        pos: 0,
    }
    .map(None)
}

/// The `$VARIABLE`s a NATS configuration reads from the environment (outside quoted strings,
/// which the server takes literally, like the `"$JS.API..."` subjects of auth.conf).
fn env_references(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let mut quote: Option<char> = None;
        for (i, c) in line.char_indices() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') => quote = Some(c),
                (None, '#') => break,
                (None, '/') if line[i..].starts_with("//") => break,
                (None, '$') => {
                    let name: String = line[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        out.insert(name);
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// A NATS duration (`10s`, `2m`, `1m30s`, `500ms`).
fn nats_duration(text: &str) -> Duration {
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        assert!(digits > 0, "duration {text:?}: expected a number");
        let n: u64 = rest[..digits].parse().expect("a number");
        rest = &rest[digits..];
        let unit = rest.chars().take_while(char::is_ascii_alphabetic).count();
        total += match &rest[..unit] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n * 60),
            "h" => Duration::from_secs(n * 3600),
            other => panic!("duration {text:?}: unknown unit {other:?}"),
        };
        rest = &rest[unit..];
    }
    total
}

/// Bytes of a size with a binary suffix, as NATS (`8GiB`, `8Gi`) or Kubernetes (`10Gi`) write
/// them. Other suffixes are refused: NATS reads `G` as 10^9 but `GB` as 2^30.
fn binary_size(text: &str) -> u64 {
    let digits = text.chars().take_while(char::is_ascii_digit).count();
    let n: u64 = text[..digits]
        .parse()
        .unwrap_or_else(|_| panic!("size {text:?}: expected a number"));
    let unit: u64 = match text[digits..].trim() {
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "Ti" | "TiB" => 1 << 40,
        other => panic!("size {text:?}: use a binary suffix (Mi/MiB, Gi/GiB), not {other:?}"),
    };
    n * unit
}

// ---------------------------------------------------------------------------------------------
// The manifests.

fn nats() -> Kustomization {
    let k = load_kustomization(&repo_root().join("k8s/nats"));
    assert!(k.missing.is_empty(), "{:#?}", k.missing);
    k
}

fn stateful_set(k: &Kustomization) -> &Object {
    k.find("StatefulSet", NATS_NS, STATEFUL_SET)
        .unwrap_or_else(|| panic!("k8s/nats has no StatefulSet {NATS_NS}/{STATEFUL_SET}"))
}

fn sts_pod_spec(sts: &Object) -> &Value {
    at(&sts.value, &["spec", "template", "spec"])
        .unwrap_or_else(|| panic!("{} has no pod template spec", sts.describe()))
}

fn sts_pod_labels(sts: &Object) -> BTreeMap<String, String> {
    string_map(at(&sts.value, &["spec", "template", "metadata", "labels"]))
}

fn nats_container(sts: &Object) -> &Value {
    seq_at(sts_pod_spec(sts), &["containers"])
        .iter()
        .find(|c| str_at(c, &["name"]) == Some("nats"))
        .unwrap_or_else(|| panic!("{} has no container `nats`", sts.describe()))
}

fn replicas(sts: &Object) -> u64 {
    at(&sts.value, &["spec", "replicas"])
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{} sets no spec.replicas", sts.describe()))
}

/// The number of a container port, by name.
fn named_port(container: &Value, name: &str) -> u64 {
    container_ports(container)
        .into_iter()
        .find(|(n, _)| n.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("the nats container declares no port {name}"))
        .1
}

/// A probe's or rule's port (number or name) as a number of the container.
fn resolve_port(container: &Value, port: &Value) -> Option<u64> {
    match port {
        Value::Number(n) => n.as_u64(),
        Value::String(name) => container_ports(container)
            .into_iter()
            .find(|(n, _)| n.as_deref() == Some(name.as_str()))
            .map(|(_, number)| number),
        _ => None,
    }
}

/// The generated ConfigMap's files: key → source file.
fn config_files(k: &Kustomization) -> BTreeMap<String, PathBuf> {
    k.generated
        .iter()
        .find(|g| g.kind == "ConfigMap" && g.name == CONFIG_MAP)
        .unwrap_or_else(|| panic!("k8s/nats generates no ConfigMap {CONFIG_MAP}"))
        .files
        .clone()
}

fn conf(k: &Kustomization) -> (String, Conf) {
    let file = config_files(k)
        .get(CONF_KEY)
        .unwrap_or_else(|| panic!("ConfigMap {CONFIG_MAP} has no key {CONF_KEY}"))
        .clone();
    let text = read(&file);
    let parsed = parse_conf(&text);
    (text, parsed)
}

/// Where the container mounts the volume that holds the ConfigMap.
fn config_mount(sts: &Object) -> PathBuf {
    let volume = seq_at(sts_pod_spec(sts), &["volumes"])
        .iter()
        .find(|v| str_at(v, &["configMap", "name"]) == Some(CONFIG_MAP))
        .and_then(|v| str_at(v, &["name"]))
        .unwrap_or_else(|| panic!("{} has no volume of ConfigMap {CONFIG_MAP}", sts.describe()));
    let mount = seq_at(nats_container(sts), &["volumeMounts"])
        .iter()
        .find(|m| str_at(m, &["name"]) == Some(volume))
        .unwrap_or_else(|| panic!("the nats container does not mount volume {volume}"));
    assert!(
        str_at(mount, &["subPath"]).is_none(),
        "mount the whole ConfigMap: the included files must sit next to {CONF_KEY}"
    );
    PathBuf::from(str_at(mount, &["mountPath"]).expect("mountPath"))
}

/// The volume mount whose directory holds `path`, and the volume's name.
fn mount_holding<'a>(container: &'a Value, path: &Path) -> Option<(&'a str, PathBuf)> {
    seq_at(container, &["volumeMounts"])
        .iter()
        .filter_map(|m| {
            let mount_path = PathBuf::from(str_at(m, &["mountPath"])?);
            path.starts_with(&mount_path)
                .then(|| (str_at(m, &["name"]).expect("mount name"), mount_path))
        })
        .max_by_key(|(_, p)| p.components().count())
}

/// The Pod's environment: name → value (fieldRef metadata.name as the first Pod's name, Secret
/// references with the placeholder values of the Secrets in k8s/nats).
fn pod_env(k: &Kustomization, sts: &Object) -> BTreeMap<String, String> {
    let container = nats_container(sts);
    let secret_data = |name: &str| -> BTreeMap<String, String> {
        let secret = k
            .find("Secret", NATS_NS, name)
            .unwrap_or_else(|| panic!("the nats container uses Secret {name}, not in k8s/nats"));
        string_map(at(&secret.value, &["stringData"]))
    };
    let mut env = BTreeMap::new();
    for from in seq_at(container, &["envFrom"]) {
        let name = str_at(from, &["secretRef", "name"])
            .unwrap_or_else(|| panic!("envFrom other than a secretRef: {from:?}"));
        env.extend(secret_data(name));
    }
    for var in seq_at(container, &["env"]) {
        let name = str_at(var, &["name"]).expect("env name").to_owned();
        let value = if let Some(value) = str_at(var, &["value"]) {
            value.to_owned()
        } else if str_at(var, &["valueFrom", "fieldRef", "fieldPath"]) == Some("metadata.name") {
            format!("{STATEFUL_SET}-0")
        } else if let Some(reference) = at(var, &["valueFrom", "secretKeyRef"]) {
            let secret = str_at(reference, &["name"]).expect("secret name");
            let key = str_at(reference, &["key"]).expect("secret key");
            secret_data(secret)
                .remove(key)
                .unwrap_or_else(|| panic!("Secret {secret} has no key {key} (env {name})"))
        } else {
            panic!("env {name}: unexpected source {var:?}")
        };
        env.insert(name, value);
    }
    env
}

fn nats_server_binary() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

// ---------------------------------------------------------------------------------------------
// The checks.

#[test]
fn the_parser_reads_the_nats_configuration_syntax() {
    let conf = parse_conf(
        "# comment\nserver_name: $POD_NAME\nport = 4222 // trailing\njetstream {\n  store_dir: \"/data\"\n}\n\
         cluster { routes: [\n nats://a:6222\n nats://b:6222, nats://c:6222 ] }\n\
         accounts { SYS: { users: [ { user: \"system\", password: $PW } ] } }\ninclude ./auth.conf\n",
    );
    assert_eq!(conf.str_at(&["server_name"]), Some("$POD_NAME"));
    assert_eq!(conf.str_at(&["port"]), Some("4222"));
    assert_eq!(conf.str_at(&["jetstream", "store_dir"]), Some("/data"));
    let Some(Conf::List(routes)) = conf.path(&["cluster", "routes"]) else {
        panic!("routes is a list");
    };
    assert_eq!(routes.len(), 3);
    assert_eq!(conf.includes(), vec!["./auth.conf"]);
    assert_eq!(
        env_references("a: $ONE\nb: \"$JS.API.INFO\" # $NOT\nc: [$TWO]"),
        BTreeSet::from(["ONE".to_owned(), "TWO".to_owned()])
    );
    assert_eq!(nats_duration("1m30s"), Duration::from_secs(90));
    assert_eq!(binary_size("8GiB"), 8 << 30);
    assert_eq!(binary_size("10Gi"), 10 << 30);
}

#[test]
fn three_servers_start_together_from_a_pinned_image() {
    let k = nats();
    let sts = stateful_set(&k);
    assert_eq!(replicas(sts), 3, "{}: three servers", sts.describe());
    // A lone server cannot elect a JetStream meta leader, so it never becomes ready: with
    // OrderedReady the other two would never be started.
    assert_eq!(
        str_at(&sts.value, &["spec", "podManagementPolicy"]),
        Some("Parallel"),
        "{}: the servers must start together",
        sts.describe()
    );
    let selector = string_map(at(&sts.value, &["spec", "selector", "matchLabels"]));
    assert!(
        selects(&selector, &sts_pod_labels(sts)),
        "{}: the selector matches the pod template",
        sts.describe()
    );
    let image = str_at(nats_container(sts), &["image"]).expect("image");
    let tag = image
        .strip_prefix("nats:")
        .unwrap_or_else(|| panic!("{image}: the official nats image"));
    let version: Vec<u64> = tag
        .trim_end_matches("-alpine")
        .split('.')
        .map(|p| {
            p.parse()
                .unwrap_or_else(|_| panic!("{image}: pin a version tag"))
        })
        .collect();
    assert_eq!(version.len(), 3, "{image}: pin a patch release");
    assert!(
        (version[0], version[1]) >= (2, 10),
        "{image}: jetrunner needs nats-server >= 2.10"
    );
}

#[test]
fn the_services_select_the_servers_and_the_headless_one_publishes_them_early() {
    let k = nats();
    let sts = stateful_set(&k);
    let labels = sts_pod_labels(sts);
    let container = nats_container(sts);
    let headless_name = str_at(&sts.value, &["spec", "serviceName"]).expect("serviceName");
    let headless = k
        .find("Service", NATS_NS, headless_name)
        .unwrap_or_else(|| panic!("no Service {headless_name} (the StatefulSet's serviceName)"));
    assert_eq!(
        str_at(&headless.value, &["spec", "clusterIP"]),
        Some("None"),
        "{} is headless: one DNS name per Pod",
        headless.describe()
    );
    // Routes resolve before any server is ready (a server becomes ready only in a cluster).
    assert_eq!(
        at(&headless.value, &["spec", "publishNotReadyAddresses"]).and_then(Value::as_bool),
        Some(true),
        "{} publishes Pods that are not ready",
        headless.describe()
    );
    let services: Vec<&Object> = k.of_kind("Service").collect();
    assert!(services.len() >= 2, "a headless and a client Service");
    let mut client_port = false;
    for service in services {
        let selector = string_map(at(&service.value, &["spec", "selector"]));
        assert!(
            selects(&selector, &labels),
            "{} selects the servers",
            service.describe()
        );
        for port in seq_at(&service.value, &["spec", "ports"]) {
            let target = at(port, &["targetPort"])
                .or_else(|| at(port, &["port"]))
                .expect("port");
            assert!(
                resolve_port(container, target).is_some(),
                "{}: target port {target:?} is not declared",
                service.describe()
            );
            if service.name() != headless_name
                && resolve_port(container, target) == Some(named_port(container, "client"))
            {
                client_port = true;
            }
        }
    }
    assert!(client_port, "a client Service on the client port");
}

#[test]
fn the_routes_name_exactly_the_three_pods_through_the_headless_service() {
    let k = nats();
    let sts = stateful_set(&k);
    let (_, conf) = conf(&k);
    let container = nats_container(sts);
    let headless = str_at(&sts.value, &["spec", "serviceName"]).expect("serviceName");
    assert!(
        conf.str_at(&["cluster", "name"])
            .is_some_and(|n| !n.is_empty()),
        "the cluster has a name"
    );
    let cluster_port: u64 = conf
        .str_at(&["cluster", "port"])
        .expect("cluster.port")
        .parse()
        .expect("cluster.port is a number");
    assert_eq!(cluster_port, named_port(container, "cluster"));
    let Some(Conf::List(routes)) = conf.path(&["cluster", "routes"]) else {
        panic!("cluster.routes is a list");
    };
    let mut pods = Vec::new();
    for route in routes {
        let Conf::Str(url) = route else {
            panic!("route {route:?} is not a URL");
        };
        assert!(url.starts_with("nats://"), "route {url}: nats://");
        let (host, port) = host_port(url);
        assert_eq!(
            u64::from(port),
            cluster_port,
            "route {url}: the cluster port"
        );
        let mut labels = host.split('.');
        let pod = labels.next().expect("a host").to_owned();
        let domain: Vec<&str> = labels.collect();
        assert_eq!(
            domain.first().copied(),
            Some(headless),
            "route {url}: through the headless Service {headless}"
        );
        let rest = &domain[1..];
        assert!(
            rest.is_empty()
                || rest == [NATS_NS]
                || rest == [NATS_NS, "svc"]
                || rest == [NATS_NS, "svc", "cluster", "local"],
            "route {url}: a name in the namespace {NATS_NS}"
        );
        pods.push(pod);
    }
    let expected: Vec<String> = (0..replicas(sts))
        .map(|i| format!("{}-{i}", sts.name()))
        .collect();
    pods.sort();
    assert_eq!(pods, expected, "the routes name every server once");
    // Server names are the Pod names: stable across restarts, as JetStream's placement needs.
    assert_eq!(conf.str_at(&["server_name"]), Some("$POD_NAME"));
    let env = seq_at(container, &["env"]);
    assert!(
        env.iter().any(|e| str_at(e, &["name"]) == Some("POD_NAME")
            && str_at(e, &["valueFrom", "fieldRef", "fieldPath"]) == Some("metadata.name")),
        "POD_NAME comes from the Pod's name"
    );
}

#[test]
fn jetstream_stores_on_each_servers_own_volume_with_room_for_the_streams() {
    let k = nats();
    let sts = stateful_set(&k);
    let (_, conf) = conf(&k);
    let store_dir = PathBuf::from(
        conf.str_at(&["jetstream", "store_dir"])
            .expect("jetstream.store_dir"),
    );
    let templates = seq_at(&sts.value, &["spec", "volumeClaimTemplates"]);
    assert!(
        !templates.is_empty(),
        "{}: volumeClaimTemplates (one PVC per server)",
        sts.describe()
    );
    let (volume, _) = mount_holding(nats_container(sts), &store_dir)
        .unwrap_or_else(|| panic!("store_dir {} is under no volume mount", store_dir.display()));
    let template = templates
        .iter()
        .find(|t| str_at(t, &["metadata", "name"]) == Some(volume))
        .unwrap_or_else(|| {
            panic!(
                "store_dir {} is on volume {volume}, not a volumeClaimTemplate",
                store_dir.display()
            )
        });
    assert!(
        !seq_at(sts_pod_spec(sts), &["volumes"])
            .iter()
            .any(|v| str_at(v, &["name"]) == Some(volume)),
        "a pod volume {volume} would shadow the claim"
    );
    let claim = binary_size(
        str_at(template, &["spec", "resources", "requests", "storage"]).expect("storage request"),
    );
    let max_file_store = binary_size(
        conf.str_at(&["jetstream", "max_file_store"])
            .expect("max_file_store"),
    );
    assert!(
        max_file_store < claim,
        "max_file_store ({max_file_store}) leaves headroom on the claim ({claim})"
    );
    // Every server holds a replica of each R3 stream: the streams' limits must fit on one.
    let (_, config) = base_config(&base());
    let streams = &config.nats.streams;
    let needed: u64 = [&streams.assignments, &streams.events, &streams.commands]
        .iter()
        .map(|s| s.max_bytes.get())
        .sum();
    assert!(
        needed <= max_file_store,
        "the streams may hold {needed} bytes, more than max_file_store ({max_file_store})"
    );
}

#[test]
fn the_budget_lets_one_server_go_at_a_time() {
    let k = nats();
    let sts = stateful_set(&k);
    let labels = sts_pod_labels(sts);
    let budgets: Vec<&Object> = k
        .of_kind("PodDisruptionBudget")
        .filter(|p| {
            p.namespace() == Some(NATS_NS)
                && selects(
                    &string_map(at(&p.value, &["spec", "selector", "matchLabels"])),
                    &labels,
                )
        })
        .collect();
    assert_eq!(
        budgets.len(),
        1,
        "one PodDisruptionBudget selects the servers"
    );
    let pdb = budgets[0];
    assert_eq!(
        at(&pdb.value, &["spec", "maxUnavailable"]).and_then(Value::as_u64),
        Some(1),
        "{}: one server away keeps the quorum (2 of 3)",
        pdb.describe()
    );
    assert!(
        at(&pdb.value, &["spec", "minAvailable"]).is_none(),
        "{}: maxUnavailable only",
        pdb.describe()
    );
}

#[test]
fn the_servers_go_to_different_nodes() {
    let k = nats();
    let sts = stateful_set(&k);
    let labels = sts_pod_labels(sts);
    let anti = at(sts_pod_spec(sts), &["affinity", "podAntiAffinity"])
        .unwrap_or_else(|| panic!("{}: no podAntiAffinity", sts.describe()));
    let required = seq_at(anti, &["requiredDuringSchedulingIgnoredDuringExecution"]).iter();
    let preferred = seq_at(anti, &["preferredDuringSchedulingIgnoredDuringExecution"])
        .iter()
        .filter_map(|w| at(w, &["podAffinityTerm"]));
    let by_node = required.chain(preferred).any(|term| {
        str_at(term, &["topologyKey"]) == Some("kubernetes.io/hostname")
            && selects(
                &string_map(at(term, &["labelSelector", "matchLabels"])),
                &labels,
            )
    });
    assert!(
        by_node,
        "{}: anti-affinity by kubernetes.io/hostname against its own Pods",
        sts.describe()
    );
}

#[test]
fn probes_gate_readiness_on_jetstream_and_liveness_on_the_server_alone() {
    let k = nats();
    let sts = stateful_set(&k);
    let (_, conf) = conf(&k);
    let container = nats_container(sts);
    let monitor: u64 = conf
        .str_at(&["http_port"])
        .expect("http_port (monitoring, /healthz)")
        .parse()
        .expect("http_port is a number");
    assert_eq!(named_port(container, "monitor"), monitor);
    let probe = |kind: &str| -> String {
        let probe = at(container, &[kind]).unwrap_or_else(|| panic!("no {kind}"));
        let port = at(probe, &["httpGet", "port"]).unwrap_or_else(|| panic!("{kind}: httpGet"));
        assert_eq!(
            resolve_port(container, port),
            Some(monitor),
            "{kind} asks the monitoring port"
        );
        str_at(probe, &["httpGet", "path"])
            .unwrap_or_else(|| panic!("{kind}: no path"))
            .to_owned()
    };
    let readiness = probe("readinessProbe");
    assert!(
        readiness.starts_with("/healthz") && readiness.contains("js-enabled-only=true"),
        "readiness: {readiness}"
    );
    let liveness = probe("livenessProbe");
    assert!(
        liveness.starts_with("/healthz") && liveness.contains("js-server-only=true"),
        "liveness must not restart a server for a JetStream problem: {liveness}"
    );
    let startup = probe("startupProbe");
    assert!(startup.starts_with("/healthz"), "startup: {startup}");
    let startup_probe = at(container, &["startupProbe"]).expect("startupProbe");
    let number = |key: &str, default: u64| {
        at(startup_probe, &[key])
            .and_then(Value::as_u64)
            .unwrap_or(default)
    };
    let patience = number("periodSeconds", 10) * number("failureThreshold", 3);
    assert!(
        patience >= 300,
        "the startupProbe gives a server {patience} s to catch up; at least 5 minutes"
    );
}

#[test]
fn lame_duck_mode_on_stop_fits_in_the_grace_period() {
    let k = nats();
    let sts = stateful_set(&k);
    let (_, conf) = conf(&k);
    let container = nats_container(sts);
    let pid_file = conf.str_at(&["pid_file"]).expect("pid_file");
    let command: Vec<String> = seq_at(container, &["lifecycle", "preStop", "exec", "command"])
        .iter()
        .map(|a| a.as_str().expect("strings").to_owned())
        .collect();
    assert_eq!(
        command,
        ["nats-server", "--signal", &format!("ldm={pid_file}")],
        "preStop puts the server into lame duck mode"
    );
    // The root file system is read-only: the pid file needs a writable volume.
    let (volume, _) = mount_holding(container, Path::new(pid_file))
        .unwrap_or_else(|| panic!("pid_file {pid_file} is under no volume mount"));
    assert!(
        seq_at(sts_pod_spec(sts), &["volumes"])
            .iter()
            .any(|v| str_at(v, &["name"]) == Some(volume) && at(v, &["emptyDir"]).is_some()),
        "pid_file {pid_file} is on the emptyDir {volume}"
    );
    let duration = |key: &str| {
        nats_duration(
            conf.str_at(&[key])
                .unwrap_or_else(|| panic!("{key} is set")),
        )
    };
    let lame_duck = duration("lame_duck_grace_period") + duration("lame_duck_duration");
    let grace = at(sts_pod_spec(sts), &["terminationGracePeriodSeconds"])
        .and_then(Value::as_u64)
        .expect("terminationGracePeriodSeconds");
    assert!(
        Duration::from_secs(grace) >= lame_duck + Duration::from_secs(10),
        "terminationGracePeriodSeconds {grace} must outlast lame duck mode ({lame_duck:?}) \
         with room for the shutdown"
    );
}

#[test]
fn the_config_map_holds_the_configuration_and_the_jetrunner_users() {
    let k = nats();
    let sts = stateful_set(&k);
    let (text, conf) = conf(&k);
    let files = config_files(&k);
    let mount = config_mount(sts);
    let command = command_of(nats_container(sts));
    assert_eq!(command.first().map(String::as_str), Some("nats-server"));
    assert_eq!(
        config_arg(&command).map(PathBuf::from),
        Some(mount.join(CONF_KEY)),
        "the server reads the mounted {CONF_KEY}"
    );
    // Every include is a key of the same ConfigMap; auth.conf among them.
    let auth = repo_root().join("k8s/nats/auth.conf");
    let mut includes_auth = false;
    for include in conf.includes() {
        let key = include.trim_start_matches("./");
        let source = files.get(key).unwrap_or_else(|| {
            panic!("{CONF_KEY} includes {include}, not a key of ConfigMap {CONFIG_MAP}")
        });
        if source == &auth {
            includes_auth = true;
        }
    }
    assert!(includes_auth, "{CONF_KEY} includes k8s/nats/auth.conf");
    // Every variable the files read is in the Pod's environment.
    let env = pod_env(&k, sts);
    let mut needed = env_references(&text);
    needed.extend(env_references(&read(&auth)));
    for name in &needed {
        assert!(
            env.contains_key(name),
            "the configuration reads ${name}; the nats container does not set it"
        );
    }
    assert!(
        needed
            .iter()
            .filter(|n| n.starts_with("JETRUNNER_"))
            .count()
            == SERVICES.len(),
        "one password per service: {needed:?}"
    );
    assert!(
        k.find("Secret", NATS_NS, USERS_SECRET).is_some(),
        "k8s/nats ships the Secret {USERS_SECRET}"
    );
}

#[test]
fn nats_server_accepts_the_configuration_with_the_pods_environment() {
    let k = nats();
    let sts = stateful_set(&k);
    let (text, _) = conf(&k);
    let dir = std::env::temp_dir().join(format!(
        "jr-nats-conf-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time")
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (key, source) in config_files(&k) {
        std::fs::copy(&source, dir.join(&key)).expect("copying the ConfigMap's files");
    }
    let env = pod_env(&k, sts);
    let mut command = Command::new(nats_server_binary());
    command.arg("-t").arg("-c").arg(dir.join(CONF_KEY));
    // Only the Pod's environment may satisfy the configuration's variables.
    let mut referenced = env_references(&text);
    referenced.extend(env_references(&read(
        &repo_root().join("k8s/nats/auth.conf"),
    )));
    for name in referenced {
        command.env_remove(name);
    }
    command.envs(&env);
    let output = command.output().unwrap_or_else(|e| {
        panic!(
            "running {} (install nats-server >= 2.10, see scripts/lib.sh, or set \
             NATS_SERVER_BIN): {e}",
            nats_server_binary().display()
        )
    });
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        output.status.success(),
        "nats-server -t refuses {CONF_KEY}:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn jetrunner_connects_to_every_server_and_creates_r3_streams() {
    let k = nats();
    let sts = stateful_set(&k);
    let headless = str_at(&sts.value, &["spec", "serviceName"]).expect("serviceName");
    let client = named_port(nats_container(sts), "client");
    let (file, config) = base_config(&base());
    // Split as the services do.
    let urls = jr_bus::server_urls(&config.nats.url);
    assert_eq!(
        urls.len(),
        3,
        "{}: nats.url lists the three servers: {}",
        file.display(),
        config.nats.url
    );
    let mut pods = Vec::new();
    for url in urls {
        assert!(url.starts_with("nats://"), "{url}");
        let (host, port) = host_port(url);
        assert_eq!(u64::from(port), client, "{url}: the client port");
        let (pod, domain) = host
            .split_once('.')
            .unwrap_or_else(|| panic!("{url}: a Pod's DNS name"));
        assert!(
            domain == format!("{headless}.{NATS_NS}.svc.cluster.local")
                || domain == format!("{headless}.{NATS_NS}.svc"),
            "{url}: a Pod behind {headless} in the namespace {NATS_NS}"
        );
        pods.push(pod.to_owned());
    }
    pods.sort();
    let expected: Vec<String> = (0..replicas(sts))
        .map(|i| format!("{}-{i}", sts.name()))
        .collect();
    assert_eq!(pods, expected, "nats.url names every server once");
    assert_eq!(
        config.nats.stream_replicas,
        3,
        "{}: stream_replicas = 3",
        file.display()
    );
    assert!(config.nats.stream_replicas as u64 <= replicas(sts));
}

// ---------------------------------------------------------------------------------------------
// NetworkPolicy: which Pods may open a connection to a server's port.

/// A Pod that might connect: its namespace (with that namespace's labels) and its labels.
struct Source {
    namespace: String,
    namespace_labels: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
}

fn matches_selector(selector: &Value, labels: &BTreeMap<String, String>) -> bool {
    assert!(
        at(selector, &["matchExpressions"]).is_none(),
        "matchExpressions are not evaluated here; use matchLabels"
    );
    string_map(at(selector, &["matchLabels"]))
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
}

fn ingress_policies<'a>(
    policies: &'a [Object],
    target: &'a BTreeMap<String, String>,
) -> impl Iterator<Item = &'a Object> + 'a {
    policies.iter().filter(move |p| {
        let types = seq_at(&p.value, &["spec", "policyTypes"]);
        let ingress = types.is_empty() || types.iter().any(|t| t.as_str() == Some("Ingress"));
        p.namespace() == Some(NATS_NS)
            && ingress
            && at(&p.value, &["spec", "podSelector"]).is_some_and(|s| matches_selector(s, target))
    })
}

/// Whether the policies let `source` connect to `port` of a server Pod.
fn admitted(
    policies: &[Object],
    container: &Value,
    target: &BTreeMap<String, String>,
    port: u64,
    source: &Source,
) -> bool {
    let isolated = ingress_policies(policies, target).next().is_some();
    if !isolated {
        return true;
    }
    ingress_policies(policies, target).any(|policy| {
        seq_at(&policy.value, &["spec", "ingress"])
            .iter()
            .any(|rule| {
                let ports = seq_at(rule, &["ports"]);
                let port_ok = ports.is_empty()
                    || ports.iter().any(|p| {
                        str_at(p, &["protocol"]).is_none_or(|proto| proto == "TCP")
                            && at(p, &["port"])
                                .is_none_or(|v| resolve_port(container, v) == Some(port))
                    });
                let from = seq_at(rule, &["from"]);
                let from_ok = from.is_empty()
                    || from.iter().any(|peer| {
                        if at(peer, &["ipBlock"]).is_some() {
                            return false;
                        }
                        let namespace_ok = match at(peer, &["namespaceSelector"]) {
                            Some(selector) => matches_selector(selector, &source.namespace_labels),
                            None => source.namespace == NATS_NS,
                        };
                        let pod_ok = at(peer, &["podSelector"])
                            .is_none_or(|selector| matches_selector(selector, &source.labels));
                        namespace_ok && pod_ok
                    });
                port_ok && from_ok
            })
    })
}

fn namespace_labels(objects: &[&Object], name: &str) -> BTreeMap<String, String> {
    let mut labels = objects
        .iter()
        .find(|o| o.kind() == "Namespace" && o.name() == name)
        .map(|ns| string_map(at(&ns.value, &["metadata", "labels"])))
        .unwrap_or_default();
    labels.insert("kubernetes.io/metadata.name".into(), name.into());
    labels
}

#[test]
fn network_policies_admit_routes_between_servers_and_clients_from_the_services_only() {
    let k = nats();
    let base = base();
    let sts = stateful_set(&k);
    let container = nats_container(sts);
    let target = sts_pod_labels(sts);
    let policies: Vec<Object> = k.of_kind("NetworkPolicy").cloned().collect();
    let namespaces: Vec<&Object> = k.objects.iter().chain(base.objects.iter()).collect();
    let client = named_port(container, "client");
    let cluster = named_port(container, "cluster");
    let monitor = named_port(container, "monitor");

    assert!(
        ingress_policies(&policies, &target).next().is_some(),
        "the servers are isolated for ingress (else executor Pods could reach them)"
    );
    let server = Source {
        namespace: NATS_NS.into(),
        namespace_labels: namespace_labels(&namespaces, NATS_NS),
        labels: target.clone(),
    };
    assert!(
        admitted(&policies, container, &target, cluster, &server),
        "routes: the servers reach each other on {cluster}"
    );
    for deployment in base.of_kind("Deployment") {
        let service = Source {
            namespace: NS.into(),
            namespace_labels: namespace_labels(&namespaces, NS),
            labels: pod_labels(deployment),
        };
        assert!(
            admitted(&policies, container, &target, client, &service),
            "{} reaches the servers on {client}",
            deployment.describe()
        );
        assert!(
            !admitted(&policies, container, &target, cluster, &service),
            "{} must not join the cluster port {cluster}",
            deployment.describe()
        );
    }
    // Executor Pods run untrusted workflow code.
    let executor = yaml_docs(&repo_root().join("k8s/executor-pod-template.yaml"))
        .into_iter()
        .find(|d| str_at(d, &["kind"]) == Some("Pod"))
        .expect("the executor Pod");
    let executor = Source {
        namespace: JOBS_NS.into(),
        namespace_labels: namespace_labels(&namespaces, JOBS_NS),
        labels: string_map(at(&executor, &["metadata", "labels"])),
    };
    let stranger = Source {
        namespace: "default".into(),
        namespace_labels: namespace_labels(&namespaces, "default"),
        labels: BTreeMap::new(),
    };
    for port in [client, cluster, monitor] {
        assert!(
            !admitted(&policies, container, &target, port, &executor),
            "executor Pods must not reach the servers' port {port}"
        );
        assert!(
            !admitted(&policies, container, &target, port, &stranger),
            "a Pod of another namespace must not reach the servers' port {port}"
        );
    }
}

#[test]
fn the_services_may_connect_out_to_nats() {
    // Egress from the services' namespace is open in k8s/base; if a policy ever restricts it,
    // it must still let the services reach the client port in the namespace `nats`.
    let base = base();
    let k = nats();
    let client = named_port(nats_container(stateful_set(&k)), "client");
    for deployment in base.of_kind("Deployment") {
        let labels = pod_labels(deployment);
        let egress: Vec<&Object> = base
            .of_kind("NetworkPolicy")
            .filter(|p| {
                p.namespace() == Some(NS)
                    && seq_at(&p.value, &["spec", "policyTypes"])
                        .iter()
                        .any(|t| t.as_str() == Some("Egress"))
                    && at(&p.value, &["spec", "podSelector"])
                        .is_some_and(|s| matches_selector(s, &labels))
            })
            .collect();
        if egress.is_empty() {
            continue;
        }
        let reaches = egress.iter().any(|p| {
            seq_at(&p.value, &["spec", "egress"]).iter().any(|rule| {
                let ports = seq_at(rule, &["ports"]);
                let to = seq_at(rule, &["to"]);
                (ports.is_empty()
                    || ports
                        .iter()
                        .any(|p| at(p, &["port"]).and_then(Value::as_u64) == Some(client)))
                    && (to.is_empty()
                        || to.iter().any(|peer| {
                            str_at(
                                peer,
                                &[
                                    "namespaceSelector",
                                    "matchLabels",
                                    "kubernetes.io/metadata.name",
                                ],
                            ) == Some(NATS_NS)
                        }))
            })
        });
        assert!(
            reaches,
            "{}: egress is restricted but not to NATS ({NATS_NS}, port {client})",
            deployment.describe()
        );
    }
}

#[test]
fn the_helm_values_describe_the_same_cluster() {
    let path = repo_root().join("k8s/nats/helm-values.yaml");
    let values = yaml_docs(&path).into_iter().next().expect("helm values");
    let k = nats();
    let sts = stateful_set(&k);
    let (_, conf) = conf(&k);
    let container = nats_container(sts);
    assert_eq!(
        at(&values, &["config", "cluster", "enabled"]).and_then(Value::as_bool),
        Some(true)
    );
    assert_eq!(
        at(&values, &["config", "cluster", "replicas"]).and_then(Value::as_u64),
        Some(replicas(sts))
    );
    assert_eq!(
        str_at(&values, &["config", "cluster", "merge", "name"]),
        conf.str_at(&["cluster", "name"]),
        "the same cluster name"
    );
    assert_eq!(
        at(&values, &["config", "jetstream", "enabled"]).and_then(Value::as_bool),
        Some(true)
    );
    let file_store = at(&values, &["config", "jetstream", "fileStore"]).expect("fileStore");
    assert_eq!(
        str_at(file_store, &["dir"]),
        conf.str_at(&["jetstream", "store_dir"])
    );
    let claim = seq_at(&sts.value, &["spec", "volumeClaimTemplates"])
        .first()
        .and_then(|t| str_at(t, &["spec", "resources", "requests", "storage"]))
        .expect("a claim");
    assert_eq!(
        str_at(file_store, &["pvc", "size"]).map(binary_size),
        Some(binary_size(claim))
    );
    assert_eq!(
        str_at(file_store, &["maxSize"]).map(binary_size),
        conf.str_at(&["jetstream", "max_file_store"])
            .map(binary_size)
    );
    let image = str_at(container, &["image"]).expect("image");
    assert_eq!(
        format!(
            "{}:{}",
            str_at(&values, &["container", "image", "repository"]).unwrap_or("?"),
            str_at(&values, &["container", "image", "tag"]).unwrap_or("?")
        ),
        image,
        "the same server version"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(
            str_at(&values, &["container", "merge", probe, "httpGet", "path"]),
            str_at(container, &[probe, "httpGet", "path"]),
            "{probe}"
        );
    }
    assert_eq!(
        str_at(&values, &["config", "merge", "$include"]).map(|p| p.rsplit('/').next()),
        Some(conf.includes().first().map(|p| p.trim_start_matches("./"))),
        "the same jetrunner users file"
    );
}
