//! One `[[github]]` entry at run time: a scale set listener run by the replica that holds the
//! entry's lease (`lease.github.<name>` in `JR_SCHEDULER`), with the JetStream ledger of
//! [`crate::ledger`] and a room read from the backend's worker consumer, as the Gitea fetchers
//! read theirs.
//!
//! A replica that loses the lease stops its listener and keeps the message session, so the new
//! leader resumes it from the saved cursor; a replica that shuts down deletes it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use jr_bus::Bus;
use jr_bus::async_nats::jetstream::kv;
use jr_bus::lease::Leadership;
use jr_config::{Config, GitHubConfig};
use jr_github::guard::Guard;
use jr_github::{Credentials, Listener, RetryPolicy, ScaleSetClient, Settings};
use jr_placement::TrustLevel;
use jr_protocol::BackendName;
use tokio_util::sync::CancellationToken;

use jr_intake::board::IntakeBoard;
use jr_intake::sink::AssignmentSink;

use crate::ledger::{JetStreamSink, Room};

/// The longest wait between two tries to reach the scale set.
const MAX_DELAY: Duration = Duration::from_secs(30);

/// Everything one `[[github]]` entry runs with.
pub struct GitHubForge {
    pub entry: GitHubConfig,
    pub client: ScaleSetClient,
    pub backend: BackendName,
    pub lookahead: usize,
    pub max_runners: u32,
    pub max_duration: Duration,
    pub guard: Option<Guard>,
    /// What its listener did (the scheduler's metrics read it).
    pub stats: Arc<jr_github::ListenerStats>,
}

/// The REST client's credentials of `entry`, read from the config and its files.
fn credentials(entry: &GitHubConfig) -> anyhow::Result<Credentials> {
    let key = entry.key("pat");
    if let Some(pat) = jr_config::read_secret(&key, &entry.pat, &entry.pat_file)? {
        return Ok(Credentials::Pat(pat));
    }
    let (Some(issuer), Some(installation_id), Some(path)) = (
        entry.app_id.clone(),
        entry.app_installation_id,
        entry.app_private_key_file.as_ref(),
    ) else {
        anyhow::bail!("{key}: no personal access token and no GitHub App configured");
    };
    let private_key_pem = jr_config::read_secret_file(&entry.key("app_private_key_file"), path)?;
    Ok(Credentials::App {
        issuer,
        installation_id,
        private_key_pem,
    })
}

impl GitHubForge {
    /// Every `[[github]]` entry of `config`, checked and with its client built; an entry
    /// that cannot be built (its key or token file unreadable, say) is the error of its own
    /// intake, named `github.<name>`, and holds up no other.
    pub fn from_config(config: &Config) -> Vec<Result<GitHubForge, (String, anyhow::Error)>> {
        let policy = config.routing.trust.policy();
        config
            .github
            .iter()
            .map(|entry| {
                Self::build(config, &policy, entry)
                    .map_err(|e| (format!("github.{}", entry.name), e))
            })
            .collect()
    }

    fn build(
        config: &Config,
        policy: &jr_placement::TrustPolicy,
        entry: &GitHubConfig,
    ) -> anyhow::Result<GitHubForge> {
        let backend_config = config
            .backend
            .get(&entry.backend)
            .with_context(|| format!("{} {:?}", entry.key("backend"), entry.backend))?;
        let backend = BackendName::new(&entry.backend)
            .with_context(|| format!("{} {:?}", entry.key("backend"), entry.backend))?;
        let client = ScaleSetClient::new(Settings {
            url: entry.url.clone(),
            api: entry.api_url.clone(),
            credentials: credentials(entry)?,
            retry: RetryPolicy::default(),
            user_agent: format!("jetrunner/{}", env!("CARGO_PKG_VERSION")),
        })
        .with_context(|| entry.origin.clone())?;
        let default_max = backend_config
            .capacity
            .saturating_add(backend_config.lookahead);
        // Only a scale set on a trusted backend needs the guard: an untrusted one may
        // take anything.
        let trust = backend_config.trust_level();
        let guard = (trust != TrustLevel::Untrusted).then(|| Guard {
            policy: policy.clone(),
            backend_trust: trust,
        });
        Ok(GitHubForge {
            entry: entry.clone(),
            client,
            backend,
            lookahead: backend_config.lookahead,
            max_runners: entry
                .max_runners
                .unwrap_or_else(|| u32::try_from(default_max).unwrap_or(u32::MAX)),
            max_duration: backend_config.max_duration,
            guard,
            stats: Default::default(),
        })
    }

    /// Where the runners register, as the assignments name it: the path of `url`
    /// (`acme`, `acme/app`, `enterprises/big`).
    fn scope(&self) -> String {
        url::Url::parse(&self.entry.url)
            .map(|u| u.path().trim_matches('/').to_owned())
            .unwrap_or_else(|_| self.entry.url.clone())
    }

    /// The intake's name on the board and in `JR_INTAKES`.
    pub fn intake(&self) -> String {
        format!("github.{}", self.entry.name)
    }

