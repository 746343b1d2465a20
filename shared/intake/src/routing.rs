//! Which backend runs a job: the job's `runs-on` labels against the configured rules.

use jr_config::Config;
use jr_placement::{ForgeContext, TrustLevel, TrustPolicy};
use jr_protocol::BackendName;

/// Which enabled backend may run a job, decided the way the forge matches jobs to runners: a
/// backend is a candidate only if **all** the job's `runs-on` labels are among its declared
/// labels. Routing rules (in order) and `default_backend` only choose among candidates.
#[derive(Clone, Debug)]
pub struct Router {
    /// Enabled backends with their declared labels, in name order.
    backends: Vec<(BackendName, Vec<String>)>,
    rules: Vec<(String, BackendName)>,
    default: Option<BackendName>,
    /// Every label some enabled backend declares (for `Declare` and error messages).
    declared: Vec<String>,
    /// Trust level of each enabled backend, in name order.
    trust: Vec<(BackendName, TrustLevel)>,
    /// `[routing.trust]`.
    policy: TrustPolicy,
}

/// Where a job runs and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    pub backend: BackendName,
    /// The trust decision, recorded on the assignment.
    pub reason: String,
}

/// Why a job cannot be placed; reported to the forge as the job's failure.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlaceError {
    #[error(transparent)]
    NoRoute(#[from] NoRoute),
    #[error("jetrunner may not run this job on any enabled backend: {0}")]
    NotAllowed(String),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "no enabled jetrunner backend declares all of runs-on {labels:?} (declared: {declared:?}); \
     change the job's runs-on or enable a backend for it"
)]
pub struct NoRoute {
    pub labels: Vec<String>,
    pub declared: Vec<String>,
}

impl Router {
    pub fn from_config(config: &Config) -> Self {
        let backends: Vec<(BackendName, Vec<String>)> = config
            .enabled_backends()
            .map(|(n, b)| {
                let labels = b.declared_labels(n.as_str());
                (n, labels)
            })
            .collect();
        let find = |name: &str| backends.iter().find(|(b, _)| b.as_str() == name);
        let rules = config
            .routing
            .rules
            .iter()
            .filter_map(|r| find(&r.backend).map(|(b, _)| (r.label.clone(), b.clone())))
            .collect();
        let default = config
            .routing
            .default_backend
            .as_deref()
            .and_then(find)
            .map(|(b, _)| b.clone());
        let trust = config
            .enabled_backends()
            .map(|(n, b)| (n, b.trust_level()))
            .collect();
        Self::assemble(
            backends,
            rules,
            default,
            trust,
            config.routing.trust.policy(),
        )
    }

    /// Labels-only routing over `backends` (every one trusted, the default trust policy): the
    /// rules and the default as configured, for tests of what depends on routing alone.
    pub fn from_parts(
        backends: Vec<(BackendName, Vec<String>)>,
        rules: Vec<(String, BackendName)>,
        default: Option<BackendName>,
    ) -> Self {
        let trust = backends
            .iter()
            .map(|(b, _)| (b.clone(), TrustLevel::Trusted))
            .collect();
        let policy = jr_config::TrustConfig::default().policy();
        Self::assemble(backends, rules, default, trust, policy)
    }

    fn assemble(
        backends: Vec<(BackendName, Vec<String>)>,
        rules: Vec<(String, BackendName)>,
        default: Option<BackendName>,
        trust: Vec<(BackendName, TrustLevel)>,
        policy: TrustPolicy,
    ) -> Self {
        let mut declared: Vec<String> = backends.iter().flat_map(|(_, l)| l.clone()).collect();
        declared.sort();
        declared.dedup();
        Self {
            backends,
            rules,
            default,
            declared,
            trust,
            policy,
        }
    }

    /// Enabled backends with the labels each declares, in name order.
    pub fn backends(&self) -> &[(BackendName, Vec<String>)] {
        &self.backends
    }

    /// Labels to `Declare` for one shared registration: the union over enabled backends.
    pub fn declared_labels(&self) -> &[String] {
        &self.declared
    }

    /// Labels one backend's own registration declares.
    pub fn labels_of(&self, backend: &BackendName) -> &[String] {
        self.backends
            .iter()
            .find(|(b, _)| b == backend)
            .map(|(_, l)| l.as_slice())
            .unwrap_or_default()
    }

    fn serves(declared: &[String], labels: &[String]) -> bool {
        labels.iter().all(|l| declared.contains(l))
    }

    fn no_route(&self, labels: &[String]) -> NoRoute {
        NoRoute {
            labels: labels.to_vec(),
            declared: self.declared.clone(),
        }
    }

