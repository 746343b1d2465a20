use std::future::Future;

use tokio_util::sync::CancellationToken;

use crate::error::BusError;
pub use jr_retry::Backoff;

/// Runs `op` until it succeeds, fails with a non-transient error, or `shutdown` fires
/// (then [`BusError::ShutDown`]). Transient failures are logged and retried with
/// [`crate::nats_backoff`].
pub async fn retry_transient<T, F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    mut op: F,
) -> Result<T, BusError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, BusError>>,
{
    let mut backoff = crate::bus::nats_backoff();
    let mut attempt = 0u32;
    loop {
        if shutdown.is_cancelled() {
            return Err(BusError::ShutDown);
        }
        attempt += 1;
        let result = tokio::select! {
            biased;
            () = shutdown.cancelled() => return Err(BusError::ShutDown),
            result = op() => result,
        };
        match result {
            Ok(value) => return Ok(value),
            Err(error) if error.is_transient() => {
                let delay = backoff.next_delay();
                tracing::warn!(%error, attempt, ?delay, "{what} failed, retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return Err(BusError::ShutDown),
                    () = tokio::time::sleep(delay) => {}
                }
            }
            Err(error) => return Err(error),
        }
    }
}
