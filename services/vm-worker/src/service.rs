//! The vm-worker process: the shared worker core over OpenSandbox.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use jr_service::Process;
use jr_worker::{Worker, settings_from_config};

use crate::backend::{VmBackend, VmBackendConfig};
use crate::opensandbox::{ClientConfig, SandboxClient};

pub async fn run(p: Process) -> anyhow::Result<()> {
    let (settings, backend_cfg) =
        settings_from_config(&p.config, &p.config.vm_worker, "vm_worker", "vm").map_err(anyhow::Error::msg)?;
    let os = backend_cfg
        .opensandbox
        .as_ref()
        .with_context(|| format!("backend.{}.opensandbox is required for vm-worker", settings.backend))?;
    let api_key = jr_config::read_secret("opensandbox.api_key", &os.api_key, &os.api_key_file)?;
    let client = SandboxClient::new(ClientConfig::new(os.url.clone(), api_key)).context("OpenSandbox client")?;
    let mut vm = VmBackendConfig::new(settings.backend.clone(), settings.worker_id.clone());
    vm.pool = os.pool.clone();
    vm.poll.steady = os.poll_interval.max(Duration::from_millis(200));
    let backend = VmBackend::new(client, vm);
    let worker = Worker::new(p.bus, backend, settings);
    let readiness = p.readiness.clone();
    let watcher = {
        let w: Arc<Worker<VmBackend>> = worker.clone();
        let stop = p.shutdown.token();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                readiness.set("worker", w.is_ready());
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        })
    };
    let result = worker.run(p.shutdown.token()).await;
    watcher.abort();
    result.map_err(Into::into)
}
