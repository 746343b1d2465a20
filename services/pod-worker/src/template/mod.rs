//! The runner block (the configurable part of the executor Pod) and the Pod/Secret builder.
//!
//! A runner block is a tree (`serde_json::Value`, converted from the TOML config) given in layers:
//! the backend's defaults, then a provider's overrides. [`layer`] merges them: a later scalar
//! replaces, mappings merge key by key, lists replace whole, `null` (or, from TOML, an empty
//! string or empty table) clears the key. The merged tree
//! is parsed into a typed [`RunnerBlock`]; unknown keys are refused with an error naming them.

mod pod;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    PodSecurityContext, ResourceRequirements, SecurityContext, Toleration,
};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::PodWorkerError;

pub use pod::{
    ANNOTATION_RUNS_ON, CONTAINER_NAME, ExecutorObjects, LABEL_ASSIGNMENT, LABEL_ATTEMPT,
    LABEL_BACKEND, LABEL_MANAGED_BY, LABEL_PROVIDER, LABEL_WORKER, MANAGED_BY, TOKEN_KEY,
    build_objects, label_value, owner_reference, selector,
};

/// Lays `overlay` over `base`: mappings merge key by key (recursively), lists and scalars replace
/// whole, and a clearing value in the overlay removes the key: `null`, or — because TOML has no
/// null — an empty string or an empty table (merging an empty table would change nothing anyway).
/// An empty list replaces whole, which also leaves nothing.
pub fn layer(base: &Value, overlay: &Value) -> Value {
    match (base, overlay) {
        (Value::Object(base_map), Value::Object(overlay_map)) => {
            let mut merged = base_map.clone();
            for (key, value) in overlay_map {
                if clears(value) {
                    merged.remove(key);
                } else {
                    let next = match base_map.get(key) {
                        Some(existing) => layer(existing, value),
                        None => strip_nulls(value),
                    };
                    merged.insert(key.clone(), next);
                }
            }
            Value::Object(merged)
        }
        (_, overlay) => strip_nulls(overlay),
    }
}

fn clears(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Object(map) => map.is_empty(),
        Value::Bool(_) | Value::Number(_) | Value::Array(_) => false,
    }
}

/// `null` means "clear" only as an override; inside a newly introduced mapping it just means absent.
fn strip_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), strip_nulls(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Lays every layer over the previous one, starting from an empty mapping.
pub fn merge_layers<'a>(layers: impl IntoIterator<Item = &'a Value>) -> Value {
    layers
        .into_iter()
        .fold(Value::Object(Map::new()), |acc, l| layer(&acc, l))
}

/// The typed runner block. Top-level keys are jetrunner's (snake_case); the values of
/// `resources`, `tolerations`, `security_context` and `pod_security_context` are Kubernetes
/// objects in their API spelling (camelCase, e.g. `runAsNonRoot`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunnerBlock {
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    /// Extra container environment; the `JETRUNNER_*` executor variables are reserved.
    pub env: BTreeMap<String, String>,
    pub resources: Option<ResourceRequirements>,
    pub runtime_class_name: Option<String>,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    pub service_account_name: Option<String>,
    /// The executor container's security context.
    pub security_context: Option<SecurityContext>,
    pub pod_security_context: Option<PodSecurityContext>,
    /// Names of Secrets (in the worker's namespace) used to pull the image.
    pub image_pull_secrets: Vec<String>,
    /// Extra Pod labels/annotations; `jetrunner.dev/*` and `app.kubernetes.io/managed-by` are reserved.
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// Every key a runner block may have (checked by every binary when it loads the config).
pub const RUNNER_BLOCK_KEYS: &[&str] = jr_config::POD_RUNNER_BLOCK_KEYS;

fn invalid(key: impl Into<String>, message: impl Into<String>) -> PodWorkerError {
    PodWorkerError::InvalidValue {
        layer: None,
        key: key.into(),
        message: message.into(),
    }
}

