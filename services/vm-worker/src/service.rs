//! The vm-worker process: the shared worker core over OpenSandbox.

use std::time::Duration;

use anyhow::Context as _;
use jr_service::Process;
use jr_worker::{Worker, settings_from_config};

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
    vm.poll.steady = os.poll_interval.max(Duration::from_millis(200));
    // Sandboxes that are changing (starting, stopping) are polled at least as often.
    vm.poll.active = vm.poll.active.min(vm.poll.steady);
    let backend = VmBackend::new(client, vm);
    let projected =
        jr_worker::projected_live(&p.config.database.url, settings.backend.as_str()).await;
    let worker = Worker::new(p.bus, backend, settings);
    worker.set_projected_live(projected);
    worker.metrics.register(&mut p.metrics.registry());
    let readiness = p.readiness.clone();
    worker
        .run(
            move |ready| readiness.set("worker", ready),
            p.shutdown.token(),
        )
        .await
        .map_err(Into::into)
}
