use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::watch;

use crate::error::BusError;
use crate::metrics::BusMetrics;

/// How this process authenticates to NATS.
#[derive(Clone)]
pub enum Credentials {
    /// A `.creds` file (user JWT + nkey seed), as `nsc` writes them.
    File(PathBuf),
    UserPassword {
        user: String,
        password: String,
    },
    Token(String),
    /// An nkey seed (`SU...`).
    NKeySeed(String),
}

impl std::fmt::Debug for Credentials {
    // Secrets stay out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::File(path) => f.debug_tuple("File").field(path).finish(),
            Credentials::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .finish_non_exhaustive(),
            Credentials::Token(_) => f.write_str("Token(..)"),
            Credentials::NKeySeed(_) => f.write_str("NKeySeed(..)"),
        }
    }
}

/// `permissions` for a refused subject (the server says "Permissions Violation for Publish to
/// ..." or "... for Subscription to ..."), `authorization` for refused credentials.
fn server_error_kind(error: &async_nats::ServerError) -> &'static str {
    match error {
        async_nats::ServerError::AuthorizationViolation => "authorization",
        async_nats::ServerError::Other(text)
            if text.to_ascii_lowercase().contains("permissions violation") =>
        {
            "permissions"
        }
        _ => "other",
    }
}

/// The servers of `url`: one URL, or several separated by commas (the nodes of a cluster), as
/// the NATS CLI takes them. The client connects to any of them and learns the rest of the
/// cluster from the server it reaches.
pub fn server_urls(url: &str) -> Vec<&str> {
    url.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// A connection to NATS with its JetStream context. Cheap to clone; all clones share one
/// connection, which reconnects forever in the background.
#[derive(Clone)]
pub struct Bus {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) metrics: Arc<BusMetrics>,
    /// Counts (re)connections, so pull loops can re-issue pull requests the server forgot.
    pub(crate) connections: Arc<watch::Sender<u64>>,
    /// Read the last message of a subject from the stream leader (JetStream API) instead of a
    /// direct get: needed only when streams have replicas, where a direct get may be answered
    /// by a follower that has not stored a fact acknowledged a moment ago.
    pub(crate) leader_reads: bool,
    /// Replicas of the KV buckets this service creates (`nats.stream_replicas`).
    pub(crate) replicas: usize,
}

/// How often an idle connection pings its server (see [`Bus::connect`]).
pub const PING_INTERVAL: Duration = Duration::from_secs(2);

/// How long one JetStream call waits for its answer: a PubAck, a confirmed ack, an API request
/// (consumer info, KV get and put, direct get). A call sent to a stream or consumer leader that
/// was just killed or stalled gets no answer; it fails after this and is retried (with
/// [`nats_backoff`]), so once the cluster has elected a new leader the next try reaches it
/// within about this plus one backoff step. A healthy cluster answers in milliseconds, also
/// at three replicas.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// The backoff of retries of NATS calls: they cost the server little, and a capped delay
/// keeps the gap after a leader election short (see [`CALL_TIMEOUT`]).
pub fn nats_backoff() -> jr_retry::Backoff {
    jr_retry::Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
}

impl Bus {
    /// Connects to `url` as client `name`. Returns at once even if the server is not reachable
    /// yet: the first connection and every reconnection are retried forever in the background,
    /// and operations issued meanwhile wait or time out (transient errors).
    pub async fn connect(
        url: &str,
        name: &str,
        credentials: Option<Credentials>,
    ) -> Result<Bus, BusError> {
        Self::connect_with_inbox(url, name, credentials, "_INBOX").await
    }

