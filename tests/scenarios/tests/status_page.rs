//! The reconciler's status page in a real browser (headless Chromium): loaded against a running
//! system with jobs running and waiting, its figures must match the status API, and a job's
//! timeline must show every step with the service behind it. The screenshot is saved as
//! `$CARGO_TARGET_TMPDIR/status-page.png` (and, with `JR_UPDATE_SCREENSHOT=1`, as
//! `docs/status-page.png`, the one the README shows). `scripts/test.sh` installs Chromium
//! when it is missing. Needs `cargo build --workspace --bins` first; run with
//! `--test-threads=1`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

/// The Chromium binary: `JR_CHROMIUM`, else the first of the usual names on `PATH`.
fn chromium() -> anyhow::Result<PathBuf> {
    if let Ok(path) = std::env::var("JR_CHROMIUM") {
        return Ok(PathBuf::from(path));
    }
    for name in [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    anyhow::bail!(
        "no Chromium on PATH (scripts/test.sh installs Debian's `chromium`; or set JR_CHROMIUM)"
    )
}

/// Runs headless Chromium on `url` with `args`, in its own profile directory; stdout.
fn headless(profile: &Path, url: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(chromium()?)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--no-first-run",
            // Time for the page's fetches to come back before the DOM is read.
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The text of each cell of each row of the table with id `table` (its `<tbody>`), from a
/// DOM dump. The page builds these tables itself, so their markup is simple.
fn table_rows(dom: &str, table: &str) -> Vec<Vec<String>> {
    let Some(start) = dom.find(&format!("id=\"{table}\"")) else {
        return Vec::new();
    };
    let rest = &dom[start..];
    let end = rest.find("</table>").unwrap_or(rest.len());
    let Some(body) = rest[..end].split("<tbody>").nth(1) else {
        return Vec::new();
    };
    body.split("<tr>")
        .skip(1)
        .map(|row| {
            row.split("<td")
                .skip(1)
                .map(|cell| {
                    let inner = cell.split_once('>').map_or("", |(_, c)| c);
                    let inner = inner.split("</td>").next().unwrap_or("");
                    strip_tags(inner)
                })
                .collect()
        })
        .collect()
}

fn strip_tags(html: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&amp;", "&").trim().to_owned()
}

#[test]
fn table_rows_are_read_from_a_dom_dump() {
    let dom = r#"<table id="t"><thead><tr><th>a</th></tr></thead><tbody><tr><td>pod</td><td><div class="bar"><span></span></div></td><td>2/3</td></tr><tr><td>vm</td></tr></tbody></table>"#;
    assert_eq!(
        table_rows(dom, "t"),
        vec![
            vec!["pod".to_owned(), String::new(), "2/3".to_owned()],
            vec!["vm".to_owned()]
        ]
    );
    assert!(table_rows(dom, "missing").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_status_page_shows_what_the_api_says_in_a_real_browser() -> anyhow::Result<()> {
    // The Pod backend through one provider, drained before the screenshot.
    let mut system = System::start(SystemSpec {
        pod_capacity: 2,
        vm_capacity: 1,
        extra_toml: format!(
            "\n[[backend.pod.providers]]\nname = \"main\"\nkubernetes = {{ namespace = \"{}\" }}\n",
            jr_scenarios::system::JOBS_NAMESPACE
        ),
        ..Default::default()
    })
    .await?;
    // One quick job to look up; then long ones: two run on `pod`, two wait.
    let quick = system.forge.enqueue_jobs(
        jr_fake_forge::JobSpec {
            repo: "acme/widgets".into(),
            name: "lint".into(),
            runs_on: vec!["pod".into()],
            ..Default::default()
        },
        1,
    );
    if let Err(e) = system
        .wait_jobs_final(&quick, Duration::from_secs(60))
        .await
    {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    // A job whose steps fail, for the recent failures.
    let failing = system.forge.enqueue_jobs(
        jr_fake_forge::JobSpec {
            repo: "acme/widgets".into(),
            name: "flaky-test".into(),
            runs_on: vec!["vm".into()],
            vars: [(
                jr_fake_executor::VAR_OUTCOME.to_owned(),
                "failure".to_owned(),
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        },
        1,
    );
    if let Err(e) = system
        .wait_jobs_final(&failing, Duration::from_secs(60))
        .await
    {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    system.enqueue("pod", 4, &[(jr_fake_executor::VAR_DURATION_MS, "60000")]);
    let status_url = format!("http://127.0.0.1:{}", system.ports.status);
    let api = |path: &'static str| {
        let url = format!("{status_url}{path}");
        async move {
            anyhow::Ok(
                reqwest::get(url)
                    .await?
                    .error_for_status()?
                    .json::<serde_json::Value>()
                    .await?,
            )
        }
    };
    // Settled: both slots held, two waiting.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        let s = api("/api/status").await?;
        let pod = s["backends"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["name"] == "pod").cloned())
            .unwrap_or_default();
        // The intake records follow within a second: pod's registration full (its lookahead
        // of 2 waiting), vm's taking work.
        let intake_of = |name: &str| {
            s["intakes"]
                .as_array()
                .and_then(|i| i.iter().find(|i| i["registration"] == name).cloned())
                .unwrap_or_default()
        };
        let intakes_settled = intake_of("pod")["backends"][0]["blocked"] == "full"
            && intake_of("vm")["backends"][0]["blocked"].is_null()
            && intake_of("vm")["backends"][0]["backend"] == "vm";
        if pod["slots_used"] == 2
            && pod["queue_depth"] == 2
            && pod["states"]["running"] == 2
            && intakes_settled
        {
            break s;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "never settled at 2 running, 2 waiting: {s}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let profile = tempfile::tempdir()?;
    let dom = headless(profile.path(), &status_url, &["--dump-dom"])?;
    let rows = table_rows(&dom, "backends");
    for backend in status["backends"].as_array().into_iter().flatten() {
        let name = backend["name"].as_str().unwrap_or_default();
        let row = rows
            .iter()
            .find(|r| r.first().map(String::as_str) == Some(name))
            .ok_or_else(|| anyhow::anyhow!("no row for {name} in {rows:?}"))?;
        // backend, queued, oldest wait, slots, bar, providers, states
        assert_eq!(
            row[1],
            backend["queue_depth"].to_string(),
            "{name}: {row:?}"
        );
        assert_eq!(
            row[3],
            format!("{}/{}", backend["slots_used"], backend["capacity"]),
            "{name}: {row:?}"
        );
        match backend["oldest_wait_secs"].as_f64() {
            Some(_) => assert!(row[2].ends_with(" s"), "{name}: {row:?}"),
            None => assert_eq!(row[2], "-", "{name}: {row:?}"),
        }
        for (state, n) in backend["states"].as_object().into_iter().flatten() {
            assert!(
                row[6].contains(&format!("{state}: {n}")),
                "{name}: {state} {n} not in {row:?}"
            );
        }
    }
    // Every intake the status API reports, with each backend taking work or blocked as the
    // API says.
    let intakes = status["intakes"].as_array().cloned().unwrap_or_default();
    assert!(!intakes.is_empty(), "no intake in {status}");
    for intake in &intakes {
        let name = intake["registration"].as_str().unwrap_or_default();
        let rows = table_rows(&dom, &format!("intake-{name}"));
        for backend in intake["backends"].as_array().into_iter().flatten() {
            let b = backend["backend"].as_str().unwrap_or_default();
            let row = rows
                .iter()
                .find(|r| r.first().map(String::as_str) == Some(b))
                .ok_or_else(|| anyhow::anyhow!("intake {name}: no row for {b} in {rows:?}"))?;
            match backend["blocked"].as_str() {
                None => assert_eq!(row[1], "taking work", "{name}/{b}: {row:?}"),
                Some(_) => assert!(row[1].starts_with("blocked"), "{name}/{b}: {row:?}"),
            }
        }
    }
    assert!(
        dom.contains(&format!(
            "id=\"qtotal\">{}</span>",
            status["quarantined"].as_u64().unwrap_or(0)
        )),
        "quarantine count not shown"
    );

    // The job list: the jobs the API lists, each linking to its timeline; and the list
    // filtered by the page's own query string, as the API filters it.
    let ids_of = |page: &serde_json::Value| -> std::collections::BTreeSet<String> {
        page["jobs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|j| j["id"].as_str().map(str::to_owned))
            .collect()
    };
    let linked = |dom: &str| -> std::collections::BTreeSet<String> {
        let Some(start) = dom.find("id=\"jobs\"") else {
            return Default::default();
        };
        let table = &dom[start..];
        let table = &table[..table.find("</table>").unwrap_or(table.len())];
        table
            .split("href=\"#")
            .skip(1)
            .filter_map(|rest| rest.split('"').next().map(str::to_owned))
            .collect()
    };
    let all_jobs: serde_json::Value = reqwest::get(format!("{status_url}/api/assignments"))
        .await?
        .json()
        .await?;
    assert!(!ids_of(&all_jobs).is_empty(), "no job listed: {all_jobs}");
    assert_eq!(
        linked(&dom),
        ids_of(&all_jobs),
        "the page lists what the API lists"
    );
    let vm_jobs: serde_json::Value =
        reqwest::get(format!("{status_url}/api/assignments?backend=vm"))
            .await?
            .json()
            .await?;
    let filtered = headless(
        profile.path(),
        &format!("{status_url}/?backend=vm"),
        &["--dump-dom"],
    )?;
    assert_eq!(linked(&filtered), ids_of(&vm_jobs), "the filtered list");
    assert!(
        ids_of(&vm_jobs).len() < ids_of(&all_jobs).len(),
        "the filter filtered"
    );
    for row in table_rows(&filtered, "jobs") {
        assert_eq!(row.get(4).map(String::as_str), Some("vm"), "{row:?}");
    }

    // The charts: one per backend the history has, drawn from /api/history.
    let history: serde_json::Value = reqwest::get(format!("{status_url}/api/history"))
        .await?
        .json()
        .await?;
    let charted: Vec<&String> = history["backends"]
        .as_object()
        .map(|b| b.keys().collect())
        .unwrap_or_default();
    assert!(!charted.is_empty(), "no history: {history}");
    for backend in charted {
        let start = dom
            .find(&format!("id=\"chart-{backend}\""))
            .ok_or_else(|| anyhow::anyhow!("no chart for {backend}"))?;
        let chart = &dom[start..];
        let chart = &chart[..chart.find("</svg>").unwrap_or(chart.len())];
        assert!(
            chart.contains("<polyline class=\"fetched\" points=\""),
            "{backend}: {chart}"
        );
    }

    // The quick job's timeline, opened by its id in the page's address.
    let task = system
        .forge
        .snapshot()
        .job(quick[0])
        .and_then(|j| j.task_ids.first().copied())
        .ok_or_else(|| anyhow::anyhow!("no task"))?;
    let id = jr_protocol::AssignmentId::for_task(system.forge.url(), task);
    // Its last step (the workload released) may still be on its way into the projection.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let t: serde_json::Value = reqwest::get(format!("{status_url}/api/assignments/{id}"))
            .await?
            .json()
            .await?;
        let released = t["timeline"]
            .as_array()
            .is_some_and(|t| t.iter().any(|e| e["step"] == "released"));
        if released {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the quick job was never released: {t}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let dom = headless(
        profile.path(),
        &format!("{status_url}/#{id}"),
        &["--dump-dom"],
    )?;
    let timeline = table_rows(&dom, "timeline");
    let step = |name: &str| {
        timeline
            .iter()
            .find(|r| r.get(3).map(String::as_str) == Some(name))
    };
    for (name, service) in [
        ("fetched", "scheduler"),
        ("workload-created", "worker"),
        ("claimed", "scheduler (facade)"),
        ("terminal", "scheduler (facade)"),
        ("released", "worker"),
    ] {
        let row = step(name).ok_or_else(|| anyhow::anyhow!("no {name} in {timeline:?}"))?;
        assert_eq!(row[4], service, "{row:?}");
    }

    // The failed job is among the recent failures, with its result.
    let failures = table_rows(&dom, "failures");
    assert!(
        failures
            .iter()
            .any(|r| r.get(1).map(String::as_str) == Some("flaky-test")
                && r.get(8).map(String::as_str) == Some("failure")),
        "{failures:?}"
    );

    // Drained at run time, as `jr provider drain pod main` does: the page says so.
    let admin = jr_bus::Bus::connect(&system.nats.url(), "status-page-test", None).await?;
    // The reconciler made the bucket at start.
    let placement = admin
        .jetstream()
        .get_key_value(jr_bus::permissions::PLACEMENT_BUCKET)
        .await?;
    placement.put("drain.pod.main", "on".into()).await?;
    let drained = headless(profile.path(), &status_url, &["--dump-dom"])?;
    let pod_row = table_rows(&drained, "backends")
        .into_iter()
        .find(|r| r.first().map(String::as_str) == Some("pod"))
        .unwrap_or_default();
    assert!(
        pod_row
            .get(5)
            .is_some_and(|p| p.contains("main") && p.contains("(drained)")),
        "{pod_row:?}"
    );

    // The screenshot: the overview with the jobs running and waiting, the charts, a blocked
    // intake, the job list, the recent failure and the quick job's timeline.
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    headless(
        profile.path(),
        &format!("{status_url}/#{id}"),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1200,2300",
        ],
    )?;
    let png = std::fs::read(&shot)?;
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5_000,
        "no screenshot at {}",
        shot.display()
    );
    println!("status page screenshot: {}", shot.display());
    if std::env::var_os("JR_UPDATE_SCREENSHOT").is_some() {
        std::fs::copy(
            &shot,
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/status-page.png"),
        )?;
    }
    // The long jobs are still running: the end-of-run invariants are other scenarios' business.
    Ok(())
}
