//! The burst tier's run-time switch: one value in the JetStream KV bucket `JR_PLACEMENT`, key
//! `burst` (`off`, `on`, `on:30`, `30`, `30%`), read by every worker with providers in a burst
//! tier. `jr burst` reads and sets it; with the NATS CLI: `nats kv put JR_PLACEMENT burst on:30`.
//!
//! A value that cannot be read counts as off (0 %) with a warning and a metric, never as an
//! error: scheduling goes on. A missing bucket or key is off. A change applies within
//! [`POLL_EVERY`].

use std::sync::Arc;
use std::time::Duration;

use jr_bus::Bus;
use jr_bus::async_nats::jetstream::kv;
use jr_placement::{BurstSetting, parse_burst};
use tokio_util::sync::CancellationToken;

use crate::providers::{Burst, PlacementMetrics};

/// The KV bucket holding the placement switches.
pub use jr_bus::permissions::PLACEMENT_BUCKET;
/// The key of the burst switch.
pub const BURST_KEY: &str = "burst";
/// How often the switch is read.
pub const POLL_EVERY: Duration = Duration::from_secs(2);

/// What the switch's current value means, and the warning to log once when it is invalid.
pub fn interpret(value: Option<&[u8]>) -> (BurstSetting, Option<String>) {
    let Some(bytes) = value else {
        return (BurstSetting::OFF, None);
    };
    let text = String::from_utf8_lossy(bytes);
    let (setting, warning) = parse_burst(&text);
    let warning = warning.map(|w| {
        format!(
            "burst switch {:?} is not valid ({}): the burst tier stays off; use off, on, on:<0-100> or <0-100>%",
            w.input,
            w.problem.kind()
        )
    });
    (setting, warning)
}

/// Reads the switch every [`POLL_EVERY`] and applies it to `burst` until `shutdown`.
pub async fn follow(
    bus: Bus,
    burst: Arc<Burst>,
    metrics: Arc<PlacementMetrics>,
    shutdown: CancellationToken,
) {
    let mut store: Option<kv::Store> = None;
    let mut last_value: Option<Option<Vec<u8>>> = None;
    loop {
        if store.is_none() {
            store = bus.jetstream().get_key_value(PLACEMENT_BUCKET).await.ok();
        }
        let value = match &store {
            Some(s) => match s.get(BURST_KEY).await {
                Ok(v) => Some(v.map(|b| b.to_vec())),
                Err(error) => {
                    tracing::debug!(%error, "reading the burst switch failed; keeping the last value");
                    store = None;
                    None
                }
            },
            // No bucket: nobody ever set the switch.
            None => Some(None),
        };
        if let Some(value) = value
            && last_value.as_ref() != Some(&value)
        {
            let (setting, warning) = interpret(value.as_deref());
            if let Some(warning) = &warning {
                tracing::warn!("{warning}");
                metrics.burst_switch_invalid.inc();
            } else {
                tracing::info!(
                    enabled = setting.enabled,
                    percent = setting.percent,
                    "burst switch applied"
                );
            }
            burst.set(setting);
            metrics.burst_percent.set(if setting.enabled {
                i64::from(setting.percent)
            } else {
                -1
            });
            last_value = Some(value);
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(POLL_EVERY) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reads_as_documented_and_bad_values_are_off_with_a_warning() {
        assert_eq!(interpret(None), (BurstSetting::OFF, None));
        let (on, warning) = interpret(Some(b"on:30"));
        assert_eq!((on.enabled, on.percent, warning), (true, 30, None));
        let (off, warning) = interpret(Some(b"lots"));
        assert_eq!(off, BurstSetting::OFF);
        assert!(warning.is_some_and(|w| w.contains("lots")));
        let (off, warning) = interpret(Some(b"150%"));
        assert!(!off.enabled || off.percent == 0);
        assert!(warning.is_some());
    }
}
