//! Fair shares inside one backend: at most `per_repository` workloads of one repository and
//! `per_owner` of one owner at once, so one repository's burst cannot take every slot while
//! another's single job waits.
//!
//! [`Fair`] wraps any [`Backend`]. A create over a quota answers [`BackendError::Wait`]: the
//! assignment waits (no attempt spent) while other repositories' assignments keep being placed.
//! The worker's state machine parks it and hands it back for redelivery as soon as a workload
//! goes (work-conserving: a freed slot never waits for the re-offer delay); beyond its parking
//! limit it is offered again after `QUOTA_RETRY`. Admission is decided by
//! [`jr_placement::admit`] over the workloads this worker process created and has not seen gone.
//! Workloads adopted after a worker restart are not attributed to a repository (workloads carry
//! no repository): until they end, the quotas count only what was created since.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use jr_placement::{Admission, Quotas, Usage};
use jr_protocol::WorkloadPhase;
use tokio::sync::mpsc;

use crate::backend::{Backend, BackendError, ObservedWorkload, WorkloadSpec};

/// How long an assignment over its quota waits before it is offered again. JetStream hands
/// out due redeliveries before new messages, so a short delay would let a large backlog over
/// its quota keep the worker busy with redeliveries while another repository's new job waits;
/// with many waiting, one of them is due again soon after a slot frees.
const QUOTA_RETRY: Duration = Duration::from_secs(5);

/// The quotas; `None` is unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FairShare {
    pub per_repository: Option<usize>,
    pub per_owner: Option<usize>,
    /// `owner/name` → weight: that repository's quota is `per_repository × weight`.
    pub weights: std::collections::BTreeMap<String, u32>,
}

impl FairShare {
    pub fn is_unlimited(&self) -> bool {
        self.per_repository.is_none() && self.per_owner.is_none()
    }
}

#[derive(Default)]
struct State {
    /// Workload reference → repository, for the workloads counted.
    running: HashMap<String, (String, Instant)>,
    /// Attempt workload name → repository, while its create call runs.
    creating: HashMap<String, String>,
}

impl State {
    fn usage(&self) -> Usage {
        let mut usage = Usage::default();
        for repository in self
            .running
            .values()
            .map(|(r, _)| r)
            .chain(self.creating.values())
        {
            usage.start(repository, owner(repository));
        }
        usage
    }
}

/// The owner part of `owner/name`.
fn owner(repository: &str) -> &str {
    repository.split_once('/').map_or(repository, |(o, _)| o)
}

/// A backend with per-repository and per-owner quotas; see the module documentation.
pub struct Fair<B> {
    inner: B,
    quotas: Quotas,
    /// No quota configured: every call goes straight to `inner`, nothing is counted.
    unlimited: bool,
    state: Mutex<State>,
}

impl<B: Backend> Fair<B> {
    pub fn new(inner: B, share: FairShare) -> Self {
        Self {
            inner,
            unlimited: share.is_unlimited(),
            quotas: Quotas {
                per_repository: share.per_repository,
                per_owner: share.per_owner,
                weights: share.weights,
            },
            state: Mutex::default(),
        }
    }

    pub fn inner(&self) -> &B {
        &self.inner
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every change is a single insert or remove; a panic cannot leave it halfway.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Workloads counted against `repository`'s quota now.
    pub fn running(&self, repository: &str) -> usize {
        self.state().usage().repository(repository)
    }
}

impl<B: Backend> Backend for Fair<B> {
    async fn create(&self, spec: &WorkloadSpec) -> Result<String, BackendError> {
        if self.unlimited {
            return self.inner.create(spec).await;
        }
        let name = spec.name();
        {
            let mut state = self.state();
            if state.creating.contains_key(&name) {
                // The same attempt again while its first call runs: let the backend answer.
            } else {
                let repository = &spec.repository;
                // A weighted repository's quota is the base quota times its weight.
                let quotas = Quotas {
                    per_repository: self
                        .quotas
                        .per_repository
                        .map(|q| q.saturating_mul(self.quotas.weight(repository) as usize)),
                    ..self.quotas.clone()
                };
                match jr_placement::admit(&quotas, &state.usage(), repository, owner(repository)) {
                    Admission::Admit => {}
                    Admission::Wait { reason } => {
                        tracing::debug!(%repository, reason = reason.kind(), "over its fair share; waits");
                        return Err(BackendError::Wait {
                            op: "fair share",
                            retry_after: QUOTA_RETRY,
                        });
                    }
                }
            }
            state.creating.insert(name.clone(), spec.repository.clone());
        }
        let result = self.inner.create(spec).await;
        let mut state = self.state();
        state.creating.remove(&name);
        if let Ok(reference) = &result {
            state
                .running
                .insert(reference.clone(), (spec.repository.clone(), Instant::now()));
        }
        result
    }

