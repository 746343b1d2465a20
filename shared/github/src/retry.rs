//! The one retry layer every call goes through.

use std::time::{Duration, SystemTime};

use reqwest::{Response, StatusCode};

use crate::GitHubError;

/// How calls are retried: `attempts` tries in all, waiting `base · 2ⁿ` (capped at `cap`)
/// between them, or what `Retry-After` says when the answer carries it (never more than
/// `max_retry_after`).
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub attempts: u32,
    pub base: Duration,
    pub cap: Duration,
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 5,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(600),
        }
    }
}

/// `Retry-After` as seconds or an HTTP date.
pub(crate) fn retry_after(response: &Response) -> Option<Duration> {
    let value = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// Whether an answer with `status` is tried again.
fn retried(status: StatusCode, has_retry_after: bool) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        || (status.is_server_error() && status != StatusCode::NOT_IMPLEMENTED)
        || (status == StatusCode::FORBIDDEN && has_retry_after)
}

/// The error for a refused answer: status, the service's exception type and message.
pub(crate) async fn refused(op: &'static str, response: Response) -> GitHubError {
    let status = response.status().as_u16();
    let after = retry_after(&response);
    let text = response.text().await.unwrap_or_default();
    let text = text.trim_start_matches('\u{feff}');
    let parsed: Option<serde_json::Value> = serde_json::from_str(text).ok();
    let field = |name: &str| {
        parsed
            .as_ref()
            .and_then(|v| v.get(name))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    let message = field("message").unwrap_or_else(|| text.chars().take(300).collect());
    GitHubError::Status {
        op,
        status,
        type_name: field("typeName"),
        message,
        retry_after: after,
    }
}

impl RetryPolicy {
    /// Sends what `build` makes until an answer is not retried or the tries run out. A
    /// retried answer's `Retry-After` (429, 503, 403 with it) sets the wait.
    pub(crate) async fn send(
        &self,
        op: &'static str,
        mut build: impl FnMut() -> reqwest::RequestBuilder,
    ) -> Result<Response, GitHubError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let last = attempt >= self.attempts;
            let wait = match build().send().await {
                Ok(response) => {
                    let after = retry_after(&response);
                    if last || !retried(response.status(), after.is_some()) {
                        return Ok(response);
                    }
                    tracing::debug!(op, status = %response.status(), ?after, attempt, "retrying");
                    after.map(|a| a.min(self.max_retry_after))
                }
                Err(source) => {
                    if last || source.is_builder() || source.is_redirect() {
                        return Err(GitHubError::Transport { op, source });
                    }
                    tracing::debug!(op, error = %source, attempt, "retrying after a transport error");
                    None
                }
            };
            let backoff = self
                .base
                .saturating_mul(1 << (attempt - 1).min(16))
                .min(self.cap);
            tokio::time::sleep(wait.unwrap_or(backoff)).await;
        }
    }
}