/// Deserialises one value, then checks that nothing in the input was silently ignored (the
/// Kubernetes types skip unknown fields): a key present in the input but absent after a round
/// trip is reported as unknown, with its full path.
fn parse_field<T: DeserializeOwned + serde::Serialize>(
    key: &str,
    value: &Value,
) -> Result<T, PodWorkerError> {
    let parsed: T =
        serde_json::from_value(value.clone()).map_err(|e| invalid(key, e.to_string()))?;
    let round_trip = serde_json::to_value(&parsed).map_err(|e| invalid(key, e.to_string()))?;
    if let Some(unknown) = first_dropped_key(value, &round_trip, key) {
        return Err(PodWorkerError::UnknownKey {
            layer: None,
            key: unknown,
        });
    }
    Ok(parsed)
}

fn first_dropped_key(input: &Value, output: &Value, path: &str) -> Option<String> {
    match (input, output) {
        (Value::Object(i), Value::Object(o)) => {
            i.iter().filter(|(_, v)| !v.is_null()).find_map(|(k, v)| {
                let child = format!("{path}.{k}");
                match o.get(k) {
                    None => Some(child),
                    Some(out) => first_dropped_key(v, out, &child),
                }
            })
        }
        (Value::Array(i), Value::Array(o)) => i
            .iter()
            .zip(o)
            .enumerate()
            .find_map(|(n, (iv, ov))| first_dropped_key(iv, ov, &format!("{path}[{n}]"))),
        _ => None,
    }
}

/// Kubernetes quantities are strings; TOML users naturally write `cpu = 2`.
fn quantities_as_strings(resources: &Value) -> Value {
    let mut resources = resources.clone();
    for section in ["limits", "requests"] {
        if let Some(Value::Object(map)) = resources.get_mut(section) {
            for v in map.values_mut() {
                if let Value::Number(n) = v {
                    *v = Value::String(n.to_string());
                }
            }
        }
    }
    resources
}

/// An empty string means "not set" (TOML cannot say null).
fn optional_string(key: &str, value: &Value) -> Result<Option<String>, PodWorkerError> {
    let text: String = parse_field(key, value)?;
    Ok(if text.is_empty() { None } else { Some(text) })
}

const RESERVED_ENV_PREFIX: &str = "JETRUNNER_";

fn is_reserved_label(key: &str) -> bool {
    key.starts_with(jr_protocol::labels::PREFIX) || key == LABEL_MANAGED_BY
}

impl RunnerBlock {
    /// Parses a merged runner block. `image` is required; unknown keys are refused.
    pub fn from_value(value: &Value) -> Result<Self, PodWorkerError> {
        let empty = Map::new();
        let map = match value {
            Value::Object(map) => map,
            Value::Null => &empty,
            _ => return Err(invalid("(runner block)", "expected a mapping")),
        };
        let mut block = RunnerBlock::default();
        for (key, v) in map {
            if v.is_null() {
                continue;
            }
            match key.as_str() {
                "image" => block.image = parse_field(key, v)?,
                "command" => block.command = parse_field(key, v)?,
                "args" => block.args = parse_field(key, v)?,
                "env" => block.env = parse_field(key, v)?,
                "resources" => block.resources = Some(parse_field(key, &quantities_as_strings(v))?),
                "runtime_class_name" => block.runtime_class_name = optional_string(key, v)?,
                "node_selector" => block.node_selector = parse_field(key, v)?,
                "tolerations" => block.tolerations = parse_field(key, v)?,
                "service_account_name" => block.service_account_name = optional_string(key, v)?,
                "security_context" => block.security_context = Some(parse_field(key, v)?),
                "pod_security_context" => block.pod_security_context = Some(parse_field(key, v)?),
                "image_pull_secrets" => block.image_pull_secrets = parse_field(key, v)?,
                "labels" => block.labels = parse_field(key, v)?,
                "annotations" => block.annotations = parse_field(key, v)?,
                _ => {
                    return Err(PodWorkerError::UnknownKey {
                        layer: None,
                        key: key.clone(),
                    });
                }
            }
        }
        block.validate()?;
        Ok(block)
    }

