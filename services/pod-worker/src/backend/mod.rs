//! [`PodBackend`]: the Kubernetes implementation of [`jr_worker::Backend`].

mod status;

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt as _;
use jr_protocol::BackendName;
use jr_worker::{Backend, BackendError, ObservedWorkload, WorkloadSpec};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde_json::json;
use tokio::sync::mpsc;

use crate::template::{
    ExecutorObjects, LABEL_ASSIGNMENT, LABEL_ATTEMPT, LABEL_BACKEND, LABEL_MANAGED_BY,
    LABEL_PROVIDER, MANAGED_BY, PodTemplate, build_objects, owner_reference, selector,
};

pub use status::{Tracker, observe_pod, pod_phase, pod_reason};

/// How long to wait before trying again after a ResourceQuota refused a Pod.
const QUOTA_RETRY_AFTER: Duration = Duration::from_secs(30);
/// Pods per page when the backend is listed.
const LIST_PAGE: u32 = 500;

/// Whether `name` is a workload name this backend makes: `jr-<assignment uuid>-<attempt>`.
pub fn is_workload_name(name: &str) -> bool {
    let parsed = name
        .strip_prefix("jr-")
        .and_then(|rest| rest.rsplit_once('-'))
        .and_then(|(uuid, attempt)| {
            let id = uuid.parse::<jr_protocol::AssignmentId>().ok()?;
            Some((id, attempt.parse::<u32>().ok()?))
        });
    // Only the canonical spelling (what `workload_name` writes) is accepted.
    parsed.is_some_and(|(id, attempt)| jr_worker::workload_name(id, attempt) == name)
}

/// Runs executor Pods (and their token Secrets) in one namespace.
#[derive(Clone)]
pub struct PodBackend {
    pods: Api<Pod>,
    secrets: Api<Secret>,
    namespace: String,
    backend: BackendName,
    template: PodTemplate,
    /// Set when this is one provider of the backend: only its Pods are listed and watched.
    provider: Option<String>,
    tracker: Arc<Mutex<Tracker>>,
    /// How old a token Secret without an owner and without its Pod must be before a listing
    /// deletes it.
    orphan_secret_grace: Duration,
}

/// A create is long over by then (it creates the Secret, then the Pod, then adopts the Secret).
const ORPHAN_SECRET_GRACE: Duration = Duration::from_secs(120);

fn lock(tracker: &Mutex<Tracker>) -> MutexGuard<'_, Tracker> {
    // The tracker holds no invariant a panic could break halfway.
    tracker
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn is_code(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == code)
}

