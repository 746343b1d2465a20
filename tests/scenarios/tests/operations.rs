//! The operator's `jr` commands against a running system: `jr status`, `jr job` (by assignment
//! id and by forge task id), `jr quarantine list`, `jr decode` of a stored message, the
//! placement switches (`jr provider drain|undrain`, `jr burst set|show`) and `jr health`, in text
//! and `--json`, checked against what the system did and stored. Needs `cargo build --workspace --bins` first; run with
//! `--test-threads=1`.

use std::time::Duration;

use jr_scenarios::{System, SystemSpec};

/// Runs `jr <args…> --status-url <the system's status API>`; stdout, or stderr on failure.
fn jr(system: &System, args: &[&str]) -> anyhow::Result<Result<String, String>> {
    let out = std::process::Command::new(jr_scenarios::process::binary("jr")?)
        .args(args)
        .args([
            "--status-url",
            &format!("http://127.0.0.1:{}", system.ports.status),
        ])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    Ok(if out.status.success() {
        Ok(stdout)
    } else {
        Err(stderr)
    })
}

fn ok(result: anyhow::Result<Result<String, String>>) -> anyhow::Result<String> {
    result?.map_err(|stderr| anyhow::anyhow!("jr failed: {stderr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jr_status_job_and_quarantine_show_what_the_system_did() -> anyhow::Result<()> {
    let mut system = System::start(SystemSpec {
        pod_capacity: 3,
        vm_capacity: 2,
        ..Default::default()
    })
    .await?;
    let jobs = system.forge.enqueue_jobs(
        jr_fake_forge::JobSpec {
            repo: "acme/widgets".into(),
            name: "build".into(),
            runs_on: vec!["pod".into()],
            steps: 2,
            ..Default::default()
        },
        2,
    );
    if let Err(e) = system.wait_all_final(Duration::from_secs(60)).await {
        anyhow::bail!("{e}\n{}", system.logs());
    }
    system.wait_no_workloads(Duration::from_secs(60)).await?;

    // A message the projection cannot use, published by someone with rights on the bus.
    let client = jr_bus::async_nats::connect(system.nats.url()).await?;
    let js = jr_bus::async_nats::jetstream::new(client);
    let poison_subject = format!(
        "jr.event.pod.{}.claimed",
        jr_protocol::AssignmentId::for_task("https://elsewhere", 1)
    );
    js.publish(poison_subject.clone(), b"not cbor".to_vec().into())
        .await?
        .await?;

    // `jr status`: the configured capacities, nothing held once every job ended; the text
    // form says the same.
    let status: serde_json::Value = serde_json::from_str(&ok(jr(&system, &["status", "--json"]))?)?;
    let backends = status["backends"].as_array().cloned().unwrap_or_default();
    let capacity = |name: &str| {
        backends
            .iter()
            .find(|b| b["name"] == name)
            .and_then(|b| b["capacity"].as_u64())
    };
    assert_eq!(capacity("pod"), Some(3), "{status}");
    assert_eq!(capacity("vm"), Some(2), "{status}");
    assert!(
        backends.iter().all(|b| b["slots_used"] == 0),
        "slots held after every job ended: {status}"
    );
    let text = ok(jr(&system, &["status"]))?;
    assert!(text.contains("backend pod: 0 of 3 slots used"), "{text}");
    assert!(text.contains("backend vm: 0 of 2 slots used"), "{text}");

    // `jr job` by forge task id: the whole life of the job, fetch to release.
    let snapshot = system.forge.snapshot();
    let task = snapshot
        .job(jobs[0])
        .and_then(|j| j.task_ids.first().copied())
        .ok_or_else(|| anyhow::anyhow!("the job has no task"))?;
    let task = task.to_string();
    let forge = system.forge.url().to_owned();
    // The projection may still be a moment behind the last `released`: ask until it is there.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let by_task = loop {
        let by_task: serde_json::Value = serde_json::from_str(&ok(jr(
            &system,
            &["job", &task, "--forge", &forge, "--json"],
        ))?)?;
        let steps: Vec<String> = by_task["timeline"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|e| e["step"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let missing: Vec<&str> = ["fetched", "claimed", "terminal", "released"]
            .into_iter()
            .filter(|step| !steps.iter().any(|s| s == step))
            .collect();
        if missing.is_empty() {
            break by_task;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{missing:?} never in the timeline {steps:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let id = by_task["assignment"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no assignment id: {by_task}"))?;
    assert_eq!(
        id,
        jr_protocol::AssignmentId::for_task(&forge, task.parse()?).to_string()
    );
    // `jr decode` on the job's `claimed` event as stored in the stream.
    let stored = js
        .get_stream(jr_protocol::STREAM_EVENTS)
        .await?
        .get_last_raw_message_by_subject(&format!("jr.event.pod.{id}.claimed"))
        .await?;
    let mut decode = std::process::Command::new(jr_scenarios::process::binary("jr")?)
        .arg("decode")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(
        &mut decode
            .stdin
            .take()
            .ok_or_else(|| anyhow::anyhow!("stdin"))?,
        &stored.payload,
    )?;
    let decoded = decode.wait_with_output()?;
    anyhow::ensure!(decoded.status.success(), "jr decode failed");
    let decoded: serde_json::Value = serde_json::from_slice(&decoded.stdout)?;
    assert_eq!(decoded["kind"], "claimed", "{decoded}");
    assert_eq!(decoded["assignment_id"], id, "{decoded}");
    // `jr jobs`: the status page's list, with its filters.
    let listed: serde_json::Value = serde_json::from_str(&ok(jr(
        &system,
        &["jobs", "--json", "--repository", "acme/widgets"],
    ))?)?;
    let listed = listed["jobs"].as_array().cloned().unwrap_or_default();
    assert!(listed.iter().any(|j| j["id"] == id), "{listed:?}");
    assert!(
        listed.iter().all(|j| j["repository"] == "acme/widgets"),
        "{listed:?}"
    );
    let none: serde_json::Value = serde_json::from_str(&ok(jr(
        &system,
        &["jobs", "--json", "--repository", "acme/other"],
    ))?)?;
    assert_eq!(none["jobs"].as_array().map(Vec::len), Some(0), "{none}");
    let text = ok(jr(&system, &["jobs", "--forge", &forge]))?;
    assert!(text.contains(id), "{text}");
    let refused = jr(&system, &["jobs", "--state", "done"])?.expect_err("not a state");
    assert!(refused.contains("state"), "{refused}");
    let text = ok(jr(&system, &["job", id]))?;
    assert!(text.starts_with(&format!("assignment {id}")), "{text}");
    assert!(text.contains("claimed"), "{text}");
    // An unknown job is an error with the API's reason.
    let unknown = jr(&system, &["job", "999999", "--forge", &forge])?;
    assert!(
        unknown
            .as_ref()
            .is_err_and(|e| e.contains("unknown assignment")),
        "{unknown:?}"
    );

    // `jr quarantine list`: the poison message, once the projector has read it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let quarantine = loop {
        let q: serde_json::Value =
            serde_json::from_str(&ok(jr(&system, &["quarantine", "list", "--json"]))?)?;
        if q["count"].as_u64().unwrap_or(0) >= 1 {
            break q;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the poison message was never quarantined: {q}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        quarantine["recent"]
            .as_array()
            .is_some_and(|r| r.iter().any(|e| e["subject"] == poison_subject.as_str())),
        "{quarantine}"
    );
    let text = ok(jr(&system, &["quarantine", "list"]))?;
    assert!(text.contains(&poison_subject), "{text}");

    // The switches, with `--json`, as the workers would read them from the KV bucket.
    let nats_jr = |args: &[&str]| -> anyhow::Result<serde_json::Value> {
        let out = std::process::Command::new(jr_scenarios::process::binary("jr")?)
            .args(&args[..1])
            .args(["--server", &system.nats.url()])
            .args(&args[1..])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "jr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let placement = js
        .get_key_value(jr_bus::permissions::PLACEMENT_BUCKET)
        .await?;
    // The pod backend here has no providers: drain checks that against the status API and
    // refuses (a typo would write a switch nothing reads); `--force` writes it anyway.
    let refused = jr(&system, &["provider", "drain", "pod", "east"])?
        .expect_err("an unknown provider is refused");
    assert!(refused.contains("has no provider east"), "{refused}");
    let refused = jr(&system, &["provider", "drain", "gpu", "east"])?
        .expect_err("an unknown backend is refused");
    assert!(refused.contains("no backend gpu"), "{refused}");
    let drained = nats_jr(&["provider", "drain", "pod", "east", "--json", "--force"])?;
    assert_eq!(drained["drained"], true, "{drained}");
    let stored = placement.get("drain.pod.east").await?;
    assert_eq!(stored.as_deref(), Some(&b"on"[..]));
    let undrained = nats_jr(&["provider", "undrain", "pod", "east", "--json", "--force"])?;
    assert_eq!(undrained["drained"], false, "{undrained}");
    assert_eq!(
        placement.get("drain.pod.east").await?.as_deref(),
        Some(&b"off"[..])
    );
    let burst = nats_jr(&["burst", "set", "40%", "--json"])?;
    assert_eq!(
        (burst["enabled"].as_bool(), burst["percent"].as_u64()),
        (Some(true), Some(40))
    );
    assert_eq!(placement.get("burst").await?.as_deref(), Some(&b"40%"[..]));
    let shown = nats_jr(&["burst", "show", "--json"])?;
    assert_eq!(shown["value"], "40%", "{shown}");

    // `jr health` against the services' ops endpoints, and against nothing.
    for port in [system.ports.scheduler_ops, system.ports.reconciler_ops] {
        let out = std::process::Command::new(jr_scenarios::process::binary("jr")?)
            .args(["health", &format!("http://127.0.0.1:{port}/readyz")])
            .output()?;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = std::process::Command::new(jr_scenarios::process::binary("jr")?)
        .args(["health", "http://127.0.0.1:9/readyz", "--timeout-secs", "2"])
        .output()?;
    assert!(
        !out.status.success(),
        "a dead endpoint passed the health check"
    );

    // A status API that is not there is a clear error, not a hang or a panic.
    let out = std::process::Command::new(jr_scenarios::process::binary("jr")?)
        .args(["status", "--status-url", "http://127.0.0.1:9"])
        .output()?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach the status API"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(system.violations().is_empty(), "{:?}", system.violations());
    Ok(())
}
