//! One message session: the long-polled queue, deleting what was handled, acquiring offered
//! jobs. Calls made with the queue token refresh the session once on 401; a session the
//! service evicted (404 on refresh) is opened again.

use reqwest::{Method, Response, StatusCode};

use crate::GitHubError;
use crate::client::{API_VERSION, POLL_TIMEOUT, ScaleSetClient, decode};
use crate::retry::refused;
use crate::wire::{JobMessage, List, QueueMessage, RawQueueMessage, Session, Statistics};

pub struct MessageSession {
    client: ScaleSetClient,
    scale_set: i64,
    session: Session,
    /// Highest message id handled (deleted); polls ask for what comes after it.
    last_message_id: i64,
    statistics: Statistics,
}

impl MessageSession {
    pub(crate) fn new(
        client: ScaleSetClient,
        scale_set: i64,
        session: Session,
        last_message_id: i64,
    ) -> MessageSession {
        let statistics = session.statistics.clone().unwrap_or_default();
        MessageSession {
            client,
            scale_set,
            session,
            last_message_id,
            statistics,
        }
    }

    pub fn id(&self) -> &str {
        &self.session.session_id
    }

    pub fn scale_set(&self) -> i64 {
        self.scale_set
    }

    pub fn last_message_id(&self) -> i64 {
        self.last_message_id
    }

    /// The statistics the service gave with the session, if it gave any.
    pub fn session_statistics(&self) -> Option<&Statistics> {
        self.session.statistics.as_ref()
    }

    /// The latest statistics (from the session or the last message).
    pub fn statistics(&self) -> &Statistics {
        &self.statistics
    }