impl PodBackend {
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        backend: BackendName,
        template: PodTemplate,
    ) -> Self {
        let namespace = namespace.into();
        Self {
            pods: Api::namespaced(client.clone(), &namespace),
            secrets: Api::namespaced(client, &namespace),
            namespace,
            backend,
            template,
            provider: None,
            tracker: Arc::default(),
            orphan_secret_grace: ORPHAN_SECRET_GRACE,
        }
    }

    /// How old an orphaned token Secret must be before a listing deletes it (default 120 s).
    pub fn with_orphan_secret_grace(mut self, grace: Duration) -> Self {
        self.orphan_secret_grace = grace;
        self
    }

    /// Deletes this backend's token Secrets that no Pod owns and whose Pod does not exist,
    /// once older than the grace: what a worker stopped between creating the Secret and the
    /// Pod leaves behind, or a failed Pod create that nothing retries under that name (a warm
    /// executor's identity is never reused). Errors are logged; the listing goes on.
    async fn sweep_orphan_secrets(&self, pods: &std::collections::BTreeSet<&str>) {
        let params = ListParams::default().labels(&self.selector());
        let secrets = match self.secrets.list(&params).await {
            Ok(list) => list.items,
            Err(error) => {
                tracing::warn!(%error, "listing token Secrets failed; orphans are looked for at the next listing");
                return;
            }
        };
        let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
        let grace = i64::try_from(self.orphan_secret_grace.as_millis()).unwrap_or(i64::MAX);
        for secret in secrets {
            let Some(name) = secret.metadata.name.as_deref() else {
                continue;
            };
            let owned = secret
                .metadata
                .owner_references
                .as_ref()
                .is_some_and(|o| !o.is_empty());
            let old_enough = secret
                .metadata
                .creation_timestamp
                .as_ref()
                .is_some_and(|t| now.saturating_sub(t.0.as_millisecond()) >= grace);
            if owned || pods.contains(name) || !is_workload_name(name) || !old_enough {
                continue;
            }
            match self.secrets.delete(name, &DeleteParams::background()).await {
                Ok(_) => tracing::info!(
                    secret = name,
                    "deleted a token Secret whose Pod was never created"
                ),
                Err(e) if is_code(&e, 404) => {}
                Err(error) => {
                    tracing::warn!(secret = name, %error, "deleting an orphaned token Secret failed")
                }
            }
        }
    }

    /// This backend as one provider: it lists and watches only the Pods labelled with the
    /// provider's name (providers may share a namespace).
    pub fn for_provider(mut self, provider: impl Into<String>) -> Self {
        self.provider = Some(provider.into());
        self
    }

    /// `app.kubernetes.io/managed-by=jetrunner,jetrunner.dev/backend=<name>` (and
    /// `jetrunner.dev/provider=<provider>` for a provider).
    pub fn selector(&self) -> String {
        match &self.provider {
            Some(provider) => format!("{},{LABEL_PROVIDER}={provider}", selector(&self.backend)),
            None => selector(&self.backend),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Carries the labels this backend lists by (managed by jetrunner, this backend).
    fn is_ours(&self, labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
        labels.is_some_and(|l| {
            l.get(LABEL_MANAGED_BY).map(String::as_str) == Some(MANAGED_BY)
                && l.get(LABEL_BACKEND).map(String::as_str) == Some(self.backend.as_str())
                && self
                    .provider
                    .as_ref()
                    .is_none_or(|p| l.get(LABEL_PROVIDER) == Some(p))
        })
    }

    /// The Pod and Secret `create` would submit (for inspection and dry runs).
    pub fn objects_for(&self, spec: &WorkloadSpec) -> Result<ExecutorObjects, BackendError> {
        let block = self
            .template
            .runner_block(spec.provider.as_deref())
            .map_err(|e| BackendError::Permanent {
                op: "build pod",
                message: e.to_string(),
            })?;
        Ok(build_objects(block, spec))
    }

    fn error(&self, op: &'static str, err: kube::Error) -> BackendError {
        kube_error(op, &self.namespace, err)
    }

    /// Makes the Secret owned by the Pod, so Kubernetes deletes it with the Pod. A missing Secret
    /// is left alone (the Pod then waits in CreateContainerConfigError and the claim timeout
    /// handles it).
    async fn adopt_secret(&self, pod: &Pod) -> Result<(), BackendError> {
        let Some(owner) = owner_reference(pod) else {
            return Ok(());
        };
        let patch = json!({ "metadata": { "ownerReferences": [owner] } });
        match self
            .secrets
            .patch(&owner.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_code(&e, 404) => Ok(()),
            Err(e) => Err(self.error("adopt secret", e)),
        }
    }

    fn is_owned_by(secret: &Secret, pod: &Pod) -> bool {
        let uid = pod.metadata.uid.as_deref();
        secret
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|r| Some(r.uid.as_str()) == uid)
    }

    /// An existing Pod of this name: check it is this attempt's and make sure its Secret is owned.
    async fn adopt_existing(&self, pod: &Pod, spec: &WorkloadSpec) -> Result<(), BackendError> {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let ours = labels.get(LABEL_ASSIGNMENT) == Some(&spec.assignment_id.to_string())
            && labels.get(LABEL_ATTEMPT) == Some(&spec.attempt.to_string());
        if !ours {
            return Err(BackendError::Permanent {
                op: "create pod",
                message: format!(
                    "a Pod named {} exists in namespace {} but is not this assignment attempt's",
                    spec.name(),
                    self.namespace
                ),
            });
        }
        let secret = self
            .secrets
            .get_opt(&spec.name())
            .await
            .map_err(|e| self.error("get secret", e))?;
        match secret {
            Some(secret) if Self::is_owned_by(&secret, pod) => Ok(()),
            Some(_) => self.adopt_secret(pod).await,
            None => Ok(()),
        }
    }

    async fn create_secret(
        &self,
        objects: &ExecutorObjects,
        name: &str,
    ) -> Result<(), BackendError> {
        match self
            .secrets
            .create(&PostParams::default(), &objects.secret)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_code(&e, 409) => {
                // An earlier delivery created the Secret but not the Pod, so no executor has read
                // it: give it this delivery's token.
                let patch = json!({ "data": objects.secret.data });
                self.secrets
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ())
                    .map_err(|e| self.error("update secret", e))
            }
            Err(e) => Err(self.error("create secret", e)),
        }
    }

    async fn delete_secret_quietly(&self, name: &str) {
        if let Err(error) = self.secrets.delete(name, &DeleteParams::default()).await
            && !is_code(&error, 404)
        {
            tracing::warn!(secret = name, %error, "could not delete the token Secret of a Pod that was not created");
        }
    }
}

