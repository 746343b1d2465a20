//! The Grafana dashboard and the Prometheus alert rules in `k8s/monitoring/` use only metrics the
//! services export: every query's metric names are checked against the `/metrics` output of a
//! running system that has run jobs on both backends. The exported names are written to
//! `$CARGO_TARGET_TMPDIR/exported-metrics.txt` as an artifact. Needs `cargo build --workspace
//! --bins` first; run with `--test-threads=1`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

fn monitoring_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../k8s/monitoring")
}

/// Sample names of a Prometheus/OpenMetrics text exposition: those of `name{labels} value`
/// lines, and those a `# TYPE` line announces (a labelled family with no sample yet, e.g. a
/// refusal counter before the first refusal, is exported all the same).
fn sample_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                "info" => &["_info"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#')
            && let Some(name) = line.split(['{', ' ']).next()
        {
            names.insert(name.to_owned());
        }
    }
    names
}

/// Identifiers in a PromQL expression that name jetrunner metrics.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut current = String::new();
    // Label values and matchers are inside quotes: skip them.
    let mut quoted = false;
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            quoted = !quoted;
        }
        if !quoted && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            current.push(c);
            continue;
        }
        if current.starts_with("jetrunner_") {
            names.insert(std::mem::take(&mut current));
        }
        current.clear();
    }
    names
}

/// Every `expr` string anywhere in a JSON document (Grafana targets).
fn json_exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match v {
                    serde_json::Value::String(s) if k == "expr" => out.push(s.clone()),
                    _ => json_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| json_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn names_are_read_from_expressions() {
    assert_eq!(
        metric_names(
            r#"sum by (backend) (rate(jetrunner_a_total{kind="jetrunner_not_a_metric"}[5m])) / jetrunner_b"#
        ),
        ["jetrunner_a_total", "jetrunner_b"]
            .into_iter()
            .map(str::to_owned)
            .collect()
    );
    assert_eq!(
        sample_names("# TYPE x counter\nx_total{a=\"b\"} 1\ny 2\n# TYPE h histogram\n"),
        ["h_bucket", "h_count", "h_sum", "x_total", "y"]
            .into_iter()
            .map(str::to_owned)
            .collect()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dashboard_and_alert_rules_use_only_exported_metrics() -> anyhow::Result<()> {
    // The Pod backend through one provider, so the provider metrics exist too.
    let mut system = System::start(SystemSpec {
        extra_toml: format!(
            "\n[[backend.pod.providers]]\nname = \"main\"\nkubernetes = {{ namespace = \"{}\" }}\n",
            jr_scenarios::system::JOBS_NAMESPACE
        ),
        ..Default::default()
    })
    .await?;
    // A create the API server fails (503 for a moment): the create error metrics exist too.
    system.kube.set_unavailable(true);
    system.enqueue("pod", 1, &[]);
    let failed = tokio::time::Instant::now() + Duration::from_secs(30);
    while !system.logs().contains("create did not succeed") {
        anyhow::ensure!(
            tokio::time::Instant::now() < failed,
            "no create failed while the API server was unavailable\n{}",
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    system.kube.set_unavailable(false);
    for label in ["pod", "vm"] {
        system.forge.enqueue_jobs(
            jr_fake_forge::JobSpec {
                repo: "acme/widgets".into(),
                name: format!("build-{label}"),
                runs_on: vec![label.into()],
                steps: 1,
                ..Default::default()
            },
            2,
        );
    }
    if let Err(e) = system.wait_all_final(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    system.wait_no_workloads(Duration::from_secs(60)).await?;

    let ports = system.ports;
    let mut exported = BTreeSet::new();
    for (service, port) in [
        ("scheduler", ports.scheduler_ops),
        ("pod-worker", ports.pod_ops),
        ("vm-worker", ports.vm_ops),
        ("reconciler", ports.reconciler_ops),
    ] {
        let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await?
            .error_for_status()?
            .text()
            .await?;
        let names = sample_names(&text);
        anyhow::ensure!(!names.is_empty(), "{service} exported no metrics");
        exported.extend(names);
    }
    let artifact = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("exported-metrics.txt");
    std::fs::write(
        &artifact,
        exported.iter().cloned().collect::<Vec<_>>().join("\n"),
    )?;
    println!("exported metric names: {}", artifact.display());

    // The dashboard: valid JSON, panels with queries, every name exported.
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        monitoring_dir().join("grafana-dashboard.json"),
    )?)?;
    let mut exprs = Vec::new();
    json_exprs(&dashboard, &mut exprs);
    let panels = dashboard["panels"].as_array().map_or(0, Vec::len);
    assert!(panels >= 8, "the dashboard has {panels} panels");
    assert!(exprs.len() >= panels - 2, "{} queries", exprs.len());

    // The alert rules: a Prometheus rule file.
    let rules: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(
        monitoring_dir().join("alerts.yaml"),
    )?)?;
    let mut alerts = BTreeSet::new();
    for group in rules["groups"].as_sequence().into_iter().flatten() {
        for rule in group["rules"].as_sequence().into_iter().flatten() {
            let name = rule["alert"].as_str().unwrap_or_default().to_owned();
            let expr = rule["expr"].as_str().unwrap_or_default().to_owned();
            assert!(!name.is_empty() && !expr.is_empty(), "rule {rule:?}");
            assert!(
                rule["annotations"]["summary"].as_str().is_some(),
                "{name} has no summary"
            );
            assert!(
                rule["labels"]["severity"].as_str().is_some(),
                "{name} has no severity"
            );
            alerts.insert(name);
            exprs.push(expr);
        }
    }
    for wanted in [
        "JetrunnerJobsWaitingTooLong",
        "JetrunnerQuarantinedMessages",
        "JetrunnerProjectionLagging",
        "JetrunnerRedispatchStorm",
        "JetrunnerFacadeRefusalsSpike",
        "JetrunnerForgeErrors",
        "JetrunnerNoFetchingReplica",
        "JetrunnerNoLeadingReconciler",
    ] {
        assert!(alerts.contains(wanted), "no alert {wanted}: {alerts:?}");
    }

    let mut missing = BTreeSet::new();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(
            !names.is_empty(),
            "a query names no jetrunner metric: {expr}"
        );
        missing.extend(names.into_iter().filter(|n| !exported.contains(n)));
    }
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\nexported: {exported:?}"
    );
    Ok(())
}