    async fn delete(&self, workload: &str) -> Result<(), BackendError> {
        // Counted until it is seen gone: a deleted workload holds its slot until then.
        self.inner.delete(workload).await
    }

    async fn list(&self) -> Result<Vec<ObservedWorkload>, BackendError> {
        if self.unlimited {
            return self.inner.list().await;
        }
        let started = Instant::now();
        let listed = self.inner.list().await?;
        let present: std::collections::HashSet<&str> = listed
            .iter()
            .filter(|o| o.phase != WorkloadPhase::Gone)
            .map(|o| o.workload.as_str())
            .collect();
        self.state().running.retain(|reference, (_, since)| {
            *since > started || present.contains(reference.as_str())
        });
        Ok(listed)
    }

    async fn observe(
        &self,
        tx: mpsc::Sender<ObservedWorkload>,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        if self.unlimited {
            return self.inner.observe(tx, shutdown).await;
        }
        let (inner_tx, mut inner_rx) = mpsc::channel::<ObservedWorkload>(256);
        let forward = async {
            while let Some(observed) = inner_rx.recv().await {
                if observed.phase == WorkloadPhase::Gone {
                    self.state().running.remove(&observed.workload);
                }
                if tx.send(observed).await.is_err() {
                    return;
                }
            }
        };
        futures::join!(self.inner.observe(inner_tx, shutdown), forward);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::tests::Fake;

    fn spec(n: u32, repository: &str) -> WorkloadSpec {
        WorkloadSpec {
            repository: repository.into(),
            ..crate::backend::test_spec(n)
        }
    }

    #[tokio::test]
    async fn a_repository_over_its_quota_waits_while_another_runs() {
        let backend = Fake::default();
        let fair = Fair::new(
            backend.clone(),
            FairShare {
                per_repository: Some(2),
                per_owner: Some(3),
                ..FairShare::default()
            },
        );
        let a1 = fair.create(&spec(1, "acme/big")).await.expect("a1");
        fair.create(&spec(2, "acme/big")).await.expect("a2");
        assert!(matches!(
            fair.create(&spec(3, "acme/big")).await,
            Err(BackendError::Wait { .. })
        ));
        // Another repository of the same owner: within the owner's 3.
        fair.create(&spec(4, "acme/small")).await.expect("b1");
        assert!(
            matches!(
                fair.create(&spec(5, "acme/small")).await,
                Err(BackendError::Wait { .. })
            ),
            "the owner's quota"
        );
        // Another owner is not limited by acme's use.
        fair.create(&spec(6, "other/one")).await.expect("c1");
        // A workload gone (here: absent from a list) frees its repository's share.
        fair.delete(&a1).await.expect("delete");
        fair.list().await.expect("list");
        assert_eq!(fair.running("acme/big"), 1);
        fair.create(&spec(3, "acme/big"))
            .await
            .expect("a3 after a1 ended");
        assert_eq!(backend.with(|s| s.workloads.len()), 4);
    }

    #[tokio::test]
    async fn a_weighted_repository_gets_its_weight_times_the_quota() {
        let fair = Fair::new(
            Fake::default(),
            FairShare {
                per_repository: Some(1),
                weights: [("acme/main".to_owned(), 3)].into(),
                ..FairShare::default()
            },
        );
        for n in 0..3 {
            fair.create(&spec(n, "acme/main"))
                .await
                .expect("within 1 × 3");
        }
        assert!(matches!(
            fair.create(&spec(3, "acme/main")).await,
            Err(BackendError::Wait { .. })
        ));
        fair.create(&spec(4, "acme/other")).await.expect("1 × 1");
        assert!(matches!(
            fair.create(&spec(5, "acme/other")).await,
            Err(BackendError::Wait { .. })
        ));
    }

    #[tokio::test]
    async fn without_quotas_everything_is_admitted() {
        let fair = Fair::new(Fake::default(), FairShare::default());
        for n in 0..50 {
            fair.create(&spec(n, "acme/big")).await.expect("admitted");
        }
    }
}