/// Builds the client `PodBackend` expects: kube's built-in retry layer is switched off.
///
/// kube 5 retries 429/503/504 by default up to 15 times with exponential backoff (5 ms doubling,
/// capped at 1000 s): one call can block for minutes during an API outage. The worker core must get
/// a [`BackendError::Transient`] promptly instead (NAK with delay, slot kept honest), and the
/// watcher has its own backoff.
pub fn client_from_config(mut config: kube::Config) -> Result<kube::Client, BackendError> {
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| BackendError::Permanent {
        op: "build kube client",
        message: e.to_string(),
    })
}

/// Maps a kube error to the worker core's retry classes.
pub fn kube_error(op: &'static str, namespace: &str, err: kube::Error) -> BackendError {
    match &err {
        kube::Error::Api(status) => {
            let retry_after = status
                .details
                .as_ref()
                .map(|d| d.retry_after_seconds)
                .filter(|s| *s > 0)
                .map(|s| Duration::from_secs(u64::from(s)));
            match status.code {
                // A ResourceQuota refusal is capacity, not a broken request: back-pressure.
                403 if status.message.contains("exceeded quota") => BackendError::Full {
                    op,
                    retry_after: retry_after.unwrap_or(QUOTA_RETRY_AFTER),
                },
                403 => BackendError::Permanent {
                    op,
                    message: format!(
                        "forbidden: the pod-worker's service account may not {op} in namespace {namespace} \
                         (check its Role and RoleBinding): {}",
                        status.message
                    ),
                },
                400 | 422 => BackendError::Permanent {
                    op,
                    message: format!(
                        "the API server refused the request ({}): {}",
                        status.reason, status.message
                    ),
                },
                404 => BackendError::Permanent {
                    op,
                    message: format!(
                        "not found (does namespace {namespace} exist?): {}",
                        status.message
                    ),
                },
                // 401: credentials are refreshed by the client; 409 Conflict: re-read and retry.
                0 | 401 | 408 | 409 | 425 | 429 | 500..=599 => BackendError::Transient {
                    op,
                    message: format!("{} {}: {}", status.code, status.reason, status.message),
                    retry_after,
                },
                code => BackendError::Permanent {
                    op,
                    message: format!("{code} {}: {}", status.reason, status.message),
                },
            }
        }
        kube::Error::BuildRequest(_) => BackendError::Permanent {
            op,
            message: err.to_string(),
        },
        // Connection refused/reset, timeouts, TLS, unreadable bodies: the API server may be back soon.
        _ => BackendError::Transient {
            op,
            message: err.to_string(),
            retry_after: None,
        },
    }
}