    /// A job fetched under one shared registration: among the backends declaring all its
    /// labels, the first rule naming one of the job's labels wins, then `default_backend`,
    /// then the first candidate by name.
    pub fn route(&self, labels: &[String]) -> Result<BackendName, NoRoute> {
        self.candidates(labels)
            .into_iter()
            .next()
            .ok_or_else(|| self.no_route(labels))
    }

    /// The backends declaring all of `labels`, most preferred first (rule, default, name).
    fn candidates(&self, labels: &[String]) -> Vec<BackendName> {
        let serving: Vec<&BackendName> = self
            .backends
            .iter()
            .filter(|(_, declared)| Self::serves(declared, labels))
            .map(|(b, _)| b)
            .collect();
        let by_rule = self
            .rules
            .iter()
            .find(|(label, b)| labels.contains(label) && serving.contains(&b))
            .map(|(_, b)| b);
        let by_default = self.default.as_ref().filter(|d| serving.contains(d));
        let mut ordered: Vec<BackendName> = Vec::with_capacity(serving.len());
        for b in by_rule.into_iter().chain(by_default).chain(serving) {
            if !ordered.contains(b) {
                ordered.push(b.clone());
            }
        }
        ordered
    }

    fn trust_of(&self, backends: &[BackendName]) -> Vec<(String, TrustLevel)> {
        backends
            .iter()
            .filter_map(|b| {
                self.trust
                    .iter()
                    .find(|(n, _)| n == b)
                    .map(|(n, t)| (n.to_string(), *t))
            })
            .collect()
    }

    /// Chooses the backend of a job from its `runs-on` labels and its forge context: the
    /// context decides the most trusted level the job may use (a fork's pull request is at most
    /// `untrusted`), and `runs-on` can only pick among backends at or below it. A job that asks
    /// for a more trusted backend than it may use runs on the most trusted one it may use.
    /// `own`: the registration that fetched the job belongs to this backend, which then is the
    /// only backend it can run on; a job that may not use it is refused with the reason (and
    /// the labels that would place it), never run there.
    pub fn place(
        &self,
        own: Option<&BackendName>,
        labels: &[String],
        context: &ForgeContext,
    ) -> Result<Placed, PlaceError> {
        self.place_preferring(own, labels, context, &[])
    }

    /// [`Router::place`], where a job without `runs-on` labels (which the forge hands to any
    /// runner, whatever it declared) prefers the backends in `taking` (those taking work now),
    /// in routing order: a shared registration never sends it to a backend it withdrew.
    pub fn place_preferring(
        &self,
        own: Option<&BackendName>,
        labels: &[String],
        context: &ForgeContext,
        taking: &[BackendName],
    ) -> Result<Placed, PlaceError> {
        let candidates = match own {
            Some(own) => vec![self.route_fetched(own, labels)?],
            None => {
                let mut c = self.candidates(labels);
                if c.is_empty() {
                    return Err(self.no_route(labels).into());
                }
                if labels.is_empty() {
                    // Stable: routing order within each group.
                    c.sort_by_key(|b| !taking.contains(b));
                }
                c
            }
        };
        let all: Vec<BackendName> = self.trust.iter().map(|(b, _)| b.clone()).collect();
        let decision = jr_placement::decide(
            &self.policy,
            context,
            &self.trust_of(&candidates),
            &self.trust_of(&all),
        )
        .map_err(|e| PlaceError::NotAllowed(e.to_string()))?;
        let backend = BackendName::new(&decision.backend)
            .map_err(|e| PlaceError::NotAllowed(e.to_string()))?;
        if let Some(own) = own
            && *own != backend
        {
            // The task belongs to `own`'s runner at the forge; only that runner can report it,
            // so it cannot move to another backend's registration.
            return Err(PlaceError::NotAllowed(format!(
                "{}; the runner of backend {own} took it, and it may run only on {backend}: \
                 ask for runs-on {:?}",
                decision.reason,
                self.labels_of(&backend)
            )));
        }
        Ok(Placed {
            backend,
            reason: decision.reason,
        })
    }

    /// A job fetched by `backend`'s own registration runs there (the task belongs to that
    /// runner at the forge); the forge only hands out jobs whose labels the runner declared,
    /// and this checks it.
    pub fn route_fetched(
        &self,
        backend: &BackendName,
        labels: &[String],
    ) -> Result<BackendName, NoRoute> {
        if Self::serves(self.labels_of(backend), labels) {
            Ok(backend.clone())
        } else {
            Err(self.no_route(labels))
        }
    }
}

