//! The vm-worker process: the shared worker core over OpenSandbox.

use std::time::Duration;

use anyhow::Context as _;
use jr_service::Process;
use jr_worker::settings_from_config;

use crate::backend::{VmBackend, VmBackendConfig};
use crate::opensandbox::{ClientConfig, SandboxClient};

pub async fn run(p: Process) -> anyhow::Result<()> {
    let (settings, backend_cfg) =
        settings_from_config(&p.config, &p.config.vm_worker, "vm_worker", "vm")
            .map_err(anyhow::Error::msg)?;
    let os = backend_cfg.opensandbox.as_ref().with_context(|| {
        format!(
            "backend.{}.opensandbox is required for vm-worker",
            settings.backend
        )
    })?;
    let backend_name = settings.backend.clone();
    let make = |url: String,
                api_key: Option<String>,
                pool: String,
                provider: Option<String>|
     -> anyhow::Result<VmBackend> {
        let mut client_cfg = ClientConfig::new(url, api_key);
        client_cfg.create_timeout = os.create_timeout;
        let client = SandboxClient::new(client_cfg).context("OpenSandbox client")?;
        let mut vm = VmBackendConfig::new(backend_name.clone());
        vm.pool = pool;
        vm.provider = provider;
        vm.entrypoint = (!os.entrypoint.is_empty()).then(|| os.entrypoint.clone());
        vm.poll.steady = os.poll_interval.max(Duration::from_millis(200));
        // Sandboxes that are changing (starting, stopping) are polled at least as often.
        vm.poll.active = vm.poll.active.min(vm.poll.steady);
        Ok(VmBackend::new(client, vm))
    };
    let api_key = jr_config::read_secret("opensandbox.api_key", &os.api_key, &os.api_key_file)?;
    if backend_cfg.providers.is_empty() {
        let backend = make(os.url.clone(), api_key, os.pool.clone(), None)?;
        let share = jr_worker::fair_share_from_config(&backend_cfg);
        return jr_worker::run_service(p, jr_worker::Fair::new(backend, share), settings)
            .await
            .map_err(Into::into);
    }
    let mut members = Vec::new();
    for provider in &backend_cfg.providers {
        let own = provider.opensandbox.clone().unwrap_or_default();
        let key = if own.api_key.is_some() || own.api_key_file.is_some() {
            jr_config::read_secret("opensandbox.api_key", &own.api_key, &own.api_key_file)?
        } else {
            api_key.clone()
        };
        let backend = make(
            own.url.unwrap_or_else(|| os.url.clone()),
            key,
            own.pool.unwrap_or_else(|| os.pool.clone()),
            Some(provider.name.clone()),
        )?;
        members.push(jr_worker::Provider::configured(provider, backend));
    }
    jr_worker::run_with_providers(p, members, &backend_cfg, settings)
        .await
        .map_err(Into::into)
}
