//! Which backend runs a job: the job's `runs-on` labels against the configured rules.

use jr_config::Config;
use jr_protocol::BackendName;

/// Routing rules in evaluation order, restricted to enabled backends.
#[derive(Clone, Debug)]
pub struct Router {
    rules: Vec<(String, BackendName)>,
    default: Option<BackendName>,
    /// Every label some enabled backend declares (for error messages).
    declared: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "no enabled jetrunner backend serves runs-on {labels:?} (rules match on {declared:?}); \
     change the job's runs-on or enable a backend for it"
)]
pub struct NoRoute {
    pub labels: Vec<String>,
    pub declared: Vec<String>,
}

impl Router {
    pub fn from_config(config: &Config) -> Self {
        let enabled: Vec<BackendName> = config.enabled_backends().map(|(n, _)| n).collect();
        let rules = config
            .routing
            .rules
            .iter()
            .filter_map(|r| {
                enabled
                    .iter()
                    .find(|b| b.as_str() == r.backend)
                    .map(|b| (r.label.clone(), b.clone()))
            })
            .collect();
        let default = config
            .routing
            .default_backend
            .as_ref()
            .and_then(|d| enabled.iter().find(|b| b.as_str() == d).cloned());
        let mut declared: Vec<String> = config
            .enabled_backends()
            .flat_map(|(n, b)| b.declared_labels(n.as_str()))
            .collect();
        declared.sort();
        declared.dedup();
        Self {
            rules,
            default,
            declared,
        }
    }

    /// Labels to `Declare` to the forge: the union over enabled backends.
    pub fn declared_labels(&self) -> &[String] {
        &self.declared
    }

    pub fn route(&self, labels: &[String]) -> Result<BackendName, NoRoute> {
        self.rules
            .iter()
            .find(|(label, _)| labels.iter().any(|l| l == label))
            .map(|(_, b)| b.clone())
            .or_else(|| self.default.clone())
            .ok_or_else(|| NoRoute {
                labels: labels.to_vec(),
                declared: self.declared.clone(),
            })
    }
}

/// The routing-relevant facts of a forge task, read from its single-job workflow payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFacts {
    pub job_name: String,
    pub runs_on: Vec<String>,
}

/// Reads `jobs.<id>.runs-on` (a string or a list) and the job id from the workflow YAML.
/// Malformed payloads give empty facts: routing then reports a clear failure to the forge.
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
    let runs_on = match job.get("runs-on") {
        Some(serde_yaml::Value::String(s)) => vec![s.clone()],
        Some(serde_yaml::Value::Sequence(items)) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    };
    JobFacts {
        job_name: name.as_str().unwrap_or_default().to_owned(),
        runs_on,
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
    fn first_matching_rule_wins() {
        let r = Router::from_config(&config(""));
        assert_eq!(
            r.route(&labels(&["self-hosted", "vm"]))
                .map(|b| b.to_string()),
            Ok("vm".into())
        );
        assert_eq!(
            r.route(&labels(&["pod"])).map(|b| b.to_string()),
            Ok("pod".into())
        );
        assert_eq!(r.declared_labels(), labels(&["pod", "self-hosted", "vm"]));
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
        assert_eq!(job_facts(Some(b"\x00not yaml: [")), JobFacts::default());
        assert_eq!(job_facts(None), JobFacts::default());
    }
}
