//! The pod-worker process: the shared worker core over the Kubernetes API.

use std::collections::BTreeMap;

use anyhow::Context as _;
use jr_service::Process;
use jr_worker::settings_from_config;

use crate::{PodBackend, PodTemplate};

fn table_to_json(table: &Option<toml::Table>) -> anyhow::Result<serde_json::Value> {
    match table {
        Some(t) => serde_json::to_value(t).context("runner block"),
        None => Ok(serde_json::Value::Object(Default::default())),
    }
}

pub async fn run(p: Process) -> anyhow::Result<()> {
    let (settings, backend_cfg) =
        settings_from_config(&p.config, &p.config.pod_worker, "pod_worker", "pod")
            .map_err(anyhow::Error::msg)?;
    let kube_cfg = backend_cfg.kubernetes.as_ref().with_context(|| {
        format!(
            "backend.{}.kubernetes is required for pod-worker",
            settings.backend
        )
    })?;
    let defaults = table_to_json(&backend_cfg.runner)?;
    let mut providers = BTreeMap::new();
    for provider in backend_cfg.providers.iter().filter(|p| !p.disabled) {
        providers.insert(provider.name.clone(), table_to_json(&provider.runner)?);
    }
    let template = PodTemplate::new(&defaults, &providers)
        .with_context(|| format!("backend.{}.runner", settings.backend))?;
    let client_config = match &kube_cfg.api_url {
        Some(url) => kube::Config::new(
            url.parse()
                .with_context(|| format!("backend.{}.kubernetes.api_url", settings.backend))?,
        ),
        None => kube::Config::infer()
            .await
            .context("no Kubernetes API: set kubernetes.api_url or run in a cluster")?,
    };
    let client = crate::backend::client_from_config(client_config).context("Kubernetes client")?;
    let backend = PodBackend::new(
        client,
        kube_cfg.namespace.clone(),
        settings.backend.clone(),
        template,
    );
    jr_worker::run_service(p, backend, settings)
        .await
        .map_err(Into::into)
}