    /// Reports whether the intake works (the board of `None`: tests).
    fn report(&self, board: Option<&IntakeBoard>, error: Option<String>) {
        if let Some(board) = board {
            board.report(&self.intake(), Some(crate::BOARD_KIND), error, true);
        }
    }

    /// Runs the entry's listener whenever this replica holds its lease, until `shutdown`.
    /// GitHub down or refusing the credentials is retried and reported, never returned.
    #[allow(
        clippy::too_many_arguments,
        reason = "the parts one listener runs with"
    )]
    pub async fn run(
        self,
        bus: Bus,
        kv: kv::Store,
        assignments: AssignmentSink,
        mut leadership: Leadership,
        owner: String,
        board: Option<Arc<IntakeBoard>>,
        shutdown: CancellationToken,
    ) {
        let name = self.entry.name.clone();
        while leadership.until_acting(&shutdown).await.is_some() {
            tracing::info!(forge = %name, scale_set = %self.entry.scale_set, "leading the GitHub scale set");
            let Some(scale_set) = self.scale_set(board.as_deref(), &shutdown).await else {
                break;
            };
            self.report(board.as_deref(), None);
            let listener = Listener {
                stats: self.stats.clone(),
                client: self.client.clone(),
                scale_set,
                owner: owner.clone(),
                forge: name.clone(),
                max_capacity: self.max_runners,
                min_idle: self.entry.min_idle,
                work_folder: self.entry.work_folder.clone(),
                guard: self.guard.clone(),
                sink: JetStreamSink {
                    bus: bus.clone(),
                    kv: kv.clone(),
                    assignments: assignments.clone(),
                    forge: name.clone(),
                    scope: self.scope(),
                    labels: std::iter::once(self.entry.scale_set.clone())
                        .chain(self.entry.labels.iter().cloned())
                        .collect(),
                    backend: self.backend.clone(),
                    max_duration: self.max_duration,
                    room: Room::Backend {
                        lookahead: self.lookahead,
                    },
                    records: Default::default(),
                },
            };
            let stop = shutdown.child_token();
            let lost = {
                let (mut leadership, stop) = (leadership.clone(), stop.clone());
                tokio::spawn(async move {
                    leadership.lost().await;
                    stop.cancel();
                })
            };
            let shut = shutdown.clone();
            // Keep the session for the next leader unless this is a shutdown.
            let result = listener
                .run_keeping(stop, move || !shut.is_cancelled())
                .await;
            lost.abort();
            if let Err(error) = result {
                let why = format!("{error:#}");
                tracing::error!(forge = %name, error = %why, "the GitHub listener stopped; starting it again");
                self.report(
                    board.as_deref(),
                    Some(format!("the listener stopped: {why}")),
                );
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        }
    }

    /// The scale set's id: found or made, tried again with back-off while GitHub is
    /// unreachable, busy or refusing (a wrong token, a missing runner group), each failure
    /// logged and reported with its whole chain. `None` at shutdown.
    async fn scale_set(
        &self,
        board: Option<&IntakeBoard>,
        shutdown: &CancellationToken,
    ) -> Option<i64> {
        let mut backoff = jr_bus::Backoff::new(Duration::from_millis(500), MAX_DELAY);
        loop {
            let delay = backoff.next_delay();
            match self
                .client
                .ensure_scale_set(
                    &self.entry.runner_group,
                    &self.entry.scale_set,
                    &self.entry.labels,
                )
                .await
            {
                Ok(set) => return Some(set.id),
                Err(error) => {
                    let transient = error.is_transient();
                    let why = format!(
                        "scale set {:?} in runner group {:?}: {}",
                        self.entry.scale_set,
                        self.entry.runner_group,
                        jr_telemetry::error_chain(&error)
                    );
                    if transient {
                        tracing::warn!(forge = %self.entry.name, error = %why, retry_in = ?delay, "cannot reach the scale set; retrying");
                    } else {
                        tracing::error!(forge = %self.entry.name, error = %why, retry_in = ?delay, "GitHub refuses the scale set; retrying (check the credentials and the runner group)");
                    }
                    self.report(board, Some(why));
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_that_cannot_be_built_is_its_own_error_and_the_others_are_built() {
        let text = r#"
[nats]
url = "nats://x:4222"
[facade]
listen = "127.0.0.1:1"
public_url = "http://x"
insecure_plain_http = true
[backend.vm]
kind = "vm"
capacity = 2
opensandbox = { url = "http://o" }
[[github]]
name = "good"
url = "https://github.com/acme"
backend = "vm"
pat = "ghp_x"
[[github]]
name = "unreadable"
url = "https://github.com/acme"
backend = "vm"
pat_file = "/nonexistent/jetrunner/pat"
"#;
        let config = jr_config::load_str(text, "t", std::iter::empty()).expect("valid config");
        let built = GitHubForge::from_config(&config);
        assert_eq!(built.len(), 2);
        assert!(matches!(&built[0], Ok(f) if f.entry.name == "good"));
        match &built[1] {
            Err((intake, error)) => {
                assert_eq!(intake, "github.unreadable");
                let text = format!("{error:#}");
                assert!(text.contains("/nonexistent/jetrunner/pat"), "{text}");
            }
            Ok(_) => panic!("an unreadable token file was accepted"),
        }
    }
}
