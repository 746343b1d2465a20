//! Kubernetes helpers over the base: the shipped config, and which volume provides a file a
//! container reads.

use std::collections::BTreeMap;
use std::path::Path;

use serde_yaml::Value;

use super::*;

pub const NS: &str = "jetrunner";
pub const JOBS_NS: &str = "jetrunner-jobs";
pub const CONFIG_MAP: &str = "jetrunner-config";

/// The ConfigMap file the Deployments mount as the config, validated like the services do.
pub fn base_config(base: &Kustomization) -> (std::path::PathBuf, jr_config::Config) {
    let generated = base
        .generated
        .iter()
        .find(|g| g.kind == "ConfigMap" && g.name == CONFIG_MAP)
        .expect("the base generates the ConfigMap jetrunner-config");
    let file = generated
        .files
        .get("jetrunner.toml")
        .expect("jetrunner-config has the key jetrunner.toml")
        .clone();
    let config = load_config(&file, &[]);
    (file, config)
}

/// Files a volume provides: relative path → "Kind/name key". `None` for scratch volumes.
pub fn volume_files(base: &Kustomization, volume: &Value) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut add = |kind: &str, name: &str, items: &[Value]| {
        let keys = base.keys_of(kind, NS, name).unwrap_or_default();
        if items.is_empty() {
            for key in keys {
                out.insert(key.clone(), format!("{kind}/{name} key {key}"));
            }
        } else {
            for item in items {
                let key = str_at(item, &["key"]).expect("item key");
                let path = str_at(item, &["path"]).expect("item path");
                if keys.contains(key) {
                    out.insert(path.to_owned(), format!("{kind}/{name} key {key}"));
                }
            }
        }
    };
    if let Some(name) = str_at(volume, &["configMap", "name"]) {
        add("ConfigMap", name, seq_at(volume, &["configMap", "items"]));
    } else if let Some(name) = str_at(volume, &["secret", "secretName"]) {
        add("Secret", name, seq_at(volume, &["secret", "items"]));
    } else if at(volume, &["projected"]).is_some() {
        for source in seq_at(volume, &["projected", "sources"]) {
            if let Some(name) = str_at(source, &["secret", "name"]) {
                add("Secret", name, seq_at(source, &["secret", "items"]));
            } else if let Some(name) = str_at(source, &["configMap", "name"]) {
                add("ConfigMap", name, seq_at(source, &["configMap", "items"]));
            }
        }
    } else {
        return None;
    }
    Some(out)
}

/// How a container sees `path`: the volume source providing it, or an error saying why not.
pub fn resolve_file(
    base: &Kustomization,
    deployment: &Object,
    path: &Path,
) -> Result<String, String> {
    let spec = pod_spec(deployment);
    let volumes: BTreeMap<&str, &Value> = seq_at(spec, &["volumes"])
        .iter()
        .map(|v| (str_at(v, &["name"]).expect("volume name"), v))
        .collect();
    for container in seq_at(spec, &["containers"]) {
        for mount in seq_at(container, &["volumeMounts"]) {
            let mount_path = Path::new(str_at(mount, &["mountPath"]).expect("mountPath"));
            let volume_name = str_at(mount, &["name"]).expect("mount name");
            let volume = volumes
                .get(volume_name)
                .ok_or_else(|| format!("mount of undeclared volume {volume_name}"))?;
            let relative = match str_at(mount, &["subPath"]) {
                Some(sub) if path == mount_path => sub.to_owned(),
                Some(_) => continue,
                None => match path.strip_prefix(mount_path) {
                    Ok(rest) => rest.display().to_string(),
                    Err(_) => continue,
                },
            };
            let files = volume_files(base, volume)
                .ok_or_else(|| format!("{} is on scratch volume {volume_name}", path.display()))?;
            return files.get(&relative).cloned().ok_or_else(|| {
                format!(
                    "{} is under the mount of volume {volume_name}, which has no file {relative} \
                     (it has {:?})",
                    path.display(),
                    files.keys().collect::<Vec<_>>()
                )
            });
        }
    }
    Err(format!("{} is not under any mount", path.display()))
}