impl Backend for PodBackend {
    async fn create(&self, spec: &WorkloadSpec) -> Result<String, BackendError> {
        let objects = self.objects_for(spec)?;
        let name = spec.name();
        if let Some(pod) = self
            .pods
            .get_opt(&name)
            .await
            .map_err(|e| self.error("get pod", e))?
        {
            // Redelivery: the Pod exists (with the token of the delivery that created it).
            self.adopt_existing(&pod, spec).await?;
            return Ok(name);
        }
        self.create_secret(&objects, &name).await?;
        let pod = match self.pods.create(&PostParams::default(), &objects.pod).await {
            Ok(pod) => pod,
            Err(e) if is_code(&e, 409) => {
                let pod = self
                    .pods
                    .get(&name)
                    .await
                    .map_err(|e| self.error("get pod", e))?;
                self.adopt_existing(&pod, spec).await?;
                return Ok(name);
            }
            Err(e) => {
                let error = self.error("create pod", e);
                if matches!(
                    error,
                    BackendError::Permanent { .. } | BackendError::Full { .. }
                ) {
                    // Nothing will retry this Pod here (a full namespace may see the attempt
                    // placed in another provider), so its Secret would leak.
                    self.delete_secret_quietly(&name).await;
                }
                return Err(error);
            }
        };
        tracing::debug!(pod = %name, namespace = %self.namespace, "executor pod created");
        self.adopt_secret(&pod).await?;
        Ok(name)
    }

