//! The run-time placement switches in the JetStream KV bucket `JR_PLACEMENT`, read by every
//! worker with providers:
//! - `burst` (`off`, `on`, `on:30`, `30`, `30%`): the burst tier. `jr burst` reads and sets it;
//!   with the NATS CLI: `nats kv put JR_PLACEMENT burst on:30`.
//! - `drain.<backend>.<provider>` (`on` / `off`): a drained provider gets nothing new, its
//!   running work finishes. `jr provider drain|undrain <backend> <provider>`.
//!
//! A value that cannot be read counts as the safe default (burst off, not drained) with a
//! warning and a metric, never as an error: scheduling goes on. A missing bucket or key is the
//! default. A change applies within [`POLL_EVERY`].

use std::sync::Arc;
use std::time::Duration;

use jr_bus::Bus;
use jr_bus::async_nats::jetstream::kv;
use jr_placement::{BurstSetting, parse_burst};
use tokio_util::sync::CancellationToken;

use crate::providers::{Burst, Drains, PlacementMetrics};

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

pub use jr_placement::{drain_key, interpret_drain};

/// What one worker follows: its backend's providers and the switches that steer them.
pub struct Switches {
    pub backend: String,
    pub providers: Vec<String>,
    pub burst: Arc<Burst>,
    pub drains: Arc<Drains>,
    pub metrics: Arc<PlacementMetrics>,
}

/// Reads the switches every [`POLL_EVERY`] and applies them until `shutdown`; `first` is told
/// when the first reading has been applied.
pub async fn follow(
    bus: Bus,
    switches: Switches,
    mut first: Option<tokio::sync::oneshot::Sender<()>>,
    shutdown: CancellationToken,
) {
    let Switches {
        backend,
        providers,
        burst,
        drains,
        metrics,
    } = switches;
    let mut store: Option<kv::Store> = None;
    let mut last_value: Option<Option<Vec<u8>>> = None;
    let mut last_drains: Vec<Option<Option<Vec<u8>>>> = vec![None; providers.len()];
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
        if let Some(s) = &store {
            for (i, provider) in providers.iter().enumerate() {
                let Ok(value) = s.get(drain_key(&backend, provider)).await else {
                    continue;
                };
                let value = value.map(|b| b.to_vec());
                if last_drains[i].as_ref() == Some(&value) {
                    continue;
                }
                let (drained, warning) = interpret_drain(value.as_deref());
                if let Some(warning) = &warning {
                    tracing::warn!(%provider, "{warning}");
                    metrics.burst_switch_invalid.inc();
                } else {
                    tracing::info!(%provider, drained, "drain switch applied");
                }
                drains.set(provider, drained);
                last_drains[i] = Some(value);
            }
        }
        if let Some(first) = first.take() {
            let _ = first.send(());
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

    #[test]
    fn drain_switches_read_on_and_off_and_anything_else_is_not_drained() {
        assert_eq!(interpret_drain(None), (false, None));
        assert_eq!(interpret_drain(Some(b"on")), (true, None));
        assert_eq!(interpret_drain(Some(b" TRUE ")), (true, None));
        assert_eq!(interpret_drain(Some(b"off")), (false, None));
        let (drained, warning) = interpret_drain(Some(b"maybe"));
        assert!(!drained && warning.is_some());
        assert_eq!(drain_key("pod", "east"), "drain.pod.east");
    }
}
