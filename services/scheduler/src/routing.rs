//! Which backend runs a job: the job's `runs-on` labels against the configured rules.

use jr_config::Config;
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
        let mut declared: Vec<String> = backends.iter().flat_map(|(_, l)| l.clone()).collect();
        declared.sort();
        declared.dedup();
        Self {
            backends,
            rules,
            default,
            declared,
        }
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
        let candidates: Vec<&BackendName> = self
            .backends
            .iter()
            .filter(|(_, declared)| Self::serves(declared, labels))
            .map(|(b, _)| b)
            .collect();
        let by_rule = self
            .rules
            .iter()
            .find(|(label, b)| labels.contains(label) && candidates.contains(&b))
            .map(|(_, b)| b);
        let by_default = self.default.as_ref().filter(|d| candidates.contains(d));
        by_rule
            .or(by_default)
            .or(candidates.first().copied())
            .cloned()
            .ok_or_else(|| self.no_route(labels))
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

    fn config(extra: &str) -> Config {
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