    /// Deletes a Pod and its Secret only when the name is one this backend makes and the objects
    /// carry this backend's jetrunner labels: a `delete-workload` naming anything else in the
    /// namespace is refused, whoever published it.
    async fn delete(&self, workload: &str) -> Result<(), BackendError> {
        if !is_workload_name(workload) {
            return Err(BackendError::Permanent {
                op: "delete pod",
                message: format!("{workload:?} is not a jetrunner workload name"),
            });
        }
        let not_ours = |kind: &str| BackendError::Permanent {
            op: "delete pod",
            message: format!(
                "{kind} {workload} in namespace {} does not carry this backend's jetrunner labels; not deleting it",
                self.namespace
            ),
        };
        let pod = self
            .pods
            .get_opt(workload)
            .await
            .map_err(|e| self.error("get pod", e))?;
        if let Some(pod) = pod {
            if !self.is_ours(pod.metadata.labels.as_ref()) {
                return Err(not_ours("Pod"));
            }
            match self
                .pods
                .delete(workload, &DeleteParams::background())
                .await
            {
                Ok(_) => {}
                Err(e) if is_code(&e, 404) => {}
                Err(e) => return Err(self.error("delete pod", e)),
            }
        }
        // Normally garbage-collected with the Pod; deleting it here also covers a Secret whose
        // Pod was never created or never adopted it.
        let secret = self
            .secrets
            .get_opt(workload)
            .await
            .map_err(|e| self.error("get secret", e))?;
        let Some(secret) = secret else {
            return Ok(());
        };
        if !self.is_ours(secret.metadata.labels.as_ref()) {
            return Err(not_ours("Secret"));
        }
        match self
            .secrets
            .delete(workload, &DeleteParams::background())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_code(&e, 404) => Ok(()),
            Err(e) => Err(self.error("delete secret", e)),
        }
    }

    async fn list(&self) -> Result<Vec<ObservedWorkload>, BackendError> {
        // Page by page, keeping only what is observed of each Pod: the full objects of a
        // namespace with thousands of Pods would otherwise be held at once. A continue token
        // that expired mid-list (410) starts the list over, a few times at most.
        let selector = self.selector();
        let mut observed: Vec<ObservedWorkload> = Vec::new();
        let mut skipped = 0_usize;
        let mut restarts = 0_u32;
        let mut token: Option<String> = None;
        loop {
            let mut params = ListParams::default().labels(&selector).limit(LIST_PAGE);
            if let Some(t) = &token {
                params = params.continue_token(t);
            }
            let page = match self.pods.list(&params).await {
                Ok(page) => page,
                Err(e) if token.is_some() && is_code(&e, 410) && restarts < 3 => {
                    restarts += 1;
                    tracing::debug!("pod list continue token expired; listing again");
                    observed.clear();
                    skipped = 0;
                    token = None;
                    continue;
                }
                Err(e) => return Err(self.error("list pods", e)),
            };
            let before = observed.len();
            observed.extend(page.items.iter().filter_map(observe_pod));
            skipped += page.items.len() - (observed.len() - before);
            match page.metadata.continue_.filter(|t| !t.is_empty()) {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        if skipped > 0 {
            tracing::warn!(
                skipped,
                "pods with the jetrunner selector but unreadable assignment/attempt labels"
            );
        }
        observed.sort_by(|a, b| a.workload.cmp(&b.workload));
        let pods = observed.iter().map(|o| o.workload.as_str()).collect();
        self.sweep_orphan_secrets(&pods).await;
        Ok(observed)
    }

    async fn observe(
        &self,
        tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        let config = watcher::Config::default().labels(&self.selector());
        let mut events =
            std::pin::pin!(watcher::watcher(self.pods.clone(), config).default_backoff());
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let event = tokio::select! {
                () = &mut shutdown => return,
                event = events.next() => event,
            };
            let observations = match event {
                None => {
                    tracing::error!("the pod watcher ended; observation stops");
                    return;
                }
                Some(Err(error)) => {
                    // The watcher resumes from its last resourceVersion (or relists) after a backoff.
                    tracing::warn!(%error, namespace = %self.namespace, "pod watch error (transient, retrying)");
                    Vec::new()
                }
                Some(Ok(event)) => {
                    let mut tracker = lock(&self.tracker);
                    match event {
                        Event::Init => {
                            tracker.begin_relist();
                            Vec::new()
                        }
                        Event::InitApply(pod) | Event::Apply(pod) => {
                            tracker.apply(&pod).into_iter().collect()
                        }
                        Event::InitDone => tracker.end_relist(),
                        Event::Delete(pod) => tracker.delete(&pod).into_iter().collect(),
                    }
                }
            };
            for observation in observations {
                tracing::debug!(pod = %observation.workload, phase = ?observation.phase, reason = ?observation.reason, "pod observed");
                if tx.send(observation).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("refused", reason)
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn kube_errors_map_to_retry_classes() {
        let kind = |code, reason| kube_error("create pod", "ci", api_error(code, reason)).kind();
        assert_eq!(kind(500, "InternalError"), "transient");
        assert_eq!(kind(503, "ServiceUnavailable"), "transient");
        assert_eq!(kind(504, "Timeout"), "transient");
        assert_eq!(kind(429, "TooManyRequests"), "transient");
        assert_eq!(kind(409, "Conflict"), "transient");
        assert_eq!(kind(422, "Invalid"), "permanent");
        assert_eq!(kind(400, "BadRequest"), "permanent");
        assert_eq!(kind(404, "NotFound"), "permanent");
    }

    #[test]
    fn forbidden_is_permanent_and_says_what_to_fix() {
        let err = kube_error("create pod", "ci", api_error(403, "Forbidden"));
        let BackendError::Permanent { message, .. } = err else {
            panic!("403 must be permanent: {err:?}")
        };
        assert!(message.contains("namespace ci"), "{message}");
        assert!(message.contains("Role"), "{message}");
    }

    #[test]
    fn a_quota_refusal_is_back_pressure() {
        let err = kube_error(
            "create pod",
            "ci",
            kube::Error::Api(
                kube::core::Status::failure(
                    "pods \"jr-x-1\" is forbidden: exceeded quota: ci-quota, requested: pods=1",
                    "Forbidden",
                )
                .with_code(403)
                .boxed(),
            ),
        );
        assert!(
            matches!(err, BackendError::Full { retry_after, .. } if retry_after == QUOTA_RETRY_AFTER),
            "{err:?}"
        );
    }

    #[test]
    fn only_canonical_workload_names_are_accepted() {
        let id = jr_protocol::AssignmentId::for_task("https://f", 1);
        assert!(is_workload_name(&jr_worker::workload_name(id, 3)));
        for bad in [
            String::new(),
            "jr-".into(),
            "coredns-5d78c9869d-abcde".into(),
            format!("jr-{id}"),
            format!("jr-{id}-"),
            format!("jr-{id}-01"),
            format!("jr-{id}-+1"),
            format!("jr-{}-1", id.to_string().to_uppercase()),
            format!("jr-{id}-1/../x"),
        ] {
            assert!(!is_workload_name(&bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn connection_errors_are_transient() {
        let io = kube::Error::ReadEvents(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert_eq!(kube_error("list pods", "ci", io).kind(), "transient");
    }
}