    /// Like [`Bus::connect`], with replies (and pulled messages) arriving on subjects under
    /// `inbox_prefix`, e.g. `_INBOX.scheduler`: a NATS user that may subscribe only to its own
    /// prefix needs this ([`crate::permissions::Role::inbox_prefix`]).
    pub async fn connect_with_inbox(
        url: &str,
        name: &str,
        credentials: Option<Credentials>,
        inbox_prefix: &str,
    ) -> Result<Bus, BusError> {
        let connections = Arc::new(watch::Sender::new(0u64));
        let on_event = connections.clone();
        // Every connection event names the servers (never a password in their URLs).
        let target: Arc<str> = Arc::from(without_credentials(url));
        let metrics = Arc::new(BusMetrics::default());
        let event_metrics = metrics.clone();
        let mut options = async_nats::ConnectOptions::new()
            .name(name)
            .custom_inbox_prefix(inbox_prefix)
            .retry_on_initial_connect()
            .max_reconnects(None)
            // A stalled server (paused process, partition) keeps the TCP connection open; two
            // unanswered pings mark it stale and the client moves to another server of the
            // cluster within about three intervals, instead of the default's two minutes.
            .ping_interval(PING_INTERVAL)
            .request_timeout(Some(CALL_TIMEOUT))
            .event_callback(move |event| {
                let connections = on_event.clone();
                let metrics = event_metrics.clone();
                let nats = target.clone();
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            connections.send_modify(|n| *n += 1);
                            tracing::info!(%nats, "connected to NATS");
                        }
                        async_nats::Event::Disconnected => {
                            tracing::warn!(%nats, "disconnected from NATS; reconnecting")
                        }
                        async_nats::Event::ServerError(error) => {
                            let kind = server_error_kind(&error);
                            BusMetrics::count(&metrics.server_errors, vec![("kind", kind.into())]);
                            tracing::error!(%nats, %error, kind, "NATS server error");
                        }
                        async_nats::Event::ClientError(error) => {
                            tracing::warn!(%nats, %error, "NATS client error (the connection is retried)")
                        }
                        other => tracing::info!(%nats, event = %other, "NATS connection event"),
                    }
                }
            });
        options = match credentials {
            None => options,
            Some(Credentials::File(path)) => options
                .credentials_file(path)
                .await
                .map_err(BusError::Credentials)?,
            Some(Credentials::UserPassword { user, password }) => {
                options.user_and_password(user, password)
            }
            Some(Credentials::Token(token)) => options.token(token),
            Some(Credentials::NKeySeed(seed)) => options.nkey(seed),
        };
        let client = options
            .connect(server_urls(url).as_slice())
            .await
            .map_err(|e| BusError::Connect {
                url: without_credentials(url),
                source: Box::new(e),
            })?;
        let js = jetstream::context::ContextBuilder::new()
            .timeout(CALL_TIMEOUT)
            .build(client.clone());
        Ok(Bus {
            client,
            js,
            metrics,
            connections,
            leader_reads: false,
            replicas: 1,
        })
    }

    /// Reads of a subject's last message go to the stream leader when `on` (streams with
    /// replicas); otherwise they are direct gets, which every server holding a single-replica
    /// stream answers at a fraction of the cost.
    #[must_use]
    pub fn with_leader_reads(mut self, on: bool) -> Bus {
        self.leader_reads = on;
        self
    }

    /// Replicas of the streams and of the KV buckets this service creates (R3 on a JetStream
    /// cluster); also turns on leader reads above 1 (see [`Bus::with_leader_reads`]).
    #[must_use]
    pub fn with_replicas(mut self, replicas: usize) -> Bus {
        self.replicas = replicas.max(1);
        self.leader_reads = self.replicas > 1;
        self
    }

    /// What [`Bus::with_replicas`] set: the `num_replicas` of a KV bucket created here.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The KV bucket `bucket`, created when missing with this bus's replicas, keeping
    /// `history` values a key (an existing bucket is used as it is, with its values).
    pub async fn key_value(
        &self,
        bucket: &str,
        description: &str,
        history: i64,
    ) -> Result<jetstream::kv::Store, BusError> {
        if let Ok(store) = self.js.get_key_value(bucket).await {
            return Ok(store);
        }
        self.js
            .create_key_value(jetstream::kv::Config {
                bucket: bucket.to_owned(),
                description: description.to_owned(),
                history,
                num_replicas: self.replicas,
                ..Default::default()
            })
            .await
            .map_err(|e| BusError::KeyValue {
                bucket: bucket.to_owned(),
                source: Box::new(e),
            })
    }

    /// Wraps an existing client (tests, or a caller with special connect options). Without
    /// [`Bus::connect`]'s event hook, gated pull loops notice a reconnection only when their
    /// pull request expires.
    pub fn from_client(client: async_nats::Client) -> Bus {
        let js = jetstream::new(client.clone());
        let connections = Arc::new(watch::Sender::new(0u64));
        Bus {
            client,
            js,
            metrics: Arc::new(BusMetrics::default()),
            connections,
            leader_reads: false,
            replicas: 1,
        }
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Counters of this bus (publishes, dispositions, undecodable messages); register them
    /// once into the service's registry with [`BusMetrics::register`].
    pub fn metrics(&self) -> &Arc<BusMetrics> {
        &self.metrics
    }

    /// Whether the connection is currently up (for `/readyz`).
    pub fn is_connected(&self) -> bool {
        matches!(
            self.client.connection_state(),
            async_nats::connection::State::Connected
        )
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_url_list_names_every_node_of_a_cluster() {
        assert_eq!(super::server_urls("nats://a:4222"), vec!["nats://a:4222"]);
        assert_eq!(
            super::server_urls("nats://a:4222, nats://b:4222,nats://c:4222,"),
            vec!["nats://a:4222", "nats://b:4222", "nats://c:4222"]
        );
    }
}

/// `url` (one server or a comma-separated list) with any `user:password@` removed, for logs
/// and errors.
pub fn without_credentials(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let one = one.trim();
            match (one.find("://"), one.rfind('@')) {
                (Some(scheme), Some(at)) if at > scheme => {
                    format!("{}{}", &one[..scheme + 3], &one[at + 1..])
                }
                (None, Some(at)) => one[at + 1..].to_owned(),
                _ => one.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod url_tests {
    use super::without_credentials;

    #[test]
    fn credentials_never_reach_a_log_line() {
        assert_eq!(
            without_credentials("nats://svc:s3cret@nats-0:4222, nats://nats-1:4222"),
            "nats://nats-0:4222,nats://nats-1:4222"
        );
        assert_eq!(without_credentials("tls://u:p@h:4222"), "tls://h:4222");
        assert_eq!(without_credentials("u:p@h:4222"), "h:4222");
        assert_eq!(without_credentials("nats://h:4222"), "nats://h:4222");
    }
}
