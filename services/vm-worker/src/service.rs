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
    let api_key = jr_config::read_secret("opensandbox.api_key", &os.api_key, &os.api_key_file)?;
    let mut client_cfg = ClientConfig::new(os.url.clone(), api_key);
    client_cfg.create_timeout = os.create_timeout;
    let client = SandboxClient::new(client_cfg).context("OpenSandbox client")?;
    let mut vm = VmBackendConfig::new(settings.backend.clone(), settings.worker_id.clone());
    vm.pool = os.pool.clone();
    vm.entrypoint = (!os.entrypoint.is_empty()).then(|| os.entrypoint.clone());
    vm.poll.steady = os.poll_interval.max(Duration::from_millis(200));
    // Sandboxes that are changing (starting, stopping) are polled at least as often.
    vm.poll.active = vm.poll.active.min(vm.poll.steady);
    let backend = VmBackend::new(client, vm);
    jr_worker::run_service(p, backend, settings)
        .await
        .map_err(Into::into)
}