    /// A new queue token for this session. If the service evicted the session, a new one is
    /// opened with the same owner.
    pub async fn refresh(&mut self) -> Result<(), GitHubError> {
        match self
            .client
            .refresh_session(self.scale_set, &self.session.session_id)
            .await
        {
            Ok(session) => {
                self.session = session;
                Ok(())
            }
            Err(error)
                if error.status() == Some(404)
                    && !error.is_exception("RunnerScaleSetNotFoundException") =>
            {
                tracing::warn!(scale_set = self.scale_set, %error, "session evicted by the service; opening a new one");
                let fresh = self
                    .client
                    .create_session(self.scale_set, &self.session.owner_name)
                    .await?;
                self.session = fresh.session;
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    fn queue_url(&self, suffix: Option<i64>) -> Result<url::Url, GitHubError> {
        let mut url =
            url::Url::parse(&self.session.message_queue_url).map_err(|e| GitHubError::Decode {
                op: "message queue url",
                detail: e.to_string(),
            })?;
        if let Some(id) = suffix {
            let path = format!("{}/{id}", url.path().trim_end_matches('/'));
            url.set_path(&path);
        }
        Ok(url)
    }

    /// Sends a queue-token call to what `url` gives; a 401 refreshes the session (which may
    /// change the queue URL) and tries once more.
    async fn with_queue_token(
        &mut self,
        op: &'static str,
        url: impl Fn(&Self) -> Result<url::Url, GitHubError>,
        build: impl Fn(&reqwest::Client, url::Url, &str) -> reqwest::RequestBuilder,
    ) -> Result<Response, GitHubError> {
        let mut refreshed = false;
        loop {
            let token = self.session.message_queue_access_token.clone();
            let target = url(self)?;
            let http = self.client.http();
            let response = self
                .client
                .retry()
                .send(op, || build(http, target.clone(), &token))
                .await?;
            if response.status() == StatusCode::UNAUTHORIZED && !refreshed {
                refreshed = true;
                self.refresh().await?;
                continue;
            }
            return Ok(response);
        }
    }

    /// Waits (up to the service's hold, about 50 s) for the next message. `None`: nothing
    /// came. `max_capacity` tells the service how many runners this client can start at most.
    pub async fn next_message(
        &mut self,
        max_capacity: u32,
    ) -> Result<Option<QueueMessage>, GitHubError> {
        const OP: &str = "get message";
        let response = self
            .with_queue_token(
                OP,
                |me| {
                    let mut url = me.queue_url(None)?;
                    if me.last_message_id > 0 {
                        url.query_pairs_mut()
                            .append_pair("lastMessageId", &me.last_message_id.to_string());
                    }
                    Ok(url)
                },
                |http, url, token| {
                    http.get(url)
                        .bearer_auth(token)
                        .header(
                            "Accept",
                            format!("application/json; api-version={API_VERSION}"),
                        )
                        .header("X-ScaleSetMaxCapacity", max_capacity.to_string())
                        .timeout(POLL_TIMEOUT)
                },
            )
            .await?;
        match response.status() {
            StatusCode::ACCEPTED | StatusCode::NO_CONTENT => return Ok(None),
            StatusCode::OK => {}
            _ => return Err(refused(OP, response).await),
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|source| GitHubError::Transport { op: OP, source })?;
        // A 200 with an empty body has been seen on the real service: no message.
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim_start_matches('\u{feff}').trim();
        if text.is_empty() {
            tracing::debug!(
                scale_set = self.scale_set,
                "empty 200 from the message queue"
            );
            return Ok(None);
        }
        let raw: RawQueueMessage = match serde_json::from_str(text) {
            Ok(raw) => raw,
            Err(e) => {
                // A message that cannot be read would come back forever and hold the queue.
                // If it names its id it is deleted unread: a job it assigned lapses on the
                // service's side and is assigned again.
                let id = serde_json::from_str::<serde_json::Value>(text)
                    .ok()
                    .and_then(|v| v.get("messageId").and_then(serde_json::Value::as_i64));
                let Some(id) = id else {
                    return Err(GitHubError::Decode {
                        op: OP,
                        detail: e.to_string(),
                    });
                };
                tracing::error!(id, error = %e, "undecodable message; deleting it unread");
                return Ok(Some(QueueMessage {
                    id,
                    jobs: Vec::new(),
                    statistics: self.statistics.clone(),
                }));
            }
        };
        self.statistics = raw.statistics.clone();
        if raw.message_type != "RunnerScaleSetJobMessages" {
            tracing::warn!(message_type = %raw.message_type, id = raw.message_id, "message of an unknown type; deleting it unread");
            return Ok(Some(QueueMessage {
                id: raw.message_id,
                jobs: Vec::new(),
                statistics: raw.statistics,
            }));
        }
        let values: Vec<serde_json::Value> = if raw.body.trim().is_empty() {
            Vec::new()
        } else {
            serde_json::from_str(&raw.body).unwrap_or_else(|e| {
                tracing::error!(id = raw.message_id, error = %e, "undecodable message body; deleting it unread");
                Vec::new()
            })
        };
        let mut jobs = Vec::with_capacity(values.len());
        for value in values {
            match JobMessage::parse(value) {
                Ok(job) => jobs.push(job),
                Err(e) => {
                    tracing::warn!(id = raw.message_id, error = %e, "undecodable job message skipped")
                }
            }
        }
        Ok(Some(QueueMessage {
            id: raw.message_id,
            jobs,
            statistics: raw.statistics,
        }))
    }

    /// Acknowledges a handled message; later polls ask for what follows it. A message that is
    /// already gone counts as deleted.
    pub async fn delete_message(&mut self, id: i64) -> Result<(), GitHubError> {
        const OP: &str = "delete message";
        let response = self
            .with_queue_token(
                OP,
                |me| me.queue_url(Some(id)),
                |http, url, token| {
                    http.request(Method::DELETE, url)
                        .bearer_auth(token)
                        .header("Content-Type", "application/json")
                },
            )
            .await?;
        match response.status() {
            StatusCode::NO_CONTENT | StatusCode::OK | StatusCode::NOT_FOUND => {
                self.last_message_id = self.last_message_id.max(id);
                Ok(())
            }
            _ => Err(refused(OP, response).await),
        }
    }

    /// Asks for offered jobs by `runnerRequestId`; returns the ones granted (possibly fewer).
    pub async fn acquire(&mut self, ids: &[i64]) -> Result<Vec<i64>, GitHubError> {
        const OP: &str = "acquire jobs";
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // The Actions service URL of the admin connection, with the queue token.
        let (service, _) = self.client.admin(false).await?;
        let path = format!(
            "_apis/runtime/runnerscalesets/{}/acquirejobs",
            self.scale_set
        );
        let response = self
            .with_queue_token(
                OP,
                |_| ScaleSetClient::service_url(&service, &path, &[]),
                |http, url, token| http.post(url).bearer_auth(token).json(ids),
            )
            .await?;
        if response.status() != StatusCode::OK {
            return Err(refused(OP, response).await);
        }
        let granted: List<i64> = decode(OP, response).await?;
        Ok(granted.value)
    }

    /// Deletes the session (on shutdown, so the next listener need not wait for it to lapse).
    pub async fn close(self) -> Result<(), GitHubError> {
        self.client
            .delete_session(self.scale_set, &self.session.session_id)
            .await
    }
}
