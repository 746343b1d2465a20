//! What both worker binaries share: settings from the config file and the service tail.

use std::time::Duration;

use jr_protocol::BackendName;

use crate::backend::Backend;
use crate::driver::{WarmSettings, Worker, WorkerSettings};
use crate::error::WorkerError;
use jr_seal::TokenKey;

/// Settings of the worker serving `[backend.<name>]` with the `[pod_worker]`/`[vm_worker]`
/// section `section`: which backend (default `default_backend`), its capacity, identity, the
/// facade URL executors use and the token key.
pub fn settings_from_config(
    config: &jr_config::Config,
    section: &jr_config::WorkerConfig,
    section_name: &str,
    default_backend: &str,
) -> Result<(WorkerSettings, jr_config::BackendConfig), String> {
    let name = section
        .backend
        .clone()
        .unwrap_or_else(|| default_backend.to_owned());
    let backend_cfg = config
        .backend
        .get(&name)
        .cloned()
        .ok_or_else(|| format!("{section_name}.backend: no [backend.{name}] in the config"))?;
    let backend = BackendName::new(name.clone()).map_err(|e| format!("backend.{name}: {e}"))?;
    let key_text = jr_config::read_secret(&format!("{section_name}.token_key"), &section.token_key, &section.token_key_file)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{section_name}.token_key (or token_key_file) is required: base64 of at least 32 random bytes"))?;
    let token_key =
        TokenKey::from_base64(&key_text).map_err(|e| format!("{section_name}.token_key: {e}"))?;
    // Stable across restarts of one replica (a restarted process takes over its earlier
    // self at once); each replica of a backend needs its own (Kubernetes: the Pod name).
    let worker_id = section
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("{name}-worker"));
    check_worker_id(&worker_id).map_err(|e| format!("{section_name}.worker_id: {e}"))?;
    let settings = WorkerSettings {
        worker_id,
        backend,
        capacity: backend_cfg.capacity,
        facade_url: config.facade.public_url.clone(),
        token_key,
        resync_interval: section.resync_interval.unwrap_or(Duration::from_secs(15)),
        stray_grace: section.stray_grace.unwrap_or(Duration::from_secs(60)),
        publish_requested: section.publish_requested,
        warm: backend_cfg
            .warm
            .as_ref()
            .filter(|w| w.max_idle() > 0)
            .map(|w| WarmSettings {
                min_idle: w.min_idle,
                max_idle: w.max_idle(),
                idle_timeout: w.idle_timeout,
                max_age: w.max_age,
                labels: if backend_cfg.labels.is_empty() {
                    vec![name.clone()]
                } else {
                    backend_cfg.labels.clone()
                },
                max_duration: backend_cfg.max_duration,
            }),
    };
    Ok((settings, backend_cfg))
}

/// The tail every worker binary shares: build the worker, register its metrics and run it
/// with readiness reporting until shutdown. Recovery needs only NATS and the backend.
pub async fn run_service<B: Backend>(
    p: jr_service::Process,
    backend: B,
    settings: WorkerSettings,
) -> Result<(), WorkerError> {
    let worker = Worker::new(p.bus, backend, settings);
    worker.metrics.register(&mut p.metrics.registry());
    let readiness = p.readiness.clone();
    worker
        .run(
            move |ready| readiness.set("worker", ready),
            p.shutdown.token(),
        )
        .await
}

/// [`run_service`] for a backend whose work goes to `members`, one per configured provider (in
/// `backend_cfg.providers` order): placement over them with the burst tier's rules and the fair
/// shares of `backend_cfg`, its metrics registered and the run-time switches (burst tier,
/// provider drains) followed.
pub async fn run_with_providers<B: Backend>(
    p: jr_service::Process,
    members: Vec<crate::Provider<B>>,
    backend_cfg: &jr_config::BackendConfig,
    settings: WorkerSettings,
) -> Result<(), WorkerError> {
    let backend = crate::Providers::new(members, p.config.reconciler.unreachable_hold)
        .with_burst(std::sync::Arc::new(burst_from_config(backend_cfg)));
    let share = fair_share_from_config(backend_cfg);
    let metrics = backend.metrics();
    metrics.register(&mut p.metrics.registry());
    let switches = crate::burst::Switches {
        backend: settings.backend.to_string(),
        providers: backend.names(),
        burst: backend.burst(),
        drains: backend.drains(),
        metrics,
    };
    let (first, applied) = tokio::sync::oneshot::channel();
    tokio::spawn(crate::burst::follow(
        p.bus.clone(),
        switches,
        Some(first),
        p.shutdown.token(),
    ));
    // Place nothing before the switches are known (a drained provider stays drained across a
    // restart); NATS being slow must not hold the start for long.
    if tokio::time::timeout(Duration::from_secs(5), applied)
        .await
        .is_err()
    {
        tracing::warn!("placement switches not read within 5 s; starting with the defaults");
    }
    run_service(p, crate::Fair::new(backend, share), settings).await
}

/// The fair shares of `[backend.<name>.fair_share]` (unlimited when absent).
pub fn fair_share_from_config(backend: &jr_config::BackendConfig) -> crate::FairShare {
    let fair = backend.fair_share.clone().unwrap_or_default();
    crate::FairShare {
        per_repository: fair.per_repository,
        per_owner: fair.per_owner,
        weights: fair.weights,
    }
}

/// The burst tier's rules of `[backend.<name>.burst]`.
fn burst_from_config(backend: &jr_config::BackendConfig) -> crate::Burst {
    let burst = backend.burst.clone().unwrap_or_default();
    let protected = burst
        .protected
        .iter()
        .map(|m| jr_placement::ProtectedMatcher {
            repository: m.repository.clone(),
            workflow: m.workflow.clone(),
            job: m.job.clone(),
            labels: m.labels.clone(),
        })
        .collect();
    crate::Burst::new(protected, burst.after)
}

/// A worker id is part of every workload's worker label (`<worker_id>_<8 hex digits>`, at most
/// 63 characters): lowercase letters, digits and `-`, starting and ending with a letter or
/// digit, at most 50 characters.
pub(crate) fn check_worker_id(id: &str) -> Result<(), String> {
    let valid = !id.is_empty()
        && id.len() <= 50
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{id:?} is not a valid worker id: use 1 to 50 lowercase letters, digits and '-', starting and ending with a letter or digit (e.g. the Pod name)"
        ))
    }
}

#[cfg(test)]
mod worker_id_tests {
    use super::check_worker_id;

    #[test]
    fn worker_ids_fit_a_label_with_the_process_suffix() {
        for good in ["pod-worker", "pod-worker-7d9f8c6b5d-x2x4q", "a"] {
            assert_eq!(check_worker_id(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "Pod-Worker",
            "pod_worker",
            "-pod",
            "pod-",
            &"a".repeat(51),
        ] {
            assert!(check_worker_id(bad).is_err(), "{bad:?}");
        }
    }
}