/// The trust-relevant facts of a forge task, read from its context (what the forge itself
/// says, not anything the workflow author wrote). A pull request event counts as fork code
/// unless its payload shows the head repository is the base repository and not a fork; a
/// payload without that information counts as a fork.
pub fn forge_context(context: Option<&prost_types::Struct>) -> ForgeContext {
    use prost_types::value::Kind;
    fn field<'a>(s: Option<&'a prost_types::Struct>, key: &str) -> Option<&'a Kind> {
        s?.fields.get(key)?.kind.as_ref()
    }
    fn text(s: Option<&prost_types::Struct>, key: &str) -> String {
        match field(s, key) {
            Some(Kind::StringValue(v)) => v.clone(),
            _ => String::new(),
        }
    }
    fn object<'a>(
        s: Option<&'a prost_types::Struct>,
        key: &str,
    ) -> Option<&'a prost_types::Struct> {
        match field(s, key) {
            Some(Kind::StructValue(v)) => Some(v),
            _ => None,
        }
    }
    let event_name = text(context, "event_name");
    let head_is_fork = event_name.starts_with("pull_request") && {
        let pr = object(object(context, "event"), "pull_request");
        let repo_of = |side: &str| object(object(pr, side), "repo");
        let head = repo_of("head");
        let base = repo_of("base");
        let marked_fork = matches!(field(head, "fork"), Some(Kind::BoolValue(true)));
        let head_name = text(head, "full_name");
        let base_name = text(base, "full_name");
        marked_fork || head_name.is_empty() || !head_name.eq_ignore_ascii_case(&base_name)
    };
    ForgeContext {
        repository: text(context, "repository"),
        owner: text(context, "repository_owner"),
        event: event_name,
        head_is_fork,
        actor: text(context, "actor"),
    }
}

/// The routing-relevant facts of a forge task, read from its single-job workflow payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFacts {
    pub job_name: String,
    pub runs_on: Vec<String>,
}

