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
    for provider in &backend_cfg.providers {
        providers.insert(provider.name.clone(), table_to_json(&provider.runner)?);
    }
    let template = PodTemplate::new(&defaults, &providers)
        .with_context(|| format!("backend.{}.runner", settings.backend))?;
    let backend_name = settings.backend.clone();
    let client_for = |api_url: Option<String>, key: String| async move {
        let client_config = match &api_url {
            Some(url) => kube::Config::new(url.parse().with_context(|| key.clone())?),
            None => kube::Config::infer()
                .await
                .context("no Kubernetes API: set kubernetes.api_url or run in a cluster")?,
        };
        crate::backend::client_from_config(client_config).context("Kubernetes client")
    };
    if backend_cfg.providers.is_empty() {
        let client = client_for(
            kube_cfg.api_url.clone(),
            format!("backend.{backend_name}.kubernetes.api_url"),
        )
        .await?;
        let backend = PodBackend::new(
            client,
            kube_cfg.namespace.clone(),
            backend_name.clone(),
            template,
        );
        let share = jr_worker::fair_share_from_config(&backend_cfg);
        return jr_worker::run_service(p, jr_worker::Fair::new(backend, share), settings)
            .await
            .map_err(Into::into);
    }
    let mut members = Vec::new();
    for (i, provider) in backend_cfg.providers.iter().enumerate() {
        let own = provider.kubernetes.clone().unwrap_or_default();
        let api_url = own.api_url.or_else(|| kube_cfg.api_url.clone());
        let namespace = own.namespace.unwrap_or_else(|| kube_cfg.namespace.clone());
        let client = client_for(
            api_url,
            format!("backend.{backend_name}.providers[{i}].kubernetes.api_url"),
        )
        .await?;
        let backend = PodBackend::new(client, namespace, backend_name.clone(), template.clone())
            .for_provider(provider.name.clone());
        members.push(jr_worker::Provider::configured(provider, backend));
    }
    jr_worker::run_with_providers(p, members, &backend_cfg, settings)
        .await
        .map_err(Into::into)
}
