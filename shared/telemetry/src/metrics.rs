//! A shared Prometheus registry (prometheus-client, OpenMetrics text).

use std::sync::{Mutex, MutexGuard, PoisonError};

use prometheus_client::registry::{Metric, Registry};

/// The metrics of one service. Crates register their counters, gauges and histograms once at
/// start; `/metrics` encodes the registry on every scrape.
#[derive(Debug, Default)]
pub struct Metrics {
    registry: Mutex<Registry>,
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// All metric names get `<prefix>_` (e.g. `jr`).
    pub fn with_prefix(prefix: &str) -> Self {
        Self {
            registry: Mutex::new(Registry::with_prefix(prefix)),
        }
    }

    /// Registers one metric. Keep a clone of `metric` to update it; clones share the value.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry().register(name, help, metric);
    }

    /// Direct access, e.g. for `sub_registry_with_prefix` or a crate's own `register(&mut Registry)`.
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while registering leaves a usable registry; keep serving it.
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `<prefix>_build_info{service, version} 1`: which release answers.
    pub fn register_build_info(&self, service: &str, version: &str) {
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        let info: Family<Vec<(String, String)>, Gauge> = Family::default();
        info.get_or_create(&vec![
            ("service".to_owned(), service.to_owned()),
            ("version".to_owned(), version.to_owned()),
        ])
        .set(1);
        self.register(
            "build_info",
            "The service and release answering (always 1)",
            info,
        );
    }

    /// OpenMetrics text exposition: the registry, then the standard `process_*` metrics of
    /// this process (unprefixed, as every exporter names them).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry());
        let process = process_metrics();
        if !process.is_empty() {
            match text.rfind("# EOF") {
                Some(end) => text.insert_str(end, &process),
                None => text.push_str(&process),
            }
        }
        text
    }
}

/// Clock ticks per second of `/proc` times (100 on every Linux this runs on).
const TICKS: f64 = 100.0;

/// `process_*` in OpenMetrics text, read from `/proc/self` (empty where there is none).
fn process_metrics() -> String {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return String::new();
    };
    // Fields after the command name (which may hold spaces) start at the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // After ')': state is field 3 of stat, so utime (14) is index 11, stime 12, threads 17,
    // starttime 19, vsize 20.
    let field = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: Option<f64>| {
        if let Some(value) = value {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}\n"
            ));
        }
    };
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    // `VmRSS` is in kB whatever the page size.
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|kb| kb.parse::<f64>().ok())
                .map(|kb| kb * 1024.0)
        });
    gauge(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        rss,
    );
    gauge(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        field(20),
    );
    gauge(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        boot.zip(field(19))
            .map(|(boot, start)| boot + start / TICKS),
    );
    gauge(
        "process_threads",
        "Number of OS threads in the process.",
        field(17),
    );
    gauge(
        "process_open_fds",
        "Number of open file descriptors.",
        std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as f64),
    );
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse::<f64>().ok())
        });
    gauge(
        "process_max_fds",
        "Maximum number of open file descriptors.",
        max_fds,
    );
    if let (Some(user), Some(system)) = (field(11), field(12)) {
        out.push_str(&format!(
            "# HELP process_cpu_seconds Total user and system CPU time spent in seconds.\n\
             # TYPE process_cpu_seconds counter\n\
             process_cpu_seconds_total {}\n",
            (user + system) / TICKS
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_info_and_process_metrics_are_exposed() {
        let metrics = Metrics::with_prefix("jr");
        metrics.register_build_info("scheduler", "1.2.3");
        let text = metrics.encode();
        assert!(
            text.contains("jr_build_info{service=\"scheduler\",version=\"1.2.3\"} 1"),
            "{text}"
        );
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(text.contains(name), "{name} missing: {text}");
        }
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
        let rss: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .and_then(|v| v.parse().ok())
            .expect("a number");
        assert!(rss > 1_000_000.0, "{rss}");
    }
}