/// Reads `jobs.<id>.runs-on` (a string, a list, or the mapping form `{group, labels}`, whose
/// `labels` is a string or a list; the group is a runner-group name the forge matches, not a
/// label) and the job id from the workflow YAML. Malformed payloads give empty facts: routing
/// then reports a clear failure to the forge.
pub fn job_facts(workflow_payload: Option<&[u8]>) -> JobFacts {
    let Some(bytes) = workflow_payload else {
        return JobFacts::default();
    };
    let Ok(doc) = serde_yaml::from_slice::<serde_yaml::Value>(bytes) else {
        return JobFacts::default();
    };
    let Some((name, job)) = doc
        .get("jobs")
        .and_then(|j| j.as_mapping())
        .and_then(|m| m.iter().next())
    else {
        return JobFacts::default();
    };
    fn labels(value: Option<&serde_yaml::Value>) -> Vec<String> {
        match value {
            Some(serde_yaml::Value::String(s)) => vec![s.clone()],
            Some(serde_yaml::Value::Sequence(items)) => items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
            Some(serde_yaml::Value::Mapping(m)) => labels(m.get("labels")),
            _ => Vec::new(),
        }
    }
    JobFacts {
        job_name: name.as_str().unwrap_or_default().to_owned(),
        runs_on: labels(job.get("runs-on")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod and a vm backend with routing rules; `extra` continues the `[backend.vm]` table.
    pub(super) fn config(extra: &str) -> Config {
        let text = format!(
            r#"
[nats]
url = "nats://x:4222"
[forge]
url = "http://f"
registration_token = "t"
[facade]
listen = "127.0.0.1:1"
public_url = "http://x"
insecure_plain_http = true
[[routing.rules]]
label = "vm"
backend = "vm"
[[routing.rules]]
label = "pod"
backend = "pod"
[backend.pod]
kind = "pod"
capacity = 2
labels = ["pod", "self-hosted"]
kubernetes = {{ namespace = "j" }}
[backend.vm]
kind = "vm"
capacity = 2
opensandbox = {{ url = "http://o" }}
{extra}
"#
        );
        jr_config::load_str(&text, "t", std::iter::empty()).expect("valid config")
    }

    fn labels(l: &[&str]) -> Vec<String> {
        l.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_backend_serves_a_job_only_if_it_declares_all_its_labels() {
        let r = Router::from_config(&config(""));
        // `vm` declares only "vm": a job asking for [self-hosted, vm] fits no backend.
        assert!(r.route(&labels(&["self-hosted", "vm"])).is_err());
        assert_eq!(
            r.route(&labels(&["pod", "self-hosted"]))
                .map(|b| b.to_string()),
            Ok("pod".into())
        );
        assert_eq!(
            r.route(&labels(&["vm"])).map(|b| b.to_string()),
            Ok("vm".into())
        );
        assert_eq!(r.declared_labels(), labels(&["pod", "self-hosted", "vm"]));
    }

    #[test]
    fn rules_and_default_only_choose_among_backends_that_serve_the_job() {
        // Both backends declare "self-hosted"; a rule naming it picks vm.
        let both = "[routing]\ndefault_backend = \"pod\"\n";
        let text = both.to_owned();
        let mut cfg = config(&text);
        if let Some(vm) = cfg.backend.get_mut("vm") {
            vm.labels = labels(&["vm", "self-hosted"]);
        }
        cfg.routing.rules.insert(
            0,
            jr_config::RoutingRule {
                label: "self-hosted".into(),
                backend: "vm".into(),
            },
        );
        let r = Router::from_config(&cfg);
        assert_eq!(
            r.route(&labels(&["self-hosted"])).map(|b| b.to_string()),
            Ok("vm".into())
        );
        // The rule names "self-hosted", but vm does not declare "pod": pod is the only candidate.
        assert_eq!(
            r.route(&labels(&["self-hosted", "pod"]))
                .map(|b| b.to_string()),
            Ok("pod".into())
        );
        // An empty runs-on fits every runner: no rule label matches, the default decides.
        assert_eq!(r.route(&[]).map(|b| b.to_string()), Ok("pod".into()));
        // ... unless the default takes no work now: then the first backend that does.
        let vm = BackendName::new("vm").expect("name");
        let placed = r
            .place_preferring(None, &[], &forge_context(None), std::slice::from_ref(&vm))
            .expect("placed");
        assert_eq!(placed.backend, vm);
        let placed = r
            .place_preferring(None, &[], &forge_context(None), &[])
            .expect("placed");
        assert_eq!(placed.backend.as_str(), "pod");
    }

    #[test]
    fn a_job_fetched_by_a_backend_registration_stays_there_if_it_fits() {
        let r = Router::from_config(&config(""));
        let vm = BackendName::new("vm".to_owned()).expect("valid name");
        assert_eq!(r.route_fetched(&vm, &labels(&["vm"])), Ok(vm.clone()));
        assert!(r.route_fetched(&vm, &labels(&["vm", "gpu"])).is_err());
        assert_eq!(r.labels_of(&vm), labels(&["vm"]));
    }

    #[test]
    fn unmatched_labels_name_what_is_served() {
        let r = Router::from_config(&config(""));
        let err = r.route(&labels(&["gpu"])).expect_err("no route");
        assert!(err.to_string().contains("gpu") && err.to_string().contains("vm"));
    }

    #[test]
    fn disabled_backends_are_not_routed_to() {
        let cfg = config("").clone();
        let mut cfg = cfg;
        if let Some(vm) = cfg.backend.get_mut("vm") {
            vm.enabled = false;
        }
        let r = Router::from_config(&cfg);
        assert!(r.route(&labels(&["vm"])).is_err());
    }

    #[test]
    fn runs_on_is_read_as_string_or_list() {
        let one = job_facts(Some(
            b"name: w\non: push\njobs:\n  build:\n    runs-on: vm\n    steps: []\n",
        ));
        assert_eq!(
            one,
            JobFacts {
                job_name: "build".into(),
                runs_on: labels(&["vm"])
            }
        );
        let many = job_facts(Some(b"jobs:\n  t:\n    runs-on: [pod, self-hosted]\n"));
        assert_eq!(many.runs_on, labels(&["pod", "self-hosted"]));
        let mapping = job_facts(Some(
            b"jobs:\n  t:\n    runs-on:\n      group: ci\n      labels: [pod, linux]\n",
        ));
        assert_eq!(mapping.runs_on, labels(&["pod", "linux"]));
        let mapping_one = job_facts(Some(b"jobs:\n  t:\n    runs-on: {group: ci, labels: vm}\n"));
        assert_eq!(mapping_one.runs_on, labels(&["vm"]));
        assert_eq!(job_facts(Some(b"\x00not yaml: [")), JobFacts::default());
        assert_eq!(job_facts(None), JobFacts::default());
    }
}

#[cfg(test)]
mod trust_tests {
    use super::*;
    use prost_types::value::Kind;
    use prost_types::{Struct, Value};

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.to_owned())),
        }
    }

    fn object(fields: Vec<(&str, Value)>) -> Value {
        Value {
            kind: Some(Kind::StructValue(Struct {
                fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            })),
        }
    }

    /// A forge context for `event` on acme/widgets; `head` is the pull request's head
    /// repository (name, fork flag) when the event carries one.
    fn context(event: &str, head: Option<(&str, bool)>) -> Struct {
        let mut event_payload = vec![];
        if let Some((name, fork)) = head {
            let repo = |n: &str, f: bool| {
                object(vec![(
                    "repo",
                    object(vec![
                        ("full_name", text(n)),
                        (
                            "fork",
                            Value {
                                kind: Some(Kind::BoolValue(f)),
                            },
                        ),
                    ]),
                )])
            };
            event_payload.push((
                "pull_request",
                object(vec![
                    ("head", repo(name, fork)),
                    ("base", repo("acme/widgets", false)),
                ]),
            ));
        }
        Struct {
            fields: [
                ("event_name", text(event)),
                ("repository", text("acme/widgets")),
                ("repository_owner", text("acme")),
                ("actor", text("someone")),
                ("event", object(event_payload)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        }
    }

    #[test]
    fn fork_code_is_recognised_from_the_forge_context() {
        let fork = |event, head| forge_context(Some(&context(event, head))).head_is_fork;
        assert!(!fork("push", None));
        assert!(fork("pull_request", Some(("mallory/widgets", true))));
        assert!(fork(
            "pull_request_target",
            Some(("mallory/widgets", false))
        ));
        assert!(!fork("pull_request", Some(("acme/widgets", false))));
        // A pull request whose payload does not say where its head lives counts as a fork.
        assert!(fork("pull_request", None));
        assert!(!forge_context(None).head_is_fork);
        let ctx = forge_context(Some(&context("push", None)));
        assert_eq!(
            (
                ctx.repository.as_str(),
                ctx.owner.as_str(),
                ctx.actor.as_str()
            ),
            ("acme/widgets", "acme", "someone")
        );
    }

    /// The routing tests' configuration; `vm_extra` continues `[backend.vm]`, `extra` follows.
    fn router_with(vm_extra: &str, extra: &str) -> Router {
        Router::from_config(&super::tests::config(&format!("{vm_extra}\n{extra}")))
    }

    fn router(extra: &str) -> Router {
        router_with("", extra)
    }

    #[test]
    fn a_fork_pull_request_asking_for_a_pod_runs_on_the_vm_backend() {
        let r = router("");
        let pod = labels(&["pod"]);
        let fork = forge_context(Some(&context(
            "pull_request",
            Some(("mallory/widgets", true)),
        )));
        let placed = r.place(None, &pod, &fork).expect("placed");
        assert_eq!(placed.backend.as_str(), "vm");
        assert!(placed.reason.contains("fork"), "{}", placed.reason);
        // The same labels from a push of the repository itself run where they asked.
        let push = forge_context(Some(&context("push", None)));
        assert_eq!(
            r.place(None, &pod, &push).expect("placed").backend.as_str(),
            "pod"
        );
        // Fetched by the pod backend's own runner: refused (never on a Pod), with the labels
        // that would place it.
        let own = BackendName::new("pod").expect("name");
        match r.place(Some(&own), &pod, &fork) {
            Err(PlaceError::NotAllowed(why)) => {
                assert!(why.contains("fork") && why.contains("\"vm\""), "{why}")
            }
            other => panic!("refused, got {other:?}"),
        }
        let vm = BackendName::new("vm").expect("name");
        assert_eq!(
            r.place(Some(&vm), &labels(&["vm"]), &fork)
                .expect("placed")
                .backend
                .as_str(),
            "vm"
        );
    }

    #[test]
    fn trust_rules_and_backend_levels_come_from_the_config() {
        // Every repository of owner `outside` is untrusted.
        let r = router(
            r#"
[[routing.trust.rules]]
matcher = { owner = "outside" }
max_trust = "untrusted"
"#,
        );
        let mut ctx = forge_context(Some(&context("push", None)));
        ctx.owner = "outside".into();
        assert_eq!(
            r.place(None, &labels(&["pod"]), &ctx)
                .expect("placed")
                .backend
                .as_str(),
            "vm"
        );
        // With no untrusted backend, such a job is refused with the reason.
        let only_trusted = router_with(
            "trust = \"trusted\"",
            r#"
[[routing.trust.rules]]
matcher = { owner = "outside" }
max_trust = "untrusted"
"#,
        );
        let err = only_trusted
            .place(None, &labels(&["pod"]), &ctx)
            .expect_err("no backend allowed");
        assert!(matches!(err, PlaceError::NotAllowed(_)), "{err}");
    }

    fn labels(l: &[&str]) -> Vec<String> {
        l.iter().map(|s| s.to_string()).collect()
    }
}