    fn validate(&self) -> Result<(), PodWorkerError> {
        if self.image.trim().is_empty() {
            return Err(PodWorkerError::MissingKey {
                layer: None,
                key: "image".into(),
            });
        }
        if let Some(name) = self.env.keys().find(|k| k.starts_with(RESERVED_ENV_PREFIX)) {
            return Err(PodWorkerError::ReservedKey {
                layer: None,
                key: format!("env.{name}"),
            });
        }
        if let Some(key) = self.labels.keys().find(|k| is_reserved_label(k)) {
            return Err(PodWorkerError::ReservedKey {
                layer: None,
                key: format!("labels.{key}"),
            });
        }
        if let Some(key) = self.annotations.keys().find(|k| is_reserved_label(k)) {
            return Err(PodWorkerError::ReservedKey {
                layer: None,
                key: format!("annotations.{key}"),
            });
        }
        for (section, map) in [
            ("labels", &self.labels),
            ("node_selector", &self.node_selector),
        ] {
            if let Some((k, v)) = map.iter().find(|(_, v)| label_value(v) != **v) {
                return Err(invalid(
                    format!("{section}.{k}"),
                    format!("{v:?} is not a valid label value"),
                ));
            }
        }
        Ok(())
    }
}

fn check_top_level_keys(layer: &Value) -> Result<(), PodWorkerError> {
    let unknown = layer
        .as_object()
        .and_then(|m| m.keys().find(|k| !RUNNER_BLOCK_KEYS.contains(&k.as_str())));
    match unknown {
        Some(key) => Err(PodWorkerError::UnknownKey {
            layer: None,
            key: key.clone(),
        }),
        None => Ok(()),
    }
}

/// The runner blocks of one backend: its defaults and per-provider overrides, merged and validated
/// up front so a bad config fails at start, not at the first job.
#[derive(Clone, Debug)]
pub struct PodTemplate {
    /// Without providers the defaults must be complete; with providers they may lack what every
    /// provider sets (e.g. `image`), and then only provider-less workloads fail.
    default_block: Result<RunnerBlock, PodWorkerError>,
    provider_blocks: BTreeMap<String, RunnerBlock>,
}

impl PodTemplate {
    /// `defaults` is the backend's runner block; `providers` maps a provider name to its overrides
    /// (layered over `defaults`).
    pub fn new(
        defaults: &Value,
        providers: &BTreeMap<String, Value>,
    ) -> Result<Self, PodWorkerError> {
        // A clearing value (`{}`, `""`) vanishes in the merge, so check each layer's own keys too.
        check_top_level_keys(defaults)?;
        for (name, overrides) in providers {
            check_top_level_keys(overrides).map_err(|e| e.in_provider(Some(name)))?;
        }
        let default_block = RunnerBlock::from_value(defaults);
        if providers.is_empty()
            && let Err(e) = default_block
        {
            return Err(e);
        }
        let provider_blocks = providers
            .iter()
            .map(|(name, overrides)| {
                RunnerBlock::from_value(&layer(defaults, overrides))
                    .map(|b| (name.clone(), b))
                    .map_err(|e| e.in_provider(Some(name)))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            default_block,
            provider_blocks,
        })
    }

    /// The merged block for a provider (`None`: the backend's defaults).
    pub fn runner_block(&self, provider: Option<&str>) -> Result<&RunnerBlock, PodWorkerError> {
        match provider {
            None => self.default_block.as_ref().map_err(Clone::clone),
            Some(p) => self
                .provider_blocks
                .get(p)
                .ok_or_else(|| PodWorkerError::UnknownProvider {
                    provider: p.to_owned(),
                    known: self
                        .provider_blocks
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
        }
    }
}

#[cfg(test)]
mod tests;
